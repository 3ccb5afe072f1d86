"""Run by test_parallel_launch under torchrun: train, run a few collectives, end at once.

    torchrun --nproc-per-node 2 tests/train_then_exit.py --strategy fsdp

The script ends right after collectives, as many training scripts do: gloo's worker threads
still let go of the last collectives' tensors then, which takes the GIL, and a worker that asks
for it once the interpreter is finalizing aborts the process (SIGABRT). Without
``mixprec.distenv.settle`` at exit, 9 of 20 launches aborted (DDP and FSDP alike).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec as mp


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    trainer = mp.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                         level="O2", dtype="bf16", strategy=args.strategy, progress=False)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
            for _ in range(4)]
    trainer.fit(data, epochs=args.epochs)
    for _ in range(8):  # the user's own collectives, each tensor dropped as soon as it returns
        dist.all_reduce(torch.ones(1000))


if __name__ == "__main__":
    main()
