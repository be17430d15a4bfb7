"""trainer.refit.ServedShard: what a trainer rank serves at a refit over the wire, joined across ranks, is the served
state dict of the whole model (fp8core.serve) bit for bit -- one worker, and two FSDP2 ranks whose dim-0 chunks
split 128-row blocks (dense, every recipe) and the experts (MoE)."""
from __future__ import annotations

import pytest
import torch

from fp8core.convert import convert_to_fp8
from fp8core.linear import FP8LinearConfig
from fp8core.moe import convert_routers
from fp8core.serve import served_state_dict
from process.refit_wire import assemble, manifest_error
from trainer.refit import ServedShard


def _model(kind: str, recipe: str, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=384, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1,
                  head_dim=128, max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=128, num_experts=5,
                                                   num_experts_per_tok=2, **common))
        convert_routers(model)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=640, **common))
    with torch.no_grad():  # values across many binades, so that block scales differ
        for p in model.parameters():
            p.mul_(torch.logspace(-2, 1, p.shape[0]).view(-1, *([1] * (p.dim() - 1))))
    convert_to_fp8(model, FP8LinearConfig(recipe=recipe, pow2_weight=recipe == "rowwise"), num_first_layers_in_bf16=1)
    return model


def _joined(shards: list[tuple[list, list]]) -> dict[str, torch.Tensor]:
    manifests = [m for m, _ in shards]
    assert manifest_error(manifests) is None
    out = {}
    for b in range(len(manifests[0])):
        parts = [(p, t) for m, ts in shards for p, t in zip(m[b], ts[b], strict=True)]
        out.update(dict(assemble(parts)))
    return out


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        if w.dtype == torch.float8_e4m3fn:
            assert g.dtype == torch.uint8 and torch.equal(g, w.view(torch.uint8)), name
        else:
            assert g.dtype == w.dtype and torch.equal(g.reshape(w.shape), w), name


@pytest.mark.parametrize("kind,recipe", [("dense", "blockwise"), ("dense", "rowwise"), ("dense", "tensorwise"),
                                         ("moe", "blockwise")])
def test_one_worker_serves_the_served_state_dict(kind, recipe):
    model = _model(kind, recipe)
    shard = ServedShard(model, fp8=True)
    assert shard.error is None
    _same(_joined([(shard.manifest, [shard.tensors(b) for b in range(shard.num_buckets)])]), served_state_dict(model))


def test_without_end_to_end_fp8_the_masters_go_in_fp32():
    from fp8core.moe import checkpoint_state_dict

    model = _model("moe", "blockwise")
    shard = ServedShard(model, fp8=False)
    got = _joined([(shard.manifest, [shard.tensors(b) for b in range(shard.num_buckets)])])
    _same(got, {k: v.float() for k, v in checkpoint_state_dict(model.state_dict()).items()})


def test_a_non_finite_weight_is_named_before_anything_is_sent():
    model = _model("dense", "blockwise")
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[3, 7] = float("nan")
    assert ServedShard(model, fp8=True).error == ("refit: model.layers.2.mlp.down_proj.weight has non-finite values "
                                                  "(trainer rank 0)")


SHARDED = [("dense", "blockwise"), ("dense", "tensorwise"), ("moe", "blockwise")]


def _rank(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from trainer.dp import shard_model

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for kind, recipe in SHARDED:
        model = _model(kind, recipe)
        shard_model(model, torch.device("cpu"))
        shard = ServedShard(model, fp8=True, rank=rank, world=world,
                            all_reduce_max=lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX))
        torch.save({"error": shard.error, "manifest": shard.manifest,
                    "tensors": [shard.tensors(b) for b in range(shard.num_buckets)]},
                   f"{out}/{kind}-{recipe}-rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two spawned FSDP2 ranks, each serving every model of SHARDED from its shard: the saved results' folder."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("refit-shard")
    mp.spawn(_rank, args=(2, str(tmp / "store"), str(tmp)), nprocs=2)
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("kind,recipe", SHARDED)
def test_two_fsdp_ranks_serve_the_whole_models_served_state(two_ranks, kind, recipe):
    """384 rows in two chunks of 192: the second 128-row block straddles the ranks (its scale from both ranks'
    amax); MoE: 5 experts in chunks of 3 and 2, each rank serving its experts under their global numbers."""
    ranks = [torch.load(two_ranks / f"{kind}-{recipe}-rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["error"] for r in ranks] == [None, None]
    straddling = [p for p in ranks[1]["manifest"][2] if p.row_offset % 128]
    assert straddling  # the split really falls inside blocks
    _same(_joined([(r["manifest"], r["tensors"]) for r in ranks]), served_state_dict(_model(kind, recipe)))
