"""Single-value decomposition: how one value is stored in a format, bit by bit.

:func:`decompose` rounds a value with the format's rule (:mod:`mixprec.formats.rounding`) and
splits the stored value into sign, exponent and fraction; it also records torch's own cast, with
a note saying why the two differ where they do (see the rounding module). Bit patterns are read
back from the real torch dtype (``view`` as an integer) wherever torch has the dtype.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import textwrap
from typing import Any

import torch

from .rounding import round_to
from .table import FloatFormat, get

__all__ = ["Decomposition", "decompose", "encode", "decode"]

_INT_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def encode(stored: float, fmt: FloatFormat) -> tuple[int, int, int]:
    """(sign, biased exponent, fraction) of a value representable in ``fmt``, by arithmetic."""
    sign = 1 if math.copysign(1.0, stored) < 0 else 0
    top = 2 ** fmt.exponent_bits - 1
    if math.isnan(stored):
        return sign, top, ((2 ** fmt.mantissa_bits - 1) if not fmt.has_inf
                           else 2 ** (fmt.mantissa_bits - 1))
    if math.isinf(stored):
        return sign, top, 0
    mag = abs(stored)
    if mag < fmt.min_normal:  # zero or subnormal: 0.fraction x 2**emin
        return sign, 0, int(mag / fmt.min_subnormal)
    m, e = math.frexp(mag)
    return sign, e - 1 + fmt.bias, int(math.ldexp(2 * m - 1, fmt.mantissa_bits))


def _fields_from_torch(stored: float, fmt: FloatFormat) -> tuple[int, int, int]:
    """(sign, biased exponent, fraction) read from the real dtype's bit pattern."""
    real = torch.tensor([stored], dtype=torch.float64).to(fmt.torch_dtype)
    pattern = real.view(_INT_VIEW[fmt.bits]).item() & ((1 << fmt.bits) - 1)
    fraction = pattern & ((1 << fmt.mantissa_bits) - 1)
    biased = (pattern >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    return pattern >> (fmt.bits - 1), biased, fraction


def decode(sign: int, biased: int, fraction: int, fmt: FloatFormat) -> float:
    """The value a bit pattern encodes (the inverse of :func:`encode`)."""
    top = 2 ** fmt.exponent_bits - 1
    if biased == top and fmt.has_inf:
        value = math.inf if fraction == 0 else math.nan
    elif biased == top and fraction == 2 ** fmt.mantissa_bits - 1:
        value = math.nan
    elif biased == 0:
        value = fraction * fmt.min_subnormal
    else:
        value = math.ldexp(1 + fraction / 2 ** fmt.mantissa_bits, biased - fmt.bias)
    return -value if sign else value


def _fmt_num(x: float) -> str:
    """Shortest repr of a float, with ``= 2^k`` appended for exact powers of two."""
    text = repr(float(x))
    if math.isfinite(x) and x != 0:
        m, e = math.frexp(abs(x))
        if m == 0.5:
            text += f" = {'-' if x < 0 else ''}2^{e - 1}"
    return text


@dataclasses.dataclass(frozen=True)
class Decomposition:
    """How one value is stored in a format (see :func:`decompose`).

    Attributes:
        value: the input, as a Python float.
        fmt: the :class:`FloatFormat`.
        sign: 0 for +, 1 for -.
        biased_exponent: the exponent field as an integer.
        exponent: the power of two the significand is scaled by (``emin`` for subnormals and
            zeros), None for inf and NaN.
        fraction: the fraction field as an integer.
        bits: "sign exponent fraction", e.g. ``"0 11110 1111111111"``.
        stored: the value after rounding to ``fmt``.
        abs_error: ``|stored - value|`` (inf on overflow, NaN for a NaN input).
        rel_error: ``abs_error / |value|`` (0 for an exact value, 1 on underflow).
        kind: "normal", "subnormal", "zero", "inf" or "nan" (of the stored value).
        overflow: a finite value became inf (NaN in fp8_e4m3).
        underflow: a nonzero value became zero.
        torch_cast: what torch's own cast of the float64 value to ``fmt.torch_dtype`` gives
            (None where this torch has no such dtype). It can differ from ``stored``, the
            format's rule: torch's CPU cast to ``float8_e4m3fn`` saturates to +-448 where the
            format stores NaN, and torch rounds float64 to 16-bit and fp8 types through float32
            (double rounding). :attr:`torch_note` says which.
    """

    value: float
    fmt: FloatFormat
    sign: int
    biased_exponent: int
    exponent: int | None
    fraction: int
    bits: str
    stored: float
    abs_error: float
    rel_error: float
    kind: str
    overflow: bool
    underflow: bool
    torch_cast: float | None = None

    @property
    def torch_agrees(self) -> bool:
        """True when torch's cast stores what the format's rule does (or torch lacks the dtype)."""
        return self.torch_cast is None or _same(self.torch_cast, self.stored)

    @property
    def torch_note(self) -> str:
        """Why torch's cast differs from the format's rule ("" when it does not)."""
        if self.torch_agrees:
            return ""
        f = self.fmt
        if not f.has_inf and math.isnan(self.stored) and not math.isnan(self.value):
            return (f"torch saturates out-of-range values and inf to +-{f.max:g}; the format "
                    f"has no inf, so its rule stores NaN")
        via_fp32 = torch.tensor([self.value], dtype=torch.float64).to(torch.float32).double()
        if _same(round_to(via_fp32, f).item(), self.torch_cast):
            return "torch rounds float64 to float32 first, then to this format (double rounding)"
        return "torch's cast differs from round-to-nearest-even"

    @property
    def significand(self) -> float | None:
        """``1.fraction`` for normal values, ``0.fraction`` for subnormals and zero, else None."""
        if self.exponent is None:
            return None
        lead = 1 if self.kind == "normal" else 0
        return lead + self.fraction / 2 ** self.fmt.mantissa_bits

    def __str__(self) -> str:
        f = self.fmt
        sign_bits, exp_bits, frac_bits = self.bits.split(" ")
        lines = [f"{_fmt_num(self.value)} in {f.name} (1 sign, {f.exponent_bits} exponent, "
                 f"{f.mantissa_bits} fraction bits; bias {f.bias})",
                 f"  bits       {self.bits}",
                 f"  sign       {sign_bits} ({'-' if self.sign else '+'})"]
        if self.exponent is None:
            lines.append(f"  exponent   {exp_bits} (all ones: special value)")
            lines.append(f"  fraction   {frac_bits}")
        else:
            if self.biased_exponent == 0:
                how = f"all zeros: subnormal/zero, 1 - {f.bias}"
            else:
                how = f"{self.biased_exponent} - {f.bias}"
            lines.append(f"  exponent   {exp_bits} ({how}) -> 2^{self.exponent}")
            lines.append(f"  fraction   {frac_bits} = {self.fraction}/{2 ** f.mantissa_bits} "
                         f"-> significand {self.significand!r}")
            lines.append(f"  value      (-1)^{self.sign} x 2^{self.exponent} x {self.significand!r}"
                         f" = {_fmt_num(self.stored)}")
        rule = "" if self.torch_agrees else " (the format's rule)"
        lines.append(f"  stored     {_fmt_num(self.stored)}{rule}")
        if self.torch_cast is not None and f.bits < 64:  # float64 -> float64 is no cast
            cast = f"  torch cast {_fmt_num(self.torch_cast)} (float64 .to({f.torch_dtype})"
            if self.torch_agrees:
                lines.append(cast + ": same)")
            else:
                lines.append(cast + "):")
                lines += textwrap.wrap(self.torch_note, 88, initial_indent=" " * 13,
                                       subsequent_indent=" " * 13)
        lines += [f"  error      abs {self.abs_error:.6g}, rel {self.rel_error:.6g}",
                  f"  kind       {self.kind}",
                  f"  overflow   {'yes' if self.overflow else 'no'}",
                  f"  underflow  {'yes' if self.underflow else 'no'}"]
        return "\n".join(lines)


def _to_float(value: Any) -> float:
    """A Python float from a real number or a one-element floating tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise TypeError(f"value must be a real number or a one-element floating tensor; "
                            f"got a {value.dtype} tensor of shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"value must be a real number; got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError as exc:
        raise ValueError(f"value {value!r} is beyond the float64 range (max ~1.8e308)") from exc


def _kind(stored: float, fmt: FloatFormat) -> str:
    if math.isnan(stored):
        return "nan"
    if math.isinf(stored):
        return "inf"
    if stored == 0:
        return "zero"
    return "subnormal" if abs(stored) < fmt.min_normal else "normal"


def _errors(value: float, stored: float) -> tuple[float, float]:
    if math.isfinite(value) and not math.isfinite(stored):  # overflow, also to NaN in fp8_e4m3
        return math.inf, math.inf
    if math.isnan(value) or math.isnan(stored):
        return math.nan, math.nan
    if stored == value:
        return 0.0, 0.0
    abs_error = abs(stored - value)
    return abs_error, abs_error / abs(value)


def decompose(value: Any, fmt: Any = "fp16") -> Decomposition:
    """Round ``value`` to ``fmt`` and split the stored value into sign, exponent and fraction.

    Args:
        value: a real number (or a one-element floating tensor), taken as float64.
        fmt: a format name, torch dtype or :class:`FloatFormat` (default fp16).

    Returns:
        A :class:`Decomposition`; ``str()`` of it is the explanation ``mixprec explain`` prints.

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: unknown format, or an int beyond the float64 range.

    Example:
        >>> decompose(65504, "fp16").bits
        '0 11110 1111111111'
    """
    fmt = get(fmt)
    x = _to_float(value)
    stored = round_to(torch.tensor([x], dtype=torch.float64), fmt).item()
    if fmt.torch_dtype is not None:
        sign, biased, fraction = _fields_from_torch(stored, fmt)
    else:
        sign, biased, fraction = encode(stored, fmt)
    decoded = decode(sign, biased, fraction, fmt)
    if not (decoded == stored or (math.isnan(decoded) and math.isnan(stored))):
        raise RuntimeError(f"internal error: {stored!r} encoded in {fmt.name} "
                           f"decodes to {decoded!r}")
    kind = _kind(stored, fmt)
    exponent = None if kind in ("inf", "nan") else max(biased, 1) - fmt.bias
    abs_error, rel_error = _errors(x, stored)
    return Decomposition(
        value=x, fmt=fmt, sign=sign, biased_exponent=biased, exponent=exponent, fraction=fraction,
        bits=f"{sign} {biased:0{fmt.exponent_bits}b} {fraction:0{fmt.mantissa_bits}b}",
        stored=stored, abs_error=abs_error, rel_error=rel_error, kind=kind,
        overflow=math.isfinite(x) and not math.isfinite(stored),
        underflow=x != 0 and stored == 0,
        torch_cast=_torch_cast(x, fmt),
    )


def _torch_cast(x: float, fmt: FloatFormat) -> float | None:
    """torch's own cast of float64 ``x`` to the format's dtype, read back as a float."""
    if fmt.torch_dtype is None:
        return None
    return torch.tensor([x], dtype=torch.float64).to(fmt.torch_dtype).double().item()


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
