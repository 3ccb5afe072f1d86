"""Range reports: how the values of a tensor fare when stored in a format.

:func:`range_report` counts, over any tensor, the values that would overflow, underflow, turn
subnormal or round when stored in a format (optionally after a loss scale), with the format's
rounding rule (:mod:`mixprec.formats.rounding`); :meth:`RangeReport.combine` merges the reports
of several tensors (a model's gradients).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import torch

from .rounding import round_to
from .table import FloatFormat, get

__all__ = ["RangeReport", "range_report", "check_scale"]

_CHUNK = 1 << 20  # elements converted to float64 at a time by range_report


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


def _chunk_counts(x: torch.Tensor, fmt: FloatFormat,
                  source: torch.Tensor | None = None) -> dict[str, float]:
    """Counts (and rel-error max/sum) for one float64 chunk ``x`` (``source`` scaled), the
    source's own zeros and non-finite values told apart from those the scale made (a value
    the scale takes beyond float64's range overflows; one it takes to 0 underflows)."""
    source = x if source is None else source
    stored = round_to(x, fmt)
    finite, stored_finite = torch.isfinite(source), torch.isfinite(stored)
    zero_in, zero_out = source == 0, stored == 0
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
        wide = chunk.to(torch.float64)
        counts = _chunk_counts(wide * scale, fmt, wide)
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
    try:
        finite = math.isfinite(scale)
    except OverflowError:  # an int beyond float64's range
        finite = False
    if not (finite and scale > 0):
        raise ValueError(f"scale must be a positive finite number; got {scale!r}")
    return float(scale)
