"""Time of one optimizer update per master method (AdamW, fp32 moments).

For each method (fp32 masters, split, kahan, stochastic), ``--tensors`` bf16 parameters of
``--numel`` elements in all, each with a fixed gradient, are stepped by the default update
(``fused="auto"``: torch's fused AdamW over the group, the compact methods between their load and
store) or with ``--fused compile`` by the compiled per-tensor kernels; the methods are
interleaved ``--rounds`` times in one process and the medians printed, with each one's ratio to
fp32 masters and the load average. What it measures is the update alone: no forward, no
backward.

    python bench/master_step_speed.py [--numel 2000000] [--tensors 1] [--fused auto|compile]
        [--rounds 15] [--threads 1] [--device cpu]
    python bench/master_step_speed.py --tensors 400 --numel 409600   # many small tensors
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import mixprec as mp
from mixprec.optim import CompactMasterOptimizer, MasterWeightOptimizer

METHODS = ("fp32", "split", "kahan", "stochastic")


def make(method: str, numel: int, tensors: int, device: str, fused: str):
    """``tensors`` bf16 parameters with gradients, and their optimizer wrapped for ``method``."""
    torch.manual_seed(0)
    each = numel // tensors
    values = [torch.randn(each, device=device) for _ in range(tensors)]
    params = [torch.nn.Parameter(v.to(torch.bfloat16)) for v in values]
    for p in params:
        p.grad = (torch.randn(each, device=device) * 1e-3).to(torch.bfloat16)
    inner = torch.optim.AdamW(params, lr=1e-3)
    initial = dict(zip(params, values))
    if method == "fp32":
        opt = MasterWeightOptimizer(inner, fused=fused, initial_masters=initial)
    else:
        opt = CompactMasterOptimizer(inner, mp.masters.resolve(method), fused=fused,
                                     initial_values=initial)
    return params, opt


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2_000_000)
    parser.add_argument("--tensors", type=int, default=1)
    parser.add_argument("--fused", default="auto", choices=("auto", "compile"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    torch.set_num_threads(args.threads)
    runs = {m: make(m, args.numel, args.tensors, args.device, args.fused) for m in METHODS}
    for _, opt in runs.values():  # compile and warm up
        for _ in range(3):
            opt.step()
    sync(args.device)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(args.rounds):
        for method, (_, opt) in runs.items():
            start = time.perf_counter()
            opt.step()
            sync(args.device)
            times[method].append((time.perf_counter() - start) * 1e3)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"AdamW update (fused={args.fused!r}), {args.numel:,} bf16 parameters in "
          f"{args.tensors} tensor(s), fp32 moments, "
          f"{args.device}, {args.threads} thread(s), torch {torch.__version__}, "
          f"median of {args.rounds} interleaved rounds, load average {load:.1f}")
    base = statistics.median(times["fp32"])
    print("| master | ms per step | vs fp32 masters |")
    print("|---|---:|---:|")
    for method in METHODS:
        ms = statistics.median(times[method])
        print(f"| {method} | {ms:.1f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
