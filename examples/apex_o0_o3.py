"""The apex O0-O3 write-up's training loop, run through ``mixprec.compat.apex_amp``.

The write-up (a blog post on mixed-precision training in PyTorch) builds a network with
BatchNorm, an Adam optimizer with two parameter groups (a low learning rate for the backbone, a
high one for the head, weight decay), a BCE loss, registers ``torch.sigmoid`` as an fp32
function, calls ``amp.initialize(net, opt, opt_level=...)`` and trains with::

    opt.zero_grad()
    with amp.scale_loss(loss, opt) as scaled_loss:
        scaled_loss.backward()
    opt.step()

It explains the levels: O0 pure fp32 (the accuracy baseline), O1 mixed precision by black and
white lists (recommended), O2 almost fp16 except batchnorm, O3 pure fp16 (unstable, the speed
baseline). This program runs that loop at each level on a synthetic two-class problem and prints
the loss per step and the time per step, the only change to the write-up's code being the import
(``from mixprec.compat import apex_amp as amp`` for ``from apex import amp``). The write-up's
distributed parts (``apex.parallel``, ``torch.distributed.launch``) are left out: wrap the model
returned by ``amp.initialize`` in ``torch.nn.parallel.DistributedDataParallel`` and save
checkpoints on rank 0 only, as it advises.

Run: ``python examples/apex_o0_o3.py [--tiny] [--steps N] [--dtype fp16|bf16]``
(``--tiny``, or ``MIXPREC_EXAMPLE_TINY=1``: 6 steps on a small batch, for the test suite).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from mixprec.compat import apex_amp as amp


class Net(nn.Module):
    """A backbone with BatchNorm and a one-logit head; sigmoid at the end (BCELoss follows)."""

    def __init__(self, d_in: int = 32, hidden: int = 128):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                      nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return torch.sigmoid(self.head(self.backbone(x))).squeeze(1)


def make_data(n: int, d_in: int = 32, seed: int = 0):
    """Two Gaussian blobs, labels 0/1."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g).float()
    centers = torch.randn(2, d_in, generator=g)
    x = centers[labels.long()] + 1.5 * torch.randn(n, d_in, generator=g)
    return x, labels


def train(opt_level: str, x, y, steps: int, dtype: str, device) -> dict:
    torch.manual_seed(0)
    net = Net(x.shape[1]).to(device)
    # eps=1e-4, the usual fp16 setting: Adam's default 1e-8 is below fp16's smallest subnormal
    # (6e-8), rounds to 0 in O3's pure-fp16 optimizer state and makes the first step diverge.
    opt = torch.optim.Adam([{"params": net.backbone.parameters(), "lr": 4e-3},
                            {"params": net.head.parameters(), "lr": 1e-2}],
                           weight_decay=1e-4, eps=1e-4)
    crit = nn.BCELoss().to(device)
    net, opt = amp.initialize(net, opt, opt_level=opt_level, dtype=dtype, verbosity=0)
    net.train()
    losses, times = [], []
    for step in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = crit(net(x), y)
        with amp.scale_loss(loss, opt) as scaled_loss:
            scaled_loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        print(f"{opt_level} step {step + 1}: loss {losses[-1]:.6f}, "
              f"loss scale {amp.state_dict()['loss_scaler0']['loss_scale']:g}")
    per_step = sum(times[1:]) / max(1, len(times) - 1)  # the first step warms up
    print(f"{opt_level}: {1e3 * per_step:.2f} ms per step, final loss {losses[-1]:.6f}")
    return {"losses": losses, "ms_per_step": 1e3 * per_step}



def _positive(text: str) -> int:
    """An argparse type: an integer >= 1 (0 used to mean "the default" silently)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value

def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        default=os.environ.get("MIXPREC_EXAMPLE_TINY") == "1")
    parser.add_argument("--steps", type=_positive, default=None)
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"),
                        help="fp16 (apex's) or bf16")
    args = parser.parse_args(argv)
    steps = args.steps or (6 if args.tiny else 100)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, y = make_data(64 if args.tiny else 2048)
    x, y = x.to(device), y.to(device)
    # The write-up's tip for functions apex has no list entry for: run sigmoid in fp32 under O1.
    amp.register_float_function(torch, "sigmoid")
    results = {level: train(level, x, y, steps, args.dtype, device)
               for level in ("O0", "O1", "O2", "O3")}
    print("\nlevel  ms/step  final loss")
    for level, r in results.items():
        print(f"{level}   {r['ms_per_step']:7.2f}  {r['losses'][-1]:.6f}")
    return results


if __name__ == "__main__":
    main()
