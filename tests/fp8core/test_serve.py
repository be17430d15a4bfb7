"""served_state_dict: FP8 codes + scales exactly as FP8Linear quantizes them, the rest in high precision."""
import pytest
import torch
from torch import nn

from fp8core.convert import convert_to_fp8
from fp8core.linear import FP8Linear, FP8LinearConfig
from fp8core.serve import scale_from_served, served_scale, served_state_dict


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 130)
        self.layers = nn.ModuleList([nn.ModuleDict({"proj": nn.Linear(130, 200), "out": nn.Linear(200, 130,
                                                                                                   bias=False)})
                                     for _ in range(3)])


def test_served_state_dict_holds_the_trainers_quantization():
    torch.manual_seed(0)
    m = Tiny()
    names = convert_to_fp8(m, FP8LinearConfig(recipe="rowwise", pow2_weight=True), num_first_layers_in_bf16=1)
    sd = served_state_dict(m)
    assert sorted(k for k in sd if k.endswith("_scale_inv")) == sorted(f"{n}.weight_scale_inv" for n in names)
    for n in names:
        q = m.get_submodule(n).quantized_weight()
        assert sd[f"{n}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(sd[f"{n}.weight"].view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(sd[f"{n}.weight_scale_inv"], q.scale) and q.scale.shape == (200 if "proj" in n else 130, 1)
    assert sd["layers.0.proj.weight"].dtype == torch.bfloat16  # BF16-kept first layer
    assert torch.equal(sd["layers.1.proj.bias"], m.layers[1].proj.bias.to(torch.bfloat16))
    assert isinstance(m.layers[1].proj, FP8Linear)
    sd32 = served_state_dict(m, hp_dtype=torch.float32)
    assert torch.equal(sd32["embed.weight"], m.embed.weight)


def test_mxfp8_scales_are_served_as_e8m0_bytes_equal_to_the_trainers():
    """MX's 1x32-group scales are powers of two: served as E8M0 (one byte per 32 weights, a quarter of FP32's), each
    exactly the trainer's FP32 scale; their bytes (as a pickled refit carries them) read back as the same scales."""
    torch.manual_seed(0)
    m = Tiny()
    names = convert_to_fp8(m, FP8LinearConfig(recipe="mxfp8", pow2_weight=True, pow2_activation=True))
    sd = served_state_dict(m)
    for n in names:
        q = m.get_submodule(n).quantized_weight()
        scale = sd[f"{n}.weight_scale_inv"]
        assert scale.dtype == torch.float8_e8m0fnu and scale.shape == q.scale.shape == (q.data.shape[0], -(-q.data.shape[1] // 32))
        assert torch.equal(scale.float(), q.scale)
        assert torch.equal(scale_from_served(scale.view(torch.uint8), "group32").float(), q.scale)
    assert scale_from_served(torch.ones(2), "block128").dtype == torch.float32  # other recipes: FP32 as they are
    with pytest.raises(ValueError, match="powers of two"):
        served_scale(torch.tensor([[0.75]]), "group32")
