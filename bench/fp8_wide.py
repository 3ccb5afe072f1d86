"""FP8 where the field reports gains: a Llama with 4096-wide layers (a 7B model's layer shape: 4096
wide, MLP 11008, 32 heads; 4 layers, 32k vocabulary), batch 8 x 1024, compiled. Rows: bf16
(``torch.autocast``), mixprec O2 bf16, mixprec O2 ``fp8="tensorwise"``, and torchao used directly
(``convert_to_float8_training`` on the same layers + ``torch.autocast`` bf16).

    python3 bench/fp8_wide.py [--eager] [--rounds 3] [--steps 6]
    python3 bench/fp8_wide.py --device cpu --tiny --eager     # a smoke run, seconds

Each row is built, warmed up, timed in ``--rounds`` consecutive rounds (ms/step: the median)
and freed (the rows do not fit side by side). The last line compares mixprec's FP8 step with
torchao's (target: at most 1.03x) and with bf16. On a CPU FP8 is emulated: numbers, never speed.
Needs torchao (the FP8 rows are skipped with a note without it) and a GPU of compute
capability 8.9+ for FP8 speed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402  (bench/ is not a package)
import gpu_rows  # noqa: E402

ROWS = ("autocast", "O2", "O2-fp8", "torchao-fp8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--eager", action="store_true", help="do not compile (the smoke run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(gpu_check.NO_CUDA.format(version=torch.__version__).replace(
            "gpu_check.py", "fp8_wide.py"), file=sys.stderr)
        return 2
    device = torch.device(args.device)
    size = gpu_rows.size_of("llama4096", args.tiny)
    steps = args.steps or (1 if args.tiny else 6)
    results = gpu_check.run_group("llama4096", not args.eager, ROWS, False, size, device, steps,
                                  args.rounds, 2 if args.tiny else 3)
    print(gpu_check.table(results, gpu_check.device_line(device), {"llama4096": size["label"]}))
    ms = {r["row"]: r["ms"] for r in results}
    if ms.get("O2-fp8") and ms.get("torchao-fp8") and ms.get("autocast"):
        print(f"\nmixprec O2 fp8 / torchao fp8: {ms['O2-fp8'] / ms['torchao-fp8']:.3f}x "
              f"(target <= 1.03); O2 fp8 / bf16 autocast: {ms['O2-fp8'] / ms['autocast']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
