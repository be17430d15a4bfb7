"""PolicyWorker: the trainer side of GRPO. Owns the HF causal LM (its decoder linears converted to FP8 by fp8core when
``policy.megatron_cfg.fp8_cfg.enabled``), AdamW with gradient clipping and an LR schedule, logprob computation, the
train step with fp8core.rl's clipped policy-gradient loss, the FP8 calibrations (KV-cache scales for the rollout
engine, Calibrated Clipping of the PPO bounds) and checkpoint save/load.

A plain class (unit-testable in-process); the pipeline runs it as a Ray actor (``ray.remote(PolicyWorker)``) so
weights travel actor-to-actor through the Ray object store, never through Prefect.

Numerics
--------
* Master weights are FP32 (what AdamW updates); ``policy.precision: bfloat16`` runs the forward/backward under CPU/GPU
  autocast to BF16 (the usual mixed-precision setup), ``float32`` without autocast. FP8Linear layers quantize their
  operands themselves (fp8core.linear; FP32 accumulation).
* ``policy.megatron_cfg.activation_checkpointing``: each decoder layer keeps only its inputs in a training forward
  and runs its forward again in the backward (trainer.dp.checkpoint_layers), inside the same routing replay,
  precision and KV rounding contexts (``_forward_contexts``): the same gradients bit for bit, less memory.
* Token alignment: for a sequence ``s`` (prompt + response), ``logp[:, j] = log softmax(z_{j-1} / T)[s_j]`` for j >= 1
  (column 0 is 0 and always masked). ``T`` is the sampling temperature: vLLM's processed logprobs are those of
  ``logits / T``, so trainer and rollout logprobs are comparable (``mismatch/*``) and the ratio is the sampled policy's.
* Train step (one GRPO step on a batch of ``P`` prompts x ``G`` generations):
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
     that optimizer step (counted in ``train/skipped_updates``; the weights are untouched).
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

import contextlib
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from configs.schema import Config
from fp8core.cpu import usable_threads
from storage.hub import local_model_dir
from trainer.batch import Batch, Packed, _pad_cols, by_length, token_logprobs, use_packed_attention
from trainer.dp import (
    DPGroup,
    all_min,
    clip_grad_norm,
    equal_count,
    full_tensor,
    gather_objects,
    longest_first_batches,
    per_layer_no_grad,
    share_batches,
    token_chunks,
)
from trainer.dp import all_sum as dp_sum
from trainer.memory import HEAP_ENV, HEAP_POLICIES


def _autocast(precision: str, device: torch.device, bf16_emulation=None):
    """The forward's precision context: BF16 autocast, the BF16 emulation (``policy.bf16_mode`` emulated: an
    fp8core.bf16.BF16Emulation instance) or nothing (float32)."""
    if precision == "bfloat16":
        return bf16_emulation if bf16_emulation is not None else torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _enter_all(parts):
    """Enter ``parts`` (context managers) in order, exit them in reverse."""
    with contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(part)
        yield


def lr_lambda(step: int, *, warmup_steps: int, decay: str, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier after ``step`` optimizer-schedule steps: linear warmup to 1 over ``warmup_steps``, then constant,
    linear or cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    frac = min(1.0, max(0.0, (step - warmup_steps) / span))
    if decay == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * frac
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


def leave_one_out_advantages(rewards: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """RLOO baseline (Ahmadian et al. 2024): ``A_i = r_i - mean_{j != i, j in g(i)} r_j``."""
    g = rewards.reshape(-1, group_size).to(torch.float64)
    loo = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - loo).reshape(-1).to(rewards.dtype)


@dataclass
class _StepState:
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


class PolicyWorker:
    """See the module docstring. ``model_dir``: HF model (safetensors + config + tokenizer)."""

    def __init__(self, model_dir: str | Path, cfg: Config, *, run_dir: str | Path | None = None,
                 dp: DPGroup | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from fp8core.rl.calibrated_clipping import CalibratedClipping

        self.cfg = cfg
        p = cfg.policy
        self.threads = usable_threads(p.threads)  # policy.threads, at most one per CPU this process may use
        torch.set_num_threads(self.threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(self.threads))
        torch.manual_seed(cfg.grpo.seed)
        self.model_dir = local_model_dir(model_dir)  # a directory, or ORG/NAME@<commit> in this node's HF cache
        self.run_dir = Path(run_dir) if run_dir else None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            heap = os.environ.get(HEAP_ENV, "keep")
            if heap not in HEAP_POLICIES:
                raise ValueError(f"{HEAP_ENV}: {heap!r} is not one of {', '.join(HEAP_POLICIES)}")
            HEAP_POLICIES[heap]()
        from fp8core.bf16 import BF16Emulation, resolve_bf16_mode
        from fp8core.cpu import cpu_caps

        self.bf16_mode = resolve_bf16_mode(p.bf16_mode, device=self.device, native_bf16=cpu_caps().native_bf16)
        self.bf16_emulation = BF16Emulation() if self.bf16_mode == "emulated" else None
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device)
        self.model.config.use_cache = False
        from fp8core.moe import convert_routers

        self.moe_layers = convert_routers(self.model)  # MoE: routers in FP32 (fp8core/moe.py); [] for dense models
        self.router_replay = bool(p.router_replay.enabled and self.moe_layers)
        self._moe_measure, self._moe_acc = False, None
        self.fp8_spec = cfg.trainer_fp8_spec()  # the one FP8 numerics spec (the engine's too in end-to-end FP8)
        self.fp8_layers: list[str] = self.fp8_spec.convert(self.model) if self.fp8_spec is not None else []
        self.dp = dp or DPGroup()
        # policy.megatron_cfg.activation_checkpointing: decoder layers recompute their activations in the backward,
        # under the contexts their forward ran under (_forward_contexts); before sharding (trainer.dp)
        self._recompute = None  # during a forward: () -> its contexts, once more (_token_logp)
        # policy.sequence_packing: batches of several rows run packed (_token_logp), cut by tokens
        sp, seq = p.sequence_packing, p.max_total_sequence_length
        self._packing = bool(sp.enabled)
        self._train_tokens = (sp.train_mb_tokens or p.train_micro_batch_size * seq) if sp.enabled else None
        self._logprob_tokens = (sp.logprob_mb_tokens or p.logprob_batch_size * seq) if sp.enabled else None
        self._packed_attention = self._packing and use_packed_attention(self.model)  # one SDPA per sequence
        self._positions = [0, 0]  # positions the forwards computed, real tokens among them (since train_step began)
        self.activation_checkpointing = bool(p.megatron_cfg.activation_checkpointing)
        if self.activation_checkpointing:
            from trainer.dp import checkpoint_layers

            checkpoint_layers(self.model, lambda: self._recompute() if self._recompute else contextlib.nullcontext())
        # loss_fn.reference_policy_kl_penalty > 0: a frozen copy of the initial policy (its FP8 numerics too), sharded
        # like the policy; its logprobs come from the trainer's own logprob pass (_reference_logprobs)
        self.ref_model = self._reference_model() if cfg.loss_fn.reference_policy_kl_penalty > 0 else None
        if self.dp.active:  # data-parallel rank: FSDP2 shards masters, gradients and optimizer state (trainer/dp.py)
            from trainer.dp import init_group, shard_model

            init_group(self.dp, self.device)
            shard_model(self.model, self.device)
            if self.ref_model is not None:
                shard_model(self.ref_model, self.device)
            if self.bf16_emulation is not None:  # no rounded copy of a gathered weight (trainer/dp.py)
                self.bf16_emulation.cache_weights = False
        o = p.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        s = p.scheduler
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda k: lr_lambda(
            k, warmup_steps=s.warmup_steps, decay=s.decay, total_steps=cfg.grpo.max_num_steps,
            min_lr_ratio=s.min_lr_ratio))
        lf, cal = cfg.loss_fn, cfg.calibration
        self.clip_low, self.clip_high = 1.0 - lf.ratio_clip_min, 1.0 + lf.ratio_clip_max
        self.cc = CalibratedClipping(cfg.calibrated_clipping_config()) if cal.calibrated_clipping else None
        self.kv_scales: dict[str, list[float]] | None = None
        # calibration.kv_rounding_in_trainer: _token_logp rounds K/V like the engine's FP8 cache with the scales the
        # engine holds (the last calibrated ones; unit scales before any), except in the BF16 shadow forwards
        self.kv_rounding = bool(cal.kv_rounding_in_trainer)
        self._kv_rounding_paused = False
        # old logprobs of the first update's rows come from its training forwards (train_step) unless the model
        # has dropout, where a training forward is not the policy's deterministic forward
        self.reuse_first_forward = not any(
            isinstance(mod, torch.nn.Dropout) and mod.p > 0 for mod in self.model.modules()) and not any(
            float(getattr(self.model.config, k, 0.0) or 0.0) > 0 for k in
            ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop"))
        self.skipped_updates = 0
        self.step = 0  # RL steps completed
        # TEST-ONLY hooks (process/faults.py): None unless the recipe sets testing.* keys or a test installs them
        from process.faults import TestHooks

        self.hooks = TestHooks.from_config(cfg, self.run_dir)

    def _reference_model(self):
        """The reference policy of the KL term: the initial policy (``policy.model_name``), built as the policy is
        (FP32 masters, the recipe's FP8 linears), frozen and in eval mode. Not with MoE models (their routing replay
        and routing counts are the policy's)."""
        from transformers import AutoModelForCausalLM

        if self.moe_layers:
            raise ValueError("loss_fn.reference_policy_kl_penalty: a reference-policy KL term is not supported for "
                             "MoE models (routing replay covers the policy only); set it to 0")
        ref = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device)
        ref.config.use_cache = False
        if self.fp8_spec is not None:
            self.fp8_spec.convert(ref)
        ref.requires_grad_(False)
        return ref.eval()

    def _reference_logprobs(self, b: Batch) -> torch.Tensor:
        """The reference policy's logprobs of ``b`` through the trainer's own logprob pass (:meth:`logprobs`, with
        the reference model in the policy's place)."""
        policy = self.model
        self.model = self.ref_model
        try:
            return self.logprobs(b)[0]
        finally:
            self.model = policy

    # ------------------------------------------------------------------------------------------------ basic info
    def info(self) -> dict:
        n = sum(p.numel() for p in self.model.parameters())
        return {"num_params": n, "fp8_layers": len(self.fp8_layers), "device": str(self.device),
                "bf16_mode": self.bf16_mode if self.cfg.policy.precision == "bfloat16" else "off",
                "clip_bounds": [self.clip_low, self.clip_high], "step": self.step,
                "num_layers": self.model.config.num_hidden_layers, "dp_rank": self.dp.rank, "dp_world": self.dp.world,
                "threads": self.threads}

    def memory(self, *, reset: bool = False) -> dict:
        """This rank's process memory (trainer.memory.snapshot: ``rss``, ``peak`` since the last reset, CUDA's
        allocator on a GPU), taken before ``reset`` sets the peak back to the current RSS."""
        from trainer.memory import reset_peak, snapshot

        out = snapshot()
        if reset:
            out["reset"] = reset_peak()
        return out

    def bounds(self) -> tuple[float, float]:
        if self.cc is not None:
            return self.cc.bounds
        return self.clip_low, self.clip_high

    def weights(self, dtype: str = "float32") -> dict[str, torch.Tensor]:
        """HF-named weights for a rollout refit: a copy of the FP32 masters by default. The engine quantizes its FP8
        layers from what it receives, so it must receive the masters the trainer's FP8Linear quantizes: a BF16 copy
        would make the engine hold ``quantize(bf16(w))`` instead of the trainer's ``quantize(w)`` (2.2% of FP8 codes
        and every block scale differed on a trained checkpoint)."""
        from fp8core.moe import checkpoint_state_dict

        dt = getattr(torch, dtype)  # MoE experts under their checkpoint (per-expert) names, as the engine loads them
        return {k: v.detach().to("cpu", dt).clone() for k, v in checkpoint_state_dict(self._full_state()).items()}

    def _full_state(self) -> dict[str, torch.Tensor]:
        """The model's full state dict. Data-parallel: gathered to rank 0 (a collective: every rank calls it; the
        others get ``{}``)."""
        if not self.dp.active:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def refit_weights(self) -> dict[str, torch.Tensor]:
        """What a refit ships. End-to-end FP8 (the engine runs this trainer's FP8 numerics, Config.rollout_fp8_spec
        == trainer_fp8_spec): the served state (fp8core.serve: this trainer's FP8 codes + weight_scale_inv for the
        FP8 linears, BF16 -- the engine's model dtype -- for the rest), loaded by the engine without re-quantizing.
        Otherwise the FP32 masters (``weights()``), which an FP8-generation-only engine quantizes itself."""
        trainer, rollout = self.cfg.trainer_fp8_spec(), self.cfg.rollout_fp8_spec()
        if trainer is not None and rollout is not None and trainer.forward_key() == rollout.forward_key():
            from fp8core.serve import served_state_dict

            state = self._full_state()  # data-parallel: full on rank 0 only, quantized there (no layer gathered)
            served = served_state_dict(self.model, hp_dtype=torch.bfloat16, state=state) if state else {}
            # FP8 codes travel as their bytes (uint8): pickling float8 tensors fails in torch 2.13, and Ray pickles
            return {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in served.items()}
        return self.weights()

    # ---------------------------------------------------------------------------------------------------- logprobs
    def _token_logp(self, b: Batch, *, want_entropy: bool = False):
        """Forward one micro-batch; returns (logp [B, L] aligned to tokens, entropy [B, L] or None). With sequence
        packing (policy.sequence_packing.enabled) a batch of several rows runs as one row of its real tokens
        (trainer.batch.Packed), its results unpacked to the padded layout."""
        packed = Packed(b) if self._packing and len(b) > 1 else None
        self._positions[0] += b.tokens.numel() if packed is None else packed.tokens.numel()  # computed positions
        self._positions[1] += int(b.attn.sum())  # of them real tokens: train/padding_frac
        if packed is None:
            tokens = b.tokens.to(self.device)
            inputs = {"input_ids": tokens, "attention_mask": b.attn.to(self.device)}
        else:  # no attention mask: the restarting position ids keep each sequence to itself
            tokens = packed.tokens.to(self.device)
            inputs = {"input_ids": tokens, "position_ids": packed.position_ids.to(self.device),
                      **(packed.attention_kwargs(self.device) if self._packed_attention else {})}
        replay = None
        if self.router_replay and b.routing is not None:  # R3: the engine's experts for every token
            k = b.routing.shape[-1]
            routing = b.routing if packed is None else b.routing[packed.real][None]
            replay = {layer: routing[:, :, j].reshape(-1, k).to(self.device)
                      for j, layer in enumerate(self.moe_layers)}
        try:
            self._recompute = lambda: self._forward_contexts(replay)  # each checkpointed layer's recompute
            with self._forward_contexts(replay):
                logits = self.model(**inputs).logits
        finally:
            self._recompute = None
        if self._moe_measure:
            self._record_routing(b, packed)
        logp, z = token_logprobs(logits, tokens, temperature=self.cfg.policy.generation.temperature)
        ent = None
        if want_entropy:
            from fp8core.rl.metrics import token_entropy

            e = token_entropy(z.detach())
            ent = torch.cat([torch.zeros_like(e[:, :1]), e], dim=1)
        if packed is not None:  # a sequence's first token follows the previous sequence: no logprob, no entropy
            starts = packed.starts.to(logp.device)[None]
            logp = packed.unpack(logp.masked_fill(starts, 0.0))
            ent = None if ent is None else packed.unpack(ent.masked_fill(starts, 0.0))
        return logp, ent

    def _forward_contexts(self, replay: dict | None) -> contextlib.AbstractContextManager:
        """The state a forward runs under: MoE routing replay (``replay``: the engine's experts per MoE layer, or
        None), the precision (autocast or the BF16 emulation) and the engine's KV rounding. A context manager
        not yet entered, its parts fixed now; activation checkpointing enters a copy around each layer's
        recompute (the backward runs outside the forward's ``with``)."""
        from fp8core.moe import forced_routing

        parts = [forced_routing(self.model, replay), _autocast(self.cfg.policy.precision, self.device,
                                                                self.bf16_emulation), self._kv_replay()]
        return _enter_all(parts)

    def _kv_replay(self):
        """The engine's FP8 KV rounding around a forward (calibration.kv_rounding_in_trainer), else nothing."""
        if not self.kv_rounding or self._kv_rounding_paused:
            return contextlib.nullcontext()
        from trainer.kv_rounding import kv_rounding, unit_scales

        scales = self.kv_scales
        if scales is None:
            from fp8core.rl.kv_calibration import find_attention_modules

            scales = unit_scales(len(find_attention_modules(self.model)))
        return kv_rounding(self.model, scales, round_k=True, round_v=True)

    def _zero_loss(self, one: Batch) -> torch.Tensor:
        """0 x a full forward of ``one``: a data-parallel rank's padding micro-batch (its backward runs every layer's
        collectives and adds zeros: trainer/dp.py); under no_grad a padding forward."""
        measure, self._moe_measure = self._moe_measure, False  # not a real forward: no moe/* counts
        try:
            return self._token_logp(one)[0].sum() * 0.0
        finally:
            self._moe_measure = measure

    @torch.no_grad()
    def _record_routing(self, b: Batch, packed: Packed | None = None) -> None:
        """Accumulate this forward's routing for the step's ``moe/*`` metrics (real tokens only): tokens whose own
        top-k set differs from the engine's, and the per-layer expert loads of the experts used. ``packed``: the
        forward ran the batch packed (its tokens are all real)."""
        from fp8core.moe import routers

        real = b.attn.reshape(-1).bool()
        ran = real if packed is None else slice(None)  # the forward's tokens that are real: all of a packed row's
        acc = self._moe_acc
        for j, (_, r) in enumerate(routers(self.model)):
            used = r.last_ids.cpu()[ran]
            acc["counts"][j] += torch.bincount(used.reshape(-1), minlength=r.num_experts).double()
            if b.routing is not None:
                own = r.last_own_ids.cpu()[ran].sort(-1).values
                eng = b.routing[:, :, j].reshape(-1, b.routing.shape[-1])[real].sort(-1).values
                acc["mismatch"] += int((own != eng).any(-1).sum())
                acc["tokens"] += int(real.sum())

    def _start_moe_measure(self) -> None:
        """Count routing (``moe/*``) in the forwards from now until ``_moe_measure`` is set back to False."""
        from fp8core.moe import routers

        n_exp = routers(self.model)[0][1].num_experts
        self._moe_measure = True
        self._moe_acc = {"mismatch": 0, "tokens": 0,
                         "counts": torch.zeros(len(self.moe_layers), n_exp, dtype=torch.float64)}

    def _moe_metrics(self) -> dict[str, float]:
        acc, m = self._moe_acc, {"moe/router_replay": float(self.router_replay)}
        if acc["tokens"]:
            m["moe/routing_mismatch_frac"] = acc["mismatch"] / acc["tokens"]
        c = acc["counts"]
        share = c / c.mean(1, keepdim=True).clamp_min(1e-12)  # per layer: expert load / the uniform load
        m["moe/expert_load_max"] = float(share.max(1).values.mean())
        m["moe/expert_load_min"] = float(share.min(1).values.mean())
        m["moe/expert_load_cv"] = float((c.std(1, unbiased=False) / c.mean(1).clamp_min(1e-12)).mean())
        return m

    @torch.no_grad()
    def logprobs(self, b: Batch, *, want_entropy: bool = False, rows: torch.Tensor | None = None):
        """No-grad logprobs (FP32) and entropies (FP64) ``[B, L]`` of ``b`` (of ``b.slice(rows)`` when given). Rows
        are batched longest-first and each batch is trimmed to its own longest sequence (less padding); results come
        back in the input order, zero beyond each batch's width. Data-parallel (a collective: every rank calls it
        with the same arguments): each rank computes a share of the single worker's batches (whole batches:
        trainer.dp.share_batches), gathering one layer at a time, and pads with discarded forwards up to rank 0's
        count; the sum over ranks assembles them on every rank."""
        if not self.dp.active:
            return self._local_logprobs(b, want_entropy=want_entropy, rows=rows)
        rows = torch.arange(len(b)) if rows is None else rows
        lengths = b.attn[rows].sum(1)
        bs = self.cfg.policy.logprob_batch_size
        mine = share_batches(lengths, bs, self.dp, self._logprob_tokens)
        n_batches = len(longest_first_batches(lengths, bs, self._logprob_tokens))
        pad = equal_count(n_batches, self.dp) - len(self.dp.share(torch.arange(n_batches)))
        lp = torch.zeros(len(rows), b.width)
        ent = torch.zeros(len(rows), b.width, dtype=torch.float64) if want_entropy else None
        with per_layer_no_grad(self.model, self.dp):
            if len(mine):
                lp_m, ent_m = self._local_logprobs(b, want_entropy=want_entropy, rows=rows[mine])
                lp[mine] = lp_m.float()
                if ent is not None:
                    ent[mine] = ent_m.double()
            self._padding_forwards(pad, b.slice(rows[:1]).trimmed())
        dp_sum(*(t for t in (lp, ent) if t is not None), group=self.dp)
        return lp, ent

    @torch.no_grad()
    def _padding_forwards(self, n: int, one: Batch) -> None:
        """``n`` discarded forwards of ``one``: a data-parallel rank with fewer batches than rank 0 runs the per-layer
        collectives of the forwards it lacks (trainer/dp.py)."""
        was = self.model.training
        self.model.eval()
        for _ in range(n):
            self._zero_loss(one)
        self.model.train(was)

    @torch.no_grad()
    def _local_logprobs(self, b: Batch, *, want_entropy: bool = False, rows: torch.Tensor | None = None):
        was = self.model.training
        self.model.eval()
        sub = b if rows is None else b.slice(rows)
        out = by_length(sub, self.cfg.policy.logprob_batch_size,
                        lambda mb: self._token_logp(mb, want_entropy=want_entropy), self._logprob_tokens)
        self.model.train(was)
        return out

    @torch.no_grad()
    def score(self, rollouts: Sequence[Mapping]) -> dict:
        """Teacher-forced logprobs of ``rollouts`` (RolloutWorker.generate output) with this trainer as it trains:
        the forward of ``train_step``'s old-logprob pass (its FP8 linears, ``policy.precision``, MoE routing replay
        and KV rounding as configured), no update. Returns ``{"logp": [B, L], "batch": Batch, "metrics": ...}`` with
        ``mismatch/*`` against the rollout's logprobs (fp8core.rl.mismatch_metrics, as logged every step),
        ``tokens`` and, for MoE models, ``moe/*``. What the diagnostics (mismatch tables, KV attribution) measure."""
        from fp8core.rl import mismatch_metrics

        b = Batch.from_rollouts(rollouts, pad_id=self.tokenizer.pad_token_id)
        if self.moe_layers:
            self._start_moe_measure()
        try:
            lp, _ = self.logprobs(b)
        finally:
            self._moe_measure = False
        m = mismatch_metrics(lp, b.rollout_logp, b.mask)
        m["tokens"] = int(b.mask.sum())
        if self.moe_layers:
            m.update(self._moe_metrics())
        return {"logp": lp, "batch": b, "metrics": m}

    def _shadow_logprobs(self, b: Batch) -> torch.Tensor:
        from fp8core.convert import high_precision

        paused, self._kv_rounding_paused = self._kv_rounding_paused, True  # the BF16 pipeline has no FP8 cache
        try:
            with high_precision(self.model):
                return self.logprobs(b)[0]
        finally:
            self._kv_rounding_paused = paused

    # ---------------------------------------------------------------------------------------------------- training
    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        from fp8core.rl import grpo_advantages

        g = self.cfg.grpo
        if g.use_leave_one_out_baseline:
            adv = leave_one_out_advantages(rewards, group_size=group_size)
            if g.normalize_rewards:
                std = rewards.reshape(-1, group_size).std(dim=1, keepdim=True).expand(-1, group_size).reshape(-1)
                adv = adv / (std + 1e-6)
            return adv
        return grpo_advantages(rewards, group_size=group_size, normalize_std=g.normalize_rewards)

    def train_step(self, rollouts: Sequence[Mapping], rewards: Sequence[float], *, step: int) -> dict[str, float]:
        """One GRPO step on ``rollouts`` (RolloutWorker.generate output) with ``rewards`` (one per sample, prompt-major).
        Returns metrics (python floats, stable names). The phases (module docstring, items 1-5) are the methods
        below, in this order."""
        if self.hooks is not None:  # TEST-ONLY: a trainer lost mid-step
            self.hooks.kill_point()
        t0 = time.perf_counter()
        self._positions = [0, 0]
        st = self._plan_step(rollouts, rewards, step)
        st.t_old = time.perf_counter() - t0
        self._prepare_loss(st)
        self.model.train()
        for u, gidx in enumerate(st.update_rows):
            finite = self._accumulate_update(st, u, gidx)
            if u == 0:
                self._complete_old_logprobs(st)
            self._optimizer_step(st, u, finite)
            self._moe_measure = False
        lr_used = float(self.optimizer.param_groups[0]["lr"])  # the LR this step's updates used (before the advance)
        self.scheduler.step()
        self._moe_measure = False
        self._gather_rank_parts(st)
        m = self._step_metrics(st, lr_used)
        if st.calibrate:
            self._calibrate_clip(st, m)
        lo, hi = self.bounds()
        m["clip/bound_low"], m["clip/bound_high"] = float(lo), float(hi)
        wall = time.perf_counter() - t0
        ntok = float(st.b.attn.sum())
        m["time/train_logprob_s"] = st.t_old
        m["time/reference_logprob_s"] = st.t_ref
        m["time/clip_calibration_s"] = st.t_cal
        m["time/train_optimizer_s"] = st.t_opt  # gradient clipping + AdamW steps
        m["time/policy_train_s"] = wall
        m["throughput/train_tokens_per_s"] = ntok / max(wall - st.t_cal, 1e-9)
        m["train/tokens"] = ntok
        self.step = step
        return m

    def _plan_step(self, rollouts: Sequence[Mapping], rewards: Sequence[float], step: int) -> _StepState:
        """The step's batch and rewards, the rows of each optimizer update (DAPO filtering), and the old logprobs
        (+ entropies) of the rows the first update's forwards will not provide (item 1 of the module docstring)."""
        cfg = self.cfg
        b = Batch.from_rollouts(rollouts, pad_id=self.tokenizer.pad_token_id)
        r = torch.tensor(list(rewards), dtype=torch.float32)
        if r.numel() != len(b):
            raise ValueError(f"train_step: {r.numel()} rewards for {len(b)} samples")
        if self.moe_layers:  # moe/* metrics from the forwards on the weights the engine ran (before the first update)
            self._start_moe_measure()
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
        first = update_rows[0] if update_rows and self.reuse_first_forward else perm[:0]
        in_first = torch.zeros(len(b), dtype=torch.bool)
        in_first[first] = True
        later = perm[~in_first[perm]]
        st = _StepState(step=step, b=b, r=r, keep=keep, trained=trained, update_rows=update_rows, first=first,
                        later=later, old_logp=torch.zeros(len(b), b.width),
                        ent=torch.zeros(len(b), b.width, dtype=torch.float64),  # token_entropy's dtype
                        known=torch.zeros(len(b), dtype=torch.bool))
        if len(later):
            st.old_logp[later], st.ent[later] = self.logprobs(b, want_entropy=True, rows=later)
            st.known[later] = True
        if self.ref_model is not None:  # reference-policy KL: the frozen initial policy on every row (dense only)
            tr = time.perf_counter()
            st.kl_ref_logp = self._reference_logprobs(b)
            st.t_ref = time.perf_counter() - tr
        return st

    def _prepare_loss(self, st: _StepState) -> None:
        """Advantages (item 2), the later rows' IS weights (item 3), the BF16 shadow's old logprobs on a Calibrated
        Clipping step (item 5), pi_old of the ratio and the clip bounds of this step."""
        from fp8core.rl import importance_weights

        lf, b, later = self.cfg.loss_fn, st.b, st.later
        st.adv = self.advantages(st.r, b.group_size)
        st.is_kw = dict(kind=lf.importance_sampling, cap=lf.is_truncation, low=lf.is_mask_low, high=lf.is_mask_high)
        if lf.use_importance_sampling_correction:  # per-row weights (tested): the later rows now, the first
            st.is_w = torch.zeros(len(b), b.width)  # update's rows in its loop
            if len(later):
                st.is_w[later] = importance_weights(st.old_logp[later], b.rollout_logp[later], b.mask[later],
                                                    **st.is_kw)[0]
        st.calibrate = self.cc is not None and self.cc.should_calibrate(st.step)
        if st.calibrate:
            tc = time.perf_counter()
            st.old_bf16 = self._shadow_logprobs(b)
            st.t_cal += time.perf_counter() - tc
        # pi_old of the ratio (loss_fn.old_logprobs): the trainer's logprobs before the first update (old_logp, filled
        # in by the first update's forwards) or the rollout engine's (the ratio then carries the mismatch)
        st.ref_logp = b.rollout_logp if lf.old_logprobs == "rollout" else st.old_logp
        st.clip_low, st.clip_high = self.bounds()

    def _accumulate_update(self, st: _StepState, u: int, gidx: torch.Tensor) -> bool:
        """Forward + backward of update ``u``'s rows (this rank's share) in micro-batches, gradients accumulated
        (data-parallel: reduced at the end); the first update's forwards also fill in the old logprobs, entropies
        and IS weights of its rows. Returns False when a loss was not finite (on any rank)."""
        from fp8core.rl import clipped_pg_loss, importance_weights

        lf, b, adv = self.cfg.loss_fn, st.b, st.adv
        mbs = self.cfg.policy.train_micro_batch_size
        agg = "token_mean" if lf.token_level_loss else "seq_mean_token_mean"
        level = "sequence" if lf.sequence_level_importance_ratios else "token"  # GSPO: one ratio per sequence
        gm = b.mask[gidx]
        normalizer = float(gm.sum().clamp_min(1)) if lf.token_level_loss else float((gm.sum(1) > 0).sum())
        self.optimizer.zero_grad(set_to_none=True)
        st.n_gb += 1
        finite = True
        mine = self.dp.share(gidx)  # data-parallel: this rank's contiguous share (all rows without a group)
        # data-parallel: every rank runs the largest rank's number of micro-batches (per-layer collectives in each);
        # one with fewer, or past a non-finite loss, runs zero-weighted ones. Micro-batches of mbs rows, or with
        # sequence packing of at most _train_tokens tokens
        if self._train_tokens is None:
            n_mb = -(-equal_count(len(gidx), self.dp) // mbs)
            chunks = [mine[j * mbs: (j + 1) * mbs] for j in range(n_mb)]
        else:
            chunks = token_chunks(mine, b.attn.sum(1), self._train_tokens)
            n_mb = -int(all_min(-float(len(chunks)), self.dp))
        one = b.slice(gidx[:1]).trimmed()
        for j in range(n_mb):
            idx = chunks[j] if j < len(chunks) else mine[:0]
            if not len(idx) or not finite:
                if not self.dp.active:
                    break
                self._zero_loss(one).backward()
                continue
            mb = b.slice(idx).trimmed()
            w = mb.width
            fresh = u == 0 and len(st.first) > 0  # rows whose old logprobs this forward provides
            logp, e = self._token_logp(mb, want_entropy=fresh)
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
            if not torch.isfinite(loss):
                finite = False
                if self.dp.active:  # this forward's collectives ran: its backward's must too (the update is skipped)
                    (logp.sum() * 0.0).backward()
                continue
            loss.backward()
            st.n_mb += 1
            st.clip_parts.append((u, lm, adv[idx], mb.mask))
            for k, v in lm.items():
                if not k.startswith("clip/"):
                    st.sums[k] = st.sums.get(k, 0.0) + v
        if self.dp.active:  # all ranks skip the update if any rank's loss was not finite
            finite = all_min(float(finite), self.dp) > 0
        return finite

    def _complete_old_logprobs(self, st: _StepState) -> None:
        """After the first update's forwards: data-parallel ranks share the rows each filled in; rows a non-finite
        loss left out get a no-grad pass (the weights are untouched: that update takes no step)."""
        from fp8core.rl import importance_weights

        b, first = st.b, st.first
        if self.dp.active and len(first):  # each rank filled its own rows of the first update
            for t in (st.old_logp, st.ent, st.is_w):
                if t is not None:
                    part = t[first].clone()
                    dp_sum(part, group=self.dp)
                    t[first] = part
            k = st.known[first].double()
            dp_sum(k, group=self.dp)
            st.known[first] = k > 0
        if not bool(st.known.all()):  # a non-finite loss stopped the first update early: its
            missing = (~st.known).nonzero().squeeze(1)  # weights are untouched (no step), so finish the pass
            st.old_logp[missing], st.ent[missing] = self.logprobs(b, want_entropy=True, rows=missing)
            if st.is_w is not None:
                st.is_w[missing] = importance_weights(st.old_logp[missing], b.rollout_logp[missing], b.mask[missing],
                                                      **st.is_kw)[0]
            st.known[missing] = True
            self.model.train()

    def _optimizer_step(self, st: _StepState, u: int, finite: bool) -> None:
        """Clip the gradient norm and step AdamW, or skip a non-finite update (``train/skipped_updates``)."""
        if self.hooks is not None:  # TEST-ONLY: full gradients of every update, before clipping
            self.hooks.on_gradients(u, lambda: {n: full_tensor(q.grad).detach().cpu().clone()
                                                for n, q in self.model.named_parameters() if q.grad is not None})
        t_opt0 = time.perf_counter()
        gn = clip_grad_norm(self.model.parameters(), self.cfg.policy.max_grad_norm, self.dp)
        if finite and math.isfinite(gn):
            self.optimizer.step()
            st.updates += 1
            st.grad_norms.append(gn)
        else:
            self.skipped_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        st.t_opt += time.perf_counter() - t_opt0

    def _gather_rank_parts(self, st: _StepState) -> None:
        """Data-parallel: every rank's micro-batch sums, clip parts and MoE routing counts, on every rank."""
        if not self.dp.active:
            return
        parts = gather_objects((st.sums, st.n_mb, [(u, lm, a, mk) for u, lm, a, mk in st.clip_parts],
                                self._positions), self.dp)
        st.sums, st.n_mb, st.clip_parts = {}, sum(p[1] for p in parts), [c for p in parts for c in p[2]]
        self._positions = [sum(p[3][i] for p in parts) for i in (0, 1)]
        for part_sums, _, _, _ in parts:
            for k, v in part_sums.items():
                st.sums[k] = st.sums.get(k, 0.0) + v
        if self.moe_layers:  # every rank's routing counts
            accs = gather_objects(self._moe_acc, self.dp)
            self._moe_acc = {**accs[0], **{k: sum(a[k] for a in accs) for k in ("mismatch", "tokens", "counts")}}

    def _step_metrics(self, st: _StepState, lr_used: float) -> dict[str, float]:
        """The step's metrics: mismatch, entropy, lengths, IS, loss terms, clip fractions, rewards, optimizer."""
        from fp8core.rl import importance_weights, mismatch_metrics, pool_clip_metrics, response_length_metrics

        b, r, clip_parts = st.b, st.r, st.clip_parts
        m: dict[str, float] = {}
        if self.moe_layers:
            m.update(self._moe_metrics())
        m.update(mismatch_metrics(st.old_logp, b.rollout_logp, b.mask))
        m["policy/entropy"] = float((st.ent * b.mask).sum() / b.mask.sum().clamp_min(1))  # exact, sampled tokens
        m.update(response_length_metrics(b.mask))
        # the share of the positions this step's forwards computed (old logprobs, updates) that were padding: 0 with
        # sequence packing, whose batches hold only real tokens
        m["train/padding_frac"] = 1.0 - self._positions[1] / max(1, self._positions[0])
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
                  pool_clip_metrics([(lm, a, mk) for _, lm, a, mk in clip_parts]).items()})
        m["train/dynamic_sampling_filtered_frac"] = float((~st.keep).float().mean())  # rows = groups (whole groups)
        m["train/samples_in_loss"] = float(len(st.trained))
        m["train/grad_norm"] = sum(st.grad_norms) / len(st.grad_norms) if st.grad_norms else float("nan")
        m["train/lr"] = lr_used
        m["train/optimizer_updates"] = float(st.updates)
        m["train/skipped_updates"] = float(self.skipped_updates)
        m["reward/mean"] = float(r.mean())
        m["reward/std"] = float(r.std()) if r.numel() > 1 else 0.0
        groups = r.reshape(-1, b.group_size)
        m["reward/frac_groups_all_same"] = float((groups.max(1).values == groups.min(1).values).float().mean())
        m["advantage/abs_mean"] = float(st.adv.abs().mean())
        return m

    def _calibrate_clip(self, st: _StepState, m: dict[str, float]) -> None:
        """Calibrated Clipping (item 5): FP8 and BF16-shadow logprobs of the updated policy on the same tokens move
        the clip bounds later steps use; adds its diagnostics to ``m``."""
        b = st.b
        tc = time.perf_counter()
        new_fp8 = self.logprobs(b)[0]
        new_bf16 = self._shadow_logprobs(b)
        # the BF16 reference ratio is the shadow's own new / old: with old_logprobs=rollout it stands for a BF16
        # pipeline's pi_theta / pi_rollout, whose mismatch (~1.002) it leaves out
        (lo, hi), diag = self.cc.calibrate(st.step, torch.exp((new_fp8 - st.ref_logp) * b.mask),
                                           torch.exp((new_bf16 - st.old_bf16) * b.mask), st.adv, b.mask,
                                           prob_fp8=torch.exp(new_fp8), prob_bf16=torch.exp(new_bf16))
        m.update(diag)
        st.t_cal += time.perf_counter() - tc

    # ------------------------------------------------------------------------------------------------ KV calibration
    @torch.no_grad()
    def calibrate_kv_scales(self, rollouts: Sequence[Mapping], *, max_samples: int) -> dict[str, list[float]]:
        """Per-layer K/V scales (amax / 448) from the policy's own forward over (prompt + response) sequences of the
        current batch; sent to the rollout engine with the next refit (``fp8core.rl.kv_calibration``)."""
        from fp8core.rl.kv_calibration import calibrate_kv_scales

        flat = []
        for r in rollouts:
            for s in r["samples"]:
                flat.append({"prompt_token_ids": r["prompt_token_ids"], "samples": [s]})
        b = Batch.from_rollouts(flat[:max_samples], pad_id=self.tokenizer.pad_token_id)
        was = self.model.training
        self.model.eval()
        bs = self.cfg.policy.logprob_batch_size
        batches = [{"input_ids": b.tokens[i:i + bs].to(self.device), "attention_mask": b.attn[i:i + bs].to(self.device)}
                   for i in range(0, len(b), bs)]
        if self.dp.active:  # each rank its share of the micro-batches; the percentile over all ranks' amaxes
            from fp8core.rl.kv_calibration import collect_qkv_amax, scales_from_amax, validate_kv_scales

            with per_layer_no_grad(self.model, self.dp), _autocast(self.cfg.policy.precision, self.device,
                                                                   self.bf16_emulation), torch.no_grad():
                mine = batches[self.dp.rank::self.dp.world]
                amax = collect_qkv_amax(self.model, mine) if mine else None
                for _ in range(equal_count(len(batches), self.dp) - len(mine)):  # rank 0's count (trainer/dp.py)
                    self.model(**batches[0])
            parts = [a for a in gather_objects(amax, self.dp) if a is not None]
            amax = {k: torch.cat([a[k] for a in parts]) for k in parts[0]}
            scales = scales_from_amax(amax)
            validate_kv_scales(scales, num_layers=amax["q"].shape[1])
        else:
            with _autocast(self.cfg.policy.precision, self.device, self.bf16_emulation):
                scales = calibrate_kv_scales(self.model, batches)
        self.model.train(was)
        # version: the policy step whose weights produced these scales (the engine refuses stale ones at refit)
        self.kv_scales = {**{k: [float(x) for x in v] for k, v in scales.items()}, "version": self.step}
        return self.kv_scales

    # ---------------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, uri: str, step: int, *, extra: Mapping | None = None, keep_last_k: int | None = None,
                        endpoint_url: str | None = None) -> str | None:
        """Write a complete checkpoint of RL step ``step`` (storage/checkpoint.py) and prune old ones.
        Data-parallel: full weights and optimizer state gathered to rank 0 and written there in the single-worker
        layout (optimizer state indexed by parameter order), so any number of workers resumes it; a collective:
        every rank calls it, ranks > 0 return None."""
        from storage.checkpoint import CheckpointStore, model_files, rng_state

        if self.dp.active:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            weights = self._full_state()
            osd = get_optimizer_state_dict(self.model, self.optimizer,
                                           options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.dp.rank != 0:
                return None
            optimizer = _optimizer_state_by_index(osd, self._param_names())
        else:
            weights, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        store = CheckpointStore(uri, endpoint_url=endpoint_url)
        state = {"clip_bounds": list(self.bounds()), "kv_scales": self.kv_scales,
                 "calibrated_clipping": self.cc.state_dict() if self.cc is not None else None,
                 "skipped_updates": self.skipped_updates, "fp8_layers": self.fp8_layers,
                 "dp_world": self.dp.world, **(extra or {})}
        out = store.save(step, weights={k: v.detach().cpu() for k, v in weights.items()},
                         model_files=model_files(self.model_dir),
                         optimizer={"optimizer": optimizer, "scheduler": self.scheduler.state_dict()},
                         rng=rng_state(), state=state)
        store.prune(keep_last_k)
        return out

    def _param_names(self) -> list[str]:
        """Parameter names in the optimizer's order (``model.parameters()``, the order of a checkpoint's optimizer
        state indices)."""
        return [n for n, _ in self.model.named_parameters()]

    def _state_keys(self) -> set[str]:
        return set(self.model.state_dict().keys())

    @torch.no_grad()
    def _load_full_state_dp(self, weights: Mapping[str, torch.Tensor], optimizer: Mapping) -> None:
        """Data-parallel load of a full (single-worker layout) checkpoint: every rank slices its own shard of each
        parameter and of its AdamW moments from the full tensors (``distribute_tensor`` with no source rank: no
        communication), and takes the optimizer's hyper-parameters. (Data-parallel FP8 linears keep no weight cache
        that could go stale: trainer.dp.shard_model.)"""
        from torch.distributed.tensor import DTensor, distribute_tensor

        def local(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            if isinstance(like, DTensor):
                return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)
            return full.to(like.dtype).clone()

        params = dict(self.model.named_parameters())
        for name, p in params.items():
            p.copy_(local(weights[name], p))
        for name, buf in self.model.named_buffers():
            if name in weights:
                buf.copy_(weights[name])
        names = self._param_names()
        saved_groups = optimizer["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"checkpoint optimizer has {len(saved_groups)} parameter groups, the trainer "
                             f"{len(self.optimizer.param_groups)}")
        for group, saved in zip(self.optimizer.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.optimizer.state.clear()
        for i, st in optimizer["state"].items():
            p = params[names[int(i)]]
            self.optimizer.state[p] = {k: (v.clone() if k == "step" else local(v, p)) for k, v in st.items()}

    def load_checkpoint(self, uri: str, step: int | None = None, *, endpoint_url: str | None = None) -> dict:
        """Restore weights, optimizer, scheduler, RNG, clip bounds and KV scales; returns the trainer state."""
        from storage.checkpoint import CheckpointStore, set_rng_state

        ck = CheckpointStore(uri, endpoint_url=endpoint_url).load(step)
        if self.dp.active:  # every rank reads the full checkpoint and keeps its shard (any M can resume any M')
            keys = self._state_keys()
            missing, unexpected = sorted(keys - set(ck.weights)), sorted(set(ck.weights) - keys)
            if missing or unexpected:
                raise ValueError(f"{ck.uri}: checkpoint does not match the model (missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]})")
            self._load_full_state_dp(ck.weights, ck.optimizer["optimizer"])
        else:
            missing, unexpected = self.model.load_state_dict(ck.weights, strict=False)
            if missing or unexpected:
                raise ValueError(f"{ck.uri}: checkpoint does not match the model (missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]})")
            self.optimizer.load_state_dict(ck.optimizer["optimizer"])
        self.scheduler.load_state_dict(ck.optimizer["scheduler"])
        if ck.rng is not None:
            set_rng_state(ck.rng)
        st = ck.state
        if self.cc is not None and st.get("calibrated_clipping"):
            self.cc.load_state_dict(st["calibrated_clipping"])
        self.kv_scales = st.get("kv_scales")
        self.skipped_updates = int(st.get("skipped_updates", 0))
        self.step = ck.step
        return {**st, "step": ck.step, "uri": ck.uri}


def _optimizer_state_by_index(osd: Mapping, names: Sequence[str]) -> dict:
    """torch.distributed.checkpoint's full optimizer state (keyed by parameter name) -> ``optimizer.state_dict()``'s
    layout (keyed by the parameter's position in ``names``), what a single worker saves and loads."""
    index = {n: i for i, n in enumerate(names)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
              for g in osd["param_groups"]]
    return {"state": {index[n]: v for n, v in osd["state"].items()}, "param_groups": groups}

