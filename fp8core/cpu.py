"""CPU capabilities: what this x86-64 CPU can do for BF16 / FP8 work, and a cap that makes it behave as a lower kind.

Kinds, lowest to highest (``KINDS``):

* ``other``       -- no AVX2 (old x86, or not x86: aarch64 etc.).
* ``avx2``        -- AVX2 only: no AVX-512, no BF16 units. vLLM CPU loads ``vllm._C_AVX2`` and refuses an FP8 KV cache.
* ``avx512``      -- AVX-512F without AVX512_BF16: ``vllm._C_AVX512``; FP8 KV cache runs; BF16 math is converted.
* ``avx512_bf16`` -- AVX-512 with AVX512_BF16 (e.g. AMD Zen 4/5, Cooper Lake): ``vllm._C``; native BF16 dot products.
* ``amx``         -- AMX tiles with AMX-BF16 (Sapphire Rapids and later): vLLM's AMX attention / GEMM paths.

The cap: ``FP8GRPO_CPU_CAP=avx2|avx512|avx512_bf16|amx`` only *lowers* what the hardware has (a cap above the
hardware is ignored with a warning: the effective kind is the hardware's, so a CI job that says ``amx`` runs on any
machine). ``apply_cpu_cap()`` enforces it in the calling process, and must run before vLLM is imported there:

* ``torch.cpu.get_capabilities()`` and the ``torch.cpu._is_*_supported()`` probes (which vLLM reads to pick its
  kernel library, its attention ISA and whether an FP8 KV cache is allowed) report the features above the cap as
  absent;
* ``ATEN_CPU_CAPABILITY`` (ATen's vectorized kernels) and ``ONEDNN_MAX_CPU_ISA`` (oneDNN's GEMMs/convolutions) are set
  (``setdefault``: a value already in the environment wins).

Measured with torch 2.13 (CPU): ATen reads ``ATEN_CPU_CAPABILITY`` once, at the first dispatch-stub kernel or the
first ``torch.backends.cpu.get_cpu_capability()`` call, not at ``import torch``: set after the import but before any
op it takes effect (``torch.randn(8).exp()`` afterwards reports ``AVX2``); once fixed it no longer changes (a
capability query before the set keeps ``AVX512``). oneDNN reads ``ONEDNN_MAX_CPU_ISA`` lazily too: set after
``import torch`` and a first op, a 512x512 BF16 linear still drops from oneDNN's AVX-512-BF16 kernel (7 ms) to the
AVX2 fallback (20 ms). ``apply_cpu_cap`` warns when ATen's capability was already fixed above the cap. For Ray actors
the driver also passes ``cap_env()`` (the cap plus both variables) in the actor's ``runtime_env``, so they are set
before the actor process imports torch.

Pure stdlib + torch (no vLLM import): flags come from ``/proc/cpuinfo`` (Linux), else from torch's cpuinfo probe.
"""
from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

CAP_ENV = "FP8GRPO_CPU_CAP"
KINDS = ("other", "avx2", "avx512", "avx512_bf16", "amx")  # ordered: each kind has everything of the ones before
CAPS = KINDS[1:]  # allowed values of FP8GRPO_CPU_CAP
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# The lowest kind at which each relevant flag may be present.
_FLAG_KIND = {"avx2": "avx2", "avx512f": "avx512", "avx512_bf16": "avx512_bf16", "amx_bf16": "amx", "amx_tile": "amx"}
# What a cap to this kind sets for torch (only when it lowers the hardware).
_ATEN_ISA = {"other": "default", "avx2": "avx2"}
_ONEDNN_ISA = {"other": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16"}
_ATEN_RANK = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}
# torch.cpu probes vLLM (and others) call; each is replaced by one that also honours the cap.
_TORCH_PROBES = {"_is_avx2_supported": "avx2", "_is_avx512_supported": "avx512_f",
                 "_is_avx512_bf16_supported": "avx512_bf16", "_is_vnni_supported": "avx512_vnni",
                 "_is_amx_tile_supported": "amx_tile", "_is_amx_fp16_supported": "amx_fp16"}

# Importing any of these makes vLLM load its kernel library (vllm._C / _C_AVX512 / _C_AVX2) for the probed kind.
_VLLM_KERNEL_MODULES = ("vllm._custom_ops", "vllm.kernels.vllm_c")

log = logging.getLogger(__name__)


def _rank(kind: str) -> int:
    return KINDS.index(kind)


def parse_cap(value: str | None) -> str | None:
    """The cap named by ``value`` (an env string), None when unset/empty; anything else raises ValueError."""
    if value is None or value.strip() == "":
        return None
    cap = value.strip().lower()
    if cap not in CAPS:
        raise ValueError(f"{CAP_ENV}={value!r} is not one of {', '.join(CAPS)} (or unset for no cap)")
    return cap


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in a ``/proc/cpuinfo`` text; ('unknown', {}) when absent."""
    model, flags = "unknown", frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip() or "unknown"
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


def hardware_kind(flags: frozenset[str] | set[str]) -> str:
    """The highest kind whose features are all in ``flags`` (/proc/cpuinfo spelling)."""
    if "avx512f" in flags and "amx_tile" in flags and "amx_bf16" in flags:
        return "amx"
    if "avx512f" in flags and "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "other"


def effective_kind(hardware: str, cap: str | None) -> str:
    """The lower of the hardware's kind and the cap (a cap never raises the kind)."""
    if cap is None or _rank(cap) >= _rank(hardware):
        return hardware
    return cap


def _allowed(flag_kind: str, kind: str) -> bool:
    return _rank(flag_kind) <= _rank(kind)


@dataclass(frozen=True)
class CpuCaps:
    model: str  # /proc/cpuinfo 'model name'
    kind: str  # effective kind after the cap
    hardware_kind: str  # before the cap
    cap: str | None  # the cap in force (FP8GRPO_CPU_CAP), None if none
    torch_capability: str  # torch.backends.cpu.get_cpu_capability() in this process
    flags: frozenset[str]  # RELEVANT_FLAGS present after the cap

    def __post_init__(self):
        for key in ("kind", "hardware_kind"):
            if getattr(self, key) not in KINDS:
                raise ValueError(f"CpuCaps.{key}={getattr(self, key)!r} is not one of {KINDS}")
        if self.cap is not None and self.cap not in CAPS:
            raise ValueError(f"CpuCaps.cap={self.cap!r} is not one of {CAPS}")

    @property
    def native_bf16(self) -> bool:
        """BF16 dot-product units (AVX512_BF16 or AMX-BF16): BF16 GEMMs run at full speed, not converted."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.flags

    @property
    def native_fp8_kv(self) -> bool:
        """vLLM 0.32's CPU FP8 KV cache needs AVX-512 or AMX (cpu_attn._get_attn_isa)."""
        return self.avx512 or self.amx

    @property
    def capped(self) -> bool:
        return self.kind != self.hardware_kind

    def as_params(self) -> dict[str, str]:
        """Flat string params for MLflow (``cpu/...``)."""
        return {"cpu/model": self.model, "cpu/kind": self.kind, "cpu/hardware_kind": self.hardware_kind,
                "cpu/cap": self.cap or "none", "cpu/torch_capability": self.torch_capability,
                "cpu/flags": ",".join(sorted(self.flags)) or "none",
                "cpu/native_bf16": str(self.native_bf16).lower(),
                "cpu/native_fp8_kv": str(self.native_fp8_kv).lower()}

    def describe(self) -> str:
        cap = f"cap {self.cap} from {CAP_ENV}" if self.cap else "no cap"
        if self.cap and not self.capped and self.cap != self.hardware_kind:
            cap += " (above the hardware: ignored)"
        return (f"CPU {self.model}: kind {self.kind} (hardware {self.hardware_kind}, {cap}); "
                f"torch {self.torch_capability}; flags {','.join(sorted(self.flags)) or 'none'}; "
                f"BF16 units {'yes' if self.native_bf16 else 'no'}; "
                f"vLLM FP8 KV cache {'native' if self.native_fp8_kv else 'not native (emulated)'}")


def caps_from(cpuinfo_text: str, *, cap: str | None, torch_capability: str) -> CpuCaps:
    """CpuCaps from a /proc/cpuinfo text and a cap (pure: no probing; tests feed fake texts)."""
    model, flags = parse_cpuinfo(cpuinfo_text)
    hw = hardware_kind(flags)
    kind = effective_kind(hw, cap)
    eff = frozenset(f for f in RELEVANT_FLAGS if f in flags and _allowed(_FLAG_KIND[f], kind))
    return CpuCaps(model=model, kind=kind, hardware_kind=hw, cap=cap, torch_capability=torch_capability, flags=eff)


def _cpuinfo_text() -> str:
    """/proc/cpuinfo, else a synthetic text from torch's own cpuinfo probe (non-Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        pass
    hw = _original_capabilities()
    names = {"avx2": "avx2", "avx512_f": "avx512f", "avx512_bf16": "avx512_bf16", "amx_bf16": "amx_bf16",
             "amx_tile": "amx_tile"}
    flags = " ".join(v for k, v in names.items() if hw.get(k))
    return f"model name\t: {platform.processor() or platform.machine() or 'unknown'}\nflags\t\t: {flags}\n"


# ---------------------------------------------------------------------------------------------------- the cap
_ORIGINALS: dict[str, object] = {}
_APPLIED: dict[str, str | None] = {}  # {"cap": the cap applied in this process} once apply_cpu_cap has run


def _original_capabilities() -> Mapping:
    fn = _ORIGINALS.get("get_capabilities", torch.cpu.get_capabilities)
    return fn()


def _masked(key: str, kind: str) -> bool:
    """Whether torch.cpu capability ``key`` is hidden at ``kind``."""
    if key.startswith(("avx512", "avx10", "amx")) and _rank(kind) < _rank("avx512"):
        return True
    if (key in ("avx512_bf16", "avx512_fp16") or key.startswith(("avx10", "amx"))) and \
            _rank(kind) < _rank("avx512_bf16"):
        return True
    return key.startswith("amx") and _rank(kind) < _rank("amx")


def _patch_torch(kind: str) -> None:
    if not _ORIGINALS:
        _ORIGINALS["get_capabilities"] = torch.cpu.get_capabilities
        for name in _TORCH_PROBES:
            if hasattr(torch.cpu, name):
                _ORIGINALS[name] = getattr(torch.cpu, name)
    hw = dict(_ORIGINALS["get_capabilities"]())
    capped = MappingProxyType({k: (False if isinstance(v, bool) and _masked(k, kind) else v) for k, v in hw.items()})

    def get_capabilities() -> Mapping:
        return capped

    get_capabilities.__doc__ = f"torch.cpu.get_capabilities under {CAP_ENV} (kind {kind}; fp8core.cpu)."
    torch.cpu.get_capabilities = get_capabilities
    for name, key in _TORCH_PROBES.items():
        if name not in _ORIGINALS:
            continue

        def probe(_orig=_ORIGINALS[name], _key=key) -> bool:
            return bool(_orig()) and not _masked(_key, kind)

        probe.__name__ = name
        setattr(torch.cpu, name, probe)


def cap_env(cap: str | None = None, *, hardware: str | None = None) -> dict[str, str]:
    """The environment a process needs for ``cap`` (default: this process's ``FP8GRPO_CPU_CAP``): the cap itself
    plus ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA when the cap lowers ``hardware`` (default: this machine's kind).
    Empty without a cap. Values already in this process's environment are kept."""
    cap = parse_cap(os.environ.get(CAP_ENV)) if cap is None else parse_cap(cap)
    if cap is None:
        return {}
    hw = hardware or hardware_kind(parse_cpuinfo(_cpuinfo_text())[1])
    kind = effective_kind(hw, cap)
    env = {CAP_ENV: cap}
    if kind != hw:
        if kind in _ATEN_ISA and _rank(hw) > _rank(kind):
            env["ATEN_CPU_CAPABILITY"] = os.environ.get("ATEN_CPU_CAPABILITY", _ATEN_ISA[kind])
        if kind in _ONEDNN_ISA:
            env["ONEDNN_MAX_CPU_ISA"] = os.environ.get("ONEDNN_MAX_CPU_ISA", _ONEDNN_ISA[kind])
    return env


def apply_cpu_cap() -> None:
    """Enforce ``FP8GRPO_CPU_CAP`` in this process (see the module docstring). Idempotent; call it before importing
    vLLM. Invalid cap -> ValueError; a cap above the hardware -> warning, no change. A different cap than the one
    already applied in this process -> RuntimeError (the cap is per process: vLLM picks its kernels once)."""
    cap = parse_cap(os.environ.get(CAP_ENV))
    if _APPLIED:
        if _APPLIED["cap"] != cap:
            raise RuntimeError(f"{CAP_ENV}={cap!r} but this process already applied cap {_APPLIED['cap']!r}: the cap "
                               f"is per process (set it before the process starts, e.g. in a Ray runtime_env)")
        return
    hw = hardware_kind(parse_cpuinfo(_cpuinfo_text())[1])
    kind = effective_kind(hw, cap)
    if cap is not None and _rank(cap) > _rank(hw):
        log.warning("%s=%s is above this CPU's kind %s: ignored (a cap only lowers)", CAP_ENV, cap, hw)
    if kind != hw:
        import sys

        loaded = [m for m in _VLLM_KERNEL_MODULES if m in sys.modules]
        if loaded:
            raise RuntimeError(f"{CAP_ENV}={cap}: vLLM has already loaded its CPU kernels in this process "
                               f"({loaded[0]} is imported), picked for {hw}; apply the cap before vLLM's kernels "
                               f"load (first thing in the process)")
        for key, value in cap_env(cap, hardware=hw).items():
            os.environ.setdefault(key, value)
        _patch_torch(kind)
        torch_cap = torch.backends.cpu.get_cpu_capability()
        if kind in _ATEN_ISA and _ATEN_RANK.get(torch_cap, 0) > _ATEN_RANK.get(_ATEN_ISA[kind].upper(), 0):
            log.warning("%s=%s: ATen's CPU capability was already fixed at %s before the cap (torch ran ops first); "
                        "torch's own kernels stay %s in this process (vLLM's probes are capped)",
                        CAP_ENV, cap, torch_cap, torch_cap)
    _APPLIED["cap"] = cap
    cpu_caps.cache_clear()


@functools.cache
def _caps(cap: str | None) -> CpuCaps:
    return caps_from(_cpuinfo_text(), cap=cap, torch_capability=torch.backends.cpu.get_cpu_capability())


def cpu_caps() -> CpuCaps:
    """This process's CpuCaps under ``FP8GRPO_CPU_CAP`` (cached per cap value; reads /proc/cpuinfo once per value).
    The view (kind, flags) follows the env; whether torch and vLLM in this process follow it is ``apply_cpu_cap``'s
    job. ``torch_capability`` is what ATen actually uses here."""
    return _caps(parse_cap(os.environ.get(CAP_ENV)))


cpu_caps.cache_clear = _caps.cache_clear  # type: ignore[attr-defined]


def describe() -> str:
    """One human line about this CPU and the cap (``fp8core.gemm.describe`` adds the FP8 GEMM path: the run's line)."""
    return cpu_caps().describe()


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, a container's cpuset, a scheduler's
    binding), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity API on this platform
        return os.cpu_count() or 1


PIN_ENV = "FP8GRPO_CPUS"  # comma-separated CPU ids a worker process pins itself to (cluster.pin_cpus sets it)


def apply_cpu_pin() -> list[int] | None:
    """Pin every thread of this process (and so the threads it starts later) to the CPUs in ``$FP8GRPO_CPUS``
    (``cluster.pin_cpus``: each worker its own cores). Returns the CPUs, or None when the variable is unset."""
    value = os.environ.get(PIN_ENV, "").strip()
    if not value:
        return None
    cpus = sorted({int(v) for v in value.split(",")})
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:  # sched_setaffinity(pid) sets one thread: each one of the process, this one among them
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return cpus


def usable_threads(requested: int) -> int:
    """``requested`` compute threads (``policy.threads``, ``policy.generation.vllm_cfg.threads``), at most one per
    usable CPU. More OpenMP threads than CPUs only lose: each parallel region ends at a barrier where the early
    threads spin while the late ones wait for a CPU (measured on 2 cores: a small MLP's update took 1.8 s with one
    thread per process and 8 s with two processes of two threads each)."""
    return max(1, min(int(requested), usable_cpus()))


def cpu_caps_dict(caps) -> dict:
    """A CpuCaps as a plain dict (what the workers report in their stats)."""
    return {"model": caps.model, "kind": caps.kind, "hardware_kind": caps.hardware_kind, "cap": caps.cap,
            "torch_capability": caps.torch_capability, "flags": sorted(caps.flags)}


if __name__ == "__main__":
    print(describe())
