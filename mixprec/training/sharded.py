"""The FSDP2 strategy of :class:`mixprec.Trainer`: sharded training, sharded checkpoints.

A checkpoint is a directory written by every rank through ``torch.distributed.checkpoint``
(model and optimizer shards, loadable at another world size), plus ``trainer.pt`` (scaler,
scheduler, counters, history; written by rank 0) and ``rank{N}.pt`` (each rank's RNG states). It
is written under a temporary name and renamed into place when every rank is done, with the
checksums of its files (:func:`mixprec.integrity.save_directory`), so a failure leaves an older
checkpoint at ``path`` intact. ``load`` also takes a one-process or DDP file
(:mod:`mixprec.training.portable`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from .. import distenv as env
from ..integrity import remove_stale_temporaries, save_directory, seal, verify_directory
from ..parallel.sharding import fsdp
from ..policy import Policy
from . import state as ts
from .portable import META, checkpoint_io, load_file_sharded, read_meta
from .strategy import DistributedStrategy, rank_checkpoint

__all__ = ["FSDPStrategy"]

_META = META


class FSDPStrategy(DistributedStrategy):
    """FSDP2 (``fully_shard``): see :func:`mixprec.parallel.fsdp` for what each level does."""

    name = "fsdp"
    checkpoint_suffix = ""

    def setup(self, model: nn.Module, optimizer, policy: Policy, ops: dict | None = None):
        env.require_group("Trainer(strategy='fsdp')")
        lists = {k: v for k, v in (ops or {}).items() if k in ("low_precision_ops", "fp32_ops",
                                                                   "emulate_fp16")}
        return fsdp(model, optimizer, policy=policy, reduce_dtype=self.reduce_dtype, **lists)

    def save(self, trainer, path) -> None:
        path = Path(path)
        if path.is_file():
            raise ValueError(f"{str(path)!r} is a file; an FSDP checkpoint is a directory: give "
                             f"a new path")
        tensors, groups = _sharded_state(trainer)
        ranks = self.rank_states(trainer)
        meta = None
        if self.is_main:
            meta = {**ts.trainer_meta(trainer), "world_size": env.world_size(),
                    "param_groups": groups}

        def write(tmp: Path) -> None:
            checkpoint_io(lambda: dcp.save(tensors, checkpoint_id=str(tmp)), "saving", path)
            if meta is not None:
                torch.save(seal(meta), tmp / _META)
            torch.save(ranks[env.rank()], tmp / f"rank{env.rank()}.pt")
        save_directory(path, write)

    def load(self, trainer, path, *, verify: bool = True) -> None:
        path = Path(path)
        if path.is_file():  # a one-process or DDP checkpoint
            return self._load_file(trainer, path, verify)
        error, meta = None, None
        try:
            if self.is_main:  # of saves an interrupted run left; the checksums of this one
                remove_stale_temporaries(path.parent)
                verify_directory(path, verify=verify)
            meta = read_meta(path, verify=verify)
            ts.check_compatible(trainer, meta, path)
            rank_file = path / f"rank{env.rank() % meta['world_size']}.pt"
            meta["ranks"] = [torch.load(rank_file, map_location="cpu", weights_only=True)]
            meta = rank_checkpoint(meta, path, env.rank(), env.world_size())
        except Exception as exc:
            error = exc
        self.agree(error, f"loading checkpoint {str(path)!r}")
        if meta["param_groups"] is None:
            state = dict(zip(("model", "optimizer"), get_state_dict(trainer.model,
                                                                    trainer.optimizer)))
            checkpoint_io(lambda: dcp.load(state, checkpoint_id=str(path)), "loading", path)
            set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        else:  # saved before the optimizer had state: weights and hyper-parameters only
            state = {"model": get_model_state_dict(trainer.model)}
            checkpoint_io(lambda: dcp.load(state, checkpoint_id=str(path)), "loading", path)
            set_model_state_dict(trainer.model, state["model"])
            trainer.optimizer.state.clear()
            for group, saved in zip(trainer.optimizer.param_groups, meta["param_groups"]):
                group.update(saved)
        _load_rest(trainer, meta)

    def _load_file(self, trainer, path: Path, verify: bool) -> None:
        """A one-process or DDP checkpoint file: every rank reads it and keeps its shards."""
        error, ckpt = None, None
        try:
            if self.is_main:  # of saves an interrupted run left
                remove_stale_temporaries(path.parent)
            ckpt = ts.read_checkpoint(path, verify=verify)
            ts.check_compatible(trainer, ckpt, path)
            ckpt = rank_checkpoint(ckpt, path, env.rank(), env.world_size())
        except Exception as exc:
            error = exc
        self.agree(error, f"loading checkpoint {str(path)!r}")
        load_file_sharded(trainer, ckpt)
        _load_rest(trainer, ckpt)


def _load_rest(trainer, ckpt: dict) -> None:
    """Scaler, scheduler, counters, history and RNG states (after the tensors)."""
    trainer.scaler.load_state_dict(ckpt["scaler"])
    if trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(ckpt["scheduler"])
    ts.restore_progress(trainer, ckpt)


def _sharded_state(trainer) -> tuple[dict, list | None]:
    """What DCP saves, and the param groups' options when the optimizer has no state yet.

    ``get_state_dict`` gives a stateless optimizer zero state by stepping it at lr 0 (Adam's
    step count becomes 1): that state is dropped again, so saving never changes training.
    """
    optimizer = trainer.optimizer
    fresh = not any(optimizer.state.values())
    model_sd, optim_sd = get_state_dict(trainer.model, optimizer)
    if not fresh:
        return {"model": model_sd, "optimizer": optim_sd}, None
    optimizer.state.clear()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"model": model_sd}, groups
