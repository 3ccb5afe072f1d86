"""The plots of the ``mixprec report`` page (:mod:`.report`): each a PNG drawn with matplotlib
(imported when a plot is drawn, with the Agg backend) and returned base64-encoded for inlining,
or None where the run recorded nothing to draw."""

from __future__ import annotations

import base64
import io
import math

from .run import Run

__all__ = ["loss_plot", "norm_plot", "heatmap", "fp8_plot"]


def _pyplot():
    import matplotlib  # optional: the demo extra
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    _pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def loss_plot(run: Run) -> str | None:
    loss, scale = run.get("loss"), run.get("loss_scale")
    if not loss and not scale:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    if loss:
        ax.plot(*zip(*loss), color="tab:blue", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    for i, s in enumerate(run.skip_steps()):
        ax.axvline(s, color="tab:red", alpha=0.5, linewidth=1,
                   label="skipped step(s) since the last record" if i == 0 else None)
    if scale:
        twin = ax.twinx()
        twin.step(*zip(*scale), where="post", color="tab:orange", label="loss scale")
        twin.set_yscale("log", base=2)
        twin.set_ylabel("loss scale", color="tab:orange")
    handles = [h for a in fig.axes for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8)
    ax.set_title("Loss and loss scale")
    return _png(fig)


def norm_plot(run: Run) -> str | None:
    norm = [(s, v) for s, v in run.get("grad_norm") if math.isfinite(v) and v > 0]
    if not norm:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 2.6))
    ax.plot(*zip(*norm), color="tab:green")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title("True gradient norm (unscaled, before clipping)")
    return _png(fig)


def heatmap(run: Run, stat: str, title: str, cmap: str, vmin=None, vmax=None,
            label: str = "") -> str | None:
    names, rows = run.matrix(stat)
    if not names:
        return None
    import numpy as np
    plt = _pyplot()
    data = np.ma.masked_invalid(np.array(rows, dtype=float))
    if vmax is None:  # a scale that shows small fractions, and all-zero rows as zero
        vmax = max(float(data.max()) if data.count() else 0.0, 0.05)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.16 * len(names)))
    steps = run.steps
    half = (steps[1] - steps[0]) / 2 if len(steps) > 1 else 0.5
    # grey: not measured (a skipped step, or no gradient)
    colors = plt.get_cmap(cmap).with_extremes(bad="#d0d0d0")
    image = ax.imshow(data, aspect="auto", cmap=colors, vmin=vmin, vmax=vmax,
                      interpolation="nearest",
                      extent=(steps[0] - half, steps[-1] + half, len(names) - 0.5, -0.5))
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=max(4, min(8, 400 // max(len(names), 1))))
    ax.set_xlabel("step")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=label, fraction=0.03, pad=0.01)
    return _png(fig)


def fp8_plot(run: Run) -> str | None:
    names = [n for n in run.series if n.endswith("_scale") and "/fp8_" in n]
    if not names:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3))
    for n in names[:12]:
        ax.plot(*zip(*run.series[n]), label=n.removeprefix("mixprec/"), linewidth=1)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.legend(fontsize=6, ncol=2)
    ax.set_title("FP8 scales (fmax / amax)")
    return _png(fig)
