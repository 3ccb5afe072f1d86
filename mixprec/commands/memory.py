"""Peak memory of a run: the CUDA allocator's peak, or the process's peak resident set on a CPU.

CPU PyTorch keeps no allocator statistics, so on the CPU the peak is the process's ``VmHWM``
(reset through ``/proc/self/clear_refs``) above its resident set at the baseline.
"""

from __future__ import annotations

import ctypes
import gc

import torch

__all__ = ["reset_peak", "peak_mb"]


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _malloc_trim() -> None:
    """Return freed heap memory to the OS (glibc), so the resident set is an honest baseline."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA device; the CPU runs synchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> int | None:
    """Reset the peak-memory counter; returns the baseline in KiB (None when unavailable)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) // 1024
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
    except OSError:
        return None
    return _status_kb("VmRSS")


def peak_mb(device: torch.device, base_kb: int | None) -> float | None:
    if base_kb is None:
        return None
    peak = (torch.cuda.max_memory_allocated(device) // 1024 if device.type == "cuda"
            else _status_kb("VmHWM"))
    return None if peak is None else round((peak - base_kb) / 1024, 1)
