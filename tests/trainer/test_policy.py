"""PolicyWorker on a 2-layer tiny Qwen3 (CPU): token alignment, GRPO train step, FP8 conversion, calibrations,
non-finite skip, checkpoint resume determinism."""
import math
from pathlib import Path

import pytest
import torch

from configs.schema import Config, config_from_dict
from trainer.batch import Batch
from trainer.policy import PolicyWorker, lr_lambda
from trainer.train_step import leave_one_out_advantages

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir():
    from embedded.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny",
                            TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000))


def _cfg(**over) -> Config:
    base = {"policy": {"train_global_batch_size": 4, "train_micro_batch_size": 2, "logprob_batch_size": 4,
                       "optimizer": {"lr": 1e-3}},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": 10}}
    return config_from_dict(base, [f"{k}={v}" for k, v in over.items()])


def _rollouts(worker, answers=("3", "7")):
    """Two prompts x 4 responses; rollout logprobs = the policy's own logprobs (a perfect rollout engine)."""
    from embedded.tiny_model import chat_prompt

    tok = worker.tokenizer
    out = []
    for i, q in enumerate(["What is 1 plus 2?", "What is 3 plus 4?"]):
        p = tok(chat_prompt(tok, q), add_special_tokens=False).input_ids
        samples = []
        for j, guess in enumerate([answers[i], "5", answers[i] + "1", "2"]):
            ids = tok(f"x = {guess}. The answer is \\boxed{{{guess}}}." + tok.eos_token, add_special_tokens=False).input_ids
            ids = ids[: 8 + 3 * j]  # different lengths
            samples.append({"token_ids": ids, "logprobs": [0.0] * len(ids), "text": tok.decode(ids)})
        out.append({"prompt_token_ids": p, "samples": samples})
    b = Batch.from_rollouts(out, pad_id=tok.pad_token_id)
    lp, _ = worker.logprobs(b)
    k = 0
    for r in out:
        for s in r["samples"]:
            start = len(r["prompt_token_ids"])
            s["logprobs"] = lp[k, start: start + len(s["token_ids"])].tolist()
            k += 1
    return out


def test_batch_alignment():
    ro = [{"prompt_token_ids": [5, 6], "samples": [{"token_ids": [7, 8, 9], "logprobs": [-1.0, -2.0, -3.0]},
                                                    {"token_ids": [7], "logprobs": [-0.5]}]}]
    b = Batch.from_rollouts(ro, pad_id=0)
    assert b.tokens.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]
    assert b.mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert b.rollout_logp[0].tolist() == [0, 0, -1, -2, -3] and b.attn[1].tolist() == [1, 1, 1, 0, 0]


def test_lr_schedule_and_rloo():
    kw = dict(warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert [lr_lambda(s, decay="constant", **kw) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_lambda(12, decay="linear", **kw) == pytest.approx(0.1)
    assert lr_lambda(7, decay="cosine", **kw) == pytest.approx(0.55)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    assert leave_one_out_advantages(r, group_size=3).tolist() == pytest.approx([1.0, -0.5, -0.5, 0, 0, 0])


def test_logprobs_match_manual_forward(model_dir):
    w = PolicyWorker(model_dir, _cfg(**{"policy.precision": "float32"}))
    ro = _rollouts(w)
    b = Batch.from_rollouts(ro, pad_id=w.tokenizer.pad_token_id)
    lp, ent = w.logprobs(b, want_entropy=True)
    seq = b.tokens[0, : int(b.attn[0].sum())]
    with torch.no_grad():
        logits = w.model(input_ids=seq[None]).logits[0]
    ref = torch.log_softmax(logits[:-1].double(), -1).gather(-1, seq[1:, None]).squeeze(-1)
    assert torch.allclose(lp[0, 1: len(seq)].double(), ref, atol=1e-5)
    assert (ent[b.mask.bool()] > 0).all()


@pytest.mark.slow
def test_train_step_learns_and_reports(model_dir):
    w = PolicyWorker(model_dir, _cfg(**{"policy.precision": "float32", "loss_fn.use_importance_sampling_correction":
                                        "true"}))
    ro = _rollouts(w)
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    b = Batch.from_rollouts(ro, pad_id=w.tokenizer.pad_token_id)

    def seq_logp():
        return (w.logprobs(b)[0] * b.mask).sum(1)

    before = seq_logp()
    m = w.train_step(ro, rewards, step=1)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-4)  # rollout logp == trainer logp
    for key in ("clip/lower_neg_adv_frac", "clip/upper_pos_adv_frac", "policy/entropy", "response/length_mean",
                "loss/pg", "train/grad_norm", "train/lr", "is/weight_mean", "reward/mean", "clip/bound_low",
                "throughput/train_tokens_per_s", "time/policy_train_s"):
        assert key in m, key
    assert m["train/optimizer_updates"] == 2 and m["reward/mean"] == 0.25
    for _ in range(3):
        w.train_step(_rollouts(w), rewards, step=2)
    delta = seq_logp() - before
    # Rewarded samples (0 and 4) gain log-probability relative to the unrewarded ones of their group.
    assert delta[0] > delta[1:4].max() and delta[4] > delta[5:8].max()


@pytest.mark.slow
def test_fp8_policy_calibrations_and_nonfinite_skip(model_dir):
    cfg = _cfg(**{"policy.megatron_cfg.fp8_cfg.enabled": "true", "calibration.calibrated_clipping": "true",
                  "calibration.clip_period": 1})
    w = PolicyWorker(model_dir, cfg)
    assert len(w.fp8_layers) == 2 * 7  # q,k,v,o,gate,up,down per decoder layer
    assert w.bounds() == (0.6, 1.8)  # calibration.clip_init_*: the paper's start, not the BF16 reference
    ro = _rollouts(w)
    m = w.train_step(ro, [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0], step=1)
    assert "calib/bound_low" in m and m["time/clip_calibration_s"] > 0
    # FP8 vs its BF16 shadow differ, so the ratio-error amplification is a finite positive number
    assert m["calib/prob_abs_err"] > 0 and 0 < m["calib/ratio_error_amplification"] < float("inf")
    lo, hi = w.bounds()  # smoothing caps from calibration.clip_max_delta_{low,high}
    assert abs(lo - 0.6) <= 0.05 + 1e-9 and abs(hi - 1.8) <= 0.1 + 1e-9
    # the step logs the bounds its loss used; the calibration's, for the next steps, under calib/
    assert (m["clip/bound_low"], m["clip/bound_high"]) == (0.6, 1.8)
    assert (m["calib/bound_low"], m["calib/bound_high"]) == w.bounds()
    scales = w.calibrate_kv_scales(ro, max_samples=4)
    assert len(scales["k_scale"]) == len(scales["v_scale"]) == 2 and min(scales["k_scale"]) > 0
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    m = w.train_step(ro, [float("nan")] + [0.0] * 7, step=2)
    assert m["train/skipped_updates"] == 2 and m["train/optimizer_updates"] == 0
    assert all(torch.equal(before[k], v) for k, v in w.model.state_dict().items())


@pytest.mark.slow
def test_checkpoint_resume_is_deterministic(model_dir, tmp_path):
    cfg = _cfg()
    a = PolicyWorker(model_dir, cfg)
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    a.train_step(_rollouts(a), rewards, step=1)
    uri = a.save_checkpoint(f"file://{tmp_path}/ck", 1, extra={"mlflow_run_id": "r1"}, keep_last_k=1)
    ro = _rollouts(a)
    ma = a.train_step(ro, rewards, step=2)
    b = PolicyWorker(model_dir, cfg)
    state = b.load_checkpoint(f"file://{tmp_path}/ck")
    assert state["step"] == 1 and state["mlflow_run_id"] == "r1" and uri.endswith("step_000001")
    mb = b.train_step(ro, rewards, step=2)
    assert mb["loss/total"] == pytest.approx(ma["loss/total"], rel=1e-6) and mb["train/lr"] == ma["train/lr"]
    for (k, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k


def test_train_lr_metric_is_the_lr_the_updates_used(model_dir):
    # warmup_steps=2: the first RL step's updates run at lr/2, the second at lr; the metric must say so, not
    # the already-advanced LR of the next step.
    w = PolicyWorker(model_dir, _cfg(**{"policy.precision": "float32", "policy.scheduler.warmup_steps": 2}))
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert w.train_step(_rollouts(w), rewards, step=1)["train/lr"] == pytest.approx(5e-4)
    assert w.train_step(_rollouts(w), rewards, step=2)["train/lr"] == pytest.approx(1e-3)


# ------------------------------------------------------------------ step speed-ups keep the numbers
def test_trimmed_sorted_logprobs_equal_full_width_forward(model_dir):
    """logprobs() batches rows longest-first and cuts each batch to its longest sequence: the values at real
    positions equal a full-width, input-order forward (right padding + causal attention)."""
    w = PolicyWorker(model_dir, _cfg(**{"policy.precision": "float32", "policy.logprob_batch_size": 3}))
    b = Batch.from_rollouts(_rollouts(w), pad_id=w.tokenizer.pad_token_id)
    lp, ent = w.logprobs(b, want_entropy=True)
    with torch.no_grad():
        w.model.eval()
        ref, ref_ent = w._token_logp(b, want_entropy=True)
    valid = b.attn.bool()
    assert torch.allclose(lp[valid], ref[valid], atol=1e-5) and torch.allclose(ent[b.mask.bool()],
                                                                              ref_ent[b.mask.bool()], atol=1e-5)
    rows = torch.tensor([5, 0, 3])
    sub, _ = w.logprobs(b, rows=rows)
    assert torch.equal(sub, w.logprobs(b.slice(rows))[0])
    trimmed = b.slice(torch.tensor([1])).trimmed()
    assert trimmed.width == int(b.attn[1].sum()) < b.width


def test_importance_weights_are_per_row():
    """train_step computes IS weights per micro-batch for the first update's rows: each row's weights must not
    depend on the other rows of the batch (every kind)."""
    from fp8core.rl import importance_weights

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=g)
    roll = old + 0.3 * torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.2).float()
    for kind in ("tis", "icepop", "seq_mask_tis"):
        full = importance_weights(old, roll, mask, kind=kind)[0]
        part = importance_weights(old[2:5], roll[2:5], mask[2:5], kind=kind)[0]
        assert torch.equal(full[2:5], part), kind


@pytest.mark.slow
@pytest.mark.parametrize("gbs,separate", [(4, 4), (8, 0)])
def test_old_logprobs_from_first_update_forward(model_dir, gbs, separate):
    """Old logprobs of the first update's rows come from its training forwards: the mismatch and entropy metrics
    equal those of a separate no-grad pass over all rows before the step, the no-grad pass covers only the later
    updates' rows (none with one update per step), and the IS-corrected update equals the one computed from the
    separate pass's old logprobs (weights after the step)."""
    from fp8core.rl import mismatch_metrics

    over = {"policy.precision": "float32", "policy.train_global_batch_size": gbs,
            "loss_fn.use_importance_sampling_correction": "true"}
    a, c = PolicyWorker(model_dir, _cfg(**over)), PolicyWorker(model_dir, _cfg(**over))
    ro = _rollouts(a)
    for s in ro[1]["samples"]:  # a rollout engine that disagrees a little: IS weights != 1
        s["logprobs"] = [x - 0.05 for x in s["logprobs"]]
    b = Batch.from_rollouts(ro, pad_id=a.tokenizer.pad_token_id)
    old, ent = a.logprobs(b, want_entropy=True)
    expected = mismatch_metrics(old, b.rollout_logp, b.mask)
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    m = c.train_step(ro, rewards, step=1)
    assert m["train/old_logprob_pass_samples"] == separate
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert m["policy/entropy"] == pytest.approx(float((ent * b.mask).sum() / b.mask.sum()), rel=1e-5)
    c.reuse_first_forward = False  # the separate-pass path on an identical worker gives the same update
    a2 = PolicyWorker(model_dir, _cfg(**over))
    a2.reuse_first_forward = False
    m2 = a2.train_step(ro, rewards, step=1)
    assert m2["train/old_logprob_pass_samples"] == 8
    for p1, p2 in zip(c.model.parameters(), a2.model.parameters(), strict=True):
        assert torch.allclose(p1, p2, rtol=1e-4, atol=1e-6)


def test_dynamic_sampling_filters_identical_reward_groups(model_dir):
    """grpo.dynamic_sampling: the all-zero group leaves the loss -- one update of the mixed group's 4 rows, the same
    weights as a run that only ever saw that group -- yet the mismatch metrics still cover all 8 rollouts."""
    # AdamW's eps = 1 makes its first step ~ lr * gradient (not ~ lr * sign(gradient), which float rounding of a
    # different micro-batch order can flip where a gradient is ~0), so equal gradients give allclose weights.
    over = {"policy.precision": "float32", "policy.train_global_batch_size": 4, "policy.optimizer.eps": 1.0,
            "policy.optimizer.lr": 1.0}
    ds = PolicyWorker(model_dir, _cfg(**over, **{"grpo.dynamic_sampling": "true"}))
    ro = _rollouts(ds)
    rewards = [1.0, 0.0, 0.0, 0.0] + [0.0] * 4  # group 1: identical rewards
    m = ds.train_step(ro, rewards, step=1)
    assert m["reward/frac_groups_all_same"] == 0.5 and m["train/dynamic_sampling_filtered_frac"] == 0.5
    assert m["train/samples_in_loss"] == 4 and m["train/optimizer_updates"] == 1
    assert m["train/old_logprob_pass_samples"] == 4  # the filtered rows: no-grad pass for the metrics
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-4)
    only = PolicyWorker(model_dir, _cfg(**over))  # dynamic sampling off, fed the mixed group alone
    m1 = only.train_step(ro[:1], rewards[:4], step=1)
    assert m1["train/dynamic_sampling_filtered_frac"] == 0.0 and m1["train/optimizer_updates"] == 1
    for p1, p2 in zip(ds.model.parameters(), only.model.parameters(), strict=True):
        assert torch.allclose(p1, p2, rtol=1e-5, atol=1e-7)
    off = PolicyWorker(model_dir, _cfg(**over))  # off on the full batch: both groups, two updates
    m2 = off.train_step(ro, rewards, step=1)
    assert m2["train/samples_in_loss"] == 8 and m2["train/optimizer_updates"] == 2
    assert m2["reward/frac_groups_all_same"] == 0.5 and m2["train/dynamic_sampling_filtered_frac"] == 0.0


def test_clip_metrics_cover_the_updates_after_the_first(model_dir):
    """Two updates per step: ``clip/*`` pools the second update only; ``clip_all_updates/*`` both, where the first
    update (ratio exactly 1) adds its tokens to the populations and nothing to the clipped counts."""
    w = PolicyWorker(model_dir, _cfg(**{"policy.precision": "float32", "policy.train_global_batch_size": 4,
                                        "policy.optimizer.lr": 0.05}))
    ro = _rollouts(w)
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    m = w.train_step(ro, rewards, step=1)
    assert m["train/clip_metric_updates"] == 1 and m["train/optimizer_updates"] == 2
    b = Batch.from_rollouts(ro, pad_id=w.tokenizer.pad_token_id)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0 * 100003 + 1))  # train_step's row order
    adv = w.advantages(torch.tensor(rewards), 4)

    def count(rows, sign):
        return float(((adv[rows][:, None] * sign > 0) & b.mask[rows].bool()).sum())

    first, second = perm[:4], perm[4:]
    for key, sign in (("lower_neg_adv_frac", -1), ("upper_pos_adv_frac", 1), ("lower_pos_adv_frac", 1)):
        share = count(second, sign) / (count(first, sign) + count(second, sign))
        assert m[f"clip_all_updates/{key}"] == pytest.approx(m[f"clip/{key}"] * share, abs=1e-12), key
    assert m["clip/lower_neg_adv_frac"] + m["clip/upper_pos_adv_frac"] > 0  # lr 0.05: the second update moved
    assert m["clip_all_updates/ratio_min"] <= 1.0 <= m["clip_all_updates/ratio_max"]


def test_kv_rounding_in_trainer_replays_the_engine_cache(model_dir):
    """calibration.kv_rounding_in_trainer: the worker's logprobs are the kv_rounding-scored ones with the engine's
    current scales (unit scales before a calibration), the BF16 shadow is not rounded, and training runs."""
    from fp8core.convert import high_precision
    from trainer.kv_rounding import kv_rounding, unit_scales

    fp8 = {"policy.megatron_cfg.fp8_cfg.enabled": "true", "policy.generation.vllm_cfg.kv_cache_dtype": "fp8"}
    plain = PolicyWorker(model_dir, _cfg(**fp8))
    w = PolicyWorker(model_dir, _cfg(**fp8, **{"calibration.kv_rounding_in_trainer": "true"}))
    ro = _rollouts(plain)
    b = Batch.from_rollouts(ro, pad_id=plain.tokenizer.pad_token_id)
    for scales in (None, plain.calibrate_kv_scales(ro, max_samples=8)):
        w.kv_scales = scales
        with kv_rounding(plain.model, scales or unit_scales(2), round_k=True, round_v=True):
            want = plain.logprobs(b)[0]
        got = w.logprobs(b)[0]
        assert torch.equal(got, want)
        assert not torch.equal(got, plain.logprobs(b)[0])  # the rounding changed something
    assert torch.equal(w._shadow_logprobs(b), plain._shadow_logprobs(b))
    with high_precision(plain.model):
        assert torch.equal(w._shadow_logprobs(b), plain.logprobs(b)[0])
    m = w.train_step(ro, [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0], step=1)
    assert m["train/optimizer_updates"] >= 1 and m["mismatch/token_mult_prob_error"] > 1.0


@pytest.mark.parametrize("old", ["trainer", "rollout"])
def test_old_logprobs_rollout_puts_the_mismatch_in_the_ratio(model_dir, old):
    """loss_fn.old_logprobs: with ``rollout`` pi_old is the engine's logprob, so an engine that scores every sampled
    token 0.5 nats higher than the trainer gives ratio e^-0.5 = 0.61 on the first update, and every
    negative-advantage token is silenced at the lower bound 0.8; with ``trainer`` the first update has ratio 1
    and silences none. The mismatch metric is the trainer's old logprobs against the engine's in both."""
    import math

    w = PolicyWorker(model_dir, _cfg(**{"policy.precision": "float32", "policy.train_global_batch_size": 8,
                                        "policy.train_micro_batch_size": 4, "loss_fn.old_logprobs": old}))
    ro = _rollouts(w)
    for r in ro:
        for s in r["samples"]:
            s["logprobs"] = [lp + 0.5 for lp in s["logprobs"]]
    m = w.train_step(ro, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], step=1)
    assert m["train/optimizer_updates"] == 1
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(math.exp(0.5), rel=1e-4)
    if old == "rollout":
        assert m["clip/lower_neg_adv_frac"] == 1.0 and m["clip/upper_pos_adv_frac"] == 0.0
        assert m["clip/ratio_max"] == pytest.approx(math.exp(-0.5), rel=1e-4)
    else:
        assert m["clip/lower_neg_adv_frac"] == 0.0 and m["clip/ratio_max"] == pytest.approx(1.0, abs=1e-6)


def test_old_logprobs_rollout_refuses_a_second_importance_weight():
    from configs.schema import ConfigError

    with pytest.raises(ConfigError, match="loss_fn.use_importance_sampling_correction"):
        _cfg(**{"loss_fn.old_logprobs": "rollout", "loss_fn.use_importance_sampling_correction": "true"})
    with pytest.raises(ConfigError, match="loss_fn.old_logprobs"):
        _cfg(**{"loss_fn.old_logprobs": "engine"})


# ------------------------------------------------------------------ activation checkpointing
AC = "policy.megatron_cfg.activation_checkpointing"
AC_REWARDS = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def _step_with_gradients(model_dir, over: dict, ro=None):
    """One train_step (two optimizer updates of two micro-batches each): the worker, its metrics and the full
    gradients of every update (before clipping)."""
    from process.faults import TestHooks

    w = PolicyWorker(model_dir, _cfg(**over))
    ro = _rollouts(w) if ro is None else ro
    w.hooks = TestHooks(record_gradients=True)
    m = w.train_step(ro, AC_REWARDS, step=1)
    return w, m, w.hooks.recorded_updates, ro


def _same_numbers(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("numerics", [
    {"policy.precision": "float32"},
    {"policy.bf16_mode": "native"},
    {"policy.bf16_mode": "emulated"},
    {"policy.megatron_cfg.fp8_cfg.enabled": "true"},
    {"policy.megatron_cfg.fp8_cfg.enabled": "true", "policy.bf16_mode": "emulated",
     "policy.generation.vllm_cfg.kv_cache_dtype": "fp8", "calibration.kv_rounding_in_trainer": "true"},
], ids=["fp32", "bf16-native", "bf16-emulated", "fp8-blockwise", "fp8-blockwise-emulated-bf16-kv-rounding"])
def test_activation_checkpointing_gives_bit_identical_gradients(model_dir, numerics):
    """policy.megatron_cfg.activation_checkpointing changes what is kept, not what is computed: every update's
    gradients, the weights after the step and every metric but the timings are bit-identical to the plain step.
    Why exactly: non-reentrant checkpointing keeps the autograd graph of the original forward and only replaces
    its saved tensors by recomputed ones, so the backward runs the same kernels in the same order; the recompute
    is the same forward on the same inputs (FP8 activation codes and scales are a deterministic function of them;
    the FP8 weight codes come from the same weight cache). The recompute must also run under the forward's state:
    torch restores autocast itself, the worker re-enters the rest -- the BF16 emulation (a TorchFunctionMode: a
    recompute without it saves other tensors, and with FP8 linears silently other values) and the engine's KV
    rounding (an attention implementation set around the forward)."""
    w_off, m_off, g_off, ro = _step_with_gradients(model_dir, {**numerics, AC: "false"})
    w_on, m_on, g_on, _ = _step_with_gradients(model_dir, {**numerics, AC: "true"}, ro)
    assert m_on["train/optimizer_updates"] == len(g_on) == len(g_off) == 2
    for u, (a, b) in enumerate(zip(g_off, g_on, strict=True)):
        assert a.keys() == b.keys() and len(a) == len(list(w_on.model.parameters()))
        for k in a:
            assert torch.equal(a[k], b[k]), (u, k)
    for (k, p), q in zip(w_off.model.named_parameters(), w_on.model.parameters(), strict=True):
        assert torch.equal(p, q), k
    assert m_on.keys() == m_off.keys()
    for k in m_off:
        if not k.startswith(("time/", "throughput/")):
            assert _same_numbers(m_on[k], m_off[k]), k
    assert m_on["loss/total"] == m_off["loss/total"] != 0


def _layer_runs_and_kept(model_dir, ac: str) -> tuple[dict, int]:
    """One train_step: how often each decoder layer ran its forward with and without grad; then the bytes a
    two-row training forward saved for its backward through autograd (parameters not counted)."""
    from trainer.dp import decoder_layers

    w = PolicyWorker(model_dir, _cfg(**{"policy.precision": "float32", AC: ac}))
    ro = _rollouts(w)
    calls, saved = [], []
    for i, layer in enumerate(decoder_layers(w.model)):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: calls.append((i, torch.is_grad_enabled())))
    w.train_step(ro, AC_REWARDS, step=1)
    runs = {(i, g): calls.count((i, g)) for i in range(2) for g in (True, False)}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            saved.append(t.numel() * t.element_size())
        return t

    mb = Batch.from_rollouts(ro, pad_id=w.tokenizer.pad_token_id).slice(torch.arange(2)).trimmed()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        w._token_logp(mb)[0].sum().backward()
    return runs, sum(saved)


def test_activation_checkpointing_recomputes_every_layer_in_the_backward(model_dir):
    """With the key on, each decoder layer runs its forward twice per training micro-batch -- the forward, then
    again in the backward -- and once per no-grad forward; off, once each. The step's four micro-batches (two
    updates of two) and its one no-grad batch (the second update's old logprobs) give 8 + 1 runs per layer on, 4 + 1
    off. What a training forward keeps for the backward, outside the checkpoint's own copy of each layer's inputs,
    shrinks to what runs outside the decoder layers (embeddings, final norm, output projection, loss): less than
    a fifth on this model."""
    runs_off, kept_off = _layer_runs_and_kept(model_dir, "false")
    runs_on, kept_on = _layer_runs_and_kept(model_dir, "true")
    assert runs_off == {(i, g): 4 if g else 1 for i in range(2) for g in (True, False)}
    assert runs_on == {(i, g): 8 if g else 1 for i in range(2) for g in (True, False)}
    assert kept_on < kept_off / 2, (kept_on, kept_off)


def test_activation_checkpointing_recomputes_under_the_routing_replay():
    """MoE with routing replay (policy.router_replay.enabled): the recompute of each layer routes to the engine's
    experts as its forward did (the worker re-enters the replay around it; the backward runs after the forward's
    replay ended), so the gradients are bit-identical to the plain step's. The engine's experts here are random,
    unlike the router's own choice (``moe/routing_mismatch_frac`` > 0), so a recompute under the router's own
    choice would differ."""
    from embedded.tiny_model import TinyModelSpec, build_tiny_model

    moe_dir = build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny-moe",
                               TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000, num_experts=4))
    over = {"policy.megatron_cfg.fp8_cfg.enabled": "true", "policy.router_replay.enabled": "true"}
    w = PolicyWorker(moe_dir, _cfg(**over))
    ro, g = _rollouts(w), torch.Generator().manual_seed(0)
    for r in ro:
        for s in r["samples"]:  # [tokens, MoE layers, top-k] distinct experts per token and layer
            n = len(r["prompt_token_ids"]) + len(s["token_ids"])
            s["routed_experts"] = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n * 2)]).reshape(
                n, 2, 2).to(torch.int16)
    _, m_off, g_off, _ = _step_with_gradients(moe_dir, {**over, AC: "false"}, ro)
    _, m_on, g_on, _ = _step_with_gradients(moe_dir, {**over, AC: "true"}, ro)
    assert m_on["moe/router_replay"] == 1.0 and m_on["moe/routing_mismatch_frac"] > 0.5
    assert len(g_on) == len(g_off) == 2
    for u, (a, b) in enumerate(zip(g_off, g_on, strict=True)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (u, k)
    assert m_on["loss/total"] == m_off["loss/total"]


def test_gspo_clips_one_ratio_per_sequence(model_dir):
    """loss_fn.sequence_level_importance_ratios (GSPO): an engine that scores only each response's first token 0.5
    nats higher gives, against it (old_logprobs: rollout), one ratio per sequence, exp(-0.5 / its length) -- the
    largest for the longest response -- where the token-level ratio is e^-0.5 on first tokens and 1 elsewhere."""
    import math

    over = {"policy.precision": "float32", "policy.train_global_batch_size": 8, "policy.train_micro_batch_size": 4,
            "loss_fn.old_logprobs": "rollout", "loss_fn.token_level_loss": "false"}
    for gspo in (True, False):
        w = PolicyWorker(model_dir, _cfg(**over, **{"loss_fn.sequence_level_importance_ratios": str(gspo).lower()}))
        ro = _rollouts(w)
        for r in ro:
            for s in r["samples"]:
                s["logprobs"] = [s["logprobs"][0] + 0.5, *s["logprobs"][1:]]
        lengths = [len(s["token_ids"]) for r in ro for s in r["samples"]]
        m = w.train_step(ro, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], step=1)
        assert m["train/optimizer_updates"] == 1
        if gspo:
            assert m["clip/ratio_max"] == pytest.approx(math.exp(-0.5 / max(lengths)), rel=1e-4)
            assert m["clip/ratio_min"] == pytest.approx(math.exp(-0.5 / min(lengths)), rel=1e-4)
        else:
            assert m["clip/ratio_max"] == pytest.approx(1.0, abs=1e-6)
            assert m["clip/ratio_min"] == pytest.approx(math.exp(-0.5), rel=1e-4)


def test_reference_kl_is_zero_at_the_start_then_the_hand_computed_k3(model_dir):
    """loss_fn.reference_policy_kl_penalty > 0: the reference is the frozen initial policy, so the first step's KL
    is exactly 0 (same weights, same FP8 numerics); the next step's ``loss/reference_kl`` is the k3 estimate between
    the policy before that step's update and a separately built initial policy, averaged over the sampled tokens."""
    import math

    over = {"policy.train_global_batch_size": 8, "policy.train_micro_batch_size": 8,
            "policy.megatron_cfg.fp8_cfg.enabled": "true", "loss_fn.reference_policy_kl_penalty": 0.1}
    w = PolicyWorker(model_dir, _cfg(**over))
    ro = _rollouts(w)
    b = Batch.from_rollouts(ro, pad_id=w.tokenizer.pad_token_id)
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    m1 = w.train_step(ro, rewards, step=1)
    assert m1["loss/reference_kl"] == 0.0 and m1["time/reference_logprob_s"] > 0
    lp = w.logprobs(b)[0]
    ref = PolicyWorker(model_dir, _cfg(**over)).logprobs(b)[0]  # the initial policy, built anew
    mask = b.mask.bool()
    d = [max(-20.0, min(20.0, p - r)) for p, r in zip(lp[mask].tolist(), ref[mask].tolist(), strict=True)]
    k3 = [min(10.0, math.exp(-x) + x - 1) for x in d]  # NeMo RL's default clamps: input 20, output 10
    m2 = w.train_step(ro, rewards, step=2)
    assert m2["loss/reference_kl"] == pytest.approx(sum(k3) / len(k3), rel=1e-4) and m2["loss/reference_kl"] > 0
    assert m2["loss/total"] == pytest.approx(m2["loss/pg"] + 0.1 * m2["loss/reference_kl"], rel=1e-5, abs=1e-7)


def test_the_step_raises_the_quantizers_error_for_a_flagged_device():
    """Off the CPU the FP8 quantizer flags non-finite input instead of raising (no host read); the train step's
    check, where it reads the loss anyway, raises quantize's error then, once, and stays quiet for clean input.
    (Exercised here through the device quantizer on CPU tensors.)"""
    from fp8core.quant import NON_FINITE, quantize_on_device
    from trainer.train_step import raise_if_fp8_saw_nonfinite

    cpu = torch.device("cpu")
    raise_if_fp8_saw_nonfinite(cpu)  # nothing flagged yet (or cleared)
    quantize_on_device(torch.randn(4, 256), "group128")
    raise_if_fp8_saw_nonfinite(cpu)
    bad = torch.randn(4, 256)
    bad[1, 7] = float("nan")
    quantize_on_device(bad, "group128")
    with pytest.raises(ValueError) as got:
        raise_if_fp8_saw_nonfinite(cpu)
    assert str(got.value) == NON_FINITE
    raise_if_fp8_saw_nonfinite(cpu)  # read and cleared
