"""The advice as text (:func:`format_table`) and as a picture (:func:`plot_advice`)."""

from __future__ import annotations

import math

from .measure import describe_scale

__all__ = ["format_table", "plot_advice"]

_SHORT = {"bf16": "bf16", "fp16": "fp16", "fp8_e4m3": "fp8"}


def _num(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.2e}"


def format_table(advice, rows) -> str:
    """One line per layer: kind, and per format the relative output error, the loss change
    and the verdict; then each unsafe layer's reasons."""
    fmts = list(advice.formats)
    header = ["layer", "kind"]
    for f in fmts:
        s = _SHORT.get(f, f)
        header += [f"{s} out err", f"{s} dloss", f"{s}"]
    lines = [header]
    for a in rows:
        cells = [a.name or "(model)", a.kind]
        for f in fmts:
            m = a.measurements.get(f)
            if m is None:
                cells += ["-", "-", "n/a"]
                continue
            cells += [_num(m.out_error), _num(a.sensitivity(f)),
                      "UNSAFE" if a.unsafe(f) else "ok"]
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
    ablated = any(m.measured_loss_change is not None for a in advice.layers
                  for m in a.measurements.values())
    text.append(f"loss {advice.loss:.4g}; dloss: |L_fmt - L| / |L| with only that layer in the "
                f"format ({'measured' if ablated else 'first-order estimate'})")
    if "fp16" in advice.loss_scales:
        text.append(describe_scale(advice.loss_scale, advice.loss_scales["fp16"]))
    for f in fmts:
        for name, why in advice.reasons(f).items():
            text.append(f"  {_SHORT.get(f, f)} unsafe: {name}: {why}")
    for name, why in advice.skipped.items():
        text.append(f"  not measured: {name}: {why}")
    return "\n".join(text)


def plot_advice(advice, path):
    """Horizontal bars of each layer's loss change per format (log scale), unsafe layers in
    red; returns ``path``."""
    try:  # object-oriented matplotlib on the Agg canvas: no pyplot, no global backend change
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("Advice.plot needs matplotlib: pip install matplotlib") from exc
    layers = advice.layers
    fmts = list(advice.formats)
    fig = Figure(figsize=(9, 1.5 + 0.28 * len(layers) * max(1, len(fmts)) / 2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    height = 0.8 / max(1, len(fmts))
    colors = ("tab:blue", "tab:green", "tab:orange", "tab:purple")
    floor = 1e-12
    for j, f in enumerate(fmts):
        ys, xs, edge = [], [], []
        for i, a in enumerate(layers):
            s = a.sensitivity(f)
            if math.isnan(s):
                continue
            ys.append(i + (j - (len(fmts) - 1) / 2) * height)
            xs.append(max(s, floor))
            edge.append("red" if a.unsafe(f) else "none")
        ax.barh(ys, xs, height=height, color=colors[j % len(colors)], edgecolor=edge,
                linewidth=1.5, label=_SHORT.get(f, f), log=True)
    ax.set_yticks(range(len(layers)), [a.name or "(model)" for a in layers], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("|L_fmt - L| / |L| with only that layer in the format (red edge: unsafe)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
