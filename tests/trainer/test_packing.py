"""Sequence packing (policy.sequence_packing): batches cut by tokens, each run as one row of its real tokens, with the
same logprobs, entropies and training step as the padded batches up to floating-point summation order."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_policy import _cfg, _rollouts, model_dir  # noqa: E402, F401  (model_dir: the tiny model fixture)

from configs.schema import ConfigError  # noqa: E402
from trainer.batch import Batch, Packed  # noqa: E402
from trainer.dp import longest_first_batches, token_chunks  # noqa: E402
from trainer.policy import PolicyWorker  # noqa: E402

PACKED = {"policy.sequence_packing.enabled": "true"}


def test_packed_row_holds_the_real_tokens_and_unpacks_to_the_padded_layout():
    ro = [{"prompt_token_ids": [5, 6], "samples": [{"token_ids": [7, 8, 9], "logprobs": [-1.0, -2.0, -3.0]},
                                                    {"token_ids": [7], "logprobs": [-0.5]}]}]
    b = Batch.from_rollouts(ro, pad_id=0)
    p = Packed(b)
    assert p.tokens.tolist() == [[5, 6, 7, 8, 9, 5, 6, 7]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert p.starts.tolist() == [True, False, False, False, False, True, False, False]
    x = torch.arange(1.0, 9.0, requires_grad=True)
    out = p.unpack(x[None])
    assert out.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    out.sum().backward()
    assert x.grad.tolist() == [1.0] * 8  # differentiable: the training loss reaches the packed logprobs


def test_token_chunks_keep_order_and_the_budget():
    lengths = torch.tensor([5, 3, 9, 2, 2, 4])
    rows = torch.tensor([0, 1, 2, 3, 4, 5])
    chunks = [c.tolist() for c in token_chunks(rows, lengths, 8)]
    assert chunks == [[0, 1], [2], [3, 4, 5]]  # 9 > 8 tokens: alone
    assert torch.cat(token_chunks(rows, lengths, 8)).tolist() == rows.tolist()
    assert token_chunks(rows[:0], lengths, 8) == []
    # the no-grad passes: longest first, then cut by tokens
    assert [c.tolist() for c in longest_first_batches(lengths, 2, max_tokens=9)] == [[2], [0, 5], [1, 3, 4]]


def test_packing_keys_are_checked_against_the_sequence_length():
    with pytest.raises(ConfigError, match="policy.sequence_packing.train_mb_tokens: 100 is less than"):
        _cfg(**PACKED, **{"policy.max_total_sequence_length": 256, "policy.sequence_packing.train_mb_tokens": 100})


FP8 = {"policy.megatron_cfg.fp8_cfg.enabled": "true"}


def _native_bf16() -> bool:
    from fp8core.cpu import cpu_caps

    return cpu_caps().native_bf16


# (overrides, tolerance): FP32 differs by summation order; FP8 amplifies that where an activation lands near an FP8
# rounding boundary; the BF16 emulation rounds every GEMM output to BF16 (measured: equal); native BF16 GEMMs block
# the batch's rows differently per layout (measured 3.8e-3 on an AMX Xeon)
NUMERICS = {"fp32": ({"policy.precision": "float32"}, 1e-5),
            "fp8-fp32": ({**FP8, "policy.precision": "float32"}, 1e-4),
            "fp8-bf16-emulated": ({**FP8, "policy.bf16_mode": "emulated"}, 1e-4),
            "bf16-native": ({"policy.bf16_mode": "native"}, 2e-2)}


@pytest.mark.parametrize("numerics", list(NUMERICS))
def test_packed_logprobs_and_entropies_equal_the_padded_ones(model_dir, numerics):  # noqa: F811
    """Same weights, the same rows: padded batches (each trimmed to its longest row) vs packed rows, logprobs and
    entropies on every real token within the numerics' tolerance (NUMERICS: the layout changes summation order; the
    measured max |diff| is printed), zero on padding and on each sequence's first token."""
    over, tol = NUMERICS[numerics]
    if numerics == "bf16-native" and not _native_bf16():
        pytest.skip("this CPU has no BF16 units")
    padded = PolicyWorker(model_dir, _cfg(**over))
    packed = PolicyWorker(model_dir, _cfg(**over, **PACKED))
    assert packed._packed_attention and not padded._packed_attention  # one SDPA call per packed sequence
    ro = _rollouts(padded)
    b = Batch.from_rollouts(ro, pad_id=padded.tokenizer.pad_token_id)
    lp0, e0 = padded.logprobs(b, want_entropy=True)
    lp1, e1 = packed.logprobs(b, want_entropy=True)
    real = b.attn.bool()  # (the padded forward also writes logprobs on padding positions; nothing reads them)
    d_lp, d_e = float((lp0 - lp1)[real].abs().max()), float((e0 - e1)[real].abs().max())
    print(f"packed vs padded: max |logp diff| {d_lp:.2e}, max |entropy diff| {d_e:.2e}")
    assert d_lp <= tol and d_e <= tol
    assert (lp1[~real] == 0).all() and (lp1[:, 0] == 0).all() and lp1[real].abs().sum() > 0


@pytest.mark.parametrize("numerics", ["fp32", "fp8-fp32"])
def test_packed_training_step_equals_the_padded_one(model_dir, numerics):  # noqa: F811
    """One step of two updates, micro-batches cut by rows vs by tokens. FP32: the metrics and updated weights agree
    to summation order. FP8: the wgrad GEMM quantizes X and dY in 1x128 groups along tokens, and packing changes
    which tokens share a group -- the padded layout puts padding tokens' activations into X's groups (their dY is
    zero, but they raise the groups' amax and so the real tokens' rounding) -- so the first update's gradients
    differ by FP8 rounding (bounded below, relative L2) and the second update starts from slightly different
    weights. (loss/pg is a mean over micro-batches, whose number differs; loss/total is normalized over the global
    batch.)"""
    over = {**NUMERICS[numerics][0], "policy.train_global_batch_size": 4, "policy.train_micro_batch_size": 2}
    padded = PolicyWorker(model_dir, _cfg(**over))
    packed = PolicyWorker(model_dir, _cfg(**over, **PACKED, **{"policy.sequence_packing.train_mb_tokens": 256}))
    from process.faults import TestHooks

    def first_update_gradients(worker):  # the step's first update (the same weights on both sides), before clipping
        worker.hooks = TestHooks(record_gradients=True)
        metrics = worker.train_step(ro, rewards, step=1)
        g = worker.hooks.recorded_updates[0]
        return metrics, torch.cat([g[k].flatten() for k in sorted(g)])

    ro = _rollouts(padded)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    m0, a = first_update_gradients(padded)
    m1, b = first_update_gradients(packed)
    dg = float((b - a).norm() / a.norm())
    rel = {k: abs(m1[k] - m0[k]) / abs(m0[k]) for k in ("loss/total", "train/grad_norm")}
    print(f"{numerics}: first update's gradient relative L2 diff {dg:.2e}, relative metric diffs {rel}")
    assert m1["train/tokens"] == m0["train/tokens"]
    assert m1["train/padding_frac"] == 0.0 < m0["train/padding_frac"]  # the packed forwards computed no padding
    assert m1["mismatch/token_mult_prob_error"] == pytest.approx(m0["mismatch/token_mult_prob_error"], rel=1e-6)
    if numerics == "fp32":
        assert dg < 1e-5 and max(rel.values()) < 1e-5
    else:  # FP8's own error against the FP32 gradient, padded and packed: packing does not make it worse
        _, exact = first_update_gradients(PolicyWorker(model_dir, _cfg(**{**over, "policy.megatron_cfg.fp8_cfg."
                                                                                   "enabled": "false"})))
        e_pad, e_pack = (float((g - exact).norm() / exact.norm()) for g in (a, b))
        print(f"FP8 gradient error vs FP32: padded {e_pad:.2e}, packed {e_pack:.2e}")
        assert e_pack <= 1.1 * e_pad and dg < 2 * e_pad and max(rel.values()) < 2e-2


@pytest.mark.parametrize("n,world,budget", [(8, 2, 12), (9, 3, 10), (5, 4, 30), (16, 3, 7)])
def test_ranks_rebuild_the_single_workers_packed_batches(n, world, budget):
    """Data-parallel no-grad passes with packing: each rank's share of whole batches, batched again by the rank
    (longest first, cut by tokens), gives exactly the single worker's packed batches."""
    from trainer.dp import DPGroup, share_batches

    lengths = torch.randint(3, 8, (n,), generator=torch.Generator().manual_seed(n * 10 + world))
    single = [b.tolist() for b in longest_first_batches(lengths, 4, max_tokens=budget)]
    ranks = []
    for rank in range(world):
        mine = share_batches(lengths, 4, DPGroup(rank=rank, world=world), max_tokens=budget)
        ranks += [mine[b].tolist() for b in longest_first_batches(lengths[mine], 4, max_tokens=budget)]
    assert ranks == single


def test_bench_table_and_bad_arguments(tmp_path, capsys):
    from bench.packing import main, table

    med = {"response_tokens_mean": 40.2, "response_tokens_max": 96, "padded_padding_frac": 0.42,
           "packed_padding_frac": 0.0, "padded_s": 2.0, "packed_s": 1.5}
    assert table([{"recipe": "configs/x.yaml", "median": med}]).splitlines()[2] == \
        "| `configs/x.yaml` | 40 / 96 | 42.0% | 0.0% | 2.00 | 1.50 | 0.75x |"
    for args, needle in [(["--steps", "0"], "--steps"), (["policy.no_such_key=1"], "policy.no_such_key")]:
        with pytest.raises(SystemExit):
            main([*args, "--no-results-doc"])
        assert needle in capsys.readouterr().err
