"""``fp8_stats``: what FP8 does to each FP8 layer's tensors while a model trains.

``stats = mp.debug.fp8_stats(model)`` makes every FP8 layer of a prepared model (see
:func:`mixprec.fp8_modules`) record, on each call, the amax, scale, saturation and underflow of
its input, weight and output gradient in their FP8 formats (see :mod:`mixprec.lowbit.stats`; for
MXFP8 layers per 32-value block, with the range of the block scales). The
numbers stay on the device: recording costs a few reductions per layer and call, and no host
sync. Reading them (:meth:`FP8Stats.summary`, :meth:`table`, :meth:`plot`, :meth:`alerts`) is
one host sync per layer. :class:`mixprec.FP8Monitor` reads them from a Trainer every so many
steps and warns about the layers that cross a threshold.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..fp8.convert import fp8_modules, unwrap
from ..lowbit.base import FP8_ATTR
from ..lowbit.stats import ROLES, LayerStats, attach, detach
from ..policy import FP8_RECIPES

__all__ = ["fp8_stats", "FP8Stats", "FP8RangeWarning"]


class FP8RangeWarning(UserWarning):
    """An FP8 layer's tensors saturate or flush to zero beyond a limit
    (:class:`mixprec.FP8Monitor`)."""


def _recorder(module: nn.Module) -> LayerStats:
    """The statistics a converted layer's format keeps (per tensor, per row or per block)."""
    return getattr(module, FP8_ATTR).recorder(module)


class FP8Stats:
    """The statistics of a model's FP8 layers (see the module docstring).

    Use as a handle or a context manager: recording stops at :meth:`close` (or the end of the
    ``with`` block); what was recorded can still be read after.

    Attributes:
        names: the FP8 layers recorded, by qualified name.
    """

    def __init__(self, model: nn.Module):
        root = unwrap(model)
        self.names = fp8_modules(root)
        if not self.names:
            raise ValueError(f"this model has no FP8 layers: prepare it with fp8= (one of "
                             f"{', '.join(map(repr, FP8_RECIPES))}), then record their "
                             f"statistics")
        modules = dict(root.named_modules())
        self._layers = {n: modules[n] for n in self.names}
        self._stats = {n: _recorder(m) for n, m in self._layers.items()}
        for n, m in self._layers.items():
            attach(m, self._stats[n])

    def __enter__(self) -> FP8Stats:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop recording (the numbers recorded so far stay readable)."""
        for n, m in self._layers.items():
            detach(m, self._stats[n])

    def reset(self) -> None:
        """Forget what was recorded (recording goes on)."""
        for s in self._stats.values():
            s.reset()

    def summary(self) -> dict[str, dict]:
        """``{layer: {role: {"amax", "amax_max", "scale", "saturated", "underflow", "calls",
        "format"}}}`` for roles "input", "weight", "grad_output" (one host sync per layer)."""
        return {n: s.read() for n, s in self._stats.items()}

    def to_dict(self) -> dict:
        """:meth:`summary` plus each layer's recipe (plain data)."""
        return {n: {"recipe": str(getattr(self._layers[n], FP8_ATTR)), **roles}
                for n, roles in self.summary().items()}

    def alerts(self, max_saturated: float = 1e-4, max_underflow: float = 0.01) -> list[str]:
        """One line per layer and tensor whose saturated or flushed fraction crossed a limit."""
        lines = []
        for name, roles in self.summary().items():
            for role, e in roles.items():
                if not e["calls"]:
                    continue
                for field, limit in (("saturated", max_saturated), ("underflow", max_underflow)):
                    if e[field] > limit:
                        lines.append(f"{name}: {role} {field} {e[field]:.3%} in {e['format']} "
                                     f"(limit {limit:.3%}; amax {e['amax_max']:.3g})")
        return lines

    def table(self) -> str:
        """One line per layer and tensor: format, amax (last, largest), scale (block-scaled
        formats: of the block with the largest value, and the largest ratio between block
        scales), saturated and flushed fractions, calls."""
        header = ("layer", "tensor", "format", "amax", "amax max", "scale", "scale range",
                  "saturated", "underflow", "calls")
        rows = [header]
        for name, roles in self.summary().items():
            for role, e in roles.items():
                rows.append((name, role, e["format"], f"{e['amax']:.3g}",
                             f"{e['amax_max']:.3g}", f"{e['scale']:.3g}",
                             f"{e['scale_range']:.3g}",
                             f"{e['saturated']:.3%}", f"{e['underflow']:.3%}",
                             str(e["calls"])))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                         for r in rows)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: Any) -> Any:
        """Save a chart: per layer, the flushed-to-zero fraction of each tensor (bars) and its
        largest amax (points, log scale). Returns ``path``.

        Raises:
            ImportError: matplotlib is not installed.
        """
        try:  # object-oriented matplotlib on the Agg canvas: no pyplot, no global backend
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise ImportError("FP8Stats.plot needs matplotlib: pip install matplotlib") from exc
        summary = self.summary()
        names = list(summary)
        fig = Figure(figsize=(10, 2.5 + 0.3 * len(names)))
        FigureCanvasAgg(fig)
        under, amax = fig.subplots(1, 2, sharey=True)
        width = 0.8 / len(ROLES)
        for j, role in enumerate(ROLES):
            ys = [i + (j - 1) * width for i in range(len(names))]
            under.barh(ys, [100 * summary[n][role]["underflow"] for n in names], height=width,
                       label=role)
            amax.scatter([max(summary[n][role]["amax_max"], 1e-30) for n in names],
                         range(len(names)), label=role, s=14)
        under.set_yticks(range(len(names)), names, fontsize=7)
        under.invert_yaxis()
        under.set_xlabel("% of nonzero values flushed to zero")
        amax.set_xscale("log")
        amax.set_xlabel("largest |value| seen (amax)")
        under.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path


def fp8_stats(model: nn.Module) -> FP8Stats:
    """Record FP8 statistics of every FP8 layer of ``model`` from now on.

    Args:
        model: a model prepared with ``fp8=`` (plain, DDP-wrapped or FSDP-sharded).

    Returns:
        An :class:`FP8Stats` (also a context manager that stops recording on exit).

    Raises:
        ValueError: the model has no FP8 layers.

    Example:
        >>> stats = mp.debug.fp8_stats(model)  # doctest: +SKIP
        >>> train(model); print(stats.table()); stats.close()  # doctest: +SKIP
    """
    return FP8Stats(model)
