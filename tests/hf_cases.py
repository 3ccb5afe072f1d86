"""Shared pieces of the Accelerate and Hugging Face Trainer tests over several processes: what
one rank runs (through parallel_cases.launch), and the same run in one process.

Accelerate turns FSDP on only on accelerators (its state ignores an FSDP plugin on MULTI_CPU),
so the CPU runs put the accelerator's state into FSDP2 mode, as it is on GPUs
(:func:`force_fsdp2`); FSDP2 itself runs over gloo.
"""

import os

import torch
import torch.nn.functional as F
from parallel_cases import GLOBAL_BATCH, Net, dataset
from torch.utils.data import DataLoader

import mixprec as mp

accelerate = __import__("pytest").importorskip("accelerate")
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402

from mixprec.integrations.accelerate import MixprecAccelerator  # noqa: E402

EPOCHS = 2


def launcher_env(world: int) -> None:
    """What ``accelerate launch``/``torchrun`` set beside RANK/WORLD_SIZE/LOCAL_RANK."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555",
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


def force_fsdp2(accelerator) -> None:
    """The accelerator's state as Accelerate sets it on GPUs for ``fsdp_version=2``."""
    from accelerate.state import PartialState

    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # AcceleratorState()


def reset_accelerate() -> None:
    """Forget the accelerator state singletons (a new run in the same process)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    if PartialState._shared_state:
        PartialState._shared_state["distributed_type"] = (
            DistributedType.MULTI_CPU if PartialState().num_processes > 1 else DistributedType.NO)


def accelerator(level, *, master=None, shard=False, **kw):
    reset_accelerate()
    acc = MixprecAccelerator(level=level, dtype="bf16", master=master, cpu=True, **kw)
    if shard:
        force_fsdp2(acc)
    return acc


def build(acc, world):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = DataLoader(dataset(), batch_size=GLOBAL_BATCH // world)
    return acc.prepare(model, opt, data)


def train(acc, model, opt, data, *, epochs=EPOCHS, stop_at=None, skip=0, first_epoch=0):
    """The user's loop; returns the global mean loss of each step."""
    losses = []
    step = first_epoch * len(data) + skip
    for _ in range(first_epoch, epochs):
        batches = acc.skip_first_batches(data, skip) if skip else data
        skip = 0
        for x, y in batches:
            loss = F.cross_entropy(model(x).float(), y)
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(acc.reduce(loss.detach(), "mean").item())
            step += 1
            if step == stop_at:
                return losses
    return losses


def weights(model, opt) -> dict:
    return {k: v.detach().cpu().clone() for k, v in mp.fp32_state_dict(model, opt).items()}


def accelerate_fit(level, world, *, master=None, shard=False) -> dict:
    acc = accelerator(level, master=master, shard=shard)
    model, opt, data = build(acc, world)
    losses = train(acc, model, opt, data)
    return {"weights": weights(model, opt), "loss": losses,
            "scale": acc.engine.scaler.get_scale()}


def accelerate_resume(out, level, world, *, master=None, shard=False, stop_at=6) -> dict:
    """Uninterrupted vs stopped at ``stop_at`` (mid-epoch 2), save_state, load_state, go on."""
    acc = accelerator(level, master=master, shard=shard)
    whole = build(acc, world)
    train(acc, *whole)
    acc = accelerator(level, master=master, shard=shard)
    first = build(acc, world)
    train(acc, *first, stop_at=stop_at)
    path = os.path.join(out, f"acc-{level}-{master}-{shard}")
    acc.save_state(path)
    before = weights(*first[:2])
    acc = accelerator(level, master=master, shard=shard)
    second = build(acc, world)
    acc.load_state(path)
    loaded = weights(*second[:2])
    per_epoch = len(second[2])
    train(acc, *second, first_epoch=stop_at // per_epoch, skip=stop_at % per_epoch)
    a, b = weights(*whole[:2]), weights(*second[:2])
    return {"equal": all(torch.equal(a[k], b[k]) for k in a),
            "loaded": all(torch.equal(before[k], loaded[k]) for k in before),
            "files": sorted(os.listdir(path)), "path": path}
