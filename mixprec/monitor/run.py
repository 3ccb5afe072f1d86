"""A recorded run as the report reads it (:class:`Run`): the global series, the per-layer ones
and the steps they cover, from what :func:`mixprec.monitor.read_run` returns."""

from __future__ import annotations

import math

__all__ = ["Run"]

_FORMAT_MAX = {"fp16": 65504.0, "bf16": 3.3895313892515355e38, "fp32": 3.4028234663852886e38}
_STATS = ("grad_underflow", "weight_update_lost", "act_headroom", "act_amax")
_STEPS, _SKIPS = "mixprec/steps", "mixprec/skipped_steps"


class Run:
    """A recorded run split into its global series and its per-layer ones.

    Args:
        series: scalar name -> ``[(step, value), ...]`` (what :func:`read_run` returns).
    """

    def __init__(self, series: dict[str, list[tuple[int, float]]]):
        self.series = series
        self.layers: list[str] = []
        for name in series:
            parts = name.split("/")
            if len(parts) >= 3 and parts[0] == "mixprec" and parts[-1] in _STATS:
                layer = "/".join(parts[1:-1])
                if layer not in self.layers:
                    self.layers.append(layer)
        closing = {s for s, _ in series.get(_STEPS, [])}
        skips = {s for s, _ in series.get(_SKIPS, [])}
        measured = {s for name, points in series.items() if name not in (_STEPS, _SKIPS)
                    for s, _ in points}
        #: the recorded steps (a closing record, :meth:`PrecisionMonitor.close`'s, is none)
        self.steps = sorted(measured | (skips - closing))
        counts = series.get(_STEPS, [])
        #: whether :attr:`step_count` is the run's own count (its closing record), or only
        #: the steps up to the last record
        last = max((s for points in series.values() for s, _ in points), default=-1)
        # records after the last closing one (a resumed run that was not closed): counted to
        # the last record
        self.count_exact = bool(counts) and max(self.steps, default=-1) <= counts[-1][0]
        #: the steps the run took: its closing count, else up to the last record
        self.step_count = (int(counts[-1][1]) if self.count_exact
                           else max(last + 1, int(counts[-1][1]) if counts else 0))

    def get(self, name: str) -> list[tuple[int, float]]:
        """The points of ``mixprec/<name>`` (empty when not recorded)."""
        return self.series.get(f"mixprec/{name}", [])

    def layer(self, layer: str, stat: str) -> list[tuple[int, float]]:
        """The points of one layer's statistic."""
        return self.get(f"{layer}/{stat}")

    def matrix(self, stat: str) -> tuple[list[str], list[list[float]]]:
        """Layers that have ``stat``, and their values on :attr:`steps` (NaN where missing)."""
        index = {s: i for i, s in enumerate(self.steps)}
        names, rows = [], []
        for layer in self.layers:
            points = self.layer(layer, stat)
            if not points:
                continue
            row = [math.nan] * len(self.steps)
            for s, v in points:
                row[index[s]] = v
            names.append(layer)
            rows.append(row)
        return names, rows

    def skipped(self) -> float:
        """The steps skipped for inf/NaN gradients, to the end of what the record holds."""
        skips = self.get("skipped_steps")
        return skips[-1][1] if skips else 0.0

    def skip_steps(self) -> list[int]:
        """Recorded steps whose window held a skipped step (the skip count rose)."""
        points, out, before = self.get("skipped_steps"), [], 0.0
        for s, v in points:
            if v > before:
                out.append(s)
            before = v
        return out

    def format_name(self) -> str | None:
        """The training format, from an activation's amax and headroom (None when unknown)."""
        for layer in self.layers:
            amax, room = dict(self.layer(layer, "act_amax")), self.layer(layer, "act_headroom")
            for s, h in room:
                if s in amax and 0 < amax[s] < math.inf and math.isfinite(h):
                    log_max = math.log2(amax[s]) + h  # (log2 of the format's largest value)
                    return min(_FORMAT_MAX,
                               key=lambda k: abs(math.log2(_FORMAT_MAX[k]) - log_max))
        return None
