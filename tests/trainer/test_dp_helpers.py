"""trainer.dp's world-size-invariance helpers, without a process group: share_batches rebuilds the single worker's
no-grad batches on every rank, clip_grad_norm clips as torch does but with a float64 norm; activation checkpointing
composed with FSDP2 sharding, on a one-rank group; and two spawned ranks that build on the meta device and
materialize only their shards."""
import contextlib
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.dp import DPGroup, clip_grad_norm, share_batches


def _batches(rows: torch.Tensor, lengths: torch.Tensor, bs: int) -> list[list[int]]:
    """What a rank's longest-first batching (trainer.logprobs.local_logprobs) makes of ``rows``."""
    order = torch.argsort(lengths[rows], descending=True, stable=True)
    return [rows[order[i:i + bs]].tolist() for i in range(0, len(rows), bs)]


@pytest.mark.parametrize("n,bs,world", [(8, 2, 2), (7, 2, 2), (9, 4, 3), (5, 2, 4), (3, 8, 2), (16, 3, 3)])
def test_ranks_rebuild_exactly_the_single_workers_batches(n, bs, world):
    g = torch.Generator().manual_seed(n * 100 + bs * 10 + world)
    lengths = torch.randint(3, 6, (n,), generator=g)  # many ties: the stable order matters
    single = _batches(torch.arange(n), lengths, bs)
    assert share_batches(lengths, bs, DPGroup()).tolist() == [r for b in single for r in b]
    ranks = []
    for rank in range(world):
        mine = share_batches(lengths, bs, DPGroup(rank=rank, world=world))
        ranks += _batches(mine, lengths, bs) if len(mine) else []
    assert ranks == single  # the same batches, each on one rank, in order


def test_no_rows_make_no_batches():
    from trainer.dp import longest_first_batches

    assert longest_first_batches(torch.zeros(0, dtype=torch.long), 4) == []
    for world in (1, 2):
        assert share_batches(torch.zeros(0, dtype=torch.long), 4, DPGroup(rank=0, world=world)).numel() == 0


def test_a_plain_share_of_rows_would_regroup_them():
    """What the no-grad passes did before: each rank batched its contiguous share of the rows."""
    lengths, bs, world = torch.tensor([2, 5, 3, 4]), 2, 2
    single = _batches(torch.arange(4), lengths, bs)
    assert single == [[1, 3], [2, 0]]
    naive = [b for r in range(world) for b in _batches(DPGroup(rank=r, world=world).share(torch.arange(4)),
                                                        lengths, bs)]
    assert naive == [[1, 0], [3, 2]]
    shared = [b for r in range(world) for b in _batches(share_batches(lengths, bs, DPGroup(rank=r, world=world)),
                                                         lengths, bs)]
    assert shared == single


def _model_with_grads(seed: int, scale: float) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 300), nn.Linear(300, 7))
    for p in m.parameters():
        p.grad = torch.randn_like(p) * scale
    return m


@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_clip_matches_torch_and_its_norm_is_float64(scale):
    a, b = _model_with_grads(0, scale), _model_with_grads(0, scale)
    exact = math.sqrt(sum(float(p.grad.double().square().sum()) for p in a.parameters()))
    ours = clip_grad_norm(a.parameters(), 1.0, DPGroup())
    theirs = float(torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0))
    assert ours == pytest.approx(exact, rel=1e-12)
    assert theirs == pytest.approx(exact, rel=1e-5)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=0)
    total_after = math.sqrt(sum(float(p.grad.double().square().sum()) for p in a.parameters()))
    assert total_after == pytest.approx(min(exact, 1.0), rel=1e-5)


def test_non_finite_gradients_are_reported_and_left_alone():
    m = _model_with_grads(1, 1.0)
    m[0].weight.grad[0, 0] = float("nan")
    before = [p.grad.clone() for p in m.parameters()]
    assert math.isnan(clip_grad_norm(m.parameters(), 1.0, DPGroup()))
    for x, p in zip(before, m.parameters(), strict=True):
        torch.testing.assert_close(p.grad, x, rtol=0, atol=0, equal_nan=True)
    m[0].weight.grad[0, 0] = float("inf")
    assert clip_grad_norm(m.parameters(), 1.0, DPGroup()) == float("inf")


def test_no_gradients_is_a_zero_norm():
    assert clip_grad_norm(nn.Linear(3, 3).parameters(), 1.0, DPGroup()) == 0.0


def test_checkpointed_layers_shard_and_give_the_plain_gradients():
    """checkpoint_layers, then shard_model (PolicyWorker's order), on a one-rank gloo group: forward + backward of a
    2-layer Qwen3 with blockwise FP8 linears give the plain model's gradients bit for bit, and each layer runs its
    forward twice, the second time in the backward inside FSDP's gathering (FSDP's forward hooks, outside the
    checkpoint's, see the backward state and leave the layer as its pre-backward hook gathered it). The sharded
    FP8 linears keep no weight cache and quantize again in the recompute: the same codes."""
    import socket

    import torch.distributed as dist
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8core.convert import convert_to_fp8
    from fp8core.linear import FP8LinearConfig
    from trainer.dp import checkpoint_layers, decoder_layers, full_tensor, shard_model

    cfg = Qwen3Config(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
    def fp8_model():
        torch.manual_seed(0)
        m = Qwen3ForCausalLM(cfg)
        convert_to_fp8(m, FP8LinearConfig(backend="emulated"))
        return m

    plain, model = fp8_model(), fp8_model()
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    plain(input_ids=ids).logits.float().square().mean().backward()

    runs = []
    entered = []

    @contextlib.contextmanager
    def recompute():
        entered.append(1)
        yield

    assert checkpoint_layers(model, recompute) == 2
    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: runs.append(i))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        shard_model(model, torch.device("cpu"))
        assert all(m.weight_cache is None for m in model.modules() if hasattr(m, "weight_cache"))
        model(input_ids=ids).logits.float().square().mean().backward()
        assert sorted(runs) == [0, 0, 1, 1] and len(entered) == 2
        grads = {n: full_tensor(p.grad) for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    for n, p in plain.named_parameters():
        assert torch.equal(grads[n], p.grad), n


def _meta_built_rank(rank: int, world: int, store: str, model_dir: str, out: str) -> None:
    """One rank of :func:`test_a_meta_built_rank_materializes_only_its_shard` (a spawned process)."""
    import torch.distributed as dist

    from trainer.dp import DPGroup, full_tensor, load_model, materialize_shards, shard_model

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    try:
        model = _as_the_trainer_converts(load_model(model_dir, torch.device("meta"), DPGroup(rank, world)))
        on_meta = all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
        shard_model(model, torch.device("cpu"))
        materialize_shards(model, model_dir, torch.device("cpu"))
        local = sum(p.to_local().numel() for p in model.parameters())
        full = {n: full_tensor(p) for n, p in model.named_parameters()}
        torch.save({"on_meta": on_meta, "local": local, "full": full,
                    "buffers": {n: b.clone() for n, b in model.named_buffers()}}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _as_the_trainer_converts(model):
    """The trainer's conversions before sharding (trainer/policy.py): FP32 routers, FP8 linears and experts."""
    from fp8core.moe import convert_routers
    from fp8core.spec import FP8Spec

    convert_routers(model)
    FP8Spec().convert(model)
    return model


@pytest.mark.parametrize("name, experts", [("policy-tiny", 0), ("policy-tiny-moe", 4)])
def test_a_meta_built_rank_materializes_only_its_shard(name, experts, tmp_path):
    """Data-parallel ranks build the model on the meta device (nothing allocated), convert and shard it, then
    allocate and fill only their own shard from the checkpoint, one tensor at a time (MoE experts fused from their
    per-expert tensors as transformers fuses them): each rank holds about half of the parameters, and the gathered
    parameters and the recomputed buffers (rotary frequencies) equal the loaded model's bit for bit."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from embedded.tiny_model import TinyModelSpec, build_tiny_model

    model_dir = build_tiny_model(Path(__file__).resolve().parents[2] / "runs" / "test-env" / name,
                                 TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000,
                                               **({"num_experts": experts} if experts else {})))
    mp.spawn(_meta_built_rank, args=(2, str(tmp_path / "store"), str(model_dir), str(tmp_path)), nprocs=2)
    loaded = _as_the_trainer_converts(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    total = sum(p.numel() for p in loaded.parameters())
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["on_meta"]
        assert got["local"] <= 0.52 * total, (rank, got["local"] / total)  # dim-0 halves (+ an odd row's padding)
        for name, p in loaded.named_parameters():
            assert torch.equal(got["full"][name], p.detach()), (rank, name)
        for name, b in loaded.named_buffers():
            assert torch.equal(got["buffers"][name], b), (rank, name)
