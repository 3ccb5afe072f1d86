"""Device capability probes: which low-precision dtypes exist on a device and which are fast."""

from __future__ import annotations

import copy
import functools
import os
import platform
import warnings

import torch

from .dtypes import TRAINING_DTYPES, dtype_name

__all__ = ["device_capabilities", "cpu_flags", "cpu_model", "is_fast", "warn_if_slow",
           "SlowDtypeWarning"]


def _cpuinfo_field(key: str) -> str | None:
    """The value of the first ``key`` line of /proc/cpuinfo (None where absent)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo is absent)."""
    return frozenset((_cpuinfo_field("flags") or "").split())


def cpu_model() -> str:
    """The CPU model name the kernel reports (``platform.processor()`` where /proc is absent)."""
    return _cpuinfo_field("model name") or platform.processor() or "unknown CPU"


def _normalize_device(device) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise ValueError("device must be a torch.device or a device string; "
                             f"got {device!r}") from exc
    if not isinstance(device, torch.device):
        raise TypeError("device must be a torch.device, a string or None; "
                        f"got {type(device).__name__}")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _cpu_caps() -> dict:
    flags = cpu_flags()
    bf16_fast = bool({"avx512_bf16", "amx_bf16"} & flags)
    # AVX512-FP16 alone does not make oneDNN's fp16 GEMM faster than fp32 (about as fast, on a
    # Sapphire Rapids VM); AMX-FP16 (Granite Rapids) does.
    fp16_fast = "amx_fp16" in flags
    bf16_why = ("AVX512-BF16/AMX-BF16 present" if bf16_fast
                else "no AVX512-BF16 or AMX-BF16: bf16 GEMM is emulated and slow")
    fp16_why = ("AMX-FP16 present" if fp16_fast
                else "no AMX-FP16: fp16 GEMM runs no faster than fp32 (often much slower)")
    return {
        "name": f"CPU ({torch.backends.cpu.get_cpu_capability()})",
        "dtypes": {
            "fp32": {"supported": True, "fast": True, "why": "native"},
            "bf16": {"supported": True, "fast": bf16_fast, "why": bf16_why},
            "fp16": {"supported": True, "fast": fp16_fast, "why": fp16_why},
        },
        "flags": sorted(f for f in flags if f.startswith(("avx512_bf16", "avx512_fp16", "amx"))),
    }


@functools.lru_cache(maxsize=None)
def _cuda_caps_cached(device: torch.device) -> dict:
    """A device's capabilities do not change: probe each CUDA device once per process."""
    return _cuda_caps(device)


def _cuda_caps(device: torch.device) -> dict:
    major, minor = torch.cuda.get_device_capability(device)
    cc = f"{major}.{minor}"
    fp16_fast = major >= 7
    bf16_ok = torch.cuda.is_bf16_supported()
    bf16_fast = major >= 8
    return {
        "name": f"{torch.cuda.get_device_name(device)} (compute capability {cc})",
        "dtypes": {
            "fp32": {"supported": True, "fast": True, "why": "native"},
            "bf16": {"supported": bf16_ok, "fast": bf16_fast,
                     "why": "Tensor Cores with bf16 (cc >= 8.0)" if bf16_fast
                     else f"compute capability {cc} < 8.0: no bf16 Tensor Cores"},
            "fp16": {"supported": True, "fast": fp16_fast,
                     "why": "fp16 Tensor Cores (cc >= 7.0)" if fp16_fast
                     else f"compute capability {cc} < 7.0: no Tensor Cores"},
        },
        "flags": [],
    }


def device_capabilities(device=None) -> dict:
    """Which floating dtypes a device supports and which of them are fast.

    Args:
        device: a ``torch.device``, a device string, or None for the CPU.

    Returns:
        A dict with ``device`` (str), ``name``, ``dtypes`` (``{"fp32"|"bf16"|"fp16": {"supported",
        "fast", "why"}}``), ``auto_dtype`` (what ``dtype="auto"`` resolves to, as a short name)
        and ``auto_reason`` (why).

    Example:
        >>> caps = device_capabilities("cpu")
        >>> caps["dtypes"]["fp32"]["fast"]
        True
    """
    dev = _normalize_device(device)
    if dev.type == "cpu":
        caps = _cpu_caps()
    elif dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {dev} was asked for but CUDA is not available")
        caps = copy.deepcopy(_cuda_caps_cached(dev))
    else:
        caps = {"name": dev.type, "flags": [], "dtypes": {
            "fp32": {"supported": True, "fast": True, "why": "native"},
            "bf16": {"supported": True, "fast": False, "why": f"no fast-path probe for {dev.type}"},
            "fp16": {"supported": True, "fast": False, "why": f"no fast-path probe for {dev.type}"},
        }}
    caps["device"] = str(dev)
    caps["auto_dtype"], caps["auto_reason"] = _auto(caps)
    return caps


def _auto(caps: dict) -> tuple[str, str]:
    d = caps["dtypes"]
    forced = os.environ.get("MIXPRECISION_AUTO_DTYPE")  # for tests and odd machines
    if forced:
        return forced, f"forced by MIXPRECISION_AUTO_DTYPE={forced}"
    if d["bf16"]["supported"] and d["bf16"]["fast"]:
        return "bf16", f"bf16 is fast here ({d['bf16']['why']})"
    if d["fp16"]["supported"] and d["fp16"]["fast"]:
        return "fp16", f"fp16 is fast here ({d['fp16']['why']}); bf16 is not ({d['bf16']['why']})"
    return "fp32", (f"no fast 16-bit type on {caps['name']}: bf16: {d['bf16']['why']}; "
                    f"fp16: {d['fp16']['why']}")


def _training_name(dtype: torch.dtype) -> str | None:
    return dtype_name(dtype) if dtype in TRAINING_DTYPES else None


def is_fast(dtype: torch.dtype, device=None) -> bool:
    """True when ``dtype`` has fast matrix kernels on ``device``."""
    name = _training_name(dtype)
    if name is None:
        return False
    return bool(device_capabilities(device)["dtypes"][name]["fast"])


_warned: set[tuple[str, str]] = set()


def warn_if_slow(dtype: torch.dtype, device=None) -> None:
    """Warn once per (device, dtype) when the user asked for a dtype that is slow there."""
    name = _training_name(dtype)
    if name in (None, "fp32"):
        return
    caps = device_capabilities(device)
    info = caps["dtypes"][name]
    key = (caps["device"], name)
    if info["fast"] or key in _warned:
        return
    _warned.add(key)
    hint = ""
    if name == "fp16" and caps["device"] == "cpu":
        hint = (" mixprec emulates fp16 matmul/conv with fp32 arithmetic on fp16-rounded values "
                "here (see mixprec.emulation), so numerics are fp16's but speed is fp32's.")
    warnings.warn(f"{name} is not fast on {caps['name']}: {info['why']}.{hint}",
                  SlowDtypeWarning, stacklevel=3)


class SlowDtypeWarning(UserWarning):
    """A low-precision dtype was requested on a device where it brings no speed."""
