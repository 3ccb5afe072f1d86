"""How often ``master="split"``'s forward weight differs from fp32 masters': the exact ties.

Both runs start from the same fp32 weights and take the same gradients at every step (the fp32
masters' run computes them, the split run is handed copies), so their masters stay bitwise
equal and their bf16 weights differ only where a master lies exactly half a bf16 ulp between two
bf16 numbers (torch's cast rounds it to even, the split away from zero). The script counts those
weights after every step, over a small GPT-style model (``mixprec.benchmodels``' transformer)
trained with AdamW, and prints the rate per rounding (bf16 weights x steps).

Run: ``python bench/split_ties.py [--steps 30] [--width 128] [--depth 2] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import copy

import torch

import mixprec as mp
from mixprec.benchmodels import get_model


def _masters(net, opt) -> list[torch.Tensor]:
    held = opt.masters_by_param()
    return [held[p].detach() for p in net.parameters() if p in held]


def run(steps: int, width: int, depth: int, seed: int) -> dict:
    """Train both runs in lockstep; return the counts."""
    bm = get_model("transformer", width=width, depth=depth, batch=8, seq_len=64)
    torch.manual_seed(seed)
    base = bm.build()
    runs = []
    for master in ("fp32", "split"):
        net = copy.deepcopy(base)
        runs.append(mp.prepare(net, bm.make_optimizer(net.parameters()), level="O2",
                               dtype="bf16", master=master))
    (net32, opt32), (net, opt) = runs
    low = [p for p in net.parameters() if p.dtype == torch.bfloat16]
    gen = torch.Generator().manual_seed(seed)
    differ, ties, not_equal = [], 0, 0
    for _ in range(steps):
        x, y = bm.batch(gen)
        bm.loss_fn(net32(x).float(), y).backward()
        for p, q in zip(net32.parameters(), net.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        opt32.step()
        opt.step()
        opt32.zero_grad()
        opt.zero_grad()
        count = 0
        for a, b, m32, m in zip((p for p in net32.parameters() if p.dtype == torch.bfloat16),
                                low, _masters(net32, opt32), _masters(net, opt)):
            not_equal += int((m32.view(torch.int32) != m.view(torch.int32)).sum())
            diff = a.view(torch.int16) != b.view(torch.int16)
            count += int(diff.sum())
            ties += int((diff & ((m.view(torch.int32) & 0xFFFF) == 0x8000)).sum())
        differ.append(count)
    n = sum(p.numel() for p in low)
    return {"bf16 weights": n, "steps": steps, "roundings": n * steps,
            "differing weights per step": differ, "of them at ties": ties,
            "masters not bitwise equal": not_equal}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    got = run(args.steps, args.width, args.depth, args.seed)
    for key, value in got.items():
        print(f"{key}: {value}")
    total = sum(got["differing weights per step"])
    print(f"rate: {total} in {got['roundings']} roundings = {total / got['roundings']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
