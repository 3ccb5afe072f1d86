"""How far a gradient accumulated over micro-batches drifts when it is held in bf16.

At O2 the model's parameters are bf16, so ``.grad`` is bf16 and every micro-batch's backward
adds into it with a bf16 rounding; at O1 the parameters (and their gradients) are fp32. For N
micro-batches the script compares the accumulated ``.grad`` of the last layer of a small MLP
with the fp32 sum of the same micro-batches' gradients taken one at a time (each micro-batch's
own gradient, as the level computes it, summed in fp32): the relative error (Frobenius norm of
the difference over the norm of the sum) is what holding the sum in 16 bits costs, beyond the
16-bit compute itself.

Run: ``python bench/accumulation_error.py [--micro-batches 4,16,64,256]``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def error(level: str, n: int) -> float:
    """The relative error of ``n`` micro-batches accumulated in ``.grad`` at ``level`` (bf16)."""
    torch.manual_seed(1)
    batches = [(torch.randn(16, 32), torch.randn(16, 8)) for _ in range(n)]
    amp = mp.MixedPrecision(level=level, dtype="bf16")
    model = _model()
    model, _ = amp.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    weight = model[2].weight
    exact = torch.zeros(weight.shape)
    for x, y in batches:  # each micro-batch's own gradient, summed in fp32
        amp.backward(F.mse_loss(model(x).float(), y) / n)
        exact += weight.grad.float()
        model.zero_grad(set_to_none=True)
    for x, y in batches:  # the accumulation the level does
        amp.backward(F.mse_loss(model(x).float(), y) / n)
    return float((weight.grad.float() - exact).norm() / exact.norm())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", default="4,16,64,256")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = {}
    print("| micro-batches | O1 (fp32 `.grad`) | O2 (bf16 `.grad`) |\n|---:|---:|---:|")
    for n in (int(v) for v in args.micro_batches.split(",")):
        rows[n] = (error("O1", n), error("O2", n))
        print(f"| {n} | {rows[n][0]:.2e} | {rows[n][1]:.2e} |")
    return rows


if __name__ == "__main__":
    main()
