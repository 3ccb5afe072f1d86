"""``mixprec report RUN -o report.html``: a recorded run as one self-contained HTML page.

RUN is what a :class:`mixprec.PrecisionMonitor` wrote: a JSONL file (``JSONLWriter``) or a
TensorBoard log folder (``TensorBoardWriter``, or any TensorBoard run holding ``mixprec/...``
scalars). The page (plots inlined; no script, no other file) shows loss and loss scale with the
skipped steps, the gradient norm, layer x step heatmaps of gradient underflow, update lost and
activation headroom, and what to do, in words. ``--json`` prints the advice instead.

A run that cannot be read (no such path, not the monitor's JSONL, no ``mixprec/...`` scalars)
is an error naming the path (exit 2); a JSONL file holding more than one run (its steps go back)
is read, with a warning naming the file and line.
"""

from __future__ import annotations

import json
import sys
import warnings

from ..monitor.report import Run, advice, read_record, write_report

__all__ = ["register"]


def _run(args) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        try:
            if args.json:
                run = Run(read_record(args.run))
                text = json.dumps({"steps": len(run.steps), "layers": run.layers,
                                   "format": run.format_name(), "advice": advice(run)}, indent=2)
            else:
                text = f"report: {write_report(args.run, args.output, args.title).resolve()}"
        except FileNotFoundError as exc:  # an OSError, not one the command line reports
            raise ValueError(str(exc)) from None
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
