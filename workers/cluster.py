"""Ray runtime for a training run: a local single-node Ray (temp dir under the run dir, dashboard off) or an existing
cluster (``ray.address``), and the run's two named actors (PolicyWorker, RolloutWorker). Note: Ray 2.60 cannot be
restricted to loopback from ``ray.init`` (it resolves 127.0.0.1 to the node IP; its gRPC ports listen on all
interfaces); machines exposed to untrusted networks should keep Ray's token auth on (RAY_AUTH_MODE=token).

Ray actors die when their last handle is dropped, so ``start_workers`` returns the handles and the flow keeps them
for the whole run; Prefect tasks look actors up by name (``actor(name)``) and never receive handles, weights or
rollouts as parameters. ``stop_workers`` kills exactly the actors it created.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from configs.schema import Config

NAMESPACE = "fp8-grpo"


def cache_env(run_dir: Path) -> dict[str, str]:
    """Caches and switches for every process of the run (set before Ray starts, so actors inherit them)."""
    cache = run_dir / "cache"
    env = {
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "HF_HOME": str(cache / "hf"),
        "PREFECT_HOME": str(cache / "prefect"),
        "PREFECT_SERVER_MEMO_STORE_PATH": str(cache / "prefect" / "memo_store.toml"),
    }
    fixed = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
             "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_AUTH_MODE": "disabled", "DO_NOT_TRACK": "1",
             "VLLM_NO_USAGE_STATS": "1", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
             "VLLM_LOGGING_LEVEL": "ERROR", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
             "TRANSFORMERS_VERBOSITY": "error", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return {**env, **fixed}


def apply_env(run_dir: Path) -> None:
    """Set the run's environment (existing values win, so tests and users can point caches elsewhere)."""
    for key, value in cache_env(run_dir).items():
        os.environ.setdefault(key, value)
        if key.endswith(("_ROOT", "_DIR", "_HOME")):
            Path(os.environ[key]).mkdir(parents=True, exist_ok=True)


def ray_temp_dir(run_dir: Path) -> str:
    """$RAY_TMPDIR, else <run_dir>/ray; Ray's unix sockets (``<tmp>/session_<date>_<time>_<us>_<pid>/sockets/
    plasma_store``, ~64 bytes after <tmp>) must fit in 107 bytes, so a run dir longer than 40 bytes falls back to a
    short per-run dir under /tmp."""
    if os.environ.get("RAY_TMPDIR"):
        return os.environ["RAY_TMPDIR"]
    candidate = (run_dir / "ray").resolve()
    if len(str(candidate)) <= 40:
        return str(candidate)
    return f"/tmp/ray-{hashlib.sha1(str(candidate).encode()).hexdigest()[:10]}"


def init_ray(cfg: Config, run_dir: Path) -> bool:
    """Connect to ``ray.address`` or start a local Ray on loopback. Returns True when this call started Ray (the
    caller shuts it down at the end)."""
    import ray

    if ray.is_initialized():
        return False
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
        return True
    need = cfg.ray.policy_worker.num_cpus + cfg.ray.rollout_worker.num_cpus
    num_cpus = cfg.ray.num_cpus or max(int(need + 0.999), os.cpu_count() or 1)
    tmp = ray_temp_dir(run_dir)
    Path(tmp).mkdir(parents=True, exist_ok=True)
    # No _node_ip_address="127.0.0.1": Ray 2.60 rewrites loopback to the node's IP (services.resolve_ip_for_localhost)
    # and its gRPC servers listen on all interfaces whatever is passed; the dashboard is off.
    ray.init(num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False, _temp_dir=tmp,
             logging_level="WARNING", log_to_driver=False)
    return True


@dataclass
class Workers:
    policy_name: str
    rollout_name: str
    policy: object  # ray actor handles: keep them alive for the run
    rollout: object


def rollout_config(cfg: Config):
    from workers.rollout import RolloutConfig

    vc = cfg.policy.generation.vllm_cfg
    spec = cfg.rollout_fp8_spec()  # end-to-end FP8: the trainer's numerics (configs/schema.py)
    fp8 = {} if spec is None else dict(
        fp8_recipe=spec.recipe,
        num_first_layers_in_bf16=spec.num_first_layers_in_bf16, num_last_layers_in_bf16=spec.num_last_layers_in_bf16,
        pow2_weight_scaling_factors=spec.pow2_weight, pow2_activation_scaling_factors=spec.pow2_activation)
    return RolloutConfig(
        precision="fp8" if vc.precision == "fp8" else "bf16", kv_cache_dtype=vc.kv_cache_dtype,
        kv_cache_impl=vc.kv_cache_impl, bf16_mode=vc.bf16_mode, **fp8,
        kv_cache_memory_bytes=vc.kv_cache_memory_bytes, max_model_len=vc.max_model_len, seed=cfg.grpo.seed,
        gpu_memory_utilization=vc.gpu_memory_utilization, enforce_eager=vc.enforce_eager,
        kv_scales_max_lag=max(0, cfg.calibration.kv_scales_period - 1))


def check_rollout_kv(cfg: Config, model_dir: Path) -> tuple[str, str]:
    """The load-time check of the rollout KV cache, before any worker starts: ``(kv mode, reason)`` from the model's
    head size and this node's CPU (after FP8GRPO_CPU_CAP), or ConfigError naming the key and the missing CPU feature /
    the head size where vLLM would refuse it. The rollout actor checks again on its own node before its engine
    starts (a Ray cluster's nodes may differ from the driver's)."""
    from configs.schema import ConfigError
    from workers.rollout import _read_model_config, resolve_kv_mode

    vc = cfg.policy.generation.vllm_cfg
    try:
        return resolve_kv_mode(_read_model_config(Path(model_dir)), vc.kv_cache_dtype, vc.kv_cache_impl,
                               on_gpu=cfg.ray.rollout_worker.num_gpus > 0)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _policy_actor_class():
    """PolicyWorker as the run's actor: applies the CPU cap in the actor process before the model is built and
    reports the actor's CpuCaps (``cpu()``)."""
    from workers.policy import PolicyWorker

    class PolicyActor(PolicyWorker):
        def __init__(self, *args, **kwargs):
            from fp8core.cpu import apply_cpu_cap

            apply_cpu_cap()
            super().__init__(*args, **kwargs)

        def cpu(self) -> dict:
            from fp8core.cpu import cpu_caps
            from workers.rollout import cpu_caps_dict

            return cpu_caps_dict(cpu_caps())

    PolicyActor.__name__ = PolicyActor.__qualname__ = "PolicyWorker"
    return PolicyActor


def start_workers(cfg: Config, model_dir: Path, run_dir: Path, tag: str) -> Workers:
    """Create the run's PolicyWorker and RolloutWorker actors (named ``fp8grpo-{policy,rollout}-{tag}``) and wait
    until both are constructed (errors surface here, with the actor's traceback)."""
    import ray

    from fp8core.cpu import cap_env
    from workers.rollout import RolloutWorker

    pw, rw = cfg.ray.policy_worker, cfg.ray.rollout_worker
    threads = cfg.policy.generation.vllm_cfg.threads
    # FP8GRPO_CPU_CAP (+ ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA when it lowers this node's kind) reach the actors
    # before they import torch; each actor also applies the cap itself (fp8core.cpu.apply_cpu_cap) before vLLM.
    cap = cap_env()
    env_p = {"OMP_NUM_THREADS": str(cfg.policy.threads), **cap}
    # glibc: keep large buffers mapped (the trainer does the same with mallopt): two 5 MB allocations took 3.9 ms
    # instead of 0.12 ms when every free returned them to the OS
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
    env_r = {"OMP_NUM_THREADS": str(threads), **malloc, **cap}
    names = (f"fp8grpo-policy-{tag}", f"fp8grpo-rollout-{tag}")
    policy = ray.remote(_policy_actor_class()).options(
        name=names[0], num_cpus=pw.num_cpus, num_gpus=pw.num_gpus, runtime_env={"env_vars": env_p},
        max_concurrency=1).remote(str(model_dir), cfg, run_dir=str(run_dir))
    rollout = ray.remote(RolloutWorker).options(
        name=names[1], num_cpus=rw.num_cpus, num_gpus=rw.num_gpus, runtime_env={"env_vars": env_r},
        max_concurrency=1).remote(str(model_dir), rollout_config(cfg), run_dir=str(run_dir))
    ray.get([policy.info.remote(), rollout.stats.remote()])
    return Workers(names[0], names[1], policy, rollout)


def stop_workers(workers: Workers | None) -> None:
    import ray

    if workers is None:
        return
    try:
        ray.get(workers.rollout.shutdown.remote(), timeout=60)
    except Exception:  # noqa: BLE001 - best effort before the kill
        pass
    for handle in (workers.rollout, workers.policy):
        ray.kill(handle)


def actor(name: str):
    """The run's actor of that name (tasks use names, never handles passed through Prefect)."""
    import ray

    return ray.get_actor(name, namespace=NAMESPACE)
