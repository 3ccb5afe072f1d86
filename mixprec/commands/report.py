"""``mixprec report RUN -o report.html``: a recorded run as one self-contained HTML page.

RUN is what a :class:`mixprec.PrecisionMonitor` wrote: a JSONL file (``JSONLWriter``) or a
TensorBoard log folder (``TensorBoardWriter``, or any TensorBoard run holding ``mixprec/...``
scalars). The page (plots inlined; no script, no other file) shows loss and loss scale with the
skipped steps, the gradient norm, layer x step heatmaps of gradient underflow, update lost and
activation headroom, and what to do, in words; the terminal gets the same in text (the run at
a glance, the worst layers per statistic, what to do) and the page's path. ``--json`` prints the
advice and the counts instead, writing nothing: ``steps`` is the steps the run took (its closing
count, :meth:`mixprec.PrecisionMonitor.close`'s; else up to the last record, and
``steps_exact`` is false), ``records`` the recorded steps.

A run that cannot be read (no such path, not the monitor's JSONL, no ``mixprec/...`` scalars)
is an error naming the path (exit 2); a JSONL file holding more than one run (its steps go back)
is read, with a warning naming the file and line.
"""

from __future__ import annotations

import json
import sys
import warnings

from ..monitor.report import Run, advice, read_record, summary_text, write_report

__all__ = ["register"]


def _run(args) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        try:
            series = read_record(args.run)
            if args.json:
                run = Run(series)
                text = json.dumps({"steps": run.step_count, "steps_exact": run.count_exact,
                                   "records": len(run.steps), "skipped_steps": run.skipped(),
                                   "layers": run.layers, "format": run.format_name(),
                                   "advice": advice(run)}, indent=2)
            else:
                page = write_report(args.run, args.output, args.title).resolve()
                text = f"{summary_text(series)}\nreport: {page}"
        except OSError as exc:  # (a missing file, a directory given as the page to write, no
            raise ValueError(str(exc)) from None  # permission): not one the command reports
        finally:
            for w in caught:
                print(f"mixprec report: warning: {w.message}", file=sys.stderr)
    print(text)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="a recorded run (JSONL or TensorBoard) as an HTML "
                                             "page", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a JSONL file or a TensorBoard log folder")
    p.add_argument("-o", "--output", default="report.html",
                   help="the page to write (default %(default)s)")
    p.add_argument("--title", default=None, help="the page's title (default: from RUN)")
    p.add_argument("--json", action="store_true", help="print the advice as JSON, write nothing")
    p.set_defaults(func=_run)
