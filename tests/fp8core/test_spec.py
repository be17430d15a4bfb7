"""FP8Spec: the one description of FP8 numerics that builds the trainer's FP8Linear config and the engine's."""
import pytest

from fp8core.linear import FP8LinearConfig
from fp8core.spec import FP8Spec


def test_spec_builds_trainer_config_and_layers():
    s = FP8Spec(recipe="rowwise", fmt="hybrid", pow2_weight=True, num_first_layers_in_bf16=1,
                num_last_layers_in_bf16=2)
    assert s.linear_config() == FP8LinearConfig(recipe="rowwise", fmt="hybrid", pow2_weight=True)
    assert s.layer_indices(6) == [1, 2, 3] and s.weight_granularity == "rowwise"
    # the gradient format does not change the forward numerics; the backend does (the order of the FP32 sums)
    assert s.forward_key() == FP8Spec(recipe="rowwise", pow2_weight=True, num_first_layers_in_bf16=1,
                                      num_last_layers_in_bf16=2).forward_key()
    assert s.forward_key() != FP8Spec(recipe="rowwise", fmt="hybrid", pow2_weight=True, num_first_layers_in_bf16=1,
                                      num_last_layers_in_bf16=2, backend="emulated").forward_key()
    assert s.forward_key() != FP8Spec(recipe="rowwise", num_first_layers_in_bf16=1,
                                      num_last_layers_in_bf16=2).forward_key()


@pytest.mark.parametrize("kwargs, match", [
    ({"recipe": "delayed"}, "FP8Spec.recipe='delayed'"), ({"fmt": "e5m2"}, "FP8Spec.fmt"),
    ({"pow2_weight": 1}, "FP8Spec.pow2_weight must be a bool"),
    ({"num_last_layers_in_bf16": -1}, "FP8Spec.num_last_layers_in_bf16 must be an int >= 0"),
])
def test_spec_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8Spec(**kwargs)
    with pytest.raises(ValueError, match="exceeds"):
        FP8Spec(num_first_layers_in_bf16=3).layer_indices(2)
