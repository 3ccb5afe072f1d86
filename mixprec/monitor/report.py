"""``mixprec report``: one static HTML page from a recorded run.

The page is self-contained (plots are PNGs inlined as base64, drawn with matplotlib; no script,
no external file): loss and loss scale with skipped steps marked, the gradient norm, layer x step
heatmaps of gradient underflow, update lost and activation headroom, and a short list of what to
do, in words, derived from the same numbers (:func:`advice`).
"""

from __future__ import annotations

import html
import math
import os
import pathlib
import statistics

from .plots import fp8_plot, heatmap, loss_plot, norm_plot
from .run import Run
from .writers import read_run

__all__ = ["write_report", "render", "advice", "Run", "read_record", "summary_rows",
           "summary_text", "worst_layers"]

# what the advice calls a problem
LOST_LIMIT = 0.25         # a layer losing this much of its updates, on average from some step on
UNDERFLOW_LIMIT = 0.01    # of its nonzero gradients below the smallest normal
HEADROOM_LIMIT = 2.0      # binades between the largest activation and the format's max
SCALE_DROP = 2.0 ** 8     # the loss scale falling this far below its largest value


# -- advice in words -------------------------------------------------------------------------------
def advice(run: Run) -> list[str]:
    """What to do, in words, one line per finding (a line saying nothing was found otherwise,
    or that the run holds no mixprec scalars to judge)."""
    if not _mixprec_names(run.series):
        return [_NOTHING_TO_JUDGE]
    found = _scale_advice(run) + _lost_advice(run) + _underflow_advice(run) + _range_advice(run)
    if not found:
        found.append("No precision problem was seen in the recorded steps: no layer lost more "
                     f"than {LOST_LIMIT:.0%} of its updates, no gradient underflow above "
                     f"{UNDERFLOW_LIMIT:.0%}, activations at least {HEADROOM_LIMIT:g} binades "
                     "below the format's largest value.")
    return found


def _scale_advice(run: Run) -> list[str]:
    out = []
    scale = [(s, v) for s, v in run.get("loss_scale") if math.isfinite(v) and v > 0]
    skips = run.get("skipped_steps")
    if scale:
        peak_step, peak = max(scale, key=lambda p: p[1])
        low_step, low = min(((s, v) for s, v in scale if s >= peak_step), key=lambda p: p[1])
        if peak / low >= SCALE_DROP:
            out.append(f"The loss scale collapsed from {peak:g} (step {peak_step}) to {low:g} "
                       f"(step {low_step}): some op overflows in the training format. Find it "
                       "with mp.debug.trace_nonfinite and keep it in fp32 (keep_fp32=, "
                       "fp32_ops=), or train in bf16.")
    if skips and run.step_count:
        total, steps = run.skipped(), _steps_text(run)
        if total > 0.02 * run.step_count:  # (the documented rule: more than 2% of steps)
            out.append(f"{total:g} of {steps} steps were skipped for inf/NaN gradients "
                       f"({total / run.step_count:.0%}): each is a batch the model did not "
                       f"learn from. {_skip_cure(run, scale)}")
    return out


def _skip_cure(run: Run, scale: list[tuple[int, float]]) -> str:
    """What avoids skipped steps where the loss was scaled: starting at the scale the run
    settled at (a dynamic scale skips each step on its way down), fewer growth attempts (each
    that overflows is a skip), bf16; where it was not (bf16 or fp32: no scale above 1
    recorded), the inf/NaN came from the loss, the inputs or the forward, which no scale
    setting changes."""
    if not any(v > 1.0 for _, v in scale):
        return ("No loss scale was in use, so no scale setting avoids them: the inf/NaN came "
                "from the loss, the inputs or the forward pass; find the first op that made "
                "one with mp.debug.trace_nonfinite.")
    first, settled = scale[0][1], statistics.median(v for _, v in scale[len(scale) // 2:])
    start = (f"The scale started at {first:g} and settled near {settled:g}: init_scale="
             f"{settled:g} starts there, without the skips on the way down. "
             if first >= 4 * settled else "")
    return (start + "A longer growth_interval= makes the growth attempts that overflow (each a "
            "skipped step) rarer" + ("; bf16 (no loss scale) has none." if
                                     run.format_name() != "bf16" else "."))


def _steps_text(run: Run) -> str:
    """The run's step count; "the first N" where the record ends at its last record (no
    closing count: the monitor was not closed)."""
    return str(run.step_count) if run.count_exact else f"the first {run.step_count}"


def _onset(points: list[tuple[int, float]], limit: float) -> tuple[int, float] | None:
    """The first step at or above ``limit`` from which the mean of the rest stays there too,
    with that mean."""
    values = [(s, v) for s, v in points if math.isfinite(v)]
    for i, (s, v) in enumerate(values):
        rest = [v for _, v in values[i:]]
        if v >= limit and sum(rest) / len(rest) >= limit:
            return s, sum(rest) / len(rest)
    return None


def _onsets(run: Run, name: str, limit: float) -> list[tuple[str, int, float]]:
    """(layer, onset step, mean from there) of every layer whose ``name`` stays at ``limit``."""
    hits = []
    for layer in run.layers:
        onset = _onset(run.layer(layer, name), limit)
        if onset is not None:
            hits.append((layer, *onset))
    return hits


def _lost_advice(run: Run) -> list[str]:
    hits = _onsets(run, "weight_update_lost", LOST_LIMIT)
    return [f"Layer {layer} lost {mean:.0%} of its updates from step {step} (its 16-bit "
            f"weights round the updates away): keep fp32 master weights (level O2) or "
            f"master='kahan' for it, or raise its learning rate." for layer, step, mean in
            _worst(hits)]


def _underflow_advice(run: Run) -> list[str]:
    hits = _onsets(run, "grad_underflow", UNDERFLOW_LIMIT)
    fmt = run.format_name() or "the training format"
    return [f"Layer {layer}: {mean:.1%} of its nonzero gradients fall below {fmt}'s smallest "
            f"normal number from step {step} (they lose bits or flush to zero): a larger loss "
            f"scale (init_scale=, or a static scale), or bf16." for layer, step, mean in
            _worst(hits)]


def _range_advice(run: Run) -> list[str]:
    hits = []
    for layer in run.layers:
        room = [(s, v) for s, v in run.layer(layer, "act_headroom") if not math.isnan(v)]
        if room:
            step, least = min(room, key=lambda p: p[1])
            if least < HEADROOM_LIMIT:
                hits.append((layer, step, least))
    fmt = run.format_name() or "the training format"
    return [(f"Layer {layer}'s outputs overflowed {fmt} (inf) at step {step}: keep it in fp32 "
             f"(keep_fp32=['{layer}']), or train in bf16." if least == -math.inf else
             f"Layer {layer}'s outputs came within {least:.1f} binades of {fmt}'s largest "
             f"value at step {step}: keep it in fp32 (keep_fp32=['{layer}']) before they "
             f"overflow, or train in bf16.") for layer, step, least in
            sorted(hits, key=lambda h: h[2])[:5]]


def _worst(hits: list[tuple[str, int, float]], most: int = 5) -> list[tuple[str, int, float]]:
    return sorted(hits, key=lambda h: -h[2])[:most]


# -- the page --------------------------------------------------------------------------------------
_STYLE = """body{font-family:system-ui,sans-serif;max-width:1080px;margin:2em auto;padding:0 1em;
color:#222}h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}figure{margin:0.5em 0}
img{max-width:100%}li{margin:0.3em 0}table{border-collapse:collapse}td,th{padding:2px 10px;
text-align:left;border-bottom:1px solid #ddd}.note{color:#555;font-size:0.9em}"""


def render(series: dict[str, list[tuple[int, float]]], title: str = "mixprec run") -> str:
    """The report page for a run's series (see :func:`mixprec.monitor.read_run`), as HTML."""
    run = Run(series)
    fmt = run.format_name() or "the training format"
    sections = [
        ("What to do", None, "<ul>" + "".join(f"<li>{html.escape(a)}</li>" for a in advice(run))
         + "</ul>"),
        ("Loss and loss scale", loss_plot(run),
         "Red lines: a step was skipped (inf/NaN gradients) since the previous record."
         if run.skip_steps() else "No step was skipped."),
        ("Gradient norm", norm_plot(run), ""),
        ("Gradient underflow", heatmap(run, "grad_underflow", "Gradient underflow (layer x step)",
                                        "magma_r", 0.0, None, "fraction"),
         f"Fraction of each layer's nonzero gradient values below {fmt}'s smallest normal number "
         "at the loss scale of the step: they keep fewer bits, or flush to zero."),
        ("Update lost", heatmap(run, "weight_update_lost", "Update lost (layer x step)",
                                 "Reds", 0.0, 1.0, "fraction"),
         "Fraction of each step's intended (fp32) update that the weights the run keeps did not "
         "take: 0 with fp32 master weights, 1 when 16-bit weights round every update away. "
         "Grey: not measured (a skipped step)."),
        ("Activation headroom", heatmap(run, "act_headroom", "Activation headroom "
                                         "(layer x step)", "RdYlGn", 0.0, 16.0, "binades"),
         f"log2({fmt} max / the layer's largest output): how many doublings its activations can "
         "still take before they overflow (red: few)."),
        ("FP8 scales", fp8_plot(run), ""),
    ]
    body = [f"<h1>{html.escape(title)}</h1>", _summary(run)]
    for heading, png, text in sections:
        if png is None and heading != "What to do":
            continue
        body.append(f"<h2>{html.escape(heading)}</h2>")
        if png is not None:
            body.append(f'<figure><img alt="{html.escape(heading)}" '
                        f'src="data:image/png;base64,{png}"></figure>')
        if text:
            body.append(text if text.startswith("<") else
                        f'<p class="note">{html.escape(text)}</p>')
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def summary_rows(run: Run) -> list[tuple[str, str]]:
    """The run at a glance, as ``(what, value)`` rows: steps and records, layers, format,
    loss, loss scale, skipped steps (the page's table, and ``mixprec report``'s text)."""
    where = (f", steps {run.steps[0]} to {run.steps[-1]}" if run.steps else "")
    count = (f"{run.step_count}" if run.count_exact else
             f"{run.step_count} to the last record (the monitor was not closed: steps after "
             f"it are not counted)")
    rows = [("steps", count), ("records", f"{len(run.steps)}{where}"),
            ("layers watched", str(len(run.layers)))]
    if run.format_name():
        rows.append(("training format", run.format_name()))
    loss = run.get("loss")
    if loss:
        rows.append(("loss", f"{loss[0][1]:.4g} at step {loss[0][0]}, {loss[-1][1]:.4g} at "
                             f"step {loss[-1][0]}"))
    scale = run.get("loss_scale")
    if scale:
        values = [v for _, v in scale]
        rows.append(("loss scale", f"{min(values):g} to {max(values):g}, {values[-1]:g} at "
                                   f"step {scale[-1][0]}"))
    if run.get("skipped_steps"):
        share = f" ({run.skipped() / run.step_count:.0%})" if run.step_count else ""
        rows.append(("skipped steps", f"{run.skipped():g} of {_steps_text(run)}{share}"))
    return rows


#: per layer statistic: (title, how a layer's series is summed up, worst first, unit)
_WORST = (("gradient underflow", "grad_underflow", max, True, "{:.2%} (most)"),
          ("update lost", "weight_update_lost", lambda v: sum(v) / len(v), True,
           "{:.1%} (mean)"),
          ("activation headroom", "act_headroom", min, False, "{:.1f} binades (least)"))


def worst_layers(run: Run, most: int = 3) -> list[tuple[str, list[tuple[str, str]]]]:
    """Per statistic the heatmaps show, the ``most`` worst layers and their figure:
    ``[(statistic, [(layer, figure), ...]), ...]`` (statistics not recorded left out)."""
    out = []
    for title, stat, reduce, high, text in _WORST:
        figures = []
        for layer in run.layers:
            values = [v for _, v in run.layer(layer, stat) if not math.isnan(v)]  # (inf: an
                                                                                   # overflow)
            if values:
                figures.append((layer, reduce(values)))
        figures.sort(key=lambda f: -f[1] if high else f[1])
        if figures:
            out.append((title, [(layer, text.format(v)) for layer, v in figures[:most]]))
    return out


def summary_text(series: dict[str, list[tuple[int, float]]]) -> str:
    """What the report page shows, as text for a terminal: the run at a glance, the worst
    layers per statistic, and what to do."""
    run = Run(series)
    rows = summary_rows(run)
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    worst = worst_layers(run)
    if worst:
        lines.append("worst layers:")
        lines += [f"  {title}: " + ", ".join(f"{layer} {v}" for layer, v in layers)
                  for title, layers in worst]
    lines.append("what to do:")
    lines += [f"  - {line}" for line in advice(run)]
    return "\n".join(lines)


def _summary(run: Run) -> str:
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                               for k, v in summary_rows(run)) + "</table>"


_NOTHING_TO_JUDGE = ("The run holds no mixprec scalars (names starting 'mixprec/'): it is not "
                     "a PrecisionMonitor's record, so there is nothing to judge.")


def _mixprec_names(series) -> list[str]:
    return [name for name in series if name.startswith("mixprec/")]


def _unprefixed(series: dict) -> dict:
    """A run logged through the Hugging Face Trainer's ``report_to`` (its TensorBoard callback
    writes ``train/<name>``): its ``train/mixprec/...`` scalars under their own names."""
    if _mixprec_names(series):
        return series
    return {name[len("train/"):] if name.startswith("train/mixprec/") else name: points
            for name, points in series.items()}


def read_record(run_path) -> dict[str, list[tuple[int, float]]]:
    """:func:`mixprec.monitor.read_run`, refusing a run with no mixprec scalars.

    Raises:
        FileNotFoundError, ValueError: what :func:`mixprec.monitor.read_run` refuses; a run
            with no ``mixprec/...`` scalars (the names it holds are listed).
    """
    series = _unprefixed(read_run(run_path))
    if not _mixprec_names(series):
        names = sorted(series)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        raise ValueError(f"{os.fspath(run_path)} holds no mixprec scalars (names starting "
                         f"'mixprec/'), only {shown}: not a PrecisionMonitor's record, nothing "
                         f"to report")
    return series


def write_report(run_path, out_path, title: str | None = None) -> pathlib.Path:
    """Read a run (a JSONL file or a TensorBoard folder) and write its report page.

    Returns:
        The path written.

    Raises:
        FileNotFoundError, ValueError: what :func:`read_record` refuses.
    """
    series = read_record(run_path)
    out = pathlib.Path(os.fspath(out_path))
    out.parent.mkdir(parents=True, exist_ok=True)
    name = title or f"mixprec run: {pathlib.Path(os.fspath(run_path)).name}"
    out.write_text(render(series, name), encoding="utf-8")
    return out
