"""How far torch's ``AveragedModel`` over a bf16 O2 model falls behind an EMA kept in fp32.

    python bench/ema_freeze.py [--steps 200] [--decay 0.999]

One O2 bf16 run of a small MLP (AdamW, lr 1e-2, random regression batches) updates, after each
step, torch's ``AveragedModel`` over the prepared model (bf16 arithmetic) and
``mp.AveragedModel`` (fp32, from the masters), both with ``get_ema_multi_avg_fn(decay)``.
Printed: the share of torch's EMA weights that never moved after its first update (which
copies the weights), the largest distance the fp32 EMA moved in that time, and the largest
gap between the two averages.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import mixprec as mp


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--decay", type=float, default=0.999)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    model, opt = amp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    ema = get_ema_multi_avg_fn(args.decay)
    theirs = AveragedModel(model, multi_avg_fn=ema)
    ours = mp.AveragedModel(model, multi_avg_fn=ema)
    g = torch.Generator().manual_seed(1)
    first = None
    for _ in range(args.steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        amp.backward(nn.functional.mse_loss(model(x).float(), y))
        amp.step(opt)
        opt.zero_grad()
        theirs.update_parameters(model)
        ours.update_parameters(model)
        if first is None:
            first = [p.detach().clone() for p in ours.parameters()]
    pairs = [(t.detach(), o.detach(), f.detach())
             for t, o, f in zip(theirs.parameters(), ours.parameters(), first)]
    frozen = sum(int((t.float() == f.bfloat16().float()).sum()) for t, _, f in pairs)
    total = sum(t.numel() for t, _, _ in pairs)
    moved = max(float((o - f).abs().max()) for _, o, f in pairs)
    gap = max(float((t.float() - o).abs().max()) for t, o, _ in pairs)
    print(f"{args.steps} O2 bf16 steps, EMA decay {args.decay}, torch {torch.__version__}: "
          f"{frozen / total:.0%} of torch's bf16 EMA weights never moved after its first "
          f"update; the fp32 EMA moved up to {moved:.2e}; the two differ by up to {gap:.2e}")


if __name__ == "__main__":
    main()
