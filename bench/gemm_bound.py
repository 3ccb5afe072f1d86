"""The GEMM-only lower bound of a nine-linear training step, per dtype.

    .venv/bin/python bench/gemm_bound.py [--width 2048] [--batch 512] [--depth 9]

Times the three matrix products a Linear layer's training step runs, in the memory layouts
autograd uses: forward ``addmm(b, x, W.t())`` (B x W x W), input gradient ``gy @ W`` and weight
gradient ``gy.t() @ x`` (W x B x W: a short inner dimension). The sum over the layers (the first
layer has no input gradient) is the time a step would take if it did nothing but GEMMs: no
framework can beat it with these kernels. Compare with ``doctor``'s square-ish probe to see how
much of the gap to the matmul peak is the kernels' own shape dependence.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _time(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--depth", type=int, default=9)
    args = ap.parse_args()
    w, b, d = args.width, args.batch, args.depth
    flops = 2 * b * w * w
    for dt in (torch.float32, torch.bfloat16):
        x, gy = torch.randn(b, w, dtype=dt), torch.randn(b, w, dtype=dt)
        weight, bias = torch.randn(w, w, dtype=dt), torch.randn(w, dtype=dt)
        fwd = _time(lambda: torch.addmm(bias, x, weight.t()))
        dgrad = _time(lambda: gy @ weight)
        wgrad = _time(lambda: gy.t() @ x)
        bound = d * fwd + (d - 1) * dgrad + d * wgrad
        total = flops * (3 * d - 1)
        print(f"{str(dt).replace('torch.', ''):<9} "
              f"forward {fwd * 1e3:6.2f} ms ({flops / fwd / 1e9:5.0f} GFLOP/s)  "
              f"input-grad {dgrad * 1e3:6.2f} ms ({flops / dgrad / 1e9:5.0f})  "
              f"weight-grad {wgrad * 1e3:6.2f} ms ({flops / wgrad / 1e9:5.0f})  "
              f"-> GEMM-only step {bound * 1e3:6.1f} ms = {total / bound / 1e9:5.0f} GFLOP/s")


if __name__ == "__main__":
    main()
