"""The ``mixprec bench`` report as text (:func:`format_table`): one line per row, the GEMM
peaks the rows are compared with, and the notes (noisy rows, losses, how memory was measured).
:mod:`.bench` measures; this module only formats what it measured."""

from __future__ import annotations

__all__ = ["format_table", "peak_share_text"]


def peak_share_text(row: dict) -> str:
    """A row's "% peak" cell: ``"40%"``, or ``"-"`` where its dtype's GEMMs were too slow to
    probe at full size (no peak to compare with)."""
    share = row.get("peak_share")
    return "-" if share is None else f"{100 * share:.0f}%"


def format_table(rep: dict) -> str:
    """The human-readable report."""
    sizes = ", ".join(f"{k} {v}" for k, v in rep["sizes"].items())
    n, steps = rep.get("repeat", 1), rep["steps"]  # a row's median pools the steps of its rounds
    pooled = f"{steps} steps" if n == 1 else f"{n * steps} steps ({n} rounds of {steps}, each)"
    low = next((r["dtype"] for r in rep["rows"] if r["row"] != "O0"), "fp32")
    lines = [f"mixprec bench: {rep['model']} ({sizes}); "
             f"{rep['flops_per_step'] / 1e9:.1f} GFLOP per step; "
             f"median of {pooled} after {rep['warmup']} warm-up; "
             f"{rep['device']}, {rep['threads']} threads, torch {rep['torch']}", "",
             *([f"dtype 'auto' -> {low}: {rep['auto_reason']}", ""]
               if rep.get("auto_reason") else []),
             f"{'row':<15}{'dtype':<6}{'ms/step':>9}{'speed-up':>9}{'peak MB':>9}{'final loss':>12}"
             f"{'GFLOP/s':>9}{'% peak':>8} {'update ms':>11}{'update %':>9}"]
    exceeded, footnotes = False, []
    for r in rep["rows"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        if r.get("noisy"):
            sp += "~"
            ups = ", ".join(f"{u:.2f}x" for u in r["round_speedups"])
            footnotes.append(f"({len(footnotes) + 1}) {r['row']}: noisy (~): its rounds ran at "
                             f"{ups} of O0's speed, a spread of {r['spread']:.2f}, wider than "
                             f"it differs from O0 ({abs(r['speedup'] - 1):.2f}): its speed-up "
                             f"says nothing; run more rounds (--repeat) on a quieter machine")
        mem = f"{r['peak_mb']:.0f}" if r["peak_mb"] is not None else "n/a"
        over = r["peak_share"] is not None and r["peak_share"] > 1  # a report from elsewhere too
        exceeded |= over
        loss = f"{r['final_loss']:.6g}"
        for note in r.get("notes", []):
            footnotes.append(f"({len(footnotes) + 1}) {r['row']}: {note}")
            loss += f"({len(footnotes)})"
        lines.append(f"{r['row']:<15}{r['dtype']:<6}{r['ms_per_step']:>9.1f}{sp:>9}{mem:>9}"
                     f"{loss:>12}{r['gflops']:>9.0f}{peak_share_text(r):>8}"
                     f"{'!' if over else ' '}{r['update_ms']:>11.1f}"
                     f"{100 * r['update_share']:>8.1f}%")
    m, k, n = rep["gemm_shape"]
    probes = rep.get("matmul_peak", {})
    peaks = ", ".join(f"{key} {v:.0f}" + _peak_remark(probes.get(key, {}))
                      for key, v in rep["matmul_peak_gflops"].items())
    lines += ["", f"GEMM peak at {m}x{k}x{n}, GFLOP/s (a Linear layer's training GEMMs combined; "
                  f"each in parentheses: forward x@W.t() / input gradient gy@W / weight gradient "
                  f"gy.t()@x): {peaks}"]
    if exceeded:
        lines.append("! above the GEMM peak even after re-probing it (the faster figures kept): "
                     "the probe's GEMMs ran slower than the row's (load during the probe, or the "
                     "row's other kernels, such as attention or other shapes, outpacing them), "
                     "so this '% peak' is not reliable")
    lines += footnotes
    lines += [
              "peak MB: peak resident memory of the row's process above its level before the "
              "model was built"
              + ("" if rep["isolated"] else " (rows share one process: indicative only)"),
              "update: optimizer step incl. master-weight copy, loss-scaler step/update, zero_grad"]
    if rep.get("compile"):
        lines.append("compiled: level rows ran Trainer(compile=True) (forward+loss compiled; "
                     "O2 fused master step); compile time is in the warm-up, not in the medians")
    return "\n".join(lines)


def _peak_remark(probe: dict) -> str:
    gemms = probe.get("gemms", {})
    notes = ["/".join(f"{g['gflops']:.0f}" for g in gemms.values())] if gemms else []
    if probe.get("emulated"):
        notes.append("emulated")
    short = [f"{name} at {'x'.join(map(str, g['shape']))}" for name, g in gemms.items()
             if not g["full_size"]]
    if short or probe.get("full_size") is False:
        notes.append("too slow to probe at full size within the budget ("
                     + (", ".join(short) or "a smaller shape") + " only): no % peak")
    return f" ({'; '.join(notes)})" if notes else ""
