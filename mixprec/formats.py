"""Floating-point formats: their constants, how one value is stored, and range reports.

Every constant of a :class:`FloatFormat` is derived from its bit layout (exponent and mantissa
widths, and whether the top exponent encodes inf/NaN), so the table reads like the MindSpore
guide's worked example: fp16 has 1 sign bit, 5 exponent bits, 10 fraction bits, bias 15, and its
largest value is ``0 11110 1111111111`` = 1.9990234375 x 2^15 = 65504.

Rounding is round-to-nearest-even, computed exactly in float64 arithmetic from the bit layout
(the quantum of a value is a power of two, so ``round(x / q) * q`` is exact). It agrees with
torch's own casts for every value they round once; it differs from them in two documented
places: torch casts float64 to fp16/bf16/fp8 through float32 (double rounding, e.g.
1 + 2^-11 + 2^-40 becomes 1.0 instead of 1.0009765625), and torch's CPU cast to
``float8_e4m3fn`` saturates out-of-range values (and inf) to +-448, where this module reports an
overflow and stores NaN, the format's only non-finite value. :func:`decompose` shows both: the
format's rule (``stored``) and torch's own cast (``torch_cast``, with ``torch_note`` saying why
they differ). Bit patterns are read back from the real torch dtype (``view`` as an integer)
wherever torch has the dtype.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import textwrap
from typing import Any

import torch

from .dtypes import ALIASES, CANONICAL, dtype_name

__all__ = ["FloatFormat", "Decomposition", "RangeReport", "get", "names", "decompose",
           "range_report", "check_scale"]

_CHUNK = 1 << 20  # elements converted to float64 at a time by range_report
_INT_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


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


def _round(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round a float64 tensor to ``fmt`` (nearest-even), overflow to inf (NaN without inf)."""
    if fmt.bits >= 64:
        return x.clone()
    _, exp = torch.frexp(x.abs())  # |x| = m * 2**exp with 0.5 <= m < 1
    exp = (exp - 1).clamp_(min=fmt.emin)  # below min_normal the quantum stays fixed: subnormals
    quantum = torch.ldexp(torch.ones_like(x), exp - fmt.mantissa_bits)
    out = torch.round(x / quantum) * quantum
    overflow_to = math.inf if fmt.has_inf else math.nan
    out = torch.where(out.abs() > fmt.max, torch.copysign(torch.full_like(x, overflow_to), x), out)
    if not fmt.has_inf:
        out = torch.where(torch.isinf(x), torch.copysign(torch.full_like(x, math.nan), x), out)
    return torch.where(torch.isnan(x), x, out)


def _encode(stored: float, fmt: FloatFormat) -> tuple[int, int, int]:
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


def _decode(sign: int, biased: int, fraction: int, fmt: FloatFormat) -> float:
    """The value a bit pattern encodes (the inverse of :func:`_encode`)."""
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
        if _same(_round(via_fp32, f).item(), self.torch_cast):
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
    stored = _round(torch.tensor([x], dtype=torch.float64), fmt).item()
    if fmt.torch_dtype is not None:
        sign, biased, fraction = _fields_from_torch(stored, fmt)
    else:
        sign, biased, fraction = _encode(stored, fmt)
    decoded = _decode(sign, biased, fraction, fmt)
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


def _fraction(field: str) -> property:
    def get_fraction(self: RangeReport) -> float:
        return getattr(self, field) / self.numel if self.numel else 0.0
    return property(get_fraction, doc=f"``{field}`` as a fraction of ``numel`` (0 when empty).")


@dataclasses.dataclass(frozen=True)
class RangeReport:
    """How the values of a tensor fare when stored in a format (see :func:`range_report`).

    ``exact_zero + underflow + representable + overflow + nonfinite == numel``.

    Attributes:
        fmt: the :class:`FloatFormat`.
        numel: number of values.
        scale: the factor values were multiplied by before rounding.
        overflow: finite values that become inf (NaN in fp8_e4m3).
        underflow: nonzero values that become zero.
        subnormal: values stored as (nonzero) subnormals; a subset of ``representable``.
        exact_zero: values that are zero in the source.
        representable: finite nonzero values stored as finite nonzero values (maybe rounded).
        exact: representable values stored without rounding error.
        nonfinite: inf or NaN in the source.
        max_rel_error: largest relative rounding error over the representable values.
        mean_rel_error: mean relative rounding error over the representable values.
    """

    fmt: FloatFormat
    numel: int
    scale: float
    overflow: int
    underflow: int
    subnormal: int
    exact_zero: int
    representable: int
    exact: int
    nonfinite: int
    max_rel_error: float
    mean_rel_error: float

    overflow_fraction = _fraction("overflow")
    underflow_fraction = _fraction("underflow")
    subnormal_fraction = _fraction("subnormal")
    exact_zero_fraction = _fraction("exact_zero")
    representable_fraction = _fraction("representable")

    @classmethod
    def combine(cls, reports: list[RangeReport]) -> RangeReport:
        """Merge reports of the same format and scale (e.g. the tensors of one model)."""
        if not reports:
            raise ValueError("RangeReport.combine needs at least one report; got none")
        first = reports[0]
        if any(r.fmt != first.fmt or r.scale != first.scale for r in reports):
            raise ValueError("RangeReport.combine needs reports of one format and one scale")
        counts = {f: sum(getattr(r, f) for r in reports) for f in _COUNT_FIELDS}
        weighted = sum(r.mean_rel_error * r.representable for r in reports)
        return cls(fmt=first.fmt, scale=first.scale, **counts,
                   max_rel_error=max(r.max_rel_error for r in reports),
                   mean_rel_error=(weighted / counts["representable"]
                                   if counts["representable"] else 0.0))

    def __str__(self) -> str:
        f = self.fmt
        scaled = f" x {self.scale:g}" if self.scale != 1 else ""
        lines = [f"{self.numel:,} values{scaled} -> {f.name} (max {f.max:.6g}, "
                 f"min normal {f.min_normal:.4g}, min subnormal {f.min_subnormal:.4g})"]
        for field in ("overflow", "underflow", "subnormal", "exact_zero", "representable",
                      "nonfinite"):
            count = getattr(self, field)
            share = count / self.numel if self.numel else 0.0
            lines.append(f"  {field.replace('_', ' '):<14}{count:>12,}  {share:8.2%}")
        lines.append(f"  rel. error    max {self.max_rel_error:.3g}, "
                     f"mean {self.mean_rel_error:.3g}")
        return "\n".join(lines)


_COUNT_FIELDS = ("numel", "overflow", "underflow", "subnormal", "exact_zero", "representable",
                 "exact", "nonfinite")


def _chunk_counts(x: torch.Tensor, fmt: FloatFormat) -> dict[str, float]:
    """Counts (and rel-error max/sum) for one float64 chunk."""
    stored = _round(x, fmt)
    finite, stored_finite = torch.isfinite(x), torch.isfinite(stored)
    zero_in, zero_out = x == 0, stored == 0
    representable = finite & ~zero_in & ~zero_out & stored_finite
    rel = ((stored - x).abs() / x.abs())[representable]
    return {
        "numel": x.numel(),
        "overflow": int((finite & ~stored_finite).sum()),
        "underflow": int((finite & ~zero_in & zero_out).sum()),
        "subnormal": int((representable & (stored.abs() < fmt.min_normal)).sum()),
        "exact_zero": int(zero_in.sum()),
        "representable": int(representable.sum()),
        "exact": int((representable & (stored == x)).sum()),
        "nonfinite": int((~finite).sum()),
        "rel_max": float(rel.max()) if rel.numel() else 0.0,
        "rel_sum": float(rel.sum()),
    }


def range_report(tensor: torch.Tensor, fmt: Any = "fp16", *, scale: float = 1.0) -> RangeReport:
    """Count how the values of ``tensor`` would overflow, underflow or round in ``fmt``.

    Values are taken to float64 and multiplied by ``scale`` there (exact for powers of two),
    then rounded to ``fmt`` (nearest-even). Works in chunks, so large tensors are fine; reading
    the counts forces a host-device sync for CUDA tensors.

    Args:
        tensor: a floating-point tensor (any shape, may be empty).
        fmt: a format name, torch dtype or :class:`FloatFormat` (default fp16).
        scale: multiply values by this first (e.g. a loss scale); a positive finite number.

    Returns:
        A :class:`RangeReport`.

    Raises:
        TypeError: not a tensor, or an integer/bool/complex tensor.
        ValueError: unknown format or a scale that is not positive and finite.

    Example:
        >>> range_report(torch.tensor([1e-9, 1.0, 1e5]), "fp16").underflow
        1
    """
    fmt = get(fmt)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"range_report needs a torch.Tensor; got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"range_report needs a floating-point tensor; got dtype {tensor.dtype}")
    scale = check_scale(scale)
    totals = dict.fromkeys(_COUNT_FIELDS, 0) | {"rel_max": 0.0, "rel_sum": 0.0}
    for chunk in tensor.detach().reshape(-1).split(_CHUNK):
        counts = _chunk_counts(chunk.to(torch.float64) * scale, fmt)
        for key, val in counts.items():
            totals[key] = max(totals[key], val) if key == "rel_max" else totals[key] + val
    rel_max, rel_sum = totals.pop("rel_max"), totals.pop("rel_sum")
    return RangeReport(fmt=fmt, scale=scale, **totals, max_rel_error=rel_max,
                       mean_rel_error=(rel_sum / totals["representable"]
                                       if totals["representable"] else 0.0))


def check_scale(scale: Any) -> float:
    """A positive finite float, else ValueError/TypeError."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a positive number; got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number; got {scale!r}")
    return float(scale)
