"""fp8core.shard: a weight quantized in row shards (each shard's amax, combined by maximum, then each shard's codes)
gives quantize()'s codes and scales of the whole weight, bit for bit, wherever the rows are split."""
import pytest
import torch

from fp8core.quant import quantize
from fp8core.shard import quantize_shard, shard_amax

SPLITS = [
    (300, 256, [300]),  # one holder
    (300, 256, [150, 150]),  # a boundary inside a 128-row block
    (384, 200, [128, 256]),  # on a block boundary; K not a multiple of 128
    (300, 256, [100, 0, 200]),  # an empty shard
    (5, 130, [1, 1, 3]),  # fewer rows than a block
    (257, 384, [86, 86, 85]),  # FSDP-like uneven chunks
]


def _whole_from_shards(w, gran, sizes, pow2):
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    shards = [w[o:o + n] for o, n in zip(offsets, sizes, strict=True)]
    amax = torch.stack([shard_amax(s, gran, row_offset=o, rows=w.shape[0]) for s, o in zip(shards, offsets, strict=True)]).amax(0)
    parts = [quantize_shard(s, amax, gran, row_offset=o, rows=w.shape[0], pow2=pow2) for s, o in zip(shards, offsets, strict=True)]
    scales = [p[1] for p in parts]
    assert all(torch.equal(s, scales[0]) for s in scales)  # every holder computes the same whole scale
    return torch.cat([p[0] for p in parts]), scales[0]


@pytest.mark.parametrize("gran", ["block128", "rowwise", "tensorwise", "group128"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("rows,k,sizes", SPLITS)
def test_shards_give_the_whole_weights_codes_and_scales(gran, pow2, rows, k, sizes):
    g = torch.Generator().manual_seed(rows * 31 + k)
    w = torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)  # scales differ per block
    w[rows // 2, k // 3] = 300.0  # one outlier in a block that may straddle
    ref = quantize(w, gran, pow2=pow2)
    data, scale = _whole_from_shards(w, gran, sizes, pow2)
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(scale, ref.scale.reshape(scale.shape))


def test_bf16_shards_and_zero_blocks():
    w = torch.randn(256, 256).to(torch.bfloat16)
    w[:128, :128] = 0
    ref = quantize(w, "block128")
    data, scale = _whole_from_shards(w, "block128", [70, 186], False)
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(scale, ref.scale)


def test_a_non_finite_value_shows_in_the_combined_amax():
    w = torch.randn(256, 128)
    w[200, 5] = float("nan")
    amax = torch.stack([shard_amax(w[:100], "block128", row_offset=0, rows=256),
                        shard_amax(w[100:], "block128", row_offset=100, rows=256)]).amax(0)
    assert not bool(torch.isfinite(amax).all())


def test_shard_outside_the_weight_is_refused():
    with pytest.raises(ValueError, match=r"shard rows \[200, 300\) are not inside the weight's 256 rows"):
        shard_amax(torch.zeros(100, 128), "block128", row_offset=200, rows=256)
