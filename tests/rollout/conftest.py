"""Fixtures shared by the rollout-engine tests. Each test module defines its own ``model_dir``."""
import pytest


@pytest.fixture(scope="module")
def checkpoint(model_dir):
    """The model's safetensors state dict, as the trainer would push it at refit."""
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture
def single_rank(monkeypatch):
    """vLLM parameters record their tensor-parallel rank; outside an engine there is no TP group: rank 0 of 1."""
    import vllm.model_executor.parameter as vparam

    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1)
