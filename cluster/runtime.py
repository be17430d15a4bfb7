"""Ray runtime for a training run: a local single-node Ray (temp dir under the run dir, dashboard off) or an existing
cluster (``ray.address``), and the run's two named actors (PolicyWorker, RolloutWorker).

Security: every Ray this project starts or joins runs with Ray's token authentication (cluster/auth.py).

Ray actors die when their last handle is dropped, so ``start_workers`` returns the handles and the flow keeps them
for the whole run; Prefect tasks look actors up by name (``actor(name)``) and never receive handles, weights or
rollouts as parameters. ``stop_workers`` kills exactly the actors it created.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cluster.auth import apply_auth, ray_auth
from configs.base import collective_timeout_s
from configs.schema import Config
from process.env import cache_env
from process.faults import TestHooks

NAMESPACE = "fp8-grpo"


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


def init_ray(cfg: Config, run_dir: Path, auth: dict[str, str] | None = None) -> bool:
    """Connect to ``ray.address`` or start a local Ray, with token authentication (``ray_auth``). Returns True
    when this call started Ray (the caller shuts it down at the end)."""
    import ray

    if ray.is_initialized():
        return False
    apply_auth(auth if auth is not None else ray_auth(cfg, run_dir))
    # ray.init replaces this process's SIGTERM handler with its own (sys.exit, and a local head's process kill).
    # Put back the one in place: inside a Prefect flow that is Prefect's SIGTERM bridge, which a runner's cancel
    # needs to find installed -- without it the cancel intent is never acknowledged, the runner's SIGTERM lands on
    # Ray's sys.exit and the flow run ends CRASHED instead of CANCELLED (seen in CI when the cancel fell between two
    # step subflows). The run's own cleanup (the flow's finally, the watchdog) ends Ray's processes either way.
    before = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        if cfg.ray.address:
            ray.init(address=cfg.ray.address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
        else:
            _init_local(cfg, run_dir)
    finally:
        if before is not None:  # signal handlers can only be set from the main thread
            signal.signal(signal.SIGTERM, before)
    return True


def _init_local(cfg: Config, run_dir: Path) -> None:
    import ray

    need = (cfg.cluster.policy_workers * cfg.ray.policy_worker.num_cpus
            + cfg.cluster.rollout_workers * cfg.ray.rollout_worker.num_cpus)
    num_cpus = cfg.ray.num_cpus or max(int(need + 0.999), os.cpu_count() or 1)
    tmp = ray_temp_dir(run_dir)
    Path(tmp).mkdir(parents=True, exist_ok=True)
    # No _node_ip_address="127.0.0.1": Ray 2.60 rewrites loopback to the node's IP (services.resolve_ip_for_localhost)
    # and its gRPC servers listen on all interfaces whatever is passed; the dashboard is off; token auth is on.
    ray.init(num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False, _temp_dir=tmp,
             logging_level="WARNING", log_to_driver=False)


PLACEMENT_TIMEOUT_S = 120.0


@dataclass
class Workers:
    policy_names: tuple[str, ...]  # every data-parallel trainer rank, rank 0 first (cluster.policy_workers)
    rollout_names: tuple[str, ...]  # cluster.rollout_workers vLLM engines
    policies: tuple  # ray actor handles: keep them alive for the run
    rollouts: tuple
    placement_group: object | None = None

    @property
    def policy_name(self) -> str:
        """Rank 0 of the trainers: the one whose results the flow uses."""
        return self.policy_names[0]

    @property
    def policy(self):
        return self.policies[0]

    @property
    def rollout(self):
        """The first engine (what all engines share: KV mode, CPU kind of the node, ...)."""
        return self.rollouts[0]


def split_groups(num_prompts: int, num_engines: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` prompt ranges, one per engine that gets work: whole GRPO groups (a prompt and
    its ``n`` samples stay on one engine), sizes differing by at most one, the larger ones first."""
    if num_prompts < 0 or num_engines < 1:
        raise ValueError(f"need num_prompts >= 0 and num_engines >= 1, got {num_prompts}, {num_engines}")
    k = max(1, min(num_engines, num_prompts))
    base, extra = divmod(num_prompts, k)
    out, start = [], 0
    for i in range(k):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def placement_bundles(cfg: Config) -> list[dict[str, float]]:
    """The run's Ray placement-group bundles: ``cluster.policy_workers`` policy bundles first, then one per rollout
    engine (``ray.{policy,rollout}_worker.{num_cpus,num_gpus}``; zero amounts left out)."""
    def bundle(w) -> dict[str, float]:
        return {k: float(v) for k, v in (("CPU", w.num_cpus), ("GPU", w.num_gpus)) if v > 0}

    return ([bundle(cfg.ray.policy_worker)] * cfg.cluster.policy_workers
            + [bundle(cfg.ray.rollout_worker)] * cfg.cluster.rollout_workers)


def check_rollout_kv(cfg: Config, model_dir: Path) -> tuple[str, str]:
    """The load-time check of the rollout KV cache, before any worker starts: ``(kv mode, reason)`` from the model's
    head size and this node's CPU (after FP8GRPO_CPU_CAP), or ConfigError naming the key and the missing CPU feature /
    the head size where vLLM would refuse it. The rollout actor checks again on its own node before its engine
    starts (a Ray cluster's nodes may differ from the driver's)."""
    from configs.schema import ConfigError
    from rollout.checkpoint import _read_model_config
    from rollout.kv_cache import check_compiled_kv, resolve_kv_mode

    vc = cfg.policy.generation.vllm_cfg
    try:
        mode, reason = resolve_kv_mode(_read_model_config(Path(model_dir)), vc.kv_cache_dtype, vc.kv_cache_impl,
                                       on_gpu=cfg.ray.rollout_worker.num_gpus > 0)
        check_compiled_kv(mode, vc.enforce_eager)
        return mode, reason
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _policy_actor_class():
    """PolicyWorker as the run's actor: applies the CPU cap in the actor process before the model is built and
    reports the actor's CpuCaps (``cpu()``)."""
    from trainer.policy import PolicyWorker

    class PolicyActor(PolicyWorker):
        def __init__(self, *args, **kwargs):
            from fp8core.cpu import apply_cpu_cap, apply_cpu_pin

            apply_cpu_cap()
            apply_cpu_pin()  # cluster.pin_cpus: this rank's own cores, before torch starts its threads
            super().__init__(*args, **kwargs)

        def cpu(self) -> dict:
            from fp8core.cpu import cpu_caps, cpu_caps_dict

            return cpu_caps_dict(cpu_caps())

    PolicyActor.__name__ = PolicyActor.__qualname__ = "PolicyWorker"
    return PolicyActor


def cpu_pins(cfg: Config) -> list[list[int]] | None:
    """``cluster.pin_cpus``: each worker's own CPUs on this node, trainer ranks first (``policy.threads`` each), then
    the engines (``vllm_cfg.threads`` each), in the order of this process's affinity mask; None when off. Raises
    ConfigError, before any worker starts, when the node has fewer CPUs than the workers' threads."""
    from configs.schema import ConfigError

    if not cfg.cluster.pin_cpus:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    sizes = ([cfg.policy.threads] * cfg.cluster.policy_workers
             + [cfg.policy.generation.vllm_cfg.threads] * cfg.cluster.rollout_workers)
    if sum(sizes) > len(cpus):
        raise ConfigError(f"cluster.pin_cpus: the workers' threads ({' + '.join(map(str, sizes))} = {sum(sizes)}: "
                          f"policy.threads per trainer, policy.generation.vllm_cfg.threads per engine) exceed the "
                          f"{len(cpus)} CPUs this node lets the run use; lower the threads or turn pinning off")
    out, at = [], 0
    for n in sizes:
        out.append(cpus[at:at + n])
        at += n
    return out


def pin_env(pins: list[list[int]] | None, i: int) -> dict[str, str]:
    """Worker ``i``'s FP8GRPO_CPUS (fp8core.cpu.apply_cpu_pin), or nothing without pinning."""
    from fp8core.cpu import PIN_ENV

    return {} if pins is None else {PIN_ENV: ",".join(map(str, pins[i]))}


def start_policy_workers(cfg: Config, model_dir: str | Path, run_dir: Path, tag: str, *, env: dict | None = None,
                         scheduling=None, hooks: TestHooks | None = None) -> tuple[tuple[str, ...], tuple]:
    """``cluster.policy_workers`` PolicyWorker actors (``fp8grpo-policy-{tag}`` for rank 0, ``-{tag}-{r}`` for the
    others), constructed concurrently: with more than one they join one process group (trainer/dp.py) whose
    rendezvous is rank 0's store, its address passed on through a zero-CPU actor (trainer.dp.Rendezvous).
    ``scheduling(i)``: the Ray scheduling strategy of placement bundle ``i`` (None: anywhere). Returns (names,
    handles), rank 0 first; construction errors surface when the caller first waits on them."""
    import ray

    from trainer.dp import DPGroup, Rendezvous

    pw, m = cfg.ray.policy_worker, cfg.cluster.policy_workers
    place = (lambda i: {"scheduling_strategy": scheduling(i)}) if scheduling is not None else (lambda i: {})
    rendezvous = ray.remote(Rendezvous).options(num_cpus=0).remote() if m > 1 else None
    names = tuple(f"fp8grpo-policy-{tag}" if r == 0 else f"fp8grpo-policy-{tag}-{r}" for r in range(m))
    pins = cpu_pins(cfg)
    timeout = collective_timeout_s(cfg.cluster.collective_timeout_s, pw.num_gpus)  # 60 s CPU / 600 s GPU when null
    handles = tuple(ray.remote(_policy_actor_class()).options(
        name=names[r], num_cpus=pw.num_cpus, num_gpus=pw.num_gpus,
        runtime_env={"env_vars": {**(env or {}), **pin_env(pins, r)}},
        max_concurrency=1, **place(r)).remote(
            str(model_dir), cfg, run_dir=str(run_dir),
            dp=DPGroup(r, m, rendezvous, timeout) if m > 1 else None, hooks=hooks) for r in range(m))
    return names, handles


def policy_call(names: Sequence[str], method: Callable | str, *args, **kwargs):
    """Call ``method`` on every trainer rank at once (data-parallel methods are collectives: each rank must take
    part) and return rank 0's result; the other ranks' results are waited for (their errors surface) and dropped.
    ``method``: a PolicyWorker method as the class's attribute (``PolicyWorker.train_step``, so a reader and a
    linter can follow the call), or :data:`RAY_CALL` (see :func:`policy_refs`)."""
    return get_fail_fast(policy_refs(names, method, *args, **kwargs))[0]


WAIT_POLL_S = 0.02  # the longest sleep between two polls of a driver-side wait (the latency it adds, at most)


def wait(refs: Sequence, *, num_returns: int | None = None, timeout: float | None = None) -> tuple[list, list]:
    """``ray.wait(refs, num_returns, timeout, fetch_local=False)`` for the driver, polled from Python: each poll is a
    non-blocking ``ray.wait`` and the time between polls a ``time.sleep`` (1 ms doubling to :data:`WAIT_POLL_S`).

    Why not Ray's blocking wait: a stop signal's Python handler runs where the main thread is. Inside Ray's wait it
    runs from Ray's Cython signal check, which passes on KeyboardInterrupt and SystemExit only: Prefect's
    TerminationSignal (SIGTERM in a flow run) came out as ``SystemError: ... returned a result with an exception
    set``, and in one run was not acted on at all (the run kept stepping). In ``time.sleep`` the handler's exception
    is raised as itself, and Prefect's handler stays installed throughout (its control listener needs it to
    acknowledge a cancel)."""
    import time

    import ray

    refs = list(dict.fromkeys(refs))  # ray.wait refuses duplicates
    want = len(refs) if num_returns is None else num_returns
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.001
    while True:
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        left = None if deadline is None else deadline - time.monotonic()
        if len(done) >= want or (left is not None and left <= 0):
            done = done[:want]  # as ray.wait: at most num_returns done (in refs' order), the rest pending
            finished = set(done)
            return done, [r for r in refs if r not in finished]
        time.sleep(pause if left is None else max(0.0, min(pause, left)))
        pause = min(2 * pause, WAIT_POLL_S)


def get(refs, *, timeout: float | None = None):
    """``ray.get(refs, timeout=timeout)`` (one ref or a list) after :func:`wait` has seen them all finish: the
    driver's blocking get, with stop signals raised as themselves (see :func:`wait`). Raises Ray's GetTimeoutError
    when they have not all finished within ``timeout``."""
    import ray
    from ray.exceptions import GetTimeoutError

    many = list(refs) if isinstance(refs, (list, tuple)) else [refs]
    _, pending = wait(many, timeout=timeout)
    if pending:
        raise GetTimeoutError(f"{len(pending)} of {len(set(many))} calls not finished within {timeout}s")
    return ray.get(refs)


def get_fail_fast(refs: Sequence) -> list:
    """``ray.get(refs)``, but the first ref that fails raises at once, in completion order (``ray.get`` of a list
    waits in list order: a dead rank 1 would surface only after rank 0, blocked in a collective with it, timed
    out). Waits with :func:`wait`."""
    import ray

    refs = list(refs)
    values, pending = {}, list(dict.fromkeys(refs))
    while pending:
        done, pending = wait(pending, num_returns=1)
        values[done[0]] = ray.get(done[0])  # raises the failure of a finished ref at once
    return [values[r] for r in refs]


class WorkerLost(RuntimeError):
    """A trainer rank died (its process was killed, crashed or lost its node): the run stops; it resumes from the
    last complete checkpoint with ``checkpointing.resume=true``."""


def actor_error(err: BaseException):
    """The RayActorError behind ``err`` (itself, or the cause of a task error whose argument came from a dead
    actor), else None."""
    from ray.exceptions import RayActorError, RayTaskError

    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, RayActorError):
            return err
        nxt = getattr(err, "cause", None) if isinstance(err, RayTaskError) else None
        err, seen = (nxt or err.__cause__), seen + 1
    return None


def dead_actors(err: BaseException, names: Sequence[str]) -> list[str]:
    """Which of the actors ``names`` ``err`` (an actor error) is about: the one whose actor id it names, and any
    whose name no longer resolves (dead for good). A restarting actor still resolves to the same id."""
    import ray

    ae = actor_error(err)
    dead_id = getattr(ae, "actor_id", None) if ae is not None else None
    out = []
    for n in names:
        try:
            handle = ray.get_actor(n, namespace=NAMESPACE)
        except ValueError:
            out.append(n)
            continue
        if dead_id and handle._actor_id.hex() == dead_id:
            out.append(n)
    return out


def lost_trainers(err: BaseException, names: Sequence[str], *, timeout_s: float = 20.0) -> list[str]:
    """The trainer ranks of ``names`` that are dead after a step failed with ``err``. An actor error names its actor
    (:func:`dead_actors`); any other error -- e.g. rank 0's gloo "connection reset" when its peer crashed, which can
    arrive before Ray has marked the peer dead -- is followed by a liveness probe: each rank gets a no-op call
    (``cpu``), and a rank whose call fails with an actor error, or whose name no longer resolves, within
    ``timeout_s`` is lost. A live rank that is busy (max_concurrency=1) does not answer in time and is not counted."""
    import time

    import ray
    from ray.exceptions import ActorUnavailableError, RayActorError

    if actor_error(err) is not None:
        return dead_actors(err, names)
    lost, probes = [], {}
    for n in names:
        try:
            probes[ray.get_actor(n, namespace=NAMESPACE).cpu.remote()] = n
        except ValueError:
            lost.append(n)
    deadline = time.monotonic() + timeout_s
    pending = list(probes)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, pending = wait(pending, num_returns=1, timeout=left)
        for ref in done:
            try:
                ray.get(ref)
            except ActorUnavailableError:
                pass  # restarting: not lost for good
            except RayActorError:
                lost.append(probes[ref])
    return [n for n in names if n in lost]


def await_actors(names: Sequence[str], timeout_s: float, *, poll_s: float = 0.5) -> float:
    """Wait until every actor of ``names`` answers (``stats``), e.g. an engine Ray is restarting (calls to it fail
    with ActorUnavailableError until its constructor is done: they are repeated); returns the seconds waited. Raises
    TimeoutError naming the ones still not answering, or ActorDiedError for one that is dead for good."""
    import time

    import ray
    from ray.exceptions import ActorUnavailableError

    t0 = time.perf_counter()
    waiting = list(names)
    while waiting:
        left = timeout_s - (time.perf_counter() - t0)
        if left <= 0:
            raise TimeoutError(f"rollout engines {waiting} did not come back within {timeout_s:.0f}s")
        refs = {actor(n).stats.remote(): n for n in waiting}
        done, _ = wait(list(refs), timeout=left)
        for ref in done:
            try:
                ray.get(ref)
                waiting.remove(refs[ref])
            except ActorUnavailableError:  # still restarting
                pass
        if waiting:
            time.sleep(poll_s)
    return time.perf_counter() - t0


RAY_CALL = "__ray_call__"  # Ray's own actor method: runs the function it is given inside the actor


def policy_refs(names: Sequence[str], method: Callable | str, *args, **kwargs) -> list:
    """The object refs of ``method`` called on every trainer rank at once, rank 0 first (see :func:`policy_call`).
    ``method`` is a PolicyWorker method (``PolicyWorker.memory``), never its name as a string (tests/cluster
    checks the call sites), or :data:`RAY_CALL` with a function to run in each actor (TEST-ONLY probes)."""
    name = _policy_method_name(method)
    return [getattr(actor(n), name).remote(*args, **kwargs) for n in names]


def _policy_method_name(method: Callable | str) -> str:
    if method == RAY_CALL:
        return RAY_CALL
    from trainer.policy import PolicyWorker

    name = getattr(method, "__name__", None)
    if name is None or getattr(PolicyWorker, name, None) is not method:
        raise TypeError(f"expected a PolicyWorker method (PolicyWorker.<name>) or RAY_CALL, got {method!r}")
    return name


def start_workers(cfg: Config, model_dir: str | Path, run_dir: Path, tag: str, *,
                  hooks: TestHooks | None = None) -> Workers:
    """``model_dir``: a model directory, or a hub model pinned as ORG/NAME@<commit> that each worker resolves in its
    node's Hugging Face cache (storage/hub.py). Reserve the run's placement group (``cluster.placement_strategy``;
    fails with the bundles and the cluster's resources if Ray cannot place it), create the PolicyWorker and ``cluster.rollout_workers`` RolloutWorkers in
    its bundles (named ``fp8grpo-policy-{tag}``, ``fp8grpo-rollout-{tag}-{k}``) and wait until all are constructed
    (errors surface here, with the actor's traceback)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from fp8core.cpu import cap_env
    from rollout.engine import RolloutWorker

    rw = cfg.ray.rollout_worker
    threads = cfg.policy.generation.vllm_cfg.threads
    # FP8GRPO_CPU_CAP (+ ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA when it lowers this node's kind) reach the actors
    # before they import torch; each actor also applies the cap itself (fp8core.cpu.apply_cpu_cap) before vLLM.
    cap = cap_env()
    # the run's caches and offline switches as this driver has them (apply_env): actors on other nodes of a
    # ray.address cluster do not inherit the driver's environment
    run_env = {k: os.environ[k] for k in cache_env(run_dir) if k in os.environ}
    env_p = {**run_env, "OMP_NUM_THREADS": str(cfg.policy.threads), **cap}
    # glibc: keep large buffers mapped (the trainer does the same with mallopt): two 5 MB allocations took 3.9 ms
    # instead of 0.12 ms when every free returned them to the OS
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
    env_r = {**run_env, "OMP_NUM_THREADS": str(threads), **malloc, **cap}
    n = cfg.cluster.rollout_workers
    bundles = placement_bundles(cfg)
    strategy = cfg.cluster.placement_strategy
    pg = placement_group(bundles, strategy=strategy, name=f"fp8grpo-{tag}")
    ready, _ = wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"cluster.placement_strategy={strategy}: Ray could not place the workers' bundles {bundles} "
            f"(cluster.policy_workers={cfg.cluster.policy_workers}, cluster.rollout_workers={n}) within "
            f"{PLACEMENT_TIMEOUT_S:.0f}s; the cluster has {ray.cluster_resources()}. Lower ray.*_worker.num_cpus / "
            "num_gpus or cluster.rollout_workers, add nodes, or relax the strategy (STRICT_* -> PACK / SPREAD)")

    def in_bundle(i: int):
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

    policy_names, policies = start_policy_workers(cfg, model_dir, run_dir, tag, env=env_p, scheduling=in_bundle,
                                                  hooks=hooks)
    names = tuple(f"fp8grpo-rollout-{tag}-{k}" for k in range(n))
    pins = cpu_pins(cfg)
    rollouts = tuple(ray.remote(RolloutWorker).options(
        name=names[k], num_cpus=rw.num_cpus, num_gpus=rw.num_gpus,
        runtime_env={"env_vars": {**env_r, **pin_env(pins, cfg.cluster.policy_workers + k)}},
        # a dead engine is restarted in its bundle (a fresh engine on model_dir's weights: the step it broke
        # refits it again, see flows/rl_step.py); calls in flight when it died fail instead of re-running
        max_restarts=cfg.cluster.rollout_max_restarts, max_task_retries=0,
        max_concurrency=1, scheduling_strategy=in_bundle(cfg.cluster.policy_workers + k)).remote(
            str(model_dir), cfg, run_dir=str(run_dir), hooks=hooks) for k in range(n))
    workers = Workers(policy_names, names, policies, rollouts, pg)
    try:
        get([*(p.info.remote() for p in policies), *(r.stats.remote() for r in rollouts)])
    except BaseException:
        stop_workers(workers, graceful=False)
        raise
    return workers


def worker_nodes(workers: Workers) -> int:
    """How many Ray nodes host the run's workers (where Ray placed the placement group's bundles)."""
    from ray.util import placement_group_table

    if workers.placement_group is None:
        return 1
    table = placement_group_table(workers.placement_group)
    return len(set((table.get("bundles_to_node_id") or {}).values())) or 1


def stop_workers(workers: Workers | None, *, graceful: bool = True) -> None:
    """End the run's actors and release their placement group. ``graceful``: ask each engine to shut down first
    (waits for a call in progress, up to 60 s); a cancelled or failed run kills them at once (``ray.kill``: the actor
    process and its in-process vLLM engine end within seconds)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if workers is None:
        return
    if graceful:
        try:
            get([r.shutdown.remote() for r in workers.rollouts], timeout=60)
        except Exception:  # noqa: BLE001 - best effort before the kill
            pass
    for handle in (*workers.rollouts, *workers.policies):
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
    if workers.placement_group is not None:
        try:
            remove_placement_group(workers.placement_group)
        except Exception:  # noqa: BLE001 - Ray already shut down
            pass


def actor(name: str):
    """The run's actor of that name (tasks use names, never handles passed through Prefect)."""
    import ray

    return ray.get_actor(name, namespace=NAMESPACE)
