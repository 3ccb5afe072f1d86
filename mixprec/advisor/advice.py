"""``Advice``: which layers can take which format, why not, and the policy that follows.

A layer is *unsafe* in a format when a measurement says so (see :class:`Thresholds`): values
that leave the format's range (overflow: beyond its largest value; underflow: nonzero values
flushed to zero), or an output or weight-gradient error well above what the format's rounding
gives an ordinary layer. Each unsafe layer carries its reasons. The sensitivity a table sorts
by is the loss change the layer causes alone in the format.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from .. import lowbit, vocabulary
from ..dtypes import to_dtype
from ..fp8 import speed
from ..policy import Policy
from ..precision import OFF, Precision
from ..precision_map import PrecisionMap
from .measure import SIXTEEN, Measurement, format_names, lowbit_formats
from .report import format_table, plot_advice

__all__ = ["Thresholds", "LayerAdvice", "Advice"]

_FP32 = torch.float32


def _lowbit_limits(which: int) -> dict[str, float]:
    """Each low-bit format's own output (0) or weight-gradient (1) error limit."""
    return {cls.advisor_format: cls.advisor_limits[which] for cls in lowbit.formats().values()}


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When a measurement makes a layer unsafe in a format.

    Attributes:
        max_overflow: fraction of values beyond the format's range (16-bit: beyond its largest
            finite value; FP8: saturated after the dynamic scale), inf/NaN included.
        max_underflow: fraction of nonzero values flushed to zero (16-bit: inputs, outputs,
            and gradients at the loss scale; FP8: inputs, weights and output gradients after
            their dynamic scales).
        max_out_error: per format, the largest relative output error
            ``||y_fmt - y|| / ||y||``.
        max_grad_error: per format, the largest relative weight-gradient error.

    The limits sit well above what the formats' rounding gives ordinary layers, so a layer is
    flagged for what sets it apart: output errors measure ~0.3% in bf16, ~0.04% in fp16 and
    ~2-4% in FP8 e4m3 (Hugging Face's GPT-2, a trained small transformer, the demo's CNN);
    weight-gradient errors ~0.2%, ~0.03% and ~2-6% for Linear and conv layers, but up to 13% in
    bf16 (0.4% in fp16) for norm layers' weights, whose gradient is a sum over every token in
    which the terms largely cancel (O2 keeps norm layers in fp32 for this). Each low-bit
    format sets its own limits (:attr:`mixprec.lowbit.LowBitFormat.advisor_limits`): 15% and
    25% for FP8 and MXFP8 (MXFP8's ordinary layers measure ~2-4%, as FP8's), 40% and 60% for
    NVFP4 (its e2m1 elements: ordinary layers measure ~8-14% output error).
    """

    max_overflow: float = 0.0
    max_underflow: float = 0.01
    max_out_error: dict = dataclasses.field(default_factory=lambda: {
        "bf16": 0.05, "fp16": 0.02, **_lowbit_limits(0)})
    max_grad_error: dict = dataclasses.field(default_factory=lambda: {
        "bf16": 0.25, "fp16": 0.05, **_lowbit_limits(1)})


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def judge(fmt: str, m: Measurement, th: Thresholds, scale: float) -> list[str]:
    """The reasons ``m`` makes a layer unsafe in ``fmt`` (empty: safe)."""
    reasons = []
    limit = f"{fmt}'s max {torch.finfo(SIXTEEN[fmt]).max:g}" if fmt in SIXTEEN else \
        f"the {fmt} range after scaling"
    at = f" at loss scale {scale:g}" if scale != 1.0 else ""
    for role, frac in m.overflow.items():
        if frac > th.max_overflow:
            grad = at if "grad" in role else ""
            reasons.append(f"{role} overflow: {_pct(frac)} of values beyond {limit}{grad} "
                           f"(largest {m.amax.get(role, math.nan):.3g})")
    for role, frac in m.underflow.items():
        if frac > th.max_underflow:
            grad = at if "grad" in role else ""
            reasons.append(f"{role} underflow: {_pct(frac)} of nonzero values flush to zero "
                           f"in {fmt}{grad}")
    out_limit = th.max_out_error.get(fmt, math.inf)
    if m.out_error > out_limit or not math.isfinite(m.out_error):
        reasons.append(f"output error {_pct(m.out_error)} > {_pct(out_limit)}")
    grad_limit = th.max_grad_error.get(fmt, math.inf)
    if m.grad_error is not None and (m.grad_error > grad_limit
                                     or not math.isfinite(m.grad_error)):
        reasons.append(f"weight-gradient error {_pct(m.grad_error)} > {_pct(grad_limit)}")
    return reasons


@dataclasses.dataclass
class LayerAdvice:
    """One layer: its measurements and verdict per format.

    Attributes:
        name: qualified name (as ``named_modules()`` gives it).
        kind: the module's class name.
        fp8_eligible: whether an FP8 policy can convert it (Linear/Conv1D, dimensions multiples
            of 16; see :mod:`mixprec.fp8.choice`).
        measurements: ``{format: Measurement}`` for the formats it can run in.
        reasons: ``{format: [reason, ...]}``, empty lists where it is safe.
        eligible: ``{low-bit format: whether a policy in it can convert the layer}`` (MXFP8:
            dimensions multiples of 32).
        gemm: ``(tokens, in_features, out_features)`` of a Linear or Conv1D layer's GEMM on the
            batch measured (tokens: the rows of its input), else None.
    """

    name: str
    kind: str
    fp8_eligible: bool
    measurements: dict
    reasons: dict
    eligible: dict = dataclasses.field(default_factory=dict)
    gemm: tuple | None = None

    def fp8_speed(self, device: str = "cuda-sm90") -> float | None:
        """The expected speed of this layer's GEMMs in FP8 relative to bf16 on a device class
        (see :mod:`mixprec.fp8.speed`: an estimate from the shape, not calibrated on a GPU in
        this release), at the batch's tokens; None for a layer without a GEMM, or a device
        where FP8 is emulated ("cpu")."""
        if self.gemm is None:
            return None
        tokens, k, n = self.gemm
        return speed.estimate(k, n, device, tokens)

    def unsafe(self, fmt: str) -> bool:
        return bool(self.reasons.get(fmt))

    def sensitivity(self, fmt: str) -> float:
        """The loss change this layer alone causes in ``fmt`` (measured when an ablation ran,
        else the first-order estimate); NaN where it can't run in ``fmt``."""
        m = self.measurements.get(fmt)
        if m is None:
            return math.nan
        return m.measured_loss_change if m.measured_loss_change is not None else m.loss_change


@dataclasses.dataclass
class Advice:
    """What :func:`mixprec.advise` measured, and what follows from it.

    Attributes:
        layers: one :class:`LayerAdvice` per measured layer, in model order.
        formats: the formats measured.
        loss: the fp32 loss on the batch.
        loss_scales: ``{format: loss scale}`` used for gradient ranges.
        fp8_recipe: the FP8 recipe "fp8_e4m3" measured ("tensorwise", "rowwise",
            "rowwise_gw_hp").
        thresholds: the :class:`Thresholds` applied.
        cost: passes and seconds the measurement took.
        skipped: ``{layer: why}`` for layers not measured (not called, no tensor output).
        loss_scale: the ``loss_scale`` argument: ``"auto"`` (fp16 gradients judged where
            dynamic scaling settles on the batch), a fixed number, or None.
    """

    layers: list
    formats: tuple
    loss: float
    loss_scales: dict
    fp8_recipe: str
    thresholds: Thresholds
    cost: dict
    skipped: dict
    loss_scale: Any = "auto"

    def _check(self, fmt: str) -> None:
        if fmt not in self.formats:
            known = format_names()
            if fmt not in known:
                raise ValueError(f"unknown format {fmt!r}: this advice measured "
                                 f"{list(self.formats)}; mp.advise measures any of "
                                 f"{list(known)}")
            raise ValueError(f"this advice measured {list(self.formats)}, not {fmt!r}: run "
                             f"mp.advise(..., formats=(..., {fmt!r}))")

    def unsafe(self, fmt: str) -> list[str]:
        """Names of the layers that must not run in ``fmt`` (model order); :meth:`reasons`
        says why.

        Raises:
            ValueError: ``fmt`` was not measured.
        """
        self._check(fmt)
        return [a.name for a in self.layers if a.unsafe(fmt)]

    def reasons(self, fmt: str) -> dict[str, str]:
        """``{layer: why it is unsafe in fmt}`` for the unsafe layers."""
        self._check(fmt)
        return {a.name: "; ".join(a.reasons[fmt]) for a in self.layers if a.unsafe(fmt)}

    def ranking(self, fmt: str) -> list[str]:
        """The layers that can run in ``fmt``, most sensitive first."""
        self._check(fmt)
        able = [a for a in self.layers if fmt in a.measurements]
        return [a.name for a in sorted(able, key=lambda a: -a.sensitivity(fmt))]

    def fp8_gains(self, device: str = "cpu", dtype="bf16") -> tuple[list[str], str]:
        """The layers FP8 pays for on a device class, and why (or why none does).

        A layer is advised FP8 when an FP8 policy can convert it, it is safe in FP8 and in the
        16-bit ``dtype``, and its estimated speed on ``device`` (:meth:`LayerAdvice.fp8_speed`,
        at the batch's tokens) is at least bf16's. None is on a CPU (FP8 is emulated there,
        slower), on a GPU without FP8 tensor cores, or where every layer is too small to gain.

        Args:
            device: "cpu", "cuda-sm89", "cuda-sm90" or "cuda-sm100" (see
                :func:`mixprec.fp8.speed.device_class`).
            dtype: the 16-bit format of the policy ("fp32": no 16-bit verdict).

        Returns:
            ``(names in model order, why)``.
        """
        if "fp8_e4m3" not in self.formats:
            return [], "fp8_e4m3 was not measured"
        if device not in speed.FIGURES:
            where = "a CPU" if device == "cpu" else f"{device} (no FP8 tensor cores)"
            return [], (f"FP8 is emulated on {where}: slower than bf16, never advised for speed "
                        f"(the fp8 columns give its numerics)")
        low = to_dtype(dtype, what="dtype")
        fmt16 = next((k for k, v in SIXTEEN.items() if v == low), None)
        able = [a for a in self.layers if a.eligible.get("fp8_e4m3") and not a.unsafe("fp8_e4m3")
                and (fmt16 is None or not a.unsafe(fmt16))]
        gains = [a.name for a in able if (a.fp8_speed(device) or 0.0) >= 1.0]
        if gains:
            return gains, (f"{len(gains)} of {len(able)} layers that can take FP8 safely are "
                           f"estimated to run faster in it than in bf16 on {device}")
        if not able:
            return [], "no layer can take FP8 safely"
        best = max(able, key=lambda a: a.fp8_speed(device) or 0.0)
        tokens, k, n = best.gemm
        return [], (f"no layer is large enough to gain from FP8 on {device}: the best, {best.name} "
                    f"({tokens} x {k} -> {n}), is estimated at {best.fp8_speed(device):.2f}x bf16")

    def precision_map(self, dtype="bf16", fp8=None, *, fp8_layers=None) -> PrecisionMap:
        """The advisor's decisions as a :class:`mixprec.PrecisionMap`, by qualified name: each
        layer unsafe in the 16-bit ``dtype`` computes in fp32 (``Precision("fp32")``); with
        ``fp8``, each layer the format can convert that is safe in it (and in ``dtype``) runs it
        (``Precision(gemm=fmt)``), and each one it could convert that is unsafe in it stays
        out (``Precision(gemm="off")``). With ``fp8`` and no layer of either kind, the map
        holds ``{nn.Module: Precision(gemm="off")}``: no layer runs low-bit. The layers named
        can include the model's first and last GEMM layer, which ``prepare``'s default choice
        keeps in 16 bits by convention (Accelerate, Megatron: stability over long runs, which
        one batch cannot measure).

        Args:
            dtype: "bf16", "fp16" (it must have been measured) or "fp32" (no 16-bit verdict).
            fp8: None, or a low-bit format (:mod:`mixprec.lowbit`) or its shorthand
                ("tensorwise", "rowwise", "rowwise_gw_hp", "mxfp8", "nvfp4"); it needs its
                advisor format measured ("fp8_e4m3" with the recipe, "mxfp8", "nvfp4").
            fp8_layers: None, or the only layers that may run ``fp8`` (the others it could
                convert stay out), such as the first list :meth:`fp8_gains` returns.

        Raises:
            ValueError: a format that was not measured, a bad dtype, an FP8 recipe other than
                the one measured.
        """
        low = to_dtype(dtype, what="dtype")
        if low == _FP32:
            unsafe = []
        else:
            names = [k for k, v in SIXTEEN.items() if v == low]
            if not names:
                raise ValueError(f"dtype must be 'bf16', 'fp16' or 'fp32'; got {dtype!r}")
            unsafe = self.unsafe(names[0])
        entries = {n: Precision(_FP32) for n in unsafe}
        fmt = lowbit.resolve(fp8)
        if fmt is not None:
            measured = fmt.advisor_format
            self._check(measured)
            seen = lowbit_formats((measured,), self.fp8_recipe)[measured]
            if not fmt.measured_by(seen):
                raise ValueError(fmt.unmeasured(seen))
            for a in self.layers:
                if a.eligible.get(measured) and a.name not in unsafe:
                    out = a.unsafe(measured) or (fp8_layers is not None
                                                 and a.name not in fp8_layers)
                    entries[a.name] = Precision(gemm=OFF if out else fmt)
            if not any(v.gemm is not None for v in entries.values()):
                entries[nn.Module] = Precision(gemm=OFF)
        return PrecisionMap(entries)

    @vocabulary.takes("level", "dtype", "fp8", differs={
        "level": ("O2", "the level whose per-layer choices the advice refines: 16-bit weights, "
                        "norms in fp32, masters"),
        "dtype": ("bf16", '"auto" has no device here: the dtype must be one the advice '
                          "measured, and bf16 is measured by default")}, notes={
        "dtype": '"bf16" or "fp16" only, measured.',
        "fp8": "Its verdicts must have been measured (see :meth:`precision_map`)."})
    def policy(self, level: str = vocabulary.Default("O2"), dtype=vocabulary.Default("bf16"),
               fp8: str | None = None, *, fp8_layers=None) -> Policy:
        """The level's policy with the advisor's decisions (:meth:`precision_map`) as its
        ``modules`` map, after the level's own entries (O2: norm layers in fp32).

        Args:
            {precision keywords}
            fp8_layers: None, or the only layers that may run ``fp8`` (see
                :meth:`precision_map`; :meth:`fp8_gains` says which pay on a device).

        Raises:
            ValueError: a format that was not measured, a bad level or dtype, an FP8 recipe
                other than the one measured.
        """
        base = Policy.from_level(level, dtype, warn=False)
        decisions = self.precision_map(base.compute_dtype, fp8, fp8_layers=fp8_layers)
        return dataclasses.replace(base, modules=base.modules.updated(decisions),
                                   fp8=lowbit.resolve(fp8))

    def _sort_format(self, sort_by: str | None) -> str:
        if sort_by is None:
            return self.formats[-1]
        self._check(sort_by)
        return sort_by

    def rows(self, sort_by: str | None = None) -> list[LayerAdvice]:
        """The layers sorted by sensitivity in ``sort_by`` (default: the last format
        measured); layers that can't run in it follow, by the formats before it."""
        order = [self._sort_format(sort_by)] + [f for f in reversed(self.formats)]

        def key(a: LayerAdvice):
            for i, fmt in enumerate(order):
                s = a.sensitivity(fmt)
                if not math.isnan(s):
                    return (i, -s)
            return (len(order), 0.0)
        return sorted(self.layers, key=key)

    def fp8_speed(self, device: str = "cuda-sm90") -> dict[str, float | None]:
        """``{layer: expected FP8 speed vs bf16}`` on a device class ("cuda-sm89",
        "cuda-sm90" -- H100/H200 --, "cuda-sm100"; "cpu": None everywhere, FP8 is emulated
        there and never faster), from each layer's GEMM shape at the batch's tokens: an
        estimate, not calibrated on a GPU in this release (see :mod:`mixprec.fp8.speed`)."""
        return {a.name: a.fp8_speed(device) for a in self.layers}

    def speed_table(self, device: str = "cuda-sm90") -> str:
        """One line per GEMM layer: its shape and expected FP8 speed vs bf16 on ``device``."""
        lines = [f"expected FP8 speed vs bf16 on {device}, from the GEMM shapes (an estimate, "
                 f"not calibrated on a GPU in this release)"]
        for a in self.layers:
            if a.gemm is None:
                continue
            x = a.fp8_speed(device)
            tokens, k, n = a.gemm
            verdict = ("emulated: slower" if x is None else
                       f"{x:.2f}x" + ("" if x >= 1.0 else "  (slower than bf16)"))
            lines.append(f"  {a.name}: {tokens} x {k} -> {n}: {verdict}")
        return "\n".join(lines)

    def table(self, sort_by: str | None = None) -> str:
        """One row per layer, most sensitive first (see :meth:`rows`): per format the output
        error and the loss change; the reasons of unsafe layers below."""
        return format_table(self, self.rows(sort_by))

    def plot(self, path):
        """Save a bar chart of each layer's loss change per format (unsafe ones marked).

        Raises:
            ImportError: matplotlib is not installed.
        """
        return plot_advice(self, path)

    def to_dict(self) -> dict:
        """Plain data (JSON-serialisable)."""
        def measurement(m: Measurement) -> dict:
            return dataclasses.asdict(m)
        return {
            "loss": self.loss, "formats": list(self.formats), "fp8_recipe": self.fp8_recipe,
            "loss_scales": dict(self.loss_scales), "loss_scale": self.loss_scale,
            "cost": dict(self.cost),
            "thresholds": dataclasses.asdict(self.thresholds), "skipped": dict(self.skipped),
            "layers": [{"name": a.name, "kind": a.kind, "fp8_eligible": a.fp8_eligible,
                        "eligible": dict(a.eligible),
                        "gemm": None if a.gemm is None else list(a.gemm),
                        "fp8_speed_sm90": a.fp8_speed("cuda-sm90"),
                        "formats": {f: {**measurement(m), "unsafe": a.unsafe(f),
                                        "reasons": list(a.reasons[f])}
                                    for f, m in a.measurements.items()}}
                       for a in self.layers]}

    def __str__(self) -> str:
        return self.table()
