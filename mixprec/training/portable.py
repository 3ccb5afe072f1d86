"""Trainer checkpoints across strategies: one-process/DDP files and FSDP directories.

The two forms hold the same things in two layouts:

* one process or DDP: one ``torch.save`` file: the model's fp32 ``state_dict``, the optimizer's
  torch ``state_dict`` (state numbered by the parameter's position in ``param_groups``), the
  scaler, scheduler, counters, history and RNG states (DDP: every rank's, under ``"ranks"``);
* FSDP: a directory: ``torch.distributed.checkpoint`` shards of the model and of the optimizer
  (state keyed by the parameter's qualified name, ``param_groups`` listing those names in
  order), ``trainer.pt`` (the rest) and ``rank{N}.pt`` (each rank's RNG states).

Both Trainers build their optimizer from the same user optimizer, so position ``i`` in one is
the ``i``-th name in the other. :meth:`mixprec.Trainer.load` takes either form under every
strategy; :func:`convert_checkpoint` writes a directory's content as one file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from ..integrity import verify_directory
from ..masters.kahan import keep_pair
from ..optim.checkpoint import MASTERS_KEY
from ..optim.states import COMPENSATION_KEY
from ..shards import local
from . import state as ts

__all__ = ["convert_checkpoint", "read_directory", "read_meta", "load_file_sharded", "META",
           "checkpoint_io"]

META = "trainer.pt"


def read_meta(path: Path, *, verify: bool = True) -> dict:
    """``trainer.pt`` of an FSDP checkpoint directory (checked; its checksum unless ``verify``
    is False)."""
    if not (path / META).is_file():
        raise FileNotFoundError(f"no Trainer checkpoint at {str(path)!r}: a directory checkpoint "
                                f"(strategy='fsdp') holds {META}, and none is there")
    meta = ts.read_checkpoint(path / META, verify=verify)
    if "world_size" not in meta:
        raise ValueError(f"{str(path / META)!r} is not an FSDP Trainer checkpoint")
    return meta


def checkpoint_io(action, what: str, path) -> None:
    """Run a DCP save or load; its ``CheckpointException`` (a ``BaseException``, which
    ``except Exception`` lets through) becomes a ``RuntimeError`` naming the path."""
    try:
        action()
    except CheckpointException as exc:
        causes = "; ".join(f"rank {r}: {type(e).__name__}: {e}"  # (exception, traceback)
                           for r, (e, _) in sorted(exc.failures.items()))
        raise RuntimeError(f"{what} FSDP checkpoint {str(path)!r} failed ({causes})") from exc


def read_directory(path, *, verify: bool = True) -> dict:
    """An FSDP checkpoint directory as the dict a one-process checkpoint file holds.

    Reads every shard in this process (no process group needed): the full model and optimizer
    state must fit in CPU memory. When the optimizer had no state yet at saving time,
    ``"optimizer"`` is None and ``"param_groups"`` holds the groups' options. A Kahan weight's
    model entry becomes weight + compensation, the fp32 value a one-process file holds.

    Raises:
        FileNotFoundError: no ``trainer.pt`` (or a rank's RNG file) in ``path``.
        ValueError: a file that does not match its checksum (unless ``verify`` is False).
        RuntimeError: the shards cannot be read (a damaged directory); names ``path``.
    """
    path = Path(path)
    verify_directory(path, verify=verify)
    meta = read_meta(path, verify=verify)
    ranks = [torch.load(path / f"rank{r}.pt", map_location="cpu", weights_only=True)
             for r in range(meta["world_size"])]
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        checkpoint_io(lambda: dcp_to_torch_save(path, whole), "reading", path)
        content = torch.load(whole, map_location="cpu", weights_only=True)
    ckpt = {**meta, "model": content["model"], "ranks": ranks, "optimizer": None}
    if meta["param_groups"] is None:
        ckpt["optimizer"] = _by_position(content["optimizer"])
        ckpt["model"] = _kahan_values(content["model"], content["optimizer"]["state"])
    return ckpt


def _kahan_values(model: dict, state: dict) -> dict:
    """Model entries by name, a Kahan weight's (its 16-bit value, saved in fp32) replaced by
    weight + compensation: exact in fp32, and what a one-process file holds for it."""
    out = dict(model)
    for name, entry in state.items():
        comp = entry.get(COMPENSATION_KEY) if isinstance(entry, dict) else None
        weight = out.get(name)
        if torch.is_tensor(comp) and torch.is_tensor(weight) and comp.shape == weight.shape:
            out[name] = weight.to(comp.dtype).float() + comp.float()
    return out


def _by_position(osd: dict) -> dict:
    """An optimizer state dict keyed by qualified names, renumbered by position."""
    index: dict[str, int] = {}
    groups = []
    for group in osd["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    return {"state": {index[name]: entry for name, entry in osd["state"].items()},
            "param_groups": groups}


def fill_fresh_optimizer(ckpt: dict, optimizer: torch.optim.Optimizer) -> dict:
    """``ckpt`` with an optimizer state dict built from its saved group options when it was
    saved before the optimizer had state (numbering from ``optimizer``)."""
    if ckpt["optimizer"] is not None:
        return ckpt
    groups = [{**now, **saved} for now, saved in zip(optimizer.state_dict()["param_groups"],
                                                      ckpt["param_groups"])]
    return {**ckpt, "optimizer": {"state": {}, "param_groups": groups}}


def convert_checkpoint(src, dst, *, verify: bool = True) -> None:
    """Write the FSDP checkpoint directory ``src`` as the one file ``dst`` that a one-process
    or DDP :class:`mixprec.Trainer` writes and loads (in one process; no process group).

    :meth:`mixprec.Trainer.load` also takes the directory itself under every strategy, and an
    FSDP Trainer takes a one-process or DDP file: load it there and ``save`` to get the
    directory form. A checkpoint saved in the middle of an epoch resumes only at the world size
    that saved it.

    Args:
        src: an FSDP Trainer checkpoint directory.
        dst: the file to write (replaced atomically).
        verify: check the checksums of ``src``'s files first (False: a directory edited on
            purpose).

    Raises:
        FileNotFoundError: ``src`` is not a directory holding a Trainer checkpoint.
        ValueError: ``dst`` is a directory, ``src`` is not a Trainer checkpoint, or one of its
            files does not match its checksum.
        RuntimeError: the shards in ``src`` cannot be read (a damaged directory).

    Example:
        >>> mp.convert_checkpoint("run/ckpt-step400", "run/step400.pt")  # doctest: +SKIP
    """
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"convert_checkpoint reads an FSDP checkpoint directory; "
                                f"{str(src)!r} is not a directory (a one-process or DDP file "
                                f"loads into an FSDP Trainer as it is)")
    ckpt = read_directory(src, verify=verify)
    if ckpt["optimizer"] is None:
        raise ValueError(f"{str(src)!r} was saved before the first step (no optimizer state): "
                         f"load it with Trainer.load, which takes the directory as it is")
    del ckpt["param_groups"]
    ts.write_checkpoint(ckpt, dst)


def load_file_sharded(trainer, ckpt: dict) -> None:
    """Load a one-process/DDP checkpoint dict into an FSDP Trainer: every rank reads the full
    tensors and keeps its shard (parameters and state shaped as their parameter)."""
    set_model_state_dict(trainer.model, ckpt["model"],
                         options=StateDictOptions(full_state_dict=True))
    optimizer = trainer.optimizer
    osd = {k: v for k, v in ckpt["optimizer"].items() if k != MASTERS_KEY}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if sum(len(g["params"]) for g in osd["param_groups"]) != len(params):
        raise ValueError(f"the checkpoint's optimizer holds "
                         f"{sum(len(g['params']) for g in osd['param_groups'])} parameters and "
                         f"this trainer's {len(params)}: build the optimizer the same way")
    state = {i: {k: _shard_like(v, params[i]) for k, v in entry.items()}
             for i, entry in osd["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": osd["param_groups"]})
    _kahan_pairs(trainer.model, optimizer, ckpt["model"])


def _kahan_pairs(model, optimizer, values: dict) -> None:
    """Each Kahan pair as it was saved: the model load rounded the file's fp32 value (weight +
    compensation) to the nearest 16-bit weight, which at a tie (weight + compensation exactly
    half an ulp from the weight) is the other neighbour; the weight becomes the value minus the
    loaded compensation where that is exact, as in one process
    (:func:`mixprec.masters.kahan.keep_pair`, on this rank's shards)."""
    compensation = getattr(optimizer, "compensation", None)
    if not callable(compensation):
        return
    for name, param in model.named_parameters():
        comp, value = compensation(param), values.get(name)
        if (comp is None or comp.dtype != param.dtype or not torch.is_tensor(value)
                or value.shape != param.shape):
            continue  # no Kahan compensation (a split remainder is an int16)
        keep_pair(local(param.detach()), local(comp), local(_shard_like(value.float(), param)))


def _shard_like(value, param: torch.Tensor):
    """A full tensor shaped as the sharded ``param``: this rank's shard of it (no
    communication: every rank holds the full value)."""
    if (isinstance(param, DTensor) and torch.is_tensor(value) and not isinstance(value, DTensor)
            and value.shape == param.shape):
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return value
