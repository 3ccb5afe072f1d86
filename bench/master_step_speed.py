"""Time of one optimizer update per master method: the compiled one-pass AdamW step.

For each method (fp32 masters, split, kahan, stochastic) one bf16 parameter of ``--numel``
elements with a fixed gradient is stepped by the compiled kernel (``fused="compile"``, fp32
moments); the methods are interleaved ``--rounds`` times in one process and the medians
printed, with each one's ratio to fp32 masters. What it measures is the update alone: no
forward, no backward.

    python bench/master_step_speed.py [--numel 2000000] [--rounds 15] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import mixprec as mp
from mixprec.master import CompactMasterOptimizer, MasterWeightOptimizer

METHODS = ("fp32", "split", "kahan", "stochastic")


def make(method: str, numel: int, device: str):
    """A bf16 parameter with a gradient, and its optimizer wrapped for ``method``."""
    torch.manual_seed(0)
    value = torch.randn(numel, device=device)
    param = torch.nn.Parameter(value.to(torch.bfloat16))
    param.grad = (torch.randn(numel, device=device) * 1e-3).to(torch.bfloat16)
    inner = torch.optim.AdamW([param], lr=1e-3)
    if method == "fp32":
        opt = MasterWeightOptimizer(inner, fused="compile", initial_masters={param: value})
    else:
        opt = CompactMasterOptimizer(inner, mp.masters.resolve(method), fused="compile",
                                     initial_values={param: value})
    return param, opt


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    torch.set_num_threads(args.threads)
    runs = {m: make(m, args.numel, args.device) for m in METHODS}
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
    print(f"compiled AdamW step, {args.numel:,} bf16 parameters, fp32 moments, "
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
