"""The fused CPU quantize-dequantize kernel (``fp8core/csrc/qdq.cpp``), built on first use for this CPU.

The emulated FP8 GEMMs spend most of their overhead quantizing activations and gradients: the torch path
(fp8core.quant) runs ~12 vectorized ops per 1 MB chunk, each a pass over memory. The kernel does amax, scale,
division, clamp, round-to-FP8-grid and the dequantizing product in one pass per 128-element group, with the same
IEEE FP32 operations, so its output is bit-identical to the torch path (tests/fp8core/test_kernels.py compares them
on random and edge-case inputs for every format, granularity and pow2 setting).

Choice at run time (logged once, at the first use, and reported by :func:`describe`):

* ``FP8GRPO_QDQ_KERNEL=auto`` (default): build/load the kernel on x86-64 Linux with a C++ compiler; where that fails,
  the torch path, with the reason logged.
* ``=torch``: never use the kernel.  ``=cpp``: require it (an error when it cannot be built).

The build targets the CPU kind of :mod:`fp8core.cpu` (``-mavx2 -mfma``, plus ``-mavx512f -mavx512bw -mavx512vl
-mavx512dq`` on AVX-512 kinds; no ``-march=native``), so a capped process (``FP8GRPO_CPU_CAP=avx2``) runs the AVX2
build, and the build directory is keyed by kind + source hash + flags + torch version (and where the sources and torch
live, so checkouts sharing the cache do not rebuild each other's): a cache shared between machines never loads code
for an instruction set the CPU lacks. Built with ``-O3 -fno-math-errno -fno-trapping-math -fopenmp`` and without
``-ffast-math`` (which would change the rounding; ``-fno-trapping-math`` changes no value -- it lets GCC compute both sides of the
quantizer's selects, so the row loops vectorize on AVX2 too, which has no masked lanes: 2.6-3.3x the quantize
throughput there); OpenMP because ATen's ``parallel_for`` opens its parallel region in the extension's own
code (without it every kernel ran on one thread: :func:`parallel_width` tells). Build directory: :func:`build_root`.
The sources include ATen's and the operator library's headers only (not torch/extension.h, which tripled each
file's compile time): the first build takes ~15 s on one core; later loads, in any process, ~0.1 s. The build is a
plain library of operators: :func:`load` returns ``torch.ops.fp8core``. A builder killed mid-load (torch
keeps a ``lock`` file while it loads, even with nothing to rebuild) does not make later processes wait forever: see
:func:`_build_lock`.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import tempfile
import threading
from pathlib import Path

import torch

ENV = "FP8GRPO_QDQ_KERNEL"
MODES = ("auto", "torch", "cpp")
_SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("qdq.cpp", "gemm.cpp"))
_HEADERS = (Path(__file__).with_name("csrc") / "quant.h",)  # included by both sources: part of the build key
# -fopenmp: ATen's parallel_for expands its OpenMP region in the extension's code (without the flag every kernel runs
# on one thread); at run time the process's libgomp (torch's) serves it
_BASE_CFLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
_log = logging.getLogger("fp8core.kernels")
_lock = threading.Lock()
_state: dict = {}

__all__ = ["ENV", "MODES", "build_dir", "build_root", "describe", "load", "no_kernel_reason", "parallel_width",
           "quantize_tiles"]


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is not supported; allowed: {', '.join(MODES)}")
    return mode


def _isa_flags() -> tuple[str, list[str]]:
    from fp8core.cpu import cpu_caps

    kind = cpu_caps().kind
    if kind == "other":
        return kind, []
    flags = ["-mavx2", "-mfma", "-mf16c"]
    if kind in ("avx512", "avx512_bf16", "amx"):
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    if kind in ("avx512_bf16", "amx"):  # the GEMM's VDPBF16PS path (AMX CPUs have AVX-512 BF16 too)
        flags += ["-mavx512bf16"]
    return kind, flags


def no_kernel_reason() -> str | None:
    """Why this machine has no kernel to build (not x86-64 Linux, a CPU kind below AVX2, or ``FP8GRPO_QDQ_KERNEL=
    torch``), or None where fp8core/csrc should build: there, :func:`load` returning None is a failed build
    (``python -m fp8core`` exits 1 and the suite fails), never a reason to skip."""
    if _mode() == "torch":
        return f"{ENV}=torch"
    if platform.machine() not in ("x86_64", "AMD64") or platform.system() != "Linux":
        return f"the kernel is built for x86-64 Linux, this is {platform.system()} {platform.machine()}"
    from fp8core.cpu import cpu_caps

    if cpu_caps().kind == "other":
        return "the CPU kind is below AVX2 (kind other): the kernel's lowest build needs AVX2 and FMA"
    return None


def load():
    """The compiled operators (``torch.ops.fp8core``), or None when the torch path is to be used (mode ``torch``, or ``auto`` where the build
    failed). Thread-safe; builds at most once per process."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        mode = _mode()
        module, reason = None, "FP8GRPO_QDQ_KERNEL=torch"
        if mode != "torch":
            try:
                if (why := no_kernel_reason()) is not None:
                    raise RuntimeError(why)
                module, reason = _build()
            except Exception as e:  # noqa: BLE001 - any build/load failure falls back (auto) or is raised (cpp)
                if mode == "cpp":
                    raise RuntimeError(f"{ENV}=cpp but the fused quantize kernel could not be built: {e}") from e
                module, reason = None, f"build failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        _state["module"] = module
        _state["choice"] = ("cpp fused kernel " if module is not None else "torch ops ") + f"({reason})"
        _log.info("fp8core quantize-dequantize: %s", _state["choice"])
        return module


def build_dir() -> Path:
    """This process's build directory: :func:`build_root` / ``fp8core_qdq_<kind>_<hash of source, flags, torch>``.
    The hash also covers where the sources and torch live: torch's build.ninja names them by absolute path, so two
    checkouts (or venvs) sharing one directory would rebuild each other's build whenever the other one loads it."""
    kind, flags = _isa_flags()
    key = "".join(p.read_text() for p in (*_SOURCES, *_HEADERS))
    key += kind + " ".join([*_BASE_CFLAGS, *flags]) + torch.__version__
    key += "".join(str(p.resolve()) for p in _SOURCES) + str(Path(torch.__file__).resolve().parent)
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    return build_root() / f"fp8core_qdq_{kind}_{tag}"


def _build():
    from torch.utils.cpp_extension import load as load_ext

    kind, flags = _isa_flags()
    bdir = build_dir()
    name = bdir.name
    bdir.mkdir(parents=True, exist_ok=True)
    with _build_lock(bdir):
        # a plain library of operators (no Python module): torch loads it and its ops appear under torch.ops.fp8core
        load_ext(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=[*_BASE_CFLAGS, *flags],
                 extra_ldflags=["-fopenmp"], build_directory=str(bdir), verbose=False, is_python_module=False)
    return torch.ops.fp8core, f"{kind} build {' '.join(flags) or '(generic x86-64)'}"


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One builder at a time per build directory, by an ``flock`` that the kernel releases when its holder dies.
    torch's own lock (a ``lock`` file its FileBaton creates and deletes) survives a builder that was SIGKILLed (a
    killed run, a worker fault) and makes every later process wait for it forever, silently. Holding the flock,
    no other builder of this directory is alive, so a ``lock`` file found then is stale and is removed."""
    import fcntl

    with open(build_dir / ".fp8core-build.flock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log.info("fp8core quantize-dequantize: waiting for another process building %s", build_dir)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                _log.warning("fp8core quantize-dequantize: removing a stale build lock %s (its builder died)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_root() -> Path:
    """Where builds are cached: ``$FP8GRPO_KERNEL_DIR``, else ``$TORCH_EXTENSIONS_DIR``, else
    ``<tmp>/fp8core-kernels-<uid>`` (shared by every run and test on the machine; never under $HOME)."""
    base = os.environ.get("FP8GRPO_KERNEL_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(base) if base else Path(tempfile.gettempdir()) / f"fp8core-kernels-{os.getuid()}"


def describe() -> str:
    """The choice made in this process (``load()`` first if nothing was chosen yet)."""
    load()
    return _state["choice"]


def parallel_width() -> int | None:
    """Threads the kernels' ``at::parallel_for`` loops run on in this process (torch.get_num_threads() on a build
    with OpenMP, 1 without), or None without a kernel."""
    mod = load()
    return None if mod is None else int(mod.parallel_width())


_FMT = {"e4m3": (448.0, 3, -9), "e5m2": (57344.0, 2, -16)}
_DT = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def quantize_tiles(x2: torch.Tensor, *, tile: tuple[int, int], fmt: str, pow2: bool, want_dq: bool,
                   want_codes: bool):
    """One pass of the kernel over a contiguous 2-D float32/bfloat16 CPU tensor ``[M, K]`` whose groups are tiles of
    ``tile = (rows, cols)`` elements: ``(dq FP32 [M, K] or None, FP8 data [M, K] or None, amax, scale)``, amax and
    scale of shape ``[ceil(M / rows), ceil(K / cols)]``; or None where the kernel is not in use (the caller then takes
    the torch path)."""
    mod = load()
    if mod is None or x2.device.type != "cpu" or x2.dtype not in (torch.float32, torch.bfloat16) or x2.dim() != 2:
        return None
    fp8_max, mbits, min_exp = _FMT[fmt]
    dq, codes, amax, scale = mod.quantize_tiles(x2.contiguous(), int(tile[0]), int(tile[1]), fp8_max, mbits, min_exp,
                                                bool(pow2), bool(want_dq), bool(want_codes))
    return (dq if want_dq else None), (codes.view(_DT[fmt]) if want_codes else None), amax, scale
