"""The bf16 write-back of fp32 masters, four ways, timed side by side in interleaved rounds:
torch's own cast (``torch._foreach_copy_``: to nearest, ties to even; the floor), the eager
passes of the split's rounding (ties away from zero) over one flat copy, the same passes over
cache-sized pieces (what the CPU runs), and the one compiled pass (what CUDA runs; see
``mixprec.master.write_back``). Bandwidth-bound: the ratios are what matter.

    python bench/write_back_speed.py [--device cuda] [--tensors 40] [--numel 500000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec import kernel_table
from mixprec.master import write_back
from mixprec.masters import split_bits


def _time(fn, device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tensors", type=int, default=40)
    p.add_argument("--numel", type=int, default=500_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    values = [torch.randn(args.numel, device=device, generator=gen) for _ in range(args.tensors)]
    params = [torch.empty(args.numel, dtype=torch.bfloat16, device=device) for _ in values]
    plain_table = kernel_table.TABLE

    def under(row: str):
        """mixprec's write-back along the path ``row``'s devices take."""
        table = plain_table.imposing(row, on=device.type)

        def run():
            kernel_table.TABLE = table
            try:
                write_back.round_into_(params, values)
            finally:
                kernel_table.TABLE = plain_table
        return run

    ways = {"torch cast (ties to even)": lambda: torch._foreach_copy_(params, values),
            "flat passes (ties away)": lambda: split_bits.round_into_(params, values),
            "passes in pieces (ties away)": under("cpu"),
            "compiled pass (ties away)": under("cuda")}
    times = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            times[name].append(_time(fn, device, args.reps))
    n = args.tensors * args.numel
    print(f"{device.type}, torch {torch.__version__}: {args.tensors} tensors x {args.numel} "
          f"(= {n / 1e6:.0f}M) fp32 -> bf16, median of {args.rounds} rounds of {args.reps}")
    floor = statistics.median(times["torch cast (ties to even)"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:28s} {med:8.2f} ms  {med / floor:5.2f}x torch's cast")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
