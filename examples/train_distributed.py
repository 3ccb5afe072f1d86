"""Mixed-precision training on one process or many, with the same script.

    python examples/train_distributed.py --level O2
    torchrun --nproc-per-node 2 examples/train_distributed.py --level O2
    torchrun --nproc-per-node 2 examples/train_distributed.py --level O2 --strategy fsdp

Under torchrun, ``mp.Trainer(strategy="auto")`` picks DDP, creates the process group from
torchrun's environment and splits the DataLoader over the ranks; the per-rank batch is the global
batch divided by the number of ranks, so every launch trains on the same global batches. Rank 0
prints and writes the fp32 weights.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec as mp


def make_data(n=512, features=32, classes=4):
    """A learnable synthetic task: the class is the argmax of a fixed random projection."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--level", default="O2", choices=["O0", "O1", "O2", "O3"])
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "auto"))
    p.add_argument("--strategy", default="auto", choices=["auto", "single", "ddp", "fsdp"])
    p.add_argument("--reduce-dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--epochs", type=_positive, default=3)
    p.add_argument("--global-batch", type=_positive, default=64)
    p.add_argument("--out", default=None, help="write the fp32 weights here (rank 0)")
    args = p.parse_args(argv)
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        p.error(f"--out {args.out}: its directory does not exist; create it or choose another")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = mp.Trainer(model, F.cross_entropy, opt, level=args.level, dtype=args.dtype,
                         strategy=args.strategy, reduce_dtype=args.reduce_dtype,
                         metrics="accuracy", progress=False)
    world = mp.parallel.world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must divide by {world} ranks")
    data = DataLoader(make_data(), batch_size=args.global_batch // world)
    history = trainer.fit(data, epochs=args.epochs)
    weights = mp.fp32_state_dict(trainer.model, trainer.optimizer)  # every rank (FSDP gathers)
    if mp.parallel.is_main_process():
        last = history.epochs[-1]
        print(f"{trainer.strategy.name} x{world} {trainer.policy}: loss {last['loss']:.4f}, "
              f"accuracy {last['accuracy']:.3f} after {history.steps} steps")
        if args.out:
            torch.save(weights, args.out)


if __name__ == "__main__":
    main()
