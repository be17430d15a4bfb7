"""Test-wide environment: every cache and temp dir under runs/test-env (never $HOME), nothing reaches out."""
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1] / "runs" / "test-env"
# the tests' helper modules (tests/_ops.py, tests/_runs.py, ...): ``from _runs import ...`` in any folder
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Under pytest-xdist (scripts/test.sh runs the suite on several workers) each worker has its own Prefect home (the
# temporary Prefect servers of in-process flow runs keep a sqlite database there) and its own results directory;
# the model, asset and compile caches are shared (their writers lock or write atomically).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")


def _own_cpus() -> None:
    """Under xdist with at least as many CPUs as workers, worker k runs on its own share of the CPUs, and so does
    every process it starts (flow runs, Ray and its actors, servers): the pipeline sizes its compute threads by the
    CPUs it may use (fp8core.cpu.usable_threads). Two workers of two-thread processes on two shared cores spin at
    each other's OpenMP barriers: a tiny run's RL step took 4.4 s beside another run instead of 0.8-1.5 s pinned."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if n < 2 or not _WORKER.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // n
    if share:
        k = int(_WORKER[2:])
        os.sched_setaffinity(0, cpus[k * share:(k + 1) * share] if k < n - 1 else cpus[k * share:])


_own_cpus()
_ENV = {
    "HF_HOME": _ROOT / "hf",
    "VLLM_CACHE_ROOT": _ROOT / "vllm-cache",
    "TORCHINDUCTOR_CACHE_DIR": _ROOT / "inductor",
    "PREFECT_HOME": _ROOT / "prefect" / _WORKER,
    "PREFECT_SERVER_MEMO_STORE_PATH": _ROOT / "prefect" / _WORKER / "memo_store.toml",
    "RAY_TMPDIR": Path("/tmp") / f"ray-fp8grpo-{os.getuid()}",
    # result files a command writes by default (tools.results): here, never over the published docs/results/
    "FP8GRPO_RESULTS_DIR": _ROOT / "docs" / "results" / _WORKER,
}
for key, path in _ENV.items():
    os.environ.setdefault(key, str(path))
    (path.parent if key.endswith("_PATH") else path).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # as process.env sets for runs
# Every Ray the tests start runs with token auth (as the pipeline's do): one random token per pytest session, in a
# 0600 file under runs/test-env (per process: concurrent sessions must not replace each other's token), removed at exit.
from cluster.auth import write_token_file  # noqa: E402

_AUTH_DIR = _ROOT / "ray-auth" / str(os.getpid())
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN_PATH"] = str(write_token_file(_AUTH_DIR))
os.environ.pop("RAY_AUTH_TOKEN", None)
atexit.register(shutil.rmtree, _AUTH_DIR, True)
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # as process.env sets for runs: no telemetry calls

# FP8GRPO_CPU_CAP=avx2|avx512|avx512_bf16|amx runs the whole suite as on that CPU kind: applied here, before any test
# imports vLLM (its kernels and FP8-KV support are picked from torch.cpu's probes); a no-op without the variable.
from fp8core.cpu import apply_cpu_cap  # noqa: E402

apply_cpu_cap()


# The time ledger: seconds per test (setup + call + teardown) of the last full run, written by
# ``scripts/test.sh --write-durations tests/durations.json``; it orders the run (longest first) and is the source of
# tests/README.md's ledger table. A test missing from it is estimated by its marks.
LEDGER = Path(__file__).with_name("durations.json")
_DEFAULT_S = {"e2e": 60.0, "slow": 5.0, "": 0.1}


def pytest_addoption(parser):
    parser.addoption("--write-durations", metavar="PATH", default=None,
                     help="write each test's seconds (setup + call + teardown) to PATH as JSON (the time ledger)")


def _estimate(item: pytest.Item, ledger: dict[str, float]) -> float:
    if item.nodeid in ledger:
        return ledger[item.nodeid]
    return _DEFAULT_S["e2e" if item.get_closest_marker("e2e") else "slow" if item.get_closest_marker("slow") else ""]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Whole modules, longest first (by the ledger), so that parallel workers (scripts/test.sh: pytest-xdist,
    ``--dist loadgroup``) take the minute-long end-to-end tests at the start and finish together on the fast set.
    Each module is one xdist group and stays in one piece: its module-scoped fixtures (engines, trainers, built
    models) are built once, where a test-by-test order rebuilt them for every test (~9 s each). The tests that use
    the local stack (one Prefect + MLflow server per pytest process: the session fixture ``stack``) or the shared
    warm start (``warm_start``: minutes of SFT, built by the first of them) form one group across their modules,
    placed by the group's total time: one worker starts each once, and no worker idles waiting on another's build."""
    ledger = json.loads(LEDGER.read_text()) if LEDGER.exists() else {}
    shared = {"stack", "warm_start"}
    group = {item.nodeid: "shared" if shared & set(getattr(item, "fixturenames", ())) else item.nodeid.split("::")[0]
             for item in items}
    total: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        g = group[item.nodeid]
        total[g] = total.get(g, 0.0) + _estimate(item, ledger)
        first.setdefault(g, i)
        item.add_marker(pytest.mark.xdist_group(g))
    order = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-total[group[item.nodeid]], first[group[item.nodeid]], order[item.nodeid]))


def pytest_collection_finish(session):
    """On an xdist worker with ``--dist loadgroup``: xdist must have tagged every test with its group (it appends
    "@<group>" to the node id); pytest 9.2 ignores that tag, and the stack tests then start one stack per worker and
    modules are split. Stop before any test runs instead."""
    if getattr(session.config.option, "loadgroup", False):
        lost = [i.nodeid for i in session.items if "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]}): this pytest "
                                    "and pytest-xdist do not work together; install requirements-dev.txt's pins")


_durations: dict[str, float] = {}
_spans: dict[str, list] = {}  # nodeid -> [worker, first start, last stop] (epoch seconds): the run's timeline
_outcomes: dict[str, int] = {}
_session: dict = {}


def pytest_sessionstart(session):
    # The C++ kernels of this process's CPU kind, loaded before any test: a process holds one build (its torch ops
    # register once), and a test that applies FP8GRPO_CPU_CAP in-process (the flow's load-time checks under the cap)
    # must not decide for the tests after it which build that is. Tests of a capped build run it in a subprocess.
    from fp8core import kernels

    kernels.load()
    path = session.config.getoption("--write-durations")
    if path and not hasattr(session.config, "workerinput"):
        from tools.results import stamp

        _session.update(t0=time.monotonic(), stamp=stamp("pytest", sys.argv[1:]))  # the code that runs, at the start


def pytest_runtest_logreport(report):
    nodeid = report.nodeid.split("@", 1)[0]  # xdist's loadgroup appends "@<group>" to grouped tests' ids
    _durations[nodeid] = _durations.get(nodeid, 0.0) + report.duration
    worker = getattr(report, "worker_id", None) or getattr(getattr(getattr(report, "node", None), "gateway", None),
                                                           "id", "")
    if getattr(report, "start", None) is not None:
        span = _spans.setdefault(nodeid, [worker, report.start, report.stop])
        span[1], span[2] = min(span[1], report.start), max(span[2], report.stop)
    if report.when == "call" or report.outcome != "passed":
        _outcomes[report.outcome] = _outcomes.get(report.outcome, 0) + 1


def pytest_sessionfinish(session):
    """The controller (or a run without xdist) writes the ledger: PATH (JSON, what orders the next run) and, beside
    it, PATH with .md (its slowest tests as the table tests/README.md shows, stamped like docs/results/) and
    ``<stem>-timeline.json`` (each test's worker, start and end)."""
    path = session.config.getoption("--write-durations")
    if not path or hasattr(session.config, "workerinput"):
        return
    path = Path(path)
    path.write_text(json.dumps({k: round(v, 2) for k, v in sorted(_durations.items())}, indent=1) + "\n")
    # beside it, the timeline (worker, start and end in seconds from the first test): where a run waited or crowded
    t0 = min((s[1] for s in _spans.values()), default=0.0)
    timeline = sorted([[round(s[1] - t0, 1), round(s[2] - t0, 1), s[0], k] for k, s in _spans.items()])
    path.with_name(path.stem + "-timeline.json").write_text("[\n" + ",\n".join(map(json.dumps, timeline)) + "\n]\n")
    from tools.results import format_result

    wall = time.monotonic() - _session["t0"]
    slowest = sorted(_durations.items(), key=lambda kv: -kv[1])[:25]
    body = "\n".join(["| s | test |", "|---|---|", *(f"| {s:.0f} | `{k}` |" for k, s in slowest)])
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(_outcomes.items()))
    workers = getattr(session.config.option, "numprocesses", None) or 0
    path.with_suffix(".md").write_text(format_result("Test time ledger", body, _session["stamp"], details=[
        f"- result: {counts}; {wall / 60:.1f} min on {workers or 1} worker(s) ({os.cpu_count()} CPUs); the tests' "
        f"seconds add up to {sum(_durations.values()) / 60:.1f} min"]))


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for servers the tests start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def warm_start() -> dict[str, Path]:
    """The shared warm start's assets (``model_dir``, ``train``, ``validation``, ..., and ``assets_dir``: what
    ``bootstrap.assets_dir`` names for a run to start from it)."""
    from _runs import WARM_START_DIR

    from embedded.bootstrap import default_sft, ensure_default_assets

    assets = ensure_default_assets(WARM_START_DIR, task="addition", sft=default_sft("addition", seed=0))
    return {**assets, "assets_dir": WARM_START_DIR}


@pytest.fixture
def moto_s3(monkeypatch):
    """A real S3 endpoint: ``moto_server`` on 127.0.0.1 (free port) with test credentials in the environment."""
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for key, val in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": url}.items():
        monkeypatch.setenv(key, val)
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _repoint_logging_handlers(stream, also=lambda stream: False) -> None:
    """Point logging handlers whose stream is closed (or for which ``also(stream)`` holds) at ``stream``."""
    import logging

    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            if not isinstance(h, logging.StreamHandler):
                continue
            console = getattr(h, "console", None)  # Prefect's handler writes through a rich Console on the stream
            cfile = getattr(console, "file", None)
            if (getattr(h.stream, "closed", False) or getattr(cfile, "closed", False) or also(h.stream)
                    or (cfile is not None and also(cfile))):
                with h.lock:  # not setStream(): it flushes the old, closed stream first
                    h.stream = stream
                    if console is not None:
                        console.file = stream


def _pytest_capture_stream(stream) -> bool:
    return type(stream).__module__.startswith("_pytest") or type(getattr(stream, "buffer", None)).__module__.startswith(
        "_pytest")


@pytest.fixture(autouse=True)
def _logging_streams_not_closed():
    """Logging handlers created during an earlier test (Prefect's console handler, set up at the first flow run) keep
    that test's captured stderr, which pytest closes when the test ends: the next test's log records would then
    raise "I/O operation on closed file" inside Prefect's handler and recurse through its print-as-log patch.
    Point such handlers at the current stderr before each test."""
    _repoint_logging_handlers(sys.stderr)
    yield


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Prefect stops its temporary server from an exit handler, after pytest has closed its capture streams: point
    every handler still on one of them at the real stderr, so the exit log line prints instead of a logging error."""
    _repoint_logging_handlers(sys.__stderr__, _pytest_capture_stream)
