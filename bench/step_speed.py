"""CPU step time of O2 and its master methods against ``torch.autocast``: a weight-bound
training step, and the update alone over many small tensors.

    python bench/step_speed.py [--part step|update|both] [--rounds 4] [--threads 1]
        [--rows autocast,O2,split,kahan] [--json FILE]

* ``step``: the 42M-parameter Llama-like stack of ``bench/_llama.py``, 4 micro-batches of 64
  tokens accumulated, AdamW; rows ``torch.autocast`` bf16 (torch's fused AdamW on fp32 params),
  O2 fp32 masters, ``master="split"`` and ``master="kahan"`` (``--rows``: any rows of
  ``bench/_llama.py``, e.g. ``O2-bf16``, ``kahan-bf16``), all built in this process and
  warmed up, then timed one step each per round, in an order that rotates every round. Printed:
  median seconds per step (and min-max), ratios to autocast's and to O2's, and the median time
  of the update alone (``amp.step`` / ``opt.step``).
* ``update``: 200 ``Linear(64, 64)`` layers (400 tensors, 0.83M parameters) with fixed
  gradients; one update timed ``--reps`` times per round, rows interleaved: torch's fused AdamW
  on fp32 params, O2's update (the prepared optimizer's ``step()``, as torch's row times its
  own) with each master method, and O2 written with
  torch's fused kernel and nothing more (widen + kernel + cast, ``bench/_plain_o2.py``).
  What a GPU pays per launch shows here on the CPU. (``bench/master_step_speed.py`` times the
  master methods alone on synthetic tensors of equal size.)

One thread by default. Each row runs as its library sets it up by default (what mixprec or
torchao compiles on their own is compiled during the warm-up; the step part prints the first
step's time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _llama  # noqa: E402
from _plain_o2 import PlainO2  # noqa: E402
from _report import load_average, write_json  # noqa: E402

import mixprec as mp  # noqa: E402

STEP_ROWS = ("autocast", "O2", "split", "kahan")
UPDATE_ROWS = {"torch": "torch's fused AdamW, fp32 params",
               "O2": "O2 bf16, fp32 masters (`opt.step()`)",
               "split": 'O2 `master="split"`', "kahan": 'O2 `master="kahan"`',
               "stochastic": 'O2 `master="stochastic"`',
               "plain": "O2 with torch's fused kernel, nothing more (widen + kernel + cast)"}


def _stats(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def step_part(rounds: int, rows: tuple[str, ...] = STEP_ROWS) -> dict:
    """The weight-bound step: every row's medians (seconds)."""
    trainees = {row: _llama.make(row) for row in rows}
    first = {}
    for row, trainee in trainees.items():  # warm up: state, first-step work
        start = time.perf_counter()
        trainee.step()
        first[row] = time.perf_counter() - start
    steps: dict[str, list[float]] = {r: [] for r in rows}
    updates: dict[str, list[float]] = {r: [] for r in rows}
    for i in range(rounds):
        order = rows[i % len(rows):] + rows[:i % len(rows)]
        for row in order:
            start = time.perf_counter()
            trainees[row].step()
            steps[row].append(time.perf_counter() - start)
            updates[row].append(trainees[row].timed_update())
    return {row: {"step": _stats(steps[row]), "update": _stats(updates[row]), "first": first[row]}
            for row in rows}


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(200)))


def _grads(params, dtype) -> None:
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)


def update_fns() -> dict:
    """Row -> a function running one update of the 400 tensors."""
    fns = {}
    model = _small_model()
    _grads(model.parameters(), torch.float32)
    opt = torch.optim.AdamW(model.parameters(), **_llama.HYPER, fused=True)
    fns["torch"] = opt.step
    for row, master in (("O2", None), ("split", "split"), ("kahan", "kahan"),
                        ("stochastic", "stochastic")):
        model = _small_model()
        amp = mp.MixedPrecision(level="O2", dtype="bf16", master=master)
        model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), **_llama.HYPER))
        _grads(model.parameters(), torch.bfloat16)
        fns[row] = opt.step  # the update alone (amp.step refuses a second step on one backward)
    model = _small_model()
    masters = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    plain = PlainO2(model.parameters(), masters, **_llama.HYPER)
    _grads(plain.params, torch.bfloat16)
    fns["plain"] = plain.step
    return fns


def update_part(rounds: int, reps: int) -> dict:
    """The update alone: every row's medians (seconds per update)."""
    fns = update_fns()
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {r: [] for r in fns}
    rows = list(fns)
    for i in range(rounds):
        for row in rows[i % len(rows):] + rows[:i % len(rows)]:
            start = time.perf_counter()
            for _ in range(reps):
                fns[row]()
            times[row].append((time.perf_counter() - start) / reps)
    return {row: {"update": _stats(times[row])} for row in rows}


def _spread(s: dict, scale: float) -> str:
    return f"{s['median'] * scale:.2f} ({s['min'] * scale:.2f}-{s['max'] * scale:.2f})"


def step_table(res: dict) -> str:
    lines = ["| row | s/step (min-max) | x autocast | x O2 | update s | first step s |",
             "|---|---:|---:|---:|---:|---:|"]
    ref, o2 = res["autocast"]["step"]["median"], res["O2"]["step"]["median"]
    for row, r in res.items():
        med = r["step"]["median"]
        lines.append(f"| {_llama.ROWS[row][0]} | {_spread(r['step'], 1)} | {med / ref:.2f} | "
                     f"{med / o2:.2f} | {r['update']['median']:.2f} | {r['first']:.1f} |")
    return "\n".join(lines)


def update_table(res: dict) -> str:
    lines = ["| row | ms/update (min-max) | x torch's fused AdamW |", "|---|---:|---:|"]
    ref = res["torch"]["update"]["median"]
    for row, r in res.items():
        lines.append(f"| {UPDATE_ROWS[row]} | {_spread(r['update'], 1e3)} | "
                     f"{r['update']['median'] / ref:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="both", choices=("step", "update", "both"))
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the step part")
    parser.add_argument("--update-rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=10, help="updates timed per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default=",".join(STEP_ROWS),
                        help="rows of the step part, from bench/_llama.py's (autocast and O2 "
                             "always run: the ratios are to them)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    rows = tuple(dict.fromkeys(("autocast", "O2", *args.rows.split(","))))
    unknown = [r for r in rows if r not in _llama.ROWS]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(_llama.ROWS)}")
    for key in ("rounds", "update_rounds", "reps", "threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1; got "
                         f"{getattr(args, key)}")
    torch.set_num_threads(args.threads)
    out: dict = {"threads": args.threads, "torch": torch.__version__, "mixprec": mp.__version__}
    head = f"{args.threads} thread(s), torch {torch.__version__}, mixprec {mp.__version__}"
    if args.part in ("step", "both"):
        out["step"] = step_part(args.rounds, rows)
        print(f"Weight-bound step: 42.5M-parameter Llama-like stack, {_llama.MICRO} micro-batches"
              f" x {_llama.TOKENS} tokens, AdamW, {head}; {args.rounds} interleaved rounds, "
              f"{load_average()}\n")
        print(step_table(out["step"]) + "\n", flush=True)
    if args.part in ("update", "both"):
        out["update"] = update_part(args.update_rounds, args.reps)
        print(f"Update alone: 200 x Linear(64, 64) (400 tensors), AdamW, {head}; "
              f"{args.update_rounds} interleaved rounds of {args.reps} updates, "
              f"{load_average()}\n")
        print(update_table(out["update"]))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
