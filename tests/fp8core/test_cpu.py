"""fp8core.cpu: /proc/cpuinfo parsing, kind ordering, the FP8GRPO_CPU_CAP cap (parsing, view, enforcement in a fresh
process). The vLLM side of the cap (FP8 KV refused inside vLLM under the AVX2 cap) is in tests/rollout/test_rollout.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8core import cpu

ROOT = Path(__file__).resolve().parents[2]

AVX2_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2
processor\t: 1
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2
"""
AVX512_SKX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz
flags\t\t: sse4_2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl
"""
ZEN4 = """processor\t: 0
model name\t: AMD EPYC 9B14
flags\t\t: avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni avx512vl
"""
SPR = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: avx avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid
"""


@pytest.mark.parametrize("text,model,kind", [
    (AVX2_EPYC, "AMD EPYC 7B12", "avx2"),
    (AVX512_SKX, "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz", "avx512"),
    (ZEN4, "AMD EPYC 9B14", "avx512_bf16"),
    (SPR, "Intel(R) Xeon(R) Platinum 8481C", "amx"),
    (ARM, "unknown", "other"),
    ("", "unknown", "other"),
])
def test_parse_cpuinfo_and_hardware_kind(text, model, kind):
    name, flags = cpu.parse_cpuinfo(text)
    assert name == model
    assert cpu.hardware_kind(flags) == kind


def test_parse_cpuinfo_reads_the_first_processor_only():
    text = AVX2_EPYC + "processor\t: 2\nmodel name\t: other\nflags\t\t: avx512f\n"
    name, flags = cpu.parse_cpuinfo(text)
    assert name == "AMD EPYC 7B12" and "avx512f" not in flags


def test_amx_needs_amx_bf16_and_avx512():
    assert cpu.hardware_kind({"avx2", "avx512f", "avx512_bf16", "amx_tile"}) == "avx512_bf16"
    assert cpu.hardware_kind({"avx2", "amx_tile", "amx_bf16"}) == "avx2"


def test_kinds_are_ordered_and_a_cap_only_lowers():
    assert cpu.KINDS == ("other", "avx2", "avx512", "avx512_bf16", "amx")
    assert cpu.effective_kind("amx", "avx2") == "avx2"
    assert cpu.effective_kind("amx", "avx512_bf16") == "avx512_bf16"
    assert cpu.effective_kind("avx512_bf16", "avx512") == "avx512"
    assert cpu.effective_kind("avx2", "amx") == "avx2"  # above the hardware: ignored
    assert cpu.effective_kind("avx512", None) == "avx512"
    assert cpu.effective_kind("other", "avx2") == "other"


@pytest.mark.parametrize("value", ["avx1", "AVX-512", "sse", "none", "avx512bf16"])
def test_invalid_cap_names_the_variable_and_the_allowed_values(value):
    with pytest.raises(ValueError) as e:
        cpu.parse_cap(value)
    msg = str(e.value)
    assert "FP8GRPO_CPU_CAP" in msg and repr(value) in msg
    for allowed in ("avx2", "avx512", "avx512_bf16", "amx"):
        assert allowed in msg


def test_cap_parsing_accepts_case_and_blank():
    assert cpu.parse_cap(None) is None and cpu.parse_cap("") is None and cpu.parse_cap("  ") is None
    assert cpu.parse_cap("AVX2") == "avx2" and cpu.parse_cap(" amx ") == "amx"


def test_caps_view_under_each_cap_on_an_amx_cpu():
    table = {None: ("amx", {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, True, True),
             "amx": ("amx", {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, True, True),
             "avx512_bf16": ("avx512_bf16", {"avx2", "avx512f", "avx512_bf16"}, True, True),
             "avx512": ("avx512", {"avx2", "avx512f"}, False, True),
             "avx2": ("avx2", {"avx2"}, False, False)}
    for cap, (kind, flags, bf16, fp8_kv) in table.items():
        c = cpu.caps_from(SPR, cap=cap, torch_capability="AVX512")
        assert (c.kind, set(c.flags), c.native_bf16, c.native_fp8_kv) == (kind, flags, bf16, fp8_kv), cap
        assert c.hardware_kind == "amx" and c.cap == cap
        assert c.avx512 == ("avx512f" in flags)
        assert c.capped == (kind != "amx")


def test_caps_on_an_avx2_cpu_and_a_cap_above_it():
    c = cpu.caps_from(AVX2_EPYC, cap="avx512_bf16", torch_capability="AVX2")
    assert c.kind == "avx2" and c.hardware_kind == "avx2" and not c.capped
    assert not c.native_bf16 and not c.avx512 and not c.native_fp8_kv
    assert "ignored" in c.describe()


def test_as_params_are_flat_strings_with_stable_names():
    p = cpu.caps_from(ZEN4, cap="avx2", torch_capability="AVX2").as_params()
    assert p == {"cpu/model": "AMD EPYC 9B14", "cpu/kind": "avx2", "cpu/hardware_kind": "avx512_bf16",
                 "cpu/cap": "avx2", "cpu/torch_capability": "AVX2", "cpu/flags": "avx2",
                 "cpu/native_bf16": "false", "cpu/native_fp8_kv": "false"}
    assert cpu.caps_from(ZEN4, cap=None, torch_capability="AVX512").as_params()["cpu/cap"] == "none"


def test_cpucaps_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="kind"):
        cpu.CpuCaps(model="x", kind="avx3", hardware_kind="avx2", cap=None, torch_capability="AVX2",
                    flags=frozenset())


def test_cap_env_sets_torch_variables_only_when_lowering(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert cpu.cap_env("avx2", hardware="amx") == {"FP8GRPO_CPU_CAP": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                                                   "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert cpu.cap_env("avx512", hardware="amx") == {"FP8GRPO_CPU_CAP": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    assert cpu.cap_env("avx512_bf16", hardware="amx") == {"FP8GRPO_CPU_CAP": "avx512_bf16",
                                                          "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    assert cpu.cap_env("amx", hardware="amx") == {"FP8GRPO_CPU_CAP": "amx"}
    assert cpu.cap_env("avx512", hardware="avx2") == {"FP8GRPO_CPU_CAP": "avx512"}
    monkeypatch.delenv("FP8GRPO_CPU_CAP", raising=False)
    assert cpu.cap_env() == {}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")  # a value the user set wins
    assert cpu.cap_env("avx2", hardware="amx")["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"


def test_this_machine_is_described():
    c = cpu.cpu_caps()
    assert c.kind in cpu.KINDS and c.torch_capability
    line = cpu.describe()
    assert c.model in line and c.kind in line


def _probe(env: dict[str, str], code: str) -> dict:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter with ``env`` added."""
    full = {k: v for k, v in os.environ.items() if k not in ("FP8GRPO_CPU_CAP", "ATEN_CPU_CAPABILITY",
                                                              "ONEDNN_MAX_CPU_ISA")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_ENFORCE = """
import json, os, torch
from fp8core import cpu
cpu.apply_cpu_cap(); cpu.apply_cpu_cap()  # idempotent
x = torch.randn(64).exp()  # first ATen kernel after the cap
c = cpu.cpu_caps()
print(json.dumps({"kind": c.kind, "hw": c.hardware_kind, "torch": torch.backends.cpu.get_cpu_capability(),
                  "avx512": torch.cpu._is_avx512_supported(), "bf16": torch.cpu._is_avx512_bf16_supported(),
                  "amx": torch.cpu._is_amx_tile_supported(), "avx2": torch.cpu._is_avx2_supported(),
                  "caps_avx512": bool(torch.cpu.get_capabilities().get("avx512_f")),
                  "aten_env": os.environ.get("ATEN_CPU_CAPABILITY"), "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA")}))
"""


def test_avx2_cap_is_enforced_in_a_fresh_process():
    """The cap set before the process starts (as a Ray runtime_env does): torch's probes and ATen report AVX2."""
    r = _probe({"FP8GRPO_CPU_CAP": "avx2"}, _ENFORCE)
    if r["hw"] in ("other", "avx2"):
        pytest.skip(f"this CPU is {r['hw']}: the AVX2 cap lowers nothing here")
    assert r["kind"] == "avx2"
    assert (r["avx512"], r["bf16"], r["amx"], r["avx2"], r["caps_avx512"]) == (False, False, False, True, False)
    assert r["torch"] == "AVX2" and r["aten_env"] == "avx2" and r["onednn"] == "AVX2"


def test_without_cap_nothing_changes():
    r = _probe({}, _ENFORCE)
    assert r["kind"] == r["hw"] and r["aten_env"] is None and r["onednn"] is None
    assert r["avx512"] == (r["hw"] in ("avx512", "avx512_bf16", "amx"))


def test_cap_above_hardware_is_ignored_with_a_warning():
    code = ("import json, logging; logging.basicConfig()\nfrom fp8core import cpu\ncpu.apply_cpu_cap()\n"
            "c = cpu.cpu_caps(); print(json.dumps({'kind': c.kind, 'hw': c.hardware_kind}))")
    r = _probe({"FP8GRPO_CPU_CAP": "amx"}, code)
    assert r["kind"] == r["hw"]


def test_apply_rejects_invalid_cap_and_a_second_different_cap():
    code = """
import json, os
from fp8core import cpu
out = {}
os.environ["FP8GRPO_CPU_CAP"] = "avx3"
try:
    cpu.apply_cpu_cap()
except ValueError as e:
    out["invalid"] = str(e)
os.environ["FP8GRPO_CPU_CAP"] = "amx"
cpu.apply_cpu_cap()
os.environ["FP8GRPO_CPU_CAP"] = "avx2"
try:
    cpu.apply_cpu_cap()
except RuntimeError as e:
    out["second"] = str(e)
print(json.dumps(out))
"""
    r = _probe({}, code)
    assert "FP8GRPO_CPU_CAP" in r["invalid"] and "avx512_bf16" in r["invalid"]
    assert "per process" in r["second"]


def test_threads_are_capped_by_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert [cpu.usable_threads(n) for n in (1, 2, 4, 8, 0)] == [1, 2, 4, 4, 1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert cpu.usable_cpus() == 1 and cpu.usable_threads(2) == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity API")
def test_a_process_bound_to_one_cpu_and_its_children_get_one_thread():
    """The real mask: a process bound to one CPU (as `taskset -c 0`, a cpuset, or a pinned test worker) and a child it
    starts (as a Ray actor is) both size their threads to that one CPU."""
    code = ("import os, subprocess, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "from fp8core.cpu import usable_threads\nprint(usable_threads(2))\n"
            "sys.stdout.flush(); subprocess.run([sys.executable, '-c', "
            "'from fp8core.cpu import usable_threads; print(usable_threads(2))'], check=True)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1"]
