"""PolicyWorker: the trainer side of GRPO. Owns the HF causal LM (its decoder linears converted to FP8 by fp8core when
``policy.megatron_cfg.fp8_cfg.enabled``), AdamW with gradient clipping and an LR schedule, logprob computation, the
train step with fp8core.rl's clipped policy-gradient loss, the FP8 calibrations (KV-cache scales for the rollout
engine, Calibrated Clipping of the PPO bounds) and checkpoint save/load.

A plain class (unit-testable in-process); the pipeline runs it as a Ray actor (``ray.remote(PolicyWorker)``) so
weights travel actor-to-actor through the Ray object store, never through Prefect.

Layout
------
This class keeps the construction and the methods the driver calls (through Ray, by name); the work is done by
functions that take the worker as their first argument: the train step's phases (module docstring of
trainer/train_step.py, items 1-5) in trainer/train_step.py, one forward and its contexts in trainer/forward.py, the
no-grad logprob passes and the reference policy in trainer/logprobs.py, the FP8 calibrations in
trainer/calibration.py, the state on storage in trainer/checkpoint_io.py.

Numerics
--------
* Master weights are FP32 (what AdamW updates); ``policy.precision: bfloat16`` runs the forward/backward under CPU/GPU
  autocast to BF16 (the usual mixed-precision setup), ``float32`` without autocast. FP8Linear layers quantize their
  operands themselves (fp8core.linear; FP32 accumulation).
* ``policy.megatron_cfg.activation_checkpointing``: each decoder layer keeps only its inputs in a training forward
  and runs its forward again in the backward (trainer.dp.checkpoint_layers), inside the same routing replay,
  precision and KV rounding contexts (trainer.forward.forward_contexts): the same gradients bit for bit, less memory.
* Token alignment: for a sequence ``s`` (prompt + response), ``logp[:, j] = log softmax(z_{j-1} / T)[s_j]`` for j >= 1
  (column 0 is 0 and always masked). ``T`` is the sampling temperature: vLLM's processed logprobs are those of
  ``logits / T``, so trainer and rollout logprobs are comparable (``mismatch/*``) and the ratio is the sampled policy's.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from configs.schema import Config
from fp8core.cpu import usable_threads
from process.faults import TestHooks
from process.memory import HEAP_ENV, HEAP_POLICIES
from storage.hub import local_model_dir
from trainer.batch import Batch, use_packed_attention
from trainer.calibration import calibrate_clip, calibrate_kv
from trainer.checkpoint_io import full_state, read_checkpoint, write_checkpoint
from trainer.dp import DPGroup, load_model
from trainer.forward import token_logp
from trainer.logprobs import no_grad_logprobs, reference_model, score_rollouts, shadow_logprobs
from trainer.train_step import (
    accumulate_update,
    complete_old_logprobs,
    compute_advantages,
    gather_rank_parts,
    optimizer_step,
    plan_step,
    prepare_loss,
    step_metrics,
)


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


def _has_dropout(model) -> bool:
    """Whether any module or the config drops activations in training (then a training forward is not the policy's
    deterministic forward)."""
    return any(isinstance(mod, torch.nn.Dropout) and mod.p > 0 for mod in model.modules()) or any(
        float(getattr(model.config, k, 0.0) or 0.0) > 0 for k in
        ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop"))


class PolicyWorker:
    """See the module docstring. ``model_dir``: HF model (safetensors + config + tokenizer)."""

    def __init__(self, model_dir: str | Path, cfg: Config, *, run_dir: str | Path | None = None,
                 dp: DPGroup | None = None, hooks: TestHooks | None = None):
        from transformers import AutoTokenizer

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
        self.dp = dp or DPGroup()
        self.model = load_model(self.model_dir, self.device, self.dp)  # a rank: meta-built, its shard filled below
        self.model.config.use_cache = False
        from fp8core.moe import convert_routers

        self.moe_layers = convert_routers(self.model)  # MoE: routers in FP32 (fp8core/moe.py); [] for dense models
        self.router_replay = bool(p.router_replay.enabled and self.moe_layers)
        self._moe_measure, self._moe_acc = False, None
        self.fp8_spec = cfg.trainer_fp8_spec()  # the one FP8 numerics spec (the engine's too in end-to-end FP8)
        self.fp8_layers: list[str] = self.fp8_spec.convert(self.model) if self.fp8_spec is not None else []
        # policy.megatron_cfg.activation_checkpointing: decoder layers recompute their activations in the backward,
        # under the contexts their forward ran under (trainer.forward.forward_contexts); before sharding (trainer.dp)
        self._recompute = None  # during a forward: () -> its contexts, once more (trainer.forward.token_logp)
        # policy.sequence_packing: batches of several rows run packed (trainer.forward.token_logp), cut by tokens
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
        # like the policy; its logprobs come from the trainer's own logprob pass (trainer.logprobs.reference_logprobs)
        self.ref_model = reference_model(self) if cfg.loss_fn.reference_policy_kl_penalty > 0 else None
        if self.dp.active:  # data-parallel rank: FSDP2 shards masters, gradients and optimizer state (trainer/dp.py)
            self._shard()
        self.optimizer, self.scheduler = self._optimizer()
        lf, cal = cfg.loss_fn, cfg.calibration
        self.clip_low, self.clip_high = 1.0 - lf.ratio_clip_min, 1.0 + lf.ratio_clip_max
        self.cc = CalibratedClipping(cfg.calibrated_clipping_config()) if cal.calibrated_clipping else None
        self.kv_scales: dict[str, list[float]] | None = None
        # calibration.kv_rounding_in_trainer: token_logp rounds K/V like the engine's FP8 cache with the scales the
        # engine holds (the last calibrated ones; unit scales before any), except in the BF16 shadow forwards
        self.kv_rounding = bool(cal.kv_rounding_in_trainer)
        self._kv_rounding_paused = False
        # old logprobs of the first update's rows come from its training forwards (train_step) unless the model
        # has dropout, where a training forward is not the policy's deterministic forward
        self.reuse_first_forward = not _has_dropout(self.model)
        self.skipped_updates = 0
        self.step = 0  # RL steps completed
        # TEST-ONLY hooks (process/faults.py): handed in by the flow (testing.* keys) or installed by a test; None in
        # a real run
        self.hooks = hooks


    def _shard(self) -> None:
        """Join the group, shard the (meta-built, converted) policy and reference models and fill this rank's
        shards from the checkpoint (trainer/dp.py)."""
        from trainer.dp import init_group, materialize_shards, shard_model

        init_group(self.dp, self.device)
        for model in (self.model, self.ref_model):
            if model is not None:
                shard_model(model, self.device)
                materialize_shards(model, self.model_dir, self.device)
        if self.bf16_emulation is not None:  # no rounded copy of a gathered weight (trainer/dp.py)
            self.bf16_emulation.cache_weights = False
    def _optimizer(self):
        """AdamW over the (sharded) masters and its LR schedule (``policy.optimizer``, ``policy.scheduler``)."""
        p = self.cfg.policy
        o, s = p.optimizer, p.scheduler
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                      weight_decay=o.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_lambda(
            k, warmup_steps=s.warmup_steps, decay=s.decay, total_steps=self.cfg.grpo.max_num_steps,
            min_lr_ratio=s.min_lr_ratio))
        return optimizer, scheduler

    # ------------------------------------------------------------------------------------------------ basic info
    def info(self) -> dict:
        n = sum(p.numel() for p in self.model.parameters())
        return {"num_params": n, "fp8_layers": len(self.fp8_layers), "device": str(self.device),
                "bf16_mode": self.bf16_mode if self.cfg.policy.precision == "bfloat16" else "off",
                "clip_bounds": [self.clip_low, self.clip_high], "step": self.step,
                "num_layers": self.model.config.num_hidden_layers, "dp_rank": self.dp.rank, "dp_world": self.dp.world,
                "threads": self.threads}

    def memory(self, *, reset: bool = False) -> dict:
        """This rank's process memory (process.memory.snapshot: ``rss``, ``peak`` since the last reset, CUDA's
        allocator on a GPU), taken before ``reset`` sets the peak back to the current RSS."""
        from process.memory import snapshot

        return snapshot(reset=reset)

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
        return {k: v.detach().to("cpu", dt).clone() for k, v in checkpoint_state_dict(full_state(self)).items()}

    def refit_weights(self) -> dict[str, torch.Tensor]:
        """What a refit ships. End-to-end FP8 (the engine runs this trainer's FP8 numerics, Config.rollout_fp8_spec
        == trainer_fp8_spec): the served state (fp8core.serve: this trainer's FP8 codes + weight_scale_inv for the
        FP8 linears, BF16 -- the engine's model dtype -- for the rest), loaded by the engine without re-quantizing.
        Otherwise the FP32 masters (``weights()``), which an FP8-generation-only engine quantizes itself."""
        if self._serves_fp8():
            from fp8core.serve import served_state_dict

            state = full_state(self)  # data-parallel: full on rank 0 only, quantized there (no layer gathered)
            served = served_state_dict(self.model, hp_dtype=torch.bfloat16, state=state) if state else {}
            # FP8 codes and E8M0 scales travel as their bytes (uint8): pickling float8 tensors fails in torch 2.13,
            # and Ray pickles
            return {k: v.view(torch.uint8) if v.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else v
                    for k, v in served.items()}
        return self.weights()

    def _serves_fp8(self) -> bool:
        """Whether a refit ships the served FP8 state (the engine runs this trainer's FP8 numerics,
        Config.rollout_fp8_spec == trainer_fp8_spec) rather than the FP32 masters."""
        trainer, rollout = self.cfg.trainer_fp8_spec(), self.cfg.rollout_fp8_spec()
        return trainer is not None and rollout is not None and trainer.forward_key() == rollout.forward_key()

    # ------------------------------------------------------------------------------------------ refit over the wire
    def refit_open_store(self, world: int, timeout_s: float) -> str:
        """Rank 0: host a new store for a refit group of ``world`` members (process.refit_wire); its address."""
        from process.refit_wire import node_ip, open_store

        self._refit_store, address = open_store(node_ip(), world, timeout_s)
        return address

    def refit_join(self, address: str, *, rank: int, world: int, senders: int, generation: int,
                   timeout_s: float) -> int:
        """Join refit group ``generation`` as sender ``rank`` (this data-parallel rank); returns the generation."""
        from process.refit_wire import join

        self._refit_group = None
        self._refit_group = join(address, rank=rank, world=world, senders=senders, generation=generation,
                                 timeout_s=timeout_s, device=self.device,
                                 store=getattr(self, "_refit_store", None) if rank == 0 else None)
        return generation

    def refit_generation(self) -> int | None:
        """The refit group this rank is in (None: none, e.g. after Ray restarted it)."""
        group = getattr(self, "_refit_group", None)
        return None if group is None else group.generation

    def refit_to_wire(self) -> dict:
        """Send what :meth:`refit_weights` would return, from this rank's shard, bucket by bucket over the refit
        group (trainer.refit.ServedShard, process.refit_wire.send); every data-parallel rank calls it. Returns
        ``{"seconds", "bytes", "buckets"}``."""
        import time

        from process.refit_wire import send
        from trainer.refit import ServedShard

        group = getattr(self, "_refit_group", None)
        if group is None:
            raise RuntimeError("refit: this trainer rank is in no refit group (refit_join first)")
        t0 = time.perf_counter()
        reduce = None
        if self.dp.active:
            import torch.distributed as dist

            def reduce(t: torch.Tensor) -> None:
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
        with torch.no_grad():
            shard = ServedShard(self.model, fp8=self._serves_fp8(), rank=self.dp.rank, world=self.dp.world, all_reduce_max=reduce)
            moved = send(group, shard.manifest, shard.tensors, error=shard.error)
        return {"seconds": time.perf_counter() - t0, **moved}

    # ---------------------------------------------------------------------------------------------------- logprobs
    def logprobs(self, b: Batch, *, want_entropy: bool = False, rows: torch.Tensor | None = None):
        """No-grad logprobs (FP32) and entropies (FP64) ``[B, L]`` of ``b`` (of ``b.slice(rows)`` when given);
        data-parallel, a collective (trainer.logprobs.no_grad_logprobs)."""
        return no_grad_logprobs(self, b, want_entropy=want_entropy, rows=rows)

    def score(self, rollouts: Sequence[Mapping]) -> dict:
        """Teacher-forced logprobs and ``mismatch/*`` of ``rollouts`` with this trainer as it trains, no update
        (trainer.logprobs.score_rollouts)."""
        return score_rollouts(self, rollouts)

    def _token_logp(self, b: Batch, *, want_entropy: bool = False):
        """One forward of a micro-batch (trainer.forward.token_logp)."""
        return token_logp(self, b, want_entropy=want_entropy)

    def _shadow_logprobs(self, b: Batch) -> torch.Tensor:
        """The BF16 shadow's logprobs of ``b`` (trainer.logprobs.shadow_logprobs)."""
        return shadow_logprobs(self, b)

    # ---------------------------------------------------------------------------------------------------- training
    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        return compute_advantages(self, rewards, group_size)

    def train_step(self, rollouts: Sequence[Mapping], rewards: Sequence[float], *, step: int) -> dict[str, float]:
        """One GRPO step on ``rollouts`` (RolloutWorker.generate output) with ``rewards`` (one per sample, prompt-major).
        Returns metrics (python floats, stable names). The phases (trainer/train_step.py's docstring, items 1-5) are
        the functions of trainer/train_step.py, called in this order."""
        if self.hooks is not None:  # TEST-ONLY: a trainer lost mid-step
            self.hooks.kill_point()
        t0 = time.perf_counter()
        self._positions = [0, 0]
        st = plan_step(self, rollouts, rewards, step)
        st.t_old = time.perf_counter() - t0
        prepare_loss(self, st)
        self.model.train()
        for u, gidx in enumerate(st.update_rows):
            finite = accumulate_update(self, st, u, gidx)
            if u == 0:
                complete_old_logprobs(self, st)
            optimizer_step(self, st, u, finite)
            self._moe_measure = False
        lr_used = float(self.optimizer.param_groups[0]["lr"])  # the LR this step's updates used (before the advance)
        self.scheduler.step()
        self._moe_measure = False
        gather_rank_parts(self, st)
        m = step_metrics(self, st, lr_used)
        if st.calibrate:  # the bounds of the next steps (calib/bound_*); clip/bound_* stay the ones this step used
            calibrate_clip(self, st, m)
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

    # ------------------------------------------------------------------------------------------------ KV calibration
    def calibrate_kv_scales(self, rollouts: Sequence[Mapping], *, max_samples: int) -> dict[str, list[float]]:
        """Per-layer K/V scales (amax / 448) from the policy's own forward over (prompt + response) sequences of the
        current batch; sent to the rollout engine with the next refit (trainer.calibration.calibrate_kv)."""
        return calibrate_kv(self, rollouts, max_samples=max_samples)

    # ---------------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, uri: str, step: int, *, extra: Mapping | None = None, keep_last_k: int | None = None,
                        endpoint_url: str | None = None) -> str | None:
        """Write a complete checkpoint of RL step ``step`` and prune old ones; data-parallel, a collective (ranks > 0
        return None) (trainer.checkpoint_io.write_checkpoint)."""
        return write_checkpoint(self, uri, step, extra=extra, keep_last_k=keep_last_k, endpoint_url=endpoint_url)

    def load_checkpoint(self, uri: str, step: int | None = None, *, endpoint_url: str | None = None) -> dict:
        """Restore weights, optimizer, scheduler, RNG, clip bounds and KV scales; returns the trainer state
        (trainer.checkpoint_io.read_checkpoint)."""
        return read_checkpoint(self, uri, step, endpoint_url=endpoint_url)
