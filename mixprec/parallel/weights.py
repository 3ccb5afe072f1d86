"""Full fp32 weights with plain names from a model trained in one process, under DDP or FSDP2."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..master import fp32_state_dict as _local_fp32_state_dict
from .env import is_fsdp

__all__ = ["unwrap", "fp32_state_dict"]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a ``DistributedDataParallel`` wrapper (else ``model`` itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def fp32_state_dict(model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> OrderedDict[str, Any]:
    """An fp32 copy of the model's weights, from fp32 masters where they exist, with plain names.

    * One process: as :func:`mixprec.master.fp32_state_dict` (masters of a
      :class:`mixprec.MasterWeightOptimizer` are used).
    * DDP: the wrapped module's weights (no ``module.`` prefix), masters used likewise.
    * FSDP2: every sharded tensor is gathered into a full CPU tensor (the fp32 shards are the
      masters; ``optimizer`` is not needed). This is a collective: call it on every rank. Every
      rank gets the full dict, one tensor gathered at a time.

    The result loads with ``load_state_dict`` into a plain, single-process fp32 copy of the model.

    Args:
        model: the model (plain, prepared, DDP-wrapped or FSDP-sharded).
        optimizer: its optimizer (a MasterWeightOptimizer holds the fp32 masters), or None.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``optimizer`` not an optimizer.
        ValueError: ``optimizer`` is a ``MasterWeightOptimizer`` over another model's params.

    Example:
        >>> model = nn.Linear(2, 2).to(torch.bfloat16)
        >>> fp32_state_dict(model)["weight"].dtype
        torch.float32
    """
    if not is_fsdp(model):
        return _local_fp32_state_dict(unwrap(model), optimizer)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be None or a torch.optim.Optimizer; "
                        f"got {type(optimizer).__name__}")
    source = model.state_dict()
    out: OrderedDict[str, Any] = OrderedDict()
    with torch.no_grad():
        for name, value in source.items():
            if not torch.is_tensor(value):
                out[name] = value
                continue
            gather = getattr(value, "full_tensor", None)  # a DTensor shard
            full = gather() if gather is not None else value.detach()
            full = full.to("cpu")
            out[name] = (full.to(torch.float32, copy=True) if full.is_floating_point()
                         else full.clone())
    out._metadata = getattr(source, "_metadata", None)  # type: ignore[attr-defined]
    return out
