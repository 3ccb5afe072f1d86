"""Time of the whole update step through the engine (``amp.step``: the overflow check, the skip
decision, the master step, the scale update) against torch's own (``torch.amp.GradScaler`` +
torch's fused AdamW on fp32 parameters under ``torch.autocast``), on many small tensors, where
what a step costs per tensor shows.

``--layers`` ``Linear(--width, --width)`` layers (2 tensors each), AdamW; each row's backward
runs untimed, its step timed; the rows are interleaved ``--rounds`` times in one process and the
medians printed, with each one's ratio to torch's. Denormal floats are flushed to zero in every
row (``torch.set_flush_denormal``): the gradients of a deep chain of linear layers are tiny, and
x86 arithmetic on denormals would time the values, not the step.

    python bench/amp_step_speed.py [--layers 200] [--width 64] [--rounds 30] [--threads 1]
        [--rows torch,O2-fp16,O2,split,kahan,stochastic]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

import mixprec as mp

ROWS = {  # row -> (dtype, master method); "torch": autocast fp16 + GradScaler
    "torch": ("fp16", None), "O2-fp16": ("fp16", None), "O2": ("bf16", None),
    "split": ("bf16", "split"), "kahan": ("bf16", "kahan"), "stochastic": ("bf16", "stochastic"),
}


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def make(row: str, layers: int, width: int):
    """A function that runs one training step of ``row`` and returns its update's seconds."""
    x = torch.randn(8, width)
    model = _model(layers, width)
    if row == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

        def step() -> float:
            with torch.autocast("cpu", torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            start = time.perf_counter()
            scaler.step(opt)
            scaler.update()
            took = time.perf_counter() - start
            opt.zero_grad(set_to_none=True)
            return took
        return step
    dtype, master = ROWS[row]
    amp = mp.MixedPrecision(level="O2", dtype=dtype, master=master,
                            loss_scale=1024.0 if dtype == "fp16" else None)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    inputs = x.to(next(model.parameters()).dtype)

    def step() -> float:
        amp.backward(model(inputs).float().pow(2).mean())
        start = time.perf_counter()
        amp.step(opt)
        took = time.perf_counter() - start
        opt.zero_grad(set_to_none=True)
        return took
    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default=",".join(ROWS))
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    if unknown := [r for r in rows if r not in ROWS]:
        raise SystemExit(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    steps = {r: make(r, args.layers, args.width) for r in rows}
    for step in steps.values():  # warm-up: state made, lists cached
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {r: [] for r in rows}
    for _ in range(args.rounds):
        for r in rows:
            times[r].append(steps[r]())
    base = statistics.median(times["torch"]) if "torch" in times else None
    print(f"{args.layers} x Linear({args.width}, {args.width}) ({2 * args.layers} tensors), "
          f"AdamW, {args.threads} thread(s), median of {args.rounds} interleaved rounds; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| row | update ms | x torch |\n|---|---:|---:|")
    for r in rows:
        ms = statistics.median(times[r]) * 1e3
        ratio = f"{ms / (base * 1e3):.2f}" if base else ""
        print(f"| {r} | {ms:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
