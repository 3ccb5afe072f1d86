"""Peak memory and step time of O2's master methods against the optimizers users would pick
instead: optimi's Kahan-summation AdamW and torchao's stochastic-rounding AdamW on a bf16 model.

    python bench/peer_memory.py [--rows autocast,O2,...] [--steps 5] [--rounds 2] [--quick]
        [--eager] [--json FILE]

The 42M-parameter Llama-like stack of ``bench/_llama.py``, 4 micro-batches of 64 tokens
accumulated per step, AdamW (same hyperparameters for every row), one thread
(``torch.set_num_threads(1)``). Each row runs in a fresh process: its libraries are imported,
then the resident set size is read (``/proc/self/statm``; ``torch._dynamo``, which torch's
``Optimizer.__init__`` imports and torchao imports with its optimizers, about 70 MiB of Python
objects, is imported before it in every row), the model is built and trained
``--steps`` steps; the **peak rise** is the process's peak RSS (``resource.getrusage``'s
``ru_maxrss``, the kernel's high-water mark) less that first reading. Printed per row: the rise
and its ratio to ``torch.autocast``'s, the median step time after the first step and its ratio
to autocast's and to the peer's (optimi for kahan, torchao for stochastic), the first step's
time, and the loss of the last micro-batch of the last step. With ``--rounds`` > 1 the rows are
run in turn that many times (each time in a fresh process) and the medians printed.
``--quick``: 3 steps, one round. ``--eager`` runs every row with ``TORCHDYNAMO_DISABLE=1``
(nothing compiled: no compiler's memory in a peak, and torchao's update runs uncompiled).

Needs ``torch-optimi`` (the ``bench`` extra) for optimi's row and torchao for torchao's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = {"kahan": "optimi-kahan", "kahan-bf16": "optimi-kahan",
         "stochastic": "torchao-sr", "stochastic-bf16": "torchao-sr"}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(row: str, steps: int) -> dict:
    """Runs ``row`` in this process; returns its figures."""
    import torch
    import torch._dynamo  # noqa: F401  (every torch.optim.Optimizer imports it when made)

    sys.path.insert(0, HERE)
    import _llama

    import mixprec  # noqa: F401  (imported before the baseline reading, as are the peers)
    if row == "optimi-kahan":
        import optimi  # noqa: F401
    if row == "torchao-sr":
        import torchao.optim  # noqa: F401
    torch.set_num_threads(1)
    if row not in _llama.ROWS:
        raise ValueError(f"unknown row {row!r}; choose one of {', '.join(_llama.ROWS)}")
    before = _rss()
    max_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainee = _llama.make(row)
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(trainee.step())
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"row": row, "params": _llama.count_params(trainee.model), "rss_before": before,
            "maxrss_before": max_before, "peak": peak, "rise": peak - before,
            "first_s": times[0], "step_s": statistics.median(times[1:] or times),
            "loss": losses[-1]}


def run_row(row: str, steps: int, eager: bool = False) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if eager:
        env["TORCHDYNAMO_DISABLE"] = "1"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", row,
                           "--steps", str(steps)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"row {row!r} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Medians over rounds per row, with ratios to autocast's and to the peer's."""
    out = {}
    for row, got in runs.items():
        out[row] = {key: statistics.median(r[key] for r in got)
                    for key in ("rise", "first_s", "step_s", "loss")}
        out[row]["params"] = got[0]["params"]
        out[row]["spread_s"] = (min(r["step_s"] for r in got), max(r["step_s"] for r in got))
    ref = out.get("autocast")
    for row, r in out.items():
        r["rise_x"] = r["rise"] / ref["rise"] if ref else None
        r["step_x"] = r["step_s"] / ref["step_s"] if ref else None
        peer = out.get(PEERS.get(row, ""))
        r["peer_rise_x"] = r["rise"] / peer["rise"] if peer else None
        r["peer_step_x"] = r["step_s"] / peer["step_s"] if peer else None
    return out


def _x(value) -> str:
    return "" if value is None else f"{value:.2f}"


def table(summary: dict[str, dict]) -> str:
    sys.path.insert(0, HERE)
    import _llama

    lines = ["| row | peak rise MiB | x autocast | x peer | step s | x autocast | x peer "
             "| first step s | loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, r in summary.items():
        lines.append(
            f"| {_llama.ROWS[row][0]} | {r['rise'] / 2**20:.0f} | {_x(r['rise_x'])} | "
            f"{_x(r['peer_rise_x'])} | {r['step_s']:.2f} | {_x(r['step_x'])} | "
            f"{_x(r['peer_step_x'])} | {r['first_s']:.2f} | {r['loss']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    sys.path.insert(0, HERE)
    import _llama
    from _report import load_average, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(_llama.ROWS),
                        help=f"comma-separated, of: {', '.join(_llama.ROWS)}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="3 steps, one round")
    parser.add_argument("--eager", action="store_true", help="TORCHDYNAMO_DISABLE=1 in every row")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return {}
    if args.quick:
        args.steps, args.rounds = 3, 1
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in _llama.ROWS]
    if unknown or args.steps < 2 or args.rounds < 1:
        parser.error(f"--rows of {', '.join(_llama.ROWS)} (got {unknown}); --steps >= 2 "
                     f"(got {args.steps}); --rounds >= 1 (got {args.rounds})")
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    for i in range(args.rounds):
        for row in rows:
            runs[row].append(run_row(row, args.steps, args.eager))
            got = runs[row][-1]
            print(f"round {i + 1} {row}: rise {got['rise'] / 2**20:.0f} MiB, step "
                  f"{got['step_s']:.2f} s, first {got['first_s']:.2f} s", flush=True)
    summary = summarize(runs)
    params = next(iter(summary.values()))["params"]
    print(f"\n{params / 1e6:.1f}M-parameter Llama-like stack, {_llama.MICRO} micro-batches x "
          f"{_llama.TOKENS} tokens, AdamW, one thread, each row a fresh process; "
          f"{args.steps} steps, {args.rounds} round(s), medians{', eager' if args.eager else ''}; "
          f"{load_average()}\n")
    print(table(summary))
    write_json(args.json, {"steps": args.steps, "rounds": args.rounds, "eager": args.eager,
                           "runs": runs,
                           "summary": summary})
    return summary


if __name__ == "__main__":
    main()
