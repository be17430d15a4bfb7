"""A worker process's memory: its resident set now and its peak since the last reset, as Linux reports them
(``/proc/self/status`` VmRSS / VmHWM; writing ``5`` to ``/proc/self/clear_refs`` resets VmHWM to the current RSS), and
on CUDA the caching allocator's peak. What ``PolicyWorker.memory`` returns and ``bench.memory`` measures with.

Precision on CPU: pages, not allocations. glibc keeps freed heap memory mapped (the trainer raises the mmap / trim
thresholds on purpose, keep_freed_heap_memory below), so RSS after a step stays near its peak; a peak taken
after a reset therefore measures what the step touched beyond what the process already held, which is what a
second worker on the same node would need."""

from __future__ import annotations

import os
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """This process's resident set size now (None where /proc is not available)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_bytes() -> int | None:
    """The largest resident set size since the process started or since the last :func:`reset_peak`."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak() -> bool:
    """Reset the peak to the current resident set (and CUDA's peak counter). False where the kernel refuses."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
    except Exception:  # noqa: BLE001 - CUDA state is best effort here
        pass
    try:
        fd = os.open(_CLEAR_REFS, os.O_WRONLY)
    except OSError:
        return False
    try:
        os.write(fd, b"5")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def snapshot(*, reset: bool = False) -> dict[str, int | None]:
    """``{"rss", "peak"}`` in bytes, plus ``cuda_allocated`` / ``cuda_peak`` on a CUDA device; with ``reset``, taken
    before the peak is set back to the current RSS (:func:`reset_peak`; its outcome under ``"reset"``)."""
    out: dict[str, int | None] = {"rss": rss_bytes(), "peak": peak_bytes()}
    try:
        import torch

        if torch.cuda.is_available():
            out["cuda_allocated"] = int(torch.cuda.memory_allocated())
            out["cuda_peak"] = int(torch.cuda.max_memory_allocated())
    except Exception:  # noqa: BLE001
        pass
    if reset:
        out["reset"] = reset_peak()
    return out


def keep_freed_heap_memory() -> bool:
    """Stop glibc from returning freed large blocks to the OS (mallopt M_MMAP_THRESHOLD / M_TRIM_THRESHOLD = 1 GiB).

    torch's CPU allocator is plain malloc: with two or more multi-MB tensors alive, glibc serves each new one with a
    fresh mmap and unmaps it on free, so every activation / quantization temporary page-faults on first touch
    (measured: allocating and filling two 5 MB tensors 4.5 ms vs 0.15 ms with this set; a copy-sized op 30x slower).
    The trainer's peak memory is unchanged; its RSS just stays at the peak. Linux/glibc only; returns whether set."""
    return _malloc_thresholds(1 << 30)


def return_freed_heap_memory() -> bool:
    """The opposite, for measuring: blocks of 128 KiB and more get their own mapping, unmapped when freed, so the
    resident set follows the live tensors and its peak is theirs (slower; what ``bench.memory --heap return`` sets)."""
    return _malloc_thresholds(128 << 10)


# FP8GRPO_TRAINER_HEAP in a trainer's environment: keep (the default) or return, the two functions above
HEAP_ENV = "FP8GRPO_TRAINER_HEAP"
HEAP_POLICIES = {"keep": keep_freed_heap_memory, "return": return_freed_heap_memory}


def _malloc_thresholds(nbytes: int) -> bool:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, nbytes)) and bool(libc.mallopt(m_trim_threshold, nbytes))
    except (OSError, AttributeError):
        return False
