"""``grad_report``: would these gradients survive a low-precision format, and at which loss scale?

The mixed-precision guides explain loss scaling with a histogram of gradient magnitudes: most
values sit far below fp16's smallest subnormal (2^-24) and become zero, while the top of the
range is unused.
:func:`grad_report` measures exactly that for a model's current ``.grad`` tensors: per
parameter, the fractions that would underflow, become subnormal or overflow in a format after
multiplying by a scale, and the largest power-of-two scale that keeps every value finite.

"Overflow" means what a loss scaler sees: a value that is inf or NaN once scaled and stored in the
format. That is a finite value that rounds past the format's largest number, or a value that
is inf/NaN already (a scaler skips the step for either). So for every parameter
``zero + underflow + representable + overflow == 1``, and a gradient that is all inf/NaN shows
100% overflow; :attr:`ParamGradStats.nonfinite` is the part that was inf/NaN before scaling.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from .. import formats
from ..formats import FloatFormat, RangeReport

__all__ = ["grad_report", "GradReport", "ParamGradStats"]

_LOG2_OFFSET = 1100  # floor(log2|x|) of a finite nonzero float64 lies in [-1074, 1023]


@dataclasses.dataclass(frozen=True)
class ParamGradStats:
    """Gradient statistics of one parameter (or of all of them, named ``"(all)"``).

    Attributes:
        name: qualified parameter name.
        numel: number of gradient values.
        dtype: dtype of the gradient tensor ("fp32", "bf16", ...).
        max_abs: largest finite ``|g|`` before scaling (0.0 when all are zero or non-finite).
        range: the :class:`~mixprec.formats.RangeReport` of ``g * scale`` in the format.
        safe_scale_log2: ``k`` of the largest scale ``2**k`` at which ``max_abs * 2**k`` stays
            finite in the format; None when every gradient value is zero or non-finite.
    """

    name: str
    numel: int
    dtype: str
    max_abs: float
    range: RangeReport
    safe_scale_log2: int | None

    @property
    def underflow(self) -> float:
        """Fraction of values that are nonzero but would become zero."""
        return self.range.underflow_fraction

    @property
    def overflow(self) -> float:
        """Fraction of values that are inf/NaN once scaled and stored in the format: finite
        values that would become inf (NaN in fp8_e4m3) plus values that are inf/NaN already
        (:attr:`nonfinite`), as a loss scaler counts them."""
        if not self.numel:
            return 0.0
        return (self.range.overflow + self.range.nonfinite) / self.numel

    @property
    def nonfinite(self) -> float:
        """Fraction of values that are inf or NaN before scaling (part of :attr:`overflow`)."""
        return self.range.nonfinite / self.numel if self.numel else 0.0

    @property
    def subnormal(self) -> float:
        """Fraction of values that would be stored as subnormals (reduced precision)."""
        return self.range.subnormal_fraction

    @property
    def zero(self) -> float:
        """Fraction of values that are exactly zero already."""
        return self.range.exact_zero_fraction

    @property
    def max_safe_scale(self) -> float | None:
        """``2.0 ** safe_scale_log2`` (inf beyond the float64 range), or None."""
        if self.safe_scale_log2 is None:
            return None
        return 2.0 ** self.safe_scale_log2 if self.safe_scale_log2 < 1024 else math.inf


@dataclasses.dataclass(frozen=True)
class GradReport:
    """Result of :func:`grad_report`; ``str()`` gives a table, :meth:`histogram` a figure.

    Attributes:
        fmt: the :class:`~mixprec.formats.FloatFormat` checked against.
        scale: the scale gradients were multiplied by.
        params: per-parameter :class:`ParamGradStats`, in ``named_parameters()`` order.
        total: the same statistics over all gradient values.
        without_grad: names of parameters whose ``.grad`` is None.
        underflow_at_safe_scale: fraction of all values that would still underflow at the
            largest safe scale of the whole model (``total.max_safe_scale``); None if there is none.
        log2_counts: name -> (lowest k, counts): how many finite nonzero values of ``g * scale``
            have ``floor(log2|g * scale|) == k``, for consecutive k.
    """

    fmt: FloatFormat
    scale: float
    params: tuple[ParamGradStats, ...]
    total: ParamGradStats
    without_grad: tuple[str, ...]
    underflow_at_safe_scale: float | None
    log2_counts: dict[str, tuple[int, tuple[int, ...]]] = dataclasses.field(repr=False)

    def __getitem__(self, name: str) -> ParamGradStats:
        for stats in self.params:
            if stats.name == name:
                return stats
        raise KeyError(f"no parameter {name!r} with a gradient; "
                       f"have: {[s.name for s in self.params]}")

    def __str__(self) -> str:
        return _table(self)

    def histogram(self, path: Any, param: str | None = None) -> Any:
        """Save a PNG histogram of ``log2|g * scale|`` with the format's range marked.

        Args:
            path: file to write (anything ``matplotlib``'s ``savefig`` accepts).
            param: one parameter's name; None for all gradient values.

        Returns:
            ``path``.

        Raises:
            KeyError: ``param`` is not a parameter with a gradient.
            ImportError: matplotlib is not installed.
        """
        stats = self.total if param is None else self[param]
        lo, counts = self.log2_counts[stats.name]
        _plot_histogram(path, lo, counts, stats, self.fmt, self.scale)
        return path


def _log2_counts(values: torch.Tensor) -> torch.Tensor:
    """Counts of floor(log2|v|) + _LOG2_OFFSET for the finite nonzero float64 values."""
    v = values[torch.isfinite(values) & (values != 0)]
    _, exp = torch.frexp(v.abs())
    return torch.bincount((exp - 1 + _LOG2_OFFSET).to(torch.int64), minlength=2 * _LOG2_OFFSET)


def _safe_scale_log2(max_abs: float, fmt: FloatFormat) -> int | None:
    """Largest k with ``max_abs * 2**k`` finite after rounding to ``fmt``."""
    if not (max_abs > 0 and math.isfinite(max_abs)):
        return None

    def fits(k: int) -> bool:
        try:
            return not formats.decompose(math.ldexp(max_abs, k), fmt).overflow
        except OverflowError:
            return False

    k = math.floor(math.log2(fmt.max) - math.log2(max_abs))
    while not fits(k):
        k -= 1
    while fits(k + 1):
        k += 1
    return k


def _grad_values(param: nn.Parameter) -> torch.Tensor:
    grad = param.grad.detach()
    return grad.coalesce().values() if grad.is_sparse else grad


def _stats(name: str, grad: torch.Tensor, fmt: FloatFormat,
           scale: float) -> tuple[ParamGradStats, torch.Tensor]:
    g64 = grad.reshape(-1).to(torch.float64)
    finite = g64[torch.isfinite(g64)]
    max_abs = float(finite.abs().max()) if finite.numel() else 0.0
    report = formats.range_report(g64, fmt, scale=scale)
    stats = ParamGradStats(name=name, numel=g64.numel(), dtype=formats.get(grad.dtype).name,
                           max_abs=max_abs, range=report,
                           safe_scale_log2=_safe_scale_log2(max_abs, fmt))
    return stats, _log2_counts(g64 * scale)


def _trim(counts: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    nonzero = torch.nonzero(counts).flatten()
    if nonzero.numel() == 0:
        return 0, ()
    lo, hi = int(nonzero[0]), int(nonzero[-1])
    return lo - _LOG2_OFFSET, tuple(counts[lo:hi + 1].tolist())


def grad_report(model: nn.Module, fmt: Any = "fp16", scale: float | None = None) -> GradReport:
    """Check a model's current gradients against a floating-point format.

    For each parameter with a ``.grad``, the gradient (taken to float64 and multiplied by
    ``scale``) is rounded to ``fmt``: the report gives the fractions that would underflow to
    zero, be subnormal, or overflow (be inf/NaN in ``fmt``, including values that are inf/NaN
    already), and the largest power-of-two scale at which the largest finite ``|g|`` still
    fits. This models scaling the loss (gradients scale with it); values inside
    the backward pass may be larger. Reads every gradient (a host-device sync on CUDA).

    Args:
        model: the module whose parameters' ``.grad`` to inspect (after ``backward()``).
        fmt: format name, torch dtype or :class:`~mixprec.formats.FloatFormat` (default fp16).
        scale: loss scale to apply first; None means 1.

    Returns:
        A :class:`GradReport`. ``print(report)`` shows a table; ``report.histogram("g.png")``
        saves the figure.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: no parameter has a gradient, unknown format, or a bad scale.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> grad_report(model, "fp16").total.underflow
        0.0
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"grad_report needs an nn.Module; got {type(model).__name__}")
    fmt = formats.get(fmt)
    scale = formats.check_scale(1.0 if scale is None else scale)
    named = list(model.named_parameters())
    with_grad = [(n, p) for n, p in named if p.grad is not None]
    if not with_grad:
        raise ValueError(f"grad_report: none of the {len(named)} parameters of "
                         f"{type(model).__name__} has a gradient (every .grad is None); "
                         "call loss.backward() first")
    params, hists = [], {}
    total_counts = torch.zeros(2 * _LOG2_OFFSET, dtype=torch.int64)
    for name, p in with_grad:
        stats, counts = _stats(name, _grad_values(p), fmt, scale)
        params.append(stats)
        hists[name] = _trim(counts)
        total_counts += counts
    total = _total(params, fmt)
    hists[total.name] = _trim(total_counts)
    return GradReport(fmt=fmt, scale=scale, params=tuple(params), total=total,
                      without_grad=tuple(n for n, p in named if p.grad is None),
                      underflow_at_safe_scale=_underflow_at(with_grad, total, fmt),
                      log2_counts=hists)


def _total(params: list[ParamGradStats], fmt: FloatFormat) -> ParamGradStats:
    max_abs = max(s.max_abs for s in params)
    dtypes = sorted({s.dtype for s in params})
    return ParamGradStats(name="(all)", numel=sum(s.numel for s in params), dtype="/".join(dtypes),
                          max_abs=max_abs, range=RangeReport.combine([s.range for s in params]),
                          safe_scale_log2=_safe_scale_log2(max_abs, fmt))


def _underflow_at(with_grad, total: ParamGradStats, fmt: FloatFormat) -> float | None:
    """Fraction of all values underflowing at the model's largest safe scale."""
    if total.safe_scale_log2 is None or total.numel == 0:
        return None
    safe = total.max_safe_scale
    if not math.isfinite(safe):
        return None
    reports = [formats.range_report(_grad_values(p), fmt, scale=safe) for _, p in with_grad]
    return RangeReport.combine(reports).underflow_fraction


def _pow2(k: int | None) -> str:
    return "-" if k is None else f"2^{k}"


def _table(report: GradReport) -> str:
    header = ("parameter", "numel", "dtype", "max|g|", "zero", "underflow", "subnormal", "overflow",
              "max safe scale")
    rows = [header]
    for s in (*report.params, report.total):
        max_abs = "-" if s.numel and s.nonfinite == 1 else f"{s.max_abs:.3g}"
        rows.append((s.name, f"{s.numel:,}", s.dtype, max_abs, f"{s.zero:.2%}",
                     f"{s.underflow:.2%}", f"{s.subnormal:.2%}", f"{s.overflow:.2%}",
                     _pow2(s.safe_scale_log2)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    rule = "-" * len(lines[0])
    lines[1:1] = [rule]
    lines.insert(len(lines) - 1, rule)
    title = (f"gradients x {report.scale:g} -> {report.fmt.name} "
             f"({report.total.numel:,} values in {len(report.params)} parameters)")
    notes = []
    if report.without_grad:
        notes.append(f"{len(report.without_grad)} parameters without .grad: "
                     + ", ".join(report.without_grad[:5])
                     + (" ..." if len(report.without_grad) > 5 else ""))
    if report.total.range.nonfinite:
        notes.append(f"{report.total.range.nonfinite:,} gradient values "
                     f"({report.total.nonfinite:.2%}) are already inf/NaN, counted under "
                     f"'overflow' (no scale makes them finite)")
    if report.underflow_at_safe_scale is not None:
        notes.append(f"at the largest safe scale {_pow2(report.total.safe_scale_log2)}, "
                     f"{report.underflow_at_safe_scale:.2%} of the values would still underflow")
    return "\n".join([title, *lines, *notes])


def _plot_histogram(path: Any, lo: int, counts: tuple[int, ...], stats: ParamGradStats,
                    fmt: FloatFormat, scale: float) -> None:
    """Bars of floor(log2|g|) as a percentage of all values, the format's range shaded."""
    try:  # object-oriented matplotlib on the Agg canvas: no pyplot, no global backend change
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("GradReport.histogram needs matplotlib: pip install matplotlib") from exc
    fig = Figure(figsize=(9, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    n = max(stats.numel, 1)
    edges = [lo + i for i in range(len(counts))]
    ax.bar(edges, [100 * c / n for c in counts], width=1.0, align="edge", color="tab:blue",
           edgecolor="white", linewidth=0.3, label="gradient values")
    sub, normal, top = math.log2(fmt.min_subnormal), math.log2(fmt.min_normal), math.log2(fmt.max)
    left = min([sub - 8, *edges])
    right = max([top + 2, *(e + 1 for e in edges)])
    ax.axvspan(left, sub - 1, color="tab:red", alpha=0.12, label=f"underflow to 0 in {fmt.name}")
    ax.axvspan(sub, normal, color="tab:orange", alpha=0.12, label="subnormal")
    ax.axvspan(top, right, color="tab:purple", alpha=0.12, label="overflow")
    for x, text in ((sub, f"min subnormal 2^{sub:.0f}"), (normal, f"min normal 2^{normal:.0f}"),
                    (top, f"max {fmt.max:.6g}")):
        ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
        ax.annotate(text, (x, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                    ha="right", fontsize=8)
    ax.set_xlim(left, right)
    ax.set_xlabel(f"log2 |gradient x {scale:g}|")
    ax.set_ylabel("% of all values")
    ax.set_title(f"{stats.name}: {stats.numel:,} values in {fmt.name} "
                 f"(zero {stats.zero:.1%}, underflow {stats.underflow:.1%}, "
                 f"overflow {stats.overflow:.1%})", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
