"""fp16 emulation vs torch's native fp16 kernels vs fp32 (and bf16): one training step.

An O2/O3-style fp16 step (fp16 parameters, forward + backward, no optimizer) on two models:
``nine-linear`` (Paddle's AMP benchmark: nine width x width Linear layers) and a small stack of
3x3 convolutions. The configurations are timed side by side in one run, interleaved
round-robin, so load from other processes hits them alike; the best sample (load only ever
adds time) and the median are reported.

    python bench/bench_emulation.py [--width 1024] [--batch 256] [--steps 3] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch import nn

import mixprec as mp
from mixprec.benchmodels import NineLinear


def _conv_stack(channels: int = 32, depth: int = 3) -> nn.Module:
    layers = [nn.Conv2d(16, channels, 3, padding=1)]
    for _ in range(depth - 1):
        layers += [nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1)]
    return nn.Sequential(*layers)


def _config(name: str, build):
    """(model, input dtype, context factory) for one configuration."""
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(name, torch.float16)
    model = build().to(dtype)
    if name == "fp16 emulated":
        return model, dtype, lambda: mp.emulate_fp16(True)
    return model, dtype, contextlib.nullcontext


def _step(model, x, context) -> None:
    with context():
        loss = model(x).float().square().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


def _time(model, x, context, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, x, context)
    return (time.perf_counter() - start) / steps * 1e3


def run(build, x: torch.Tensor, steps=3, rounds=5, names=None) -> dict[str, tuple[float, float]]:
    """(best, median) ms per fwd+bwd step of ``build()`` on ``x`` per configuration."""
    names = names or ["fp32", "fp16 native", "fp16 emulated", "bf16"]
    configs = {n: _config(n, build) for n in names}
    inputs = {n: x.to(dtype) for n, (_, dtype, _) in configs.items()}
    for n, (model, _, ctx) in configs.items():  # warm-up
        _step(model, inputs[n], ctx)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for n, (model, _, ctx) in configs.items():
            samples[n].append(_time(model, inputs[n], ctx, steps))
    return {n: (min(v), statistics.median(v)) for n, v in samples.items()}


def _print(title: str, result: dict[str, tuple[float, float]], flops: float | None) -> None:
    base = result["fp32"][0]
    print(f"\n{title}")
    print(f"{'config':<15} {'best ms':>9} {'median':>9} {'GFLOP/s':>9} {'vs fp32':>8}")
    for name, (ms, med) in result.items():
        rate = f"{flops / ms / 1e6:>9.0f}" if flops else f"{'-':>9}"
        print(f"{name:<15} {ms:>9.2f} {med:>9.2f} {rate} {base / ms:>7.2f}x")
    native, emulated = result["fp16 native"][0], result["fp16 emulated"][0]
    print(f"emulated fp16: {native / emulated:.2f}x the speed of native fp16, "
          f"{base / emulated:.2f}x the speed of fp32")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=9)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--conv-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed sample")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved samples per config")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"fp16 fast here: {mp.hardware.is_fast(torch.float16, 'cpu')}")
    w, d, b = args.width, args.depth, args.batch
    result = run(lambda: NineLinear(w, d), torch.randn(b, w), args.steps, args.rounds)
    _print(f"nine-linear fwd+bwd: width {w}, depth {d}, batch {b}", result, 3 * 2 * b * w * w * d)
    result = run(_conv_stack, torch.randn(args.conv_batch, 16, 32, 32), args.steps, args.rounds)
    _print(f"3 x Conv2d(32, 3x3) fwd+bwd: batch {args.conv_batch}, 32x32", result, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
