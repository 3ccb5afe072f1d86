"""``fp32_state_dict``: an fp32 copy of any model's weights, from its fp32 masters where they
exist (a prepared model's companions, :mod:`mixprec.statedict`), for one process, DDP and FSDP2.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from .distenv import is_fsdp, unwrap
from .dtypes import to_dtype
from .optim import CompactMasterOptimizer, MasterWeightOptimizer
from .statedict import links_of

__all__ = ["fp32_state_dict"]


def fp32_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    dtype: Any = torch.float32) -> OrderedDict[str, Any]:
    """An fp32 copy of a model's weights, from its fp32 masters where they exist, plain names.

    The one path for fp32 weights (``mp.fp32_state_dict``, ``mp.parallel.fp32_state_dict``):

    * one process: floating parameters and buffers as fp32 copies, low-precision weights taken
      from the fp32 masters of ``optimizer`` (a :class:`mixprec.MasterWeightOptimizer`), else
      from the companions the prepared model holds (its masters, or a copy's shadows: ``model``
      prepared, inside a prepared model, or holding one), else upcast; integer buffers copied
      unchanged;
    * DDP: the wrapped module's weights (no ``module.`` prefix), likewise;
    * FSDP2: every sharded tensor gathered into a full CPU tensor (the fp32 shards are the
      masters; with ``master="split"`` or ``"kahan"`` pass the optimizer
      :func:`mixprec.parallel.fsdp` returned for the value the pairs hold: the model alone
      holds the 16-bit weights, which is what its sharded checkpoints save). A collective:
      call it on every rank; every rank gets the full dict.

    The result loads with ``load_state_dict`` into a plain, single-process fp32 copy.

    Args:
        model: the model (plain, prepared, DDP-wrapped or FSDP-sharded).
        optimizer: its optimizer (a MasterWeightOptimizer holds the fp32 masters), or None.
        dtype: the floating dtype of the values (PaddlePaddle's ``decorate(save_dtype=)``):
            fp32 (the default), or "bf16", "fp16", "fp64": the fp32 values cast once, with
            torch's rounding (a checkpoint of half the size, or one a 16-bit deployment reads).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``optimizer`` not an optimizer.
        ValueError: ``optimizer`` is a ``MasterWeightOptimizer`` over another model's params;
            a ``dtype`` other than fp32, bf16, fp16 or fp64.

    Example:
        >>> model = nn.Linear(2, 2).to(torch.bfloat16)
        >>> fp32_state_dict(model)["weight"].dtype
        torch.float32
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be None or a torch.optim.Optimizer; got {type(optimizer).__name__}")
    save = to_dtype(dtype, what="dtype")
    if save not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"dtype must be 'fp32', 'bf16', 'fp16' or 'fp64'; got {dtype!r}")
    model = unwrap(model)
    source = model.state_dict(keep_vars=True)  # FSDP: the sharded parameters themselves
    if isinstance(optimizer, (MasterWeightOptimizer, CompactMasterOptimizer)):
        masters = optimizer.masters_by_param()
        if masters and not any(torch.is_tensor(v) and v in masters for v in source.values()):
            raise ValueError("optimizer holds none of this model's parameters; pass the "
                             "optimizer that was built over this model")
    else:  # (a prepared model inside another module: its own companions; a sub-module of
        masters = {}  # a prepared model: the model's)
        for link in links_of(model):
            masters.update(link.settle())
    out = _copy(source, masters, gather=is_fsdp(model))
    if save != torch.float32:
        for name, value in out.items():
            if torch.is_tensor(value) and value.is_floating_point():
                out[name] = value.to(save)
    return out


def _copy(source: dict, masters: dict, gather: bool) -> OrderedDict[str, Any]:
    out: OrderedDict[str, Any] = OrderedDict()
    with torch.no_grad():
        for name, value in source.items():
            if not torch.is_tensor(value):
                out[name] = value  # extra state
                continue
            master = masters.get(value)
            value = (value if master is None else master.to(value.device)).detach()
            full = getattr(value, "full_tensor", None) if gather else None  # a DTensor shard
            if full is not None:
                value = full().to("cpu")
            out[name] = (value.to(torch.float32, copy=True) if value.is_floating_point()
                         else value.clone())
    out._metadata = getattr(source, "_metadata", None)  # type: ignore[attr-defined]
    return out
