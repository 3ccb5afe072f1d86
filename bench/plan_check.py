"""``mixprec plan`` against measurement: memory held between steps, per rank, for nine-linear.

For each strategy (one process; DDP and FSDP2 on two gloo ranks) and level, every rank measures
its resident memory (Linux ``/proc/self/statm``) before building the model and after the
Trainer's set-up and one training step (gradients set to None by the Trainer), and compares the
increase with the planned bytes held between steps: parameters + fp32 masters + optimizer state,
plus, under DDP, the gradient buckets DDP keeps allocated (``gradient_as_bucket_view``). Run with
glibc's mmap threshold fixed (set below) so freed tensors go back to the system.

    python bench/plan_check.py [--width 2048] [--depth 9] [--optimizer adamw]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile

# Large allocations come from mmap and go back to the system when freed. glibc reads this at
# process start: it applies to the worker processes this script spawns.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mixprec as mp  # noqa: E402
from mixprec.benchmodels import NineLinear  # noqa: E402

LEVELS = ("O0", "O1", "O2", "O3")
_OPTIMIZERS = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-4),
               "sgd": lambda p: torch.optim.SGD(p, lr=1e-4),
               "momentum": lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9)}


def rss() -> int:
    """Resident bytes of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(strategy, level, width, depth, optimizer, batch=32):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.rand(batch, width, generator=gen), torch.rand(batch, width, generator=gen)
    gc.collect()
    before = rss()
    model = NineLinear(width, depth)
    trainer = mp.Trainer(model, F.mse_loss, _OPTIMIZERS[optimizer](model.parameters()),
                         level=level, dtype="bf16", strategy=strategy, progress=False)
    del model
    trainer.train_step([(x, y)])
    gc.collect()
    after = rss()
    del trainer
    gc.collect()
    return after - before


def _worker(rank, world, strategy, width, depth, optimizer, out):
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1 if world > 1 else 2)
    _measure(strategy, "O2", 64, 2, optimizer)  # warm-up: lazy imports and first allocations
    rows = {level: _measure(strategy, level, width, depth, optimizer) for level in LEVELS}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    if world > 1:
        dist.barrier()
    os._exit(0)  # skip gloo's teardown (it can abort at exit); results are on disk


def _run(strategy, world, width, depth, optimizer):
    out = tempfile.mkdtemp()
    args = (world, strategy, width, depth, optimizer, out)
    tmp.spawn(_worker, args=args, nprocs=world)  # a fresh process: it reads the mmap threshold
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=9)
    p.add_argument("--optimizer", default="adamw", choices=sorted(_OPTIMIZERS))
    args = p.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("plan_check reads /proc/self/statm: Linux only")
    n = mp.benchmodels.params_count(NineLinear(args.width, args.depth))
    print(f"nine-linear width {args.width} depth {args.depth}: {n / 1e6:.2f}M parameters, "
          f"{args.optimizer}; MiB per rank held between steps")
    print("| strategy | ranks | level | planned | measured (rank 0 / 1) | measured / planned |")
    print("|---|---|---|---|---|---|")
    for strategy, world in (("single", 1), ("ddp", 2), ("fsdp", 2)):
        results = _run(strategy, world, args.width, args.depth, args.optimizer)
        for level in LEVELS:
            plan = mp.parallel.plan(n, level=level, dtype="bf16", strategy=strategy, world=world,
                                    optimizer=args.optimizer)
            planned = plan.parameters_and_optimizer + (plan.gradients if strategy == "ddp" else 0)
            measured = [r[level] for r in results]
            print(f"| {strategy} | {world} | {level} | {planned / 2**20:.1f} | "
                  f"{' / '.join(f'{m / 2**20:.1f}' for m in measured)} | "
                  f"{max(measured, key=lambda m: abs(m - planned)) / planned:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
