"""Progress bars for the long phases (the SFT warm start, validation) on a terminal, and nothing on a log file: a
bar is drawn only when both stdout and stderr are terminals (so CI logs and ``| tee`` keep their plain lines) and
``FP8GRPO_PROGRESS`` is not ``off``. The bar goes to stderr (tqdm) and disappears when its phase ends."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable

ENV = "FP8GRPO_PROGRESS"


def on_terminal() -> bool:
    """Whether bars are drawn: stdout and stderr are terminals, and $FP8GRPO_PROGRESS is not ``off``."""
    if os.environ.get(ENV, "auto").strip().lower() == "off":
        return False
    return sys.stdout.isatty() and sys.stderr.isatty()


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it"):
    """A tqdm bar over ``iterable`` (or one updated by hand: ``bar.update(n)``); disabled -- a plain pass-through
    with the same methods -- where :func:`on_terminal` is false."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not on_terminal(), leave=False,
                dynamic_ncols=True)
