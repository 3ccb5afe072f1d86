"""How a :class:`mixprec.Trainer` spreads over processes: one process and DDP.

A strategy owns everything the training loop does differently across ranks, so the loop itself
reads the same for all of them: preparing and wrapping the model, rebuilding data loaders over a
``DistributedSampler``, skipping the gradient reduction on all but the last micro-batch, agreeing
on numbers (the logged loss, metrics, "stop") across ranks, and checkpoints. The FSDP strategy
lives in :mod:`mixprec.training.sharded`; :mod:`mixprec.training.choose` picks one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from .. import distenv as env
from ..integrity import remove_stale_temporaries
from ..parallel import ddp
from ..policy import Policy
from ..prepare import module_device, prepare_many
from . import state as ts
from .portable import fill_fresh_optimizer, read_directory

__all__ = ["Strategy", "DistributedStrategy", "DDPStrategy", "distributed_loader",
           "rank_checkpoint"]

log = logging.getLogger("mixprec")


def _sampler_of(data: DataLoader):
    sampler = data.sampler
    inner = getattr(data.batch_sampler, "sampler", None)
    return sampler if isinstance(sampler, DistributedSampler) else inner


def distributed_loader(data, *, rank: int, world: int):
    """``data`` rebuilt over a ``DistributedSampler`` when it is a plain ``DataLoader``.

    Keeps ``batch_size`` (per rank), ``shuffle`` (seeded from the loader's ``generator``, else
    0), ``drop_last``, ``collate_fn``, ``num_workers`` and the other worker options. A loader
    that already has a ``DistributedSampler``, an ``IterableDataset`` loader (it must shard itself)
    and data that is not a ``DataLoader`` are returned as they are.

    Raises:
        ValueError: a loader with a custom sampler or batch sampler (give it a
            ``DistributedSampler`` yourself).
    """
    if not isinstance(data, DataLoader) or isinstance(data.dataset, IterableDataset):
        return data
    if isinstance(_sampler_of(data), DistributedSampler):
        return data
    if data.batch_size is None or not isinstance(data.sampler, (RandomSampler, SequentialSampler)):
        raise ValueError(f"this DataLoader has a custom {type(data.sampler).__name__} or batch "
                         f"sampler, which mixprec cannot split across ranks; build it with a "
                         f"torch.utils.data.DistributedSampler (it is then used as it is)")
    seed = data.generator.initial_seed() if data.generator is not None else 0
    sampler = DistributedSampler(data.dataset, num_replicas=world, rank=rank,
                                 shuffle=isinstance(data.sampler, RandomSampler), seed=seed,
                                 drop_last=data.drop_last)
    options = dict(batch_size=data.batch_size, sampler=sampler, num_workers=data.num_workers,
                   collate_fn=data.collate_fn, pin_memory=data.pin_memory,
                   drop_last=data.drop_last, timeout=data.timeout,
                   worker_init_fn=data.worker_init_fn, generator=data.generator,
                   multiprocessing_context=data.multiprocessing_context,
                   persistent_workers=data.persistent_workers)
    if data.num_workers > 0:
        options["prefetch_factor"] = data.prefetch_factor
    return DataLoader(data.dataset, **options)


class Strategy:
    """One process: every hook is the identity (the base of the distributed strategies)."""

    name = "single"
    distributed = False
    checkpoint_suffix = ".pt"   # ModelCheckpoint's file names; "" for checkpoint directories

    def __init__(self, reduce_dtype: torch.dtype = torch.float32):
        self.reduce_dtype = reduce_dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reduce_dtype={self.reduce_dtype})"

    @property
    def is_main(self) -> bool:
        """True on the rank that prints and writes files."""
        return True

    # -- set-up -----------------------------------------------------------------------------
    def device(self, model: nn.Module) -> torch.device:
        """Where to train when the Trainer is given no ``device``."""
        return module_device(model)

    def setup(self, model: nn.Module, optimizer, policy: Policy, ops: dict | None = None):
        """Prepare (and wrap) the model for ``policy`` (``ops``: the autocast options of
        :func:`mixprec.prepare`); returns ``(model, optimizer)``."""
        model, (optimizer,) = prepare_many(model, [optimizer], policy, **(ops or {}))
        return model, optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module (plain state-dict names)."""
        return model

    # -- data -------------------------------------------------------------------------------
    def loader(self, data):
        """The data each rank iterates (a DataLoader rebuilt over a DistributedSampler)."""
        return data

    def begin_epoch(self, data, epoch: int) -> None:
        """Called before each epoch's ``iter(data)`` (``set_epoch`` of a DistributedSampler)."""

    def micro_batch(self, model: nn.Module, last: bool):
        """Context for one micro-batch's forward and backward (``no_sync`` unless ``last``)."""
        return contextlib.nullcontext()

    # -- agreement across ranks -------------------------------------------------------------
    def mean(self, value: torch.Tensor) -> float:
        """A scalar tensor averaged over the ranks, as a float (a host sync)."""
        return float(value)

    def sum(self, values: list[float], device) -> list[float]:
        """Floats summed over the ranks."""
        return list(values)

    def any(self, flag: bool, device) -> bool:
        """True when ``flag`` is true on any rank."""
        return bool(flag)

    def metric_values(self, metrics, device) -> dict:
        """``{name: value}`` of metrics accumulated over every rank's batches."""
        return {m.name: m.compute() for m in metrics}

    def failed(self, exc: BaseException) -> None:
        """Called when fit() raises; may raise a clearer error instead."""

    def finish(self) -> None:
        """Called when fit() returns or raises, after the callbacks' ``on_fit_end``."""

    # -- checkpoints ------------------------------------------------------------------------
    def save(self, trainer, path) -> None:
        ts.write_checkpoint(ts.trainer_state(trainer), path)

    def load(self, trainer, path, *, verify: bool = True) -> None:
        remove_stale_temporaries(Path(path).parent)  # of saves an interrupted run left
        ckpt = read_any(path, trainer.optimizer, verify=verify)
        ts.load_trainer_state(trainer, rank_checkpoint(ckpt, path, 0, 1), path)


class DistributedStrategy(Strategy):
    """What DDP and FSDP share: samplers, agreement across ranks, per-rank RNG in checkpoints."""

    distributed = True
    _sent: tuple = ()   # the tensor of the latest all-reduce below, for finish()

    @property
    def is_main(self) -> bool:
        return env.is_main_process()

    def device(self, model: nn.Module) -> torch.device:
        return env.device()

    def loader(self, data):
        return distributed_loader(data, rank=env.rank(), world=env.world_size())

    def begin_epoch(self, data, epoch: int) -> None:
        sampler = _sampler_of(data) if isinstance(data, DataLoader) else None
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        dist.all_reduce(t, op=op)
        self._sent = (t,)
        return t

    def mean(self, value: torch.Tensor) -> float:
        t = self._all_reduce(value.detach().float().reshape(1).clone())
        return float(t) / env.world_size()

    def sum(self, values: list[float], device) -> list[float]:
        return self._all_reduce(torch.tensor(values, dtype=torch.float64, device=device)).tolist()

    def any(self, flag: bool, device) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        return bool(self._all_reduce(t, op=dist.ReduceOp.MAX).item())

    def finish(self) -> None:
        """Wait until the collectives' worker threads are done (:func:`.env.settle`).

        The script may end right after ``fit``; a gloo worker still letting go of a collective's
        tensors when the interpreter finalizes aborts the process.
        """
        sent, self._sent = self._sent, ()
        env.settle(sent)

    def metric_values(self, metrics, device) -> dict:
        out = {}
        for m in metrics:
            fields = getattr(m, "sum_state", None)
            if fields:  # additive state: sum it over the ranks, then compute once
                merged = copy.copy(m)
                sums = self.sum([float(getattr(m, f)) for f in fields], device)
                for f, v in zip(fields, sums):
                    setattr(merged, f, v)
                out[m.name] = merged.compute()
            else:       # no declared state: average the per-rank values (equal-sized shards)
                out[m.name] = self.sum([m.compute()], device)[0] / env.world_size()
        return out

    def failed(self, exc: BaseException) -> None:
        where = f"rank {env.rank()} of {env.world_size()}"
        if _collective_failure(exc):
            raise RuntimeError(f"{where}: a collective operation failed, most likely because "
                               f"another rank raised or stopped (see its log): {exc}") from exc
        log.error("mixprec: %s failed: %s: %s", where, type(exc).__name__, exc)

    def rank_states(self, trainer) -> list[dict]:
        """Every rank's RNG states (gathered: they differ per rank)."""
        mine = {"rng": ts.capture_rng(trainer.state.data),
                "epoch_start_rng": trainer.state.epoch_start_rng,
                "metrics": ts.metric_states(trainer)}
        gathered: list = [None] * env.world_size()
        dist.all_gather_object(gathered, mine)
        return gathered

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank when ``what`` failed on any (:func:`mixprec.distenv.agree`)."""
        env.agree(error, what)


def _collective_failure(exc: BaseException) -> bool:
    """A failed or timed-out collective (gloo's come through autograd as plain RuntimeErrors)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("gloo" in text or "nccl" in text)


def read_any(path, optimizer, *, verify: bool = True) -> dict:
    """A checkpoint file, or an FSDP checkpoint directory read whole (in this process); its
    checksums checked unless ``verify`` is False."""
    if Path(path).is_dir():
        return fill_fresh_optimizer(read_directory(path, verify=verify), optimizer)
    return ts.read_checkpoint(path, verify=verify)


def rank_checkpoint(ckpt: dict, path, rank: int, world: int) -> dict:
    """``ckpt`` with this rank's RNG states (a checkpoint saved at another world size only at an
    epoch boundary: mid-epoch, the position refers to another split of the data)."""
    saved_world = ckpt.get("world_size", 1)
    ranks = ckpt.get("ranks")
    if saved_world != world and ckpt["counters"]["batch_in_epoch"] > 0:
        raise ValueError(f"checkpoint {str(path)!r} was saved by {saved_world} process(es) in the "
                         f"middle of an epoch, and this run has {world}: resume mid-epoch at the "
                         f"same world size, or from a checkpoint saved at an epoch end "
                         f"(ModelCheckpoint(every_epoch=True))")
    if not ranks:
        return ckpt
    mine = ranks[rank % len(ranks)]
    return {**ckpt, "rng": mine["rng"], "epoch_start_rng": mine["epoch_start_rng"],
            "metrics": mine.get("metrics") if saved_world == world else None}


class DDPStrategy(DistributedStrategy):
    """``DistributedDataParallel``: a full model per rank, gradients averaged in ``reduce_dtype``.

    Before :func:`mixprec.prepare`, rank 0's fp32 weights are broadcast, so the fp32 masters made
    at O2 agree on every rank. Checkpoints: rank 0 writes one file (atomically) holding every
    rank's RNG states.
    """

    name = "ddp"
    ddp_kwargs: dict = {}  # DistributedDataParallel's options (Trainer's ``ddp_kwargs=``)

    def setup(self, model: nn.Module, optimizer, policy: Policy, ops: dict | None = None):
        env.require_group("Trainer(strategy='ddp')")
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        model, (optimizer,) = prepare_many(model, [optimizer], policy, **(ops or {}))
        return ddp(model, reduce_dtype=self.reduce_dtype, **self.ddp_kwargs), optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def micro_batch(self, model: nn.Module, last: bool):
        return contextlib.nullcontext() if last else model.no_sync()

    def save(self, trainer, path) -> None:
        ranks = self.rank_states(trainer)
        error = None
        if self.is_main:
            try:
                state = ts.trainer_state(trainer)
                state.update(world_size=env.world_size(), ranks=ranks)
                ts.write_checkpoint(state, path)
            except Exception as exc:  # reported on every rank by agree()
                error = exc
        self.agree(error, f"saving checkpoint {str(path)!r}")

    def load(self, trainer, path, *, verify: bool = True) -> None:
        error = None
        try:
            if self.is_main:  # of saves an interrupted run left
                remove_stale_temporaries(Path(path).parent)
            ckpt = rank_checkpoint(read_any(path, trainer.optimizer, verify=verify), path,
                                   env.rank(), env.world_size())
            ts.load_trainer_state(trainer, ckpt, path)
        except Exception as exc:
            error = exc
        self.agree(error, f"loading checkpoint {str(path)!r}")
