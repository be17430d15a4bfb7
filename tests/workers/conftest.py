"""Fixtures shared by the rollout-engine tests. Each test module defines its own ``model_dir``."""
import pytest


@pytest.fixture(scope="module")
def checkpoint(model_dir):
    """The model's safetensors state dict, as the trainer would push it at refit."""
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))
