"""The phases of one GRPO training step (``PolicyWorker.train_step`` runs them in this order): plan the step's
rows and old logprobs, prepare the loss, per optimizer update accumulate the gradients (the first update also
completes the old logprobs) and step the optimizer, gather the ranks' parts, compute the step's metrics (Calibrated
Clipping's pass after the update: trainer/calibration.py).

Functions of the PolicyWorker's state: ``worker`` is the PolicyWorker (trainer/policy.py) they read and update;
what one step carries from phase to phase is a :class:`StepState`.

Train step (one GRPO step on a batch of ``P`` prompts x ``G`` generations):
1. ``old_logp`` = trainer logprobs before any update -> ``mismatch/*`` against the rollout logprobs. The rows of
   the first optimizer update take them from that update's own training forwards (same weights, detached), so a
   separate no-grad pass runs only over the later updates' rows (none with one update per step; the count is
   ``train/old_logprob_pass_samples``). Every forward is cut to its micro-batch's longest sequence.
2. Advantages ``A_i = (r_i - mean_g r) / (std_g r + eps)`` (``grpo.normalize_rewards``; else ``r_i - mean_g r``),
   or leave-one-out baseline ``r_i - mean_{j != i} r_j`` (``grpo.use_leave_one_out_baseline``).
3. Optional IS correction weights ``w = f(pi_old / pi_rollout)`` (TIS / ICE-POP / seq-mask-TIS).
4. The batch is split into ``P*G / train_global_batch_size`` optimizer steps, each accumulated over micro-batches
   with the loss normalizer = valid tokens (token-level loss) or sequences of the global batch, so accumulation
   reproduces the full-batch loss. Gradient norm clipped to ``max_grad_norm``; a non-finite loss or gradient skips
   that optimizer step (counted in ``train/skipped_updates``; the weights are untouched). Non-finite input to an FP8
   quantization fails the step with quantize's error: at once on a CPU, at the loss check off the CPU.
   DAPO dynamic sampling (``grpo.dynamic_sampling``): groups whose rewards are all equal (zero advantage, no
   gradient) are *filtered out of the loss*, not re-sampled: the kept rows are split into
   ``ceil(kept / train_global_batch_size)`` updates of near-equal size, so their tokens are no longer diluted by
   zero-advantage ones in the token-level normalizer. Their old logprobs are still computed (no-grad pass) so the
   mismatch / entropy metrics cover every rollout. ``train/dynamic_sampling_filtered_frac`` = share of groups
   filtered (0 when off); ``reward/frac_groups_all_same`` is logged either way.
   ``clip/*`` fractions are pooled over the updates after the first (the first update's ratio is exactly 1, so it
   only dilutes them; with a single update they cover it); ``clip_all_updates/*`` pools every update.
5. Calibrated Clipping (every K steps, FP8 training only): BF16-shadow (``fp8core.convert.high_precision``) and FP8
   logprobs of the same tokens before and after the update give ``ratio_bf16`` / ``ratio_fp8``; the controller
   moves the clip bounds used by later steps. The same forwards give ``calib/ratio_error_amplification``
   (mean |r_fp8 - r_bf16| / mean |p_fp8 - p_bf16| on the sampled tokens, p the updated policy's probabilities);
   ``time/clip_calibration_s`` is the shadow passes' wall time (0 on steps without a calibration).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fp8core.quant import NON_FINITE, NonFiniteInput, nonfinite_seen
from trainer.batch import Batch, _pad_cols
from trainer.dp import all_min, clip_grad_norm, equal_count, full_tensor, gather_objects, token_chunks
from trainer.dp import all_sum as dp_sum
from trainer.forward import moe_metrics, start_moe_measure, token_logp, zero_loss
from trainer.logprobs import reference_logprobs, shadow_logprobs


def leave_one_out_advantages(rewards: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """RLOO baseline (Ahmadian et al. 2024): ``A_i = r_i - mean_{j != i, j in g(i)} r_j``."""
    g = rewards.reshape(-1, group_size).to(torch.float64)
    loo = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - loo).reshape(-1).to(rewards.dtype)


@dataclass
class StepState:
    """What one ``train_step`` carries from phase to phase (rows are indices into ``b``)."""

    step: int
    b: Batch
    r: torch.Tensor  # rewards, one per row
    keep: torch.Tensor  # rows in the loss (DAPO dynamic sampling filters whole groups)
    trained: torch.Tensor  # the kept rows, shuffled
    update_rows: list[torch.Tensor]  # rows of each optimizer update
    first: torch.Tensor  # rows whose old logprobs the first update's forwards provide
    later: torch.Tensor  # rows with a separate no-grad old-logprob pass
    old_logp: torch.Tensor  # [B, L] the policy before the first update
    ent: torch.Tensor  # [B, L] its entropies (FP64)
    known: torch.Tensor  # rows whose old_logp is filled in
    adv: torch.Tensor | None = None
    is_w: torch.Tensor | None = None  # [B, L] IS weights (loss_fn.use_importance_sampling_correction)
    is_kw: dict = field(default_factory=dict)
    ref_logp: torch.Tensor | None = None  # pi_old of the ratio
    kl_ref_logp: torch.Tensor | None = None  # [B, L] the reference policy's logprobs (reference-policy KL)
    clip_low: float = 0.0
    clip_high: float = 0.0
    calibrate: bool = False  # a Calibrated Clipping step
    old_bf16: torch.Tensor | None = None  # the BF16 shadow's old logprobs on such a step
    sums: dict = field(default_factory=dict)  # loss terms summed over micro-batches
    clip_parts: list = field(default_factory=list)  # (update, clip metrics, advantages, mask) per micro-batch
    n_mb: int = 0
    n_gb: int = 0
    grad_norms: list = field(default_factory=list)
    updates: int = 0
    t_old: float = 0.0
    t_cal: float = 0.0
    t_opt: float = 0.0
    t_ref: float = 0.0


def compute_advantages(worker, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    from fp8core.rl import grpo_advantages

    g = worker.cfg.grpo
    if g.use_leave_one_out_baseline:
        adv = leave_one_out_advantages(rewards, group_size=group_size)
        if g.normalize_rewards:
            std = rewards.reshape(-1, group_size).std(dim=1, keepdim=True).expand(-1, group_size).reshape(-1)
            adv = adv / (std + 1e-6)
        return adv
    return grpo_advantages(rewards, group_size=group_size, normalize_std=g.normalize_rewards)


def plan_step(worker, rollouts: Sequence[Mapping], rewards: Sequence[float], step: int) -> StepState:
    """The step's batch and rewards, the rows of each optimizer update (DAPO filtering), and the old logprobs
    (+ entropies) of the rows the first update's forwards will not provide (item 1 of the module docstring)."""
    cfg = worker.cfg
    b = Batch.from_rollouts(rollouts, pad_id=worker.tokenizer.pad_token_id)
    r = torch.tensor(list(rewards), dtype=torch.float32)
    if r.numel() != len(b):
        raise ValueError(f"train_step: {r.numel()} rewards for {len(b)} samples")
    if worker.moe_layers:  # moe/* metrics from the forwards on the weights the engine ran (before the first update)
        start_moe_measure(worker)
    perm = torch.randperm(len(b), generator=torch.Generator().manual_seed(cfg.grpo.seed * 100003 + step))
    keep = torch.ones(len(b), dtype=torch.bool)
    if cfg.grpo.dynamic_sampling:  # DAPO: identical-reward groups leave the loss (module docstring, item 4)
        from fp8core.rl import dynamic_sampling_mask

        keep = dynamic_sampling_mask(r, group_size=b.group_size, per_sample=True)
    trained = perm[keep[perm]]
    n_upd = -(-len(trained) // cfg.policy.train_global_batch_size)
    update_rows = list(torch.tensor_split(trained, n_upd)) if n_upd else []
    # Old logprobs = the policy before this step's first update. The first update's own training forwards run
    # exactly those weights, so its rows take old_logp (and entropy) from them (detached) and only the other
    # rows need a separate no-grad pass -- none with one update per step and no filtering. Not with dropout
    # (the training forward would differ from the eval one).
    first = update_rows[0] if update_rows and worker.reuse_first_forward else perm[:0]
    in_first = torch.zeros(len(b), dtype=torch.bool)
    in_first[first] = True
    later = perm[~in_first[perm]]
    st = StepState(step=step, b=b, r=r, keep=keep, trained=trained, update_rows=update_rows, first=first,
                    later=later, old_logp=torch.zeros(len(b), b.width),
                    ent=torch.zeros(len(b), b.width, dtype=torch.float64),  # token_entropy's dtype
                    known=torch.zeros(len(b), dtype=torch.bool))
    if len(later):
        st.old_logp[later], st.ent[later] = worker.logprobs(b, want_entropy=True, rows=later)
        st.known[later] = True
    if worker.ref_model is not None:  # reference-policy KL: the frozen initial policy on every row (dense only)
        tr = time.perf_counter()
        st.kl_ref_logp = reference_logprobs(worker, b)
        st.t_ref = time.perf_counter() - tr
    return st


def prepare_loss(worker, st: StepState) -> None:
    """Advantages (item 2), the later rows' IS weights (item 3), the BF16 shadow's old logprobs on a Calibrated
    Clipping step (item 5), pi_old of the ratio and the clip bounds of this step."""
    from fp8core.rl import importance_weights

    lf, b, later = worker.cfg.loss_fn, st.b, st.later
    st.adv = worker.advantages(st.r, b.group_size)
    st.is_kw = dict(kind=lf.importance_sampling, cap=lf.is_truncation, low=lf.is_mask_low, high=lf.is_mask_high)
    if lf.use_importance_sampling_correction:  # per-row weights (tested): the later rows now, the first
        st.is_w = torch.zeros(len(b), b.width)  # update's rows in its loop
        if len(later):
            st.is_w[later] = importance_weights(st.old_logp[later], b.rollout_logp[later], b.mask[later],
                                                **st.is_kw)[0]
    st.calibrate = worker.cc is not None and worker.cc.should_calibrate(st.step)
    if st.calibrate:
        tc = time.perf_counter()
        st.old_bf16 = shadow_logprobs(worker, b)
        st.t_cal += time.perf_counter() - tc
    # pi_old of the ratio (loss_fn.old_logprobs): the trainer's logprobs before the first update (old_logp, filled
    # in by the first update's forwards) or the rollout engine's (the ratio then carries the mismatch)
    st.ref_logp = b.rollout_logp if lf.old_logprobs == "rollout" else st.old_logp
    st.clip_low, st.clip_high = worker.bounds()


def accumulate_update(worker, st: StepState, u: int, gidx: torch.Tensor) -> bool:
    """Forward + backward of update ``u``'s rows (this rank's share) in micro-batches, gradients accumulated
    (data-parallel: reduced at the end); the first update's forwards also fill in the old logprobs, entropies
    and IS weights of its rows. Returns False when a loss was not finite (on any rank)."""
    from fp8core.rl import clipped_pg_loss, importance_weights

    lf, b, adv = worker.cfg.loss_fn, st.b, st.adv
    mbs = worker.cfg.policy.train_micro_batch_size
    agg = "token_mean" if lf.token_level_loss else "seq_mean_token_mean"
    level = "sequence" if lf.sequence_level_importance_ratios else "token"  # GSPO: one ratio per sequence
    gm = b.mask[gidx]
    normalizer = float(gm.sum().clamp_min(1)) if lf.token_level_loss else float((gm.sum(1) > 0).sum())
    worker.optimizer.zero_grad(set_to_none=True)
    st.n_gb += 1
    finite = True
    mine = worker.dp.share(gidx)  # data-parallel: this rank's contiguous share (all rows without a group)
    # data-parallel: every rank runs the largest rank's number of micro-batches (per-layer collectives in each);
    # one with fewer, or past a non-finite loss, runs zero-weighted ones. Micro-batches of mbs rows, or with
    # sequence packing of at most _train_tokens tokens
    if worker._train_tokens is None:
        n_mb = -(-equal_count(len(gidx), worker.dp) // mbs)
        chunks = [mine[j * mbs: (j + 1) * mbs] for j in range(n_mb)]
    else:
        chunks = token_chunks(mine, b.attn.sum(1), worker._train_tokens)
        n_mb = -int(all_min(-float(len(chunks)), worker.dp))
    one = b.slice(gidx[:1]).trimmed()
    for j in range(n_mb):
        idx = chunks[j] if j < len(chunks) else mine[:0]
        if not len(idx) or not finite:
            if not worker.dp.active:
                break
            zero_loss(worker, one).backward()
            continue
        mb = b.slice(idx).trimmed()
        w = mb.width
        fresh = u == 0 and len(st.first) > 0  # rows whose old logprobs this forward provides
        logp, e = token_logp(worker, mb, want_entropy=fresh)
        if fresh:
            st.old_logp[idx] = _pad_cols(logp.detach().cpu(), b.width)
            st.ent[idx] = _pad_cols(e.cpu(), b.width)
            st.known[idx] = True
            if st.is_w is not None:
                st.is_w[idx] = _pad_cols(importance_weights(st.old_logp[idx, :w], mb.rollout_logp, mb.mask,
                                                            **st.is_kw)[0], b.width)
        loss, lm = clipped_pg_loss(
            logp, st.ref_logp[idx, :w].to(logp.device), adv[idx].to(logp.device), mb.mask.to(logp.device),
            clip_low=st.clip_low, clip_high=st.clip_high, dual_clip=lf.ratio_clip_c, loss_agg=agg, ratio_level=level,
            is_weights=None if st.is_w is None else st.is_w[idx, :w].to(logp.device), normalizer=normalizer,
            ref_logp=None if st.kl_ref_logp is None else st.kl_ref_logp[idx, :w].to(logp.device),
            kl_coef=lf.reference_policy_kl_penalty, kl_type=lf.reference_policy_kl_type,
            kl_input_clamp=lf.kl_input_clamp_value, kl_output_clamp=lf.kl_output_clamp_value)
        loss_finite = bool(torch.isfinite(loss))  # the step reads the device here anyway
        raise_if_fp8_saw_nonfinite(logp.device)
        if not loss_finite:
            finite = False
            if worker.dp.active:  # this forward's collectives ran: its backward's must too (the update is skipped)
                (logp.sum() * 0.0).backward()
            continue
        loss.backward()
        st.n_mb += 1
        st.clip_parts.append((u, lm, adv[idx], mb.mask))
        for k, v in lm.items():
            if not k.startswith("clip/"):
                st.sums[k] = st.sums.get(k, 0.0) + v
    if worker.dp.active:  # all ranks skip the update if any rank's loss was not finite
        finite = all_min(float(finite), worker.dp) > 0
    return finite


def complete_old_logprobs(worker, st: StepState) -> None:
    """After the first update's forwards: data-parallel ranks share the rows each filled in; rows a non-finite
    loss left out get a no-grad pass (the weights are untouched: that update takes no step)."""
    from fp8core.rl import importance_weights

    b, first = st.b, st.first
    if worker.dp.active and len(first):  # each rank filled its own rows of the first update
        for t in (st.old_logp, st.ent, st.is_w):
            if t is not None:
                part = t[first].clone()
                dp_sum(part, group=worker.dp)
                t[first] = part
        k = st.known[first].double()
        dp_sum(k, group=worker.dp)
        st.known[first] = k > 0
    if not bool(st.known.all()):  # a non-finite loss stopped the first update early: its
        missing = (~st.known).nonzero().squeeze(1)  # weights are untouched (no step), so finish the pass
        st.old_logp[missing], st.ent[missing] = worker.logprobs(b, want_entropy=True, rows=missing)
        if st.is_w is not None:
            st.is_w[missing] = importance_weights(st.old_logp[missing], b.rollout_logp[missing], b.mask[missing],
                                                  **st.is_kw)[0]
        st.known[missing] = True
        worker.model.train()


def raise_if_fp8_saw_nonfinite(device: torch.device) -> None:
    """Raise quantize's error if an FP8 quantization on ``device`` saw non-finite input since the last check. On a
    CPU quantize raises at once; off the CPU it cannot without reading the device, so it flags the device
    (fp8core.quant.nonfinite_seen) and the step checks the flag where it reads the loss anyway. No flag, no read."""
    if nonfinite_seen(device):
        raise NonFiniteInput(NON_FINITE)


def optimizer_step(worker, st: StepState, u: int, finite: bool) -> None:
    """Clip the gradient norm and step AdamW, or skip a non-finite update (``train/skipped_updates``)."""
    if worker.hooks is not None:  # TEST-ONLY: full gradients of every update, before clipping
        worker.hooks.on_gradients(u, lambda: {n: full_tensor(q.grad).detach().cpu().clone()
                                              for n, q in worker.model.named_parameters() if q.grad is not None})
    t_opt0 = time.perf_counter()
    gn = clip_grad_norm(worker.model.parameters(), worker.cfg.policy.max_grad_norm, worker.dp)
    if finite and math.isfinite(gn):
        worker.optimizer.step()
        st.updates += 1
        st.grad_norms.append(gn)
    else:
        worker.skipped_updates += 1
    worker.optimizer.zero_grad(set_to_none=True)
    st.t_opt += time.perf_counter() - t_opt0


def gather_rank_parts(worker, st: StepState) -> None:
    """Data-parallel: every rank's micro-batch sums, clip parts and MoE routing counts, on every rank."""
    if not worker.dp.active:
        return
    parts = gather_objects((st.sums, st.n_mb, [(u, lm, a, mk) for u, lm, a, mk in st.clip_parts],
                            worker._positions), worker.dp)
    st.sums, st.n_mb, st.clip_parts = {}, sum(p[1] for p in parts), [c for p in parts for c in p[2]]
    worker._positions = [sum(p[3][i] for p in parts) for i in (0, 1)]
    for part_sums, _, _, _ in parts:
        for k, v in part_sums.items():
            st.sums[k] = st.sums.get(k, 0.0) + v
    if worker.moe_layers:  # every rank's routing counts
        accs = gather_objects(worker._moe_acc, worker.dp)
        worker._moe_acc = {**accs[0], **{k: sum(a[k] for a in accs) for k in ("mismatch", "tokens", "counts")}}


def step_metrics(worker, st: StepState, lr_used: float) -> dict[str, float]:
    """The step's metrics: mismatch, entropy, lengths, IS, loss terms, clip fractions, rewards, optimizer."""
    from fp8core.rl import importance_weights, mismatch_metrics, pool_clip_metrics, response_length_metrics

    b, r, clip_parts = st.b, st.r, st.clip_parts
    m: dict[str, float] = {}
    if worker.moe_layers:
        m.update(moe_metrics(worker))
    m.update(mismatch_metrics(st.old_logp, b.rollout_logp, b.mask))
    m["policy/entropy"] = float((st.ent * b.mask).sum() / b.mask.sum().clamp_min(1))  # exact, sampled tokens
    m.update(response_length_metrics(b.mask))
    # the share of the positions this step's forwards computed (old logprobs, updates) that were padding: 0 with
    # sequence packing, whose batches hold only real tokens
    m["train/padding_frac"] = 1.0 - worker._positions[1] / max(1, worker._positions[0])
    if st.is_w is not None:
        m.update(importance_weights(st.old_logp, b.rollout_logp, b.mask, **st.is_kw)[1])
    m["train/old_logprob_pass_samples"] = float(len(st.later))
    for k, v in st.sums.items():  # micro-batch means; loss/total is normalized globally, so sum per global batch
        m[k] = v / max(1, st.n_gb) if k == "loss/total" else v / max(1, st.n_mb)
    later_parts = [(lm, a, mk) for u, lm, a, mk in clip_parts if u > 0]
    m.update(pool_clip_metrics(later_parts or [(lm, a, mk) for _, lm, a, mk in clip_parts]))
    m["train/clip_metric_updates"] = float(len({u for u, *_ in clip_parts if u > 0}) or
                                           len({u for u, *_ in clip_parts}))
    m.update({k.replace("clip/", "clip_all_updates/"): v for k, v in
              pool_clip_metrics([(lm, a, mk) for _, lm, a, mk in clip_parts]).items() if "/bound_" not in k})
    m["train/dynamic_sampling_filtered_frac"] = float((~st.keep).float().mean())  # rows = groups (whole groups)
    m["train/samples_in_loss"] = float(len(st.trained))
    m["train/grad_norm"] = sum(st.grad_norms) / len(st.grad_norms) if st.grad_norms else float("nan")
    m["train/lr"] = lr_used
    m["train/optimizer_updates"] = float(st.updates)
    m["train/skipped_updates"] = float(worker.skipped_updates)
    m["reward/mean"] = float(r.mean())
    m["reward/std"] = float(r.std()) if r.numel() > 1 else 0.0
    groups = r.reshape(-1, b.group_size)
    m["reward/frac_groups_all_same"] = float((groups.max(1).values == groups.min(1).values).float().mean())
    m["advantage/abs_mean"] = float(st.adv.abs().mean())
    return m
