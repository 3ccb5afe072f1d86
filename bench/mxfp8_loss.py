"""Train a small GPT-style transformer at O2 bf16, with and without MXFP8 GEMMs, and print the
final losses (the mean of the last 10 steps) and their ratio.

    PYTHONPATH=. python bench/mxfp8_loss.py [--steps 200] [--dim 128] [--depth 2]

MXFP8 runs torchao's emulated kernels on a CPU (the same casts as the native sm100 kernels).
"""

from __future__ import annotations

import argparse
import time

import torch

import mixprec as mp
from mixprec.benchmodels import get_model


def train(fp8, steps: int, dim: int, depth: int, seq_len: int, batch: int) -> list[float]:
    """The per-step losses of one run (same seed, same batches)."""
    bm = get_model("transformer", width=dim, depth=depth, seq_len=seq_len, batch=batch)
    torch.manual_seed(0)
    model = bm.build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mp.prepare(model, opt, level="O2", dtype="bf16", fp8=fp8)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = bm.batch(g)
        loss = bm.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    out = {}
    for fp8 in (None, "tensorwise", "mxfp8"):
        start = time.perf_counter()
        losses = train(fp8, args.steps, args.dim, args.depth, args.seq_len, args.batch)
        final = sum(losses[-10:]) / 10
        out[str(fp8 or "bf16")] = final
        print(f"{str(fp8 or 'bf16'):>10}: first loss {losses[0]:.4f}, final loss {final:.4f} "
              f"({time.perf_counter() - start:.1f} s)")
    print(f"mxfp8 / bf16 final loss: {out['mxfp8'] / out['bf16']:.4f}")
    return out


if __name__ == "__main__":
    main()
