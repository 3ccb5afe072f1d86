"""Where FP8 GEMMs pay: an expected speed per layer from its shape, and a warning when ``fp8=``
converts layers too small to gain.

An FP8 layer (torchao's dynamic tensorwise or rowwise scaling) runs its three GEMMs (forward,
grad-input, grad-weight) on FP8 tensor cores at up to twice bf16's rate, but first casts its
input, weight and output gradient: an amax reduction and a scaled cast each, plus the
transposed copies the backward GEMMs read. Those casts move bytes in proportion to
``M*K + K*N + M*N`` while the GEMMs' work grows as ``M*K*N``: a layer gains only when its GEMMs
are large. The model here (:func:`estimate`) times both on a device class's figures:

==============  =========  ========  ======  =============================================
device class    bf16 TF/s  FP8 TF/s  TB/s    square layer (K = N) at 8192 tokens per step
==============  =========  ========  ======  =============================================
``cuda-sm89``   180        360       0.86    even at ~1200 wide; 1.5x at 4096 (Ada: L40S)
``cuda-sm90``   790        1580      3.0     even at ~1800 wide; 0.66x at 1024, 1.4x at 4096
``cuda-sm100``  1800       3600      7.0     even at ~2200 wide; 1.4x at 4096 (Blackwell)
``cpu``         --         --        --      never: FP8 is emulated there, always slower
==============  =========  ========  ======  =============================================

The rule to read off it: on an H100 or H200 a layer gains from FP8 when its smaller dimension
is well above 2048 (GPT-2's 768 and a 1024-wide Llama lose; a 7B model's 4096 and 11008
gain). TF/s are dense GEMM rates reached on large products (the sm90 bf16 figure measured on an H100
and an H200; the others from the vendors' datasheets, FP8 at twice bf16), TB/s the memory
bandwidth the casts stream at. Each cast kernel also costs a fixed 4 us of launch. The figures
are an estimate, **not calibrated on a GPU in this release**: measure (``make gpu-check``)
before relying on them. On a CPU, ``torch._scaled_mm`` emulates FP8: it is for numerics,
never speed.

``mp.prepare(..., fp8=...)`` on a CUDA device warns once (:class:`FP8SpeedWarning`), listing the
converted layers' shapes whose estimate is below 1.0x bf16; on a CPU it warns once per process
(:class:`FP8EmulatedWarning`, a :class:`mixprec.SlowDtypeWarning`) that FP8 is emulated there.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from ..hardware import SlowDtypeWarning

__all__ = ["DeviceFigures", "FIGURES", "TOKENS", "FP8SpeedWarning", "FP8EmulatedWarning",
           "device_class", "estimate", "slow_layers", "warn_if_slow", "warn_if_emulated"]

TOKENS = 8192  # the tokens of one step assumed when the batch is not known (8 x 1024)
_LAUNCH_S = 4e-6  # the fixed cost of one kernel launch
_CASTS = 6  # cast kernels per layer and step: amax + scaled cast, for each of three tensors
# bytes moved per element of each cast tensor: read for the amax (2), read again and write FP8
# (2 + 1), and the FP8 transposed copy the backward GEMM reads (1 + 1)
_CAST_BYTES = 7


@dataclasses.dataclass(frozen=True)
class DeviceFigures:
    """The rates :func:`estimate` times a layer with (dense TFLOP/s, TB/s)."""

    bf16_tflops: float
    fp8_tflops: float
    tbps: float


FIGURES = {
    "cuda-sm89": DeviceFigures(180.0, 360.0, 0.86),
    "cuda-sm90": DeviceFigures(790.0, 1580.0, 3.0),
    "cuda-sm100": DeviceFigures(1800.0, 3600.0, 7.0),
}


class FP8SpeedWarning(UserWarning):
    """``fp8=`` converted layers whose GEMMs are too small for FP8 to beat bf16 on the device
    (an estimate from their shapes: see :mod:`mixprec.fp8.speed`)."""


class FP8EmulatedWarning(SlowDtypeWarning):
    """``fp8=`` on a device without FP8 tensor cores (a CPU): ``torch._scaled_mm`` emulates the
    GEMMs there, slower than bf16's; the numerics are FP8's. Warned once per process and device
    class."""


_emulated_warned: set[str] = set()


def device_class(device) -> str:
    """``"cpu"``, ``"cuda-sm89"``, ``"cuda-sm90"``, ``"cuda-sm100"`` (capability 10 and up), or
    ``"cuda-old"`` (no FP8 tensor cores), for a ``torch.device`` or its name."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu" if device.type == "cpu" else device.type
    major, minor = torch.cuda.get_device_capability(device)
    return _class_of_capability(major, minor)


def _class_of_capability(major: int, minor: int) -> str:
    if major >= 10:
        return "cuda-sm100"
    if major == 9:
        return "cuda-sm90"
    if (major, minor) >= (8, 9):
        return "cuda-sm89"
    return "cuda-old"


def estimate(in_features: int, out_features: int, device: str = "cuda-sm90",
             tokens: int = TOKENS) -> float | None:
    """The expected speed of a Linear layer's three GEMMs in FP8 relative to bf16 (> 1: faster),
    an estimate from the shape alone (see the module docstring); None where FP8 has no speed to
    estimate (``"cpu"``: emulated, always slower; a GPU without FP8 tensor cores).

    Args:
        in_features, out_features: the layer's ``K`` and ``N``.
        device: a device class (:func:`device_class`).
        tokens: ``M``, the rows of the layer's input per step (batch x sequence).

    Raises:
        ValueError: a dimension or ``tokens`` that is not a positive integer.
    """
    for name, v in (("in_features", in_features), ("out_features", out_features),
                    ("tokens", tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer; got {v!r}")
    fig = FIGURES.get(device)
    if fig is None:
        return None
    m, k, n = tokens, in_features, out_features
    flops = 3 * 2 * m * k * n
    bf16 = flops / (fig.bf16_tflops * 1e12)
    casts = (m * k + k * n + m * n) * _CAST_BYTES / (fig.tbps * 1e12) + _CASTS * _LAUNCH_S
    return bf16 / (flops / (fig.fp8_tflops * 1e12) + casts)


def slow_layers(shapes: dict[str, tuple[int, int]], device: str,
                tokens: int = TOKENS) -> dict[str, float]:
    """The layers of ``shapes`` (name -> ``(in_features, out_features)``) whose estimate on
    ``device`` is below 1.0x bf16, with their estimate."""
    out = {}
    for name, (k, n) in shapes.items():
        speed = estimate(k, n, device, tokens)
        if speed is not None and speed < 1.0:
            out[name] = speed
    return out


def warn_if_emulated(layers: int, device, fmt: str = "FP8", stacklevel: int = 2) -> None:
    """On a device without FP8 tensor cores (a CPU), warn once per process and device class
    (:class:`FP8EmulatedWarning`) that the ``layers`` converted layers' GEMMs are emulated."""
    cls = device_class(device)
    if cls in FIGURES or cls in _emulated_warned:
        return
    _emulated_warned.add(cls)
    where = "a CPU" if cls == "cpu" else f"this device ({cls}: no FP8 tensor cores)"
    warnings.warn(
        f"fp8={fmt!r} on {where}: torch._scaled_mm emulates the low-bit GEMMs of the {layers} "
        f"converted layer{'s' * (layers != 1)}, slower than bf16 (the format's numerics, not "
        f"its speed); for speed, train in it on a GPU of compute capability 8.9 or above, and "
        f"here without fp8=", FP8EmulatedWarning, stacklevel=stacklevel)


def warn_if_slow(shapes: dict[str, tuple[int, int]], device, stacklevel: int = 2) -> None:
    """Warn once (:class:`FP8SpeedWarning`) listing the shapes of the layers of ``shapes`` that
    FP8 is not expected to speed up on ``device`` (CUDA only: elsewhere FP8 is emulated and
    never faster, which :func:`warn_if_emulated` says)."""
    cls = device_class(device)
    if not cls.startswith("cuda"):
        return
    slow = slow_layers(shapes, cls)
    if not slow:
        return
    by_shape: dict[tuple[int, int], list[float]] = {}
    for name, speed in slow.items():
        by_shape.setdefault(shapes[name], []).append(speed)
    listed = ", ".join(f"{k}x{n} ({len(v)} layer{'s' * (len(v) > 1)}, ~{v[0]:.2f}x)"
                       for (k, n), v in sorted(by_shape.items()))
    warnings.warn(
        f"fp8= converts {len(slow)} of {len(shapes)} layers whose GEMMs are too small for FP8 to "
        f"beat bf16 on this GPU ({cls}): in_features x out_features {listed}, estimated speed "
        f"vs bf16 at {TOKENS} tokens per step (an estimate from the shapes, not calibrated on a "
        f"GPU in this release). On an H100 FP8 gains from well above 2048 wide; leave these "
        f"layers in 16 bits (fp8_modules=) or measure with make gpu-check", FP8SpeedWarning,
        stacklevel=stacklevel)
