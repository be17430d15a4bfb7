"""Third-party start-up noise, silenced at its source so a run's terminal shows the project's own progress lines.

What a run printed before this module, and where each line comes from:

- ``Failed to load .../torchao/_C_mxfp8...so: ...`` (and the other ``_C*.so``): ``torchao/__init__.py`` tries to
  load its CUDA extensions on import and reports each failure with ``logger.warning`` on the ``torchao`` logger.
  The project never calls torchao kernels (it is imported by transformers / vLLM); -> ``torchao`` logger at ERROR.
- ``<enum 'KernelPreference'> is an Enum subclass ... Calling register_constant() on Enum subclasses is
  deprecated``: ``torch/utils/_pytree.py`` logs it (logger ``torch.utils._pytree``) when torchao registers its
  enums; -> that logger at ERROR.
- ``Loading weights: 100%|...`` bars: transformers' ``from_pretrained`` progress bars; -> ``TRANSFORMERS_VERBOSITY=error``
  plus ``transformers.utils.logging.disable_progress_bar()`` when transformers is already imported, and
  ``HF_HUB_DISABLE_PROGRESS_BARS`` / ``HF_DATASETS_DISABLE_PROGRESS_BARS`` for hub / datasets bars
  (``Generating train split``).
- ``INFO mlflow.store.db.utils: Creating initial MLflow database tables...``: MLflow's sqlite store on first use;
  -> ``mlflow.store`` logger at WARNING.

Only logger levels and environment switches are touched (before the imports that print), never our own output,
stdout or stderr: errors and real warnings from these libraries still show. ``quiet_third_party()`` is idempotent and
runs on import of this module, so ``import process.quiet`` first thing in a process (the CLI, each Ray actor's
module) is enough.
"""

from __future__ import annotations

import logging
import os

LOGGER_LEVELS = {
    "torchao": logging.ERROR,
    "torch.utils._pytree": logging.ERROR,
    "mlflow.store": logging.WARNING,
    "alembic": logging.WARNING,
}
ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}


def quiet_third_party() -> None:
    """Set the levels and switches above (existing environment values win, so a user can turn a library back on)."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    for name, level in LOGGER_LEVELS.items():
        logging.getLogger(name).setLevel(level)
    import sys

    if "transformers" in sys.modules:  # already imported: its verbosity was read at import
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()


quiet_third_party()
