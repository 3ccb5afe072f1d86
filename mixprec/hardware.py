"""Device capability probes: which low-precision dtypes exist on a device and which are fast.

On a CPU, whether bf16 is fast is measured, not read from the CPU's flags: AVX512-BF16 without
AMX has bf16 instructions, and torch's bf16 GEMMs still run slower than its fp32 ones (a two-core
Intel Xeon with AVX512-BF16 and no AMX: 0.51-0.96x fp32's rate at 1024x1024x1024 in nine probes
under load from other processes). :func:`cpu_gemm_probe` times one bf16 and one fp32 GEMM at
:data:`PROBE_SHAPE`, interleaved, once per process (0.57-0.61 s on that machine at load average
8; less on an idle one); bf16 is fast when it ran at least :data:`BF16_FAST_RATIO` times fp32's
rate. CUDA devices keep their rules (compute capability).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import platform
import time
import warnings

import torch

from .callsite import user_stacklevel
from .dtypes import TRAINING_DTYPES, dtype_name

__all__ = ["device_capabilities", "cpu_flags", "cpu_model", "is_fast", "warn_if_slow",
           "SlowDtypeWarning", "cpu_gemm_probe", "bf16_verdict", "PROBE_SHAPE",
           "BF16_FAST_RATIO"]

_LOG = logging.getLogger("mixprec")
#: The CPU probe's GEMM: a Linear layer's forward (``x @ W.t()``) at 1024 tokens, 1024 wide.
PROBE_SHAPE = (1024, 1024, 1024)
#: bf16 is fast on a CPU when its probe GEMM runs at least this share of fp32's rate.
BF16_FAST_RATIO = 1.0
_PROBE_ROUNDS = 2        # interleaved bf16/fp32 products after one warm-up each
_PROBE_SLOW_S = 0.25     # a warm-up product this long ends the probe (an emulated kernel)


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


def _probe_times(shape, rounds: int, slow_s: float) -> dict[str, list[float]]:
    """Seconds per ``x @ W.t()`` product, fp32 and bf16 interleaved; the warm-up products come
    first (a warm-up longer than ``slow_s`` ends the probe there, timed)."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    pairs = {"fp32": (x, w.t()), "bf16": (x.bfloat16(), w.bfloat16().t())}
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for r in range(rounds + 1):
        for name, (a, b) in pairs.items():
            start = time.perf_counter()
            a @ b
            times[name].append(time.perf_counter() - start)
        if r == 0 and max(t[0] for t in times.values()) > slow_s:
            break
    return times


@functools.lru_cache(maxsize=1)
def cpu_gemm_probe() -> dict:
    """bf16 and fp32 GEMM throughput on this CPU, measured once per process.

    Times ``x @ W.t()`` at :data:`PROBE_SHAPE` (a warm-up product each, then
    two rounds, the dtypes interleaved so a burst of load elsewhere hits both) and keeps each
    dtype's fastest product: load only ever slows a product down. Under a second (0.6 s on a
    busy two-core Xeon); a warm-up product slower than 0.25 s (an emulated kernel) ends it
    early. Tests replace it to drive :func:`bf16_verdict` with chosen figures.

    Returns:
        ``{"fp32_gflops", "bf16_gflops", "ratio" (bf16 over fp32), "shape"}``.
    """
    times = _probe_times(PROBE_SHAPE, _PROBE_ROUNDS, _PROBE_SLOW_S)
    flops = 2.0 * PROBE_SHAPE[0] * PROBE_SHAPE[1] * PROBE_SHAPE[2]
    rates = {name: flops / min(t[1:] or t) / 1e9 for name, t in times.items()}
    return {"fp32_gflops": round(rates["fp32"], 1), "bf16_gflops": round(rates["bf16"], 1),
            "ratio": round(rates["bf16"] / rates["fp32"], 2), "shape": list(PROBE_SHAPE)}


def bf16_verdict(probe: dict) -> tuple[bool, str]:
    """Whether bf16 is fast on a CPU, and why, from a :func:`cpu_gemm_probe` measurement."""
    m, k, n = probe["shape"]
    figures = (f"a {m}x{k}x{n} GEMM measured {probe['bf16_gflops']:g} GFLOP/s in bf16 against "
               f"{probe['fp32_gflops']:g} in fp32 ({probe['ratio']:.2f}x)")
    if probe["ratio"] >= BF16_FAST_RATIO:
        return True, figures
    return False, f"{figures}: bf16 GEMMs are slower than fp32's here"


def _cpu_caps() -> dict:
    flags = cpu_flags()
    probe = cpu_gemm_probe()
    bf16_fast, bf16_why = bf16_verdict(probe)
    # AVX512-FP16 alone does not make oneDNN's fp16 GEMM faster than fp32 (about as fast, on a
    # Sapphire Rapids VM); AMX-FP16 (Granite Rapids) does.
    fp16_fast = "amx_fp16" in flags
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
        "gemm_probe": probe,
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
        and ``auto_reason`` (why); on a CPU also ``gemm_probe``, the bf16/fp32 GEMM
        measurement that decides whether bf16 is fast (:func:`cpu_gemm_probe`).

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
                  SlowDtypeWarning, stacklevel=user_stacklevel())


class SlowDtypeWarning(UserWarning):
    """A low-precision dtype was requested on a device where it brings no speed."""
