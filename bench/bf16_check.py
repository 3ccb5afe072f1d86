"""What bf16's inf/NaN check costs a training step: ``amp.step`` (timed; the forward and
backward before it are not) with the check (``NoLossScaler(skip_nonfinite=True)``, what
``loss_scale="auto"`` gives a bf16 run) and without it (``NoLossScaler()``: every step applied),
timed side by side in interleaved rounds, at O2 (fp32 masters: the flag goes to torch's fused
kernel and is read after the step) and O1 (a plain optimizer: the gradients are checked, the
flag read, then the step).

    python bench/bf16_check.py [--width 512] [--layers 8] [--batch 16] [--rounds 7] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

import mixprec as mp


def _step_fn(level: str, check: bool, args):
    torch.manual_seed(0)
    layers = [nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())])
    scaler = mp.NoLossScaler(skip_nonfinite=check)
    amp = mp.MixedPrecision(level=level, dtype="bf16", loss_scale=scaler)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(args.batch, args.width)

    def step() -> float:
        amp.backward(model(x).float().pow(2).mean())
        start = time.perf_counter()
        amp.step(opt)
        took = time.perf_counter() - start
        opt.zero_grad()
        return took
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", mp.SlowDtypeWarning)
    rows = {(level, check): _step_fn(level, check, args)
            for level in ("O2", "O1") for check in (False, True)}
    times: dict = {key: [] for key in rows}
    for fn in rows.values():  # warm-up: first-step set-up out of the timings
        fn()
        fn()
    for _ in range(args.rounds):
        for key, fn in rows.items():
            times[key].append(sum(fn() for _ in range(args.reps)) / args.reps * 1e3)
    params = args.layers * (args.width * args.width + args.width)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {params / 1e6:.1f}M "
          f"parameters, batch {args.batch}, {args.rounds} interleaved rounds x {args.reps} steps; "
          f"amp.step only")
    print(f"{'level':6} {'no check ms':>12} {'check ms':>10} {'ratio':>7} {'ratio spread':>14}")
    for level in ("O2", "O1"):
        off, on = times[(level, False)], times[(level, True)]
        ratios = sorted(b / a for a, b in zip(off, on))
        print(f"{level:6} {statistics.median(off):12.1f} {statistics.median(on):10.1f} "
              f"{statistics.median(ratios):7.3f} {ratios[0]:6.3f}-{ratios[-1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
