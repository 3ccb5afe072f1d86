"""The format table: :class:`FloatFormat` and its constants, derived from each bit layout.

Every constant is derived from the bit layout (exponent and mantissa widths, and whether the top
exponent encodes inf/NaN), so the table reads like the MindSpore guide's worked example: fp16
has 1 sign bit, 5 exponent bits, 10 fraction bits, bias 15, and its largest value is
``0 11110 1111111111`` = 1.9990234375 x 2^15 = 65504.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..dtypes import ALIASES, CANONICAL, dtype_name

__all__ = ["FloatFormat", "get", "names"]


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format, described by its bit layout.

    Attributes:
        name: canonical short name ("fp16", "bf16", "fp8_e4m3", ...).
        bits: total width (1 sign bit + exponent bits + mantissa bits).
        exponent_bits: width of the exponent field.
        mantissa_bits: width of the fraction field (the leading 1 is implicit).
        bias: exponent bias, ``2**(exponent_bits - 1) - 1``.
        max: largest finite value.
        min_normal: smallest positive normal value, ``2**(1 - bias)``.
        min_subnormal: smallest positive subnormal value, ``2**(1 - bias - mantissa_bits)``.
        eps: distance from 1.0 to the next larger value, ``2**-mantissa_bits``.
        torch_dtype: the torch dtype storing this format, or None if this torch build lacks it.
        has_inf: False for fp8_e4m3 (the "fn" variant): no infinities, the top exponent holds
            normal values and a single NaN pattern (``S 1111 111``), so the max is 448.
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    min_normal: float
    min_subnormal: float
    eps: float
    torch_dtype: torch.dtype | None
    has_inf: bool = True

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (also the scale of subnormals)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        return math.frexp(self.max)[1] - 1

    def __str__(self) -> str:
        return (f"{self.name} (1+{self.exponent_bits}+{self.mantissa_bits} bits, bias {self.bias}, "
                f"max {self.max:.6g}, min normal {self.min_normal:.4g}, "
                f"min subnormal {self.min_subnormal:.4g}, eps {self.eps:.4g})")


def _layout(name: str, exponent_bits: int, mantissa_bits: int, *,
            has_inf: bool = True) -> FloatFormat:
    """Build a FloatFormat whose constants all follow from the bit layout."""
    bias = 2 ** (exponent_bits - 1) - 1
    if has_inf:  # IEEE 754: the all-ones exponent is reserved for inf and NaN
        emax, top_fraction = 2 ** exponent_bits - 2 - bias, 2 ** mantissa_bits - 1
    else:  # OCP "fn": only S.1111.111 is NaN, the rest of the top exponent is normal
        emax, top_fraction = 2 ** exponent_bits - 1 - bias, 2 ** mantissa_bits - 2
    return FloatFormat(
        name=name,
        bits=1 + exponent_bits + mantissa_bits,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        bias=bias,
        max=math.ldexp(1 + top_fraction / 2 ** mantissa_bits, emax),
        min_normal=math.ldexp(1.0, 1 - bias),
        min_subnormal=math.ldexp(1.0, 1 - bias - mantissa_bits),
        eps=math.ldexp(1.0, -mantissa_bits),
        torch_dtype=CANONICAL.get(name),
        has_inf=has_inf,
    )


_FORMATS: dict[str, FloatFormat] = {
    f.name: f for f in (
        _layout("fp64", 11, 52),
        _layout("fp32", 8, 23),
        _layout("fp16", 5, 10),
        _layout("bf16", 8, 7),
        _layout("fp8_e4m3", 4, 3, has_inf=False),
        _layout("fp8_e5m2", 5, 2),
    )
}


def names() -> tuple[str, ...]:
    """Canonical names of the known formats, widest first."""
    return tuple(_FORMATS)


def get(name_or_dtype: Any) -> FloatFormat:
    """Look up a format by name, alias or torch dtype.

    Args:
        name_or_dtype: "fp16", "half", "float16", "bf16", "fp8_e4m3", ..., a floating
            ``torch.dtype``, or a :class:`FloatFormat` (returned as is).

    Returns:
        The :class:`FloatFormat`.

    Raises:
        ValueError: an unknown name or a dtype with no known format.
        TypeError: neither a string, a torch dtype nor a FloatFormat.

    Example:
        >>> get("half").max
        65504.0
    """
    if isinstance(name_or_dtype, FloatFormat):
        return name_or_dtype
    known = ", ".join(_FORMATS)
    if isinstance(name_or_dtype, torch.dtype):
        fmt = _FORMATS.get(dtype_name(name_or_dtype))
        if fmt is None:
            raise ValueError(f"no floating-point format for {name_or_dtype}; "
                             f"known formats: {known}")
        return fmt
    if isinstance(name_or_dtype, str):
        canonical = ALIASES.get(name_or_dtype.strip().lower())
        if canonical is None:
            raise ValueError(f"unknown format {name_or_dtype!r}; known formats: {known} "
                             f"(aliases: {', '.join(sorted(ALIASES))})")
        return _FORMATS[canonical]
    raise TypeError(f"a format must be a name, a torch.dtype or a FloatFormat; "
                    f"got {type(name_or_dtype).__name__} {name_or_dtype!r}")
