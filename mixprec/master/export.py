"""``fp32_state_dict``: a model's weights in fp32, taken from the fp32 masters where they exist."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from .optimizer import MasterWeightOptimizer

__all__ = ["fp32_state_dict"]


def fp32_state_dict(model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> OrderedDict[str, Any]:
    """An fp32 copy of ``model.state_dict()``, taking weights from fp32 masters where they exist.

    Floating parameters and buffers are returned as fp32 copies (low-precision weights whose
    master lives in ``optimizer`` are taken from the master, so no precision is lost); integer
    buffers are copied unchanged. The result loads into an fp32 copy of the model.

    Args:
        model: the (possibly low-precision) model.
        optimizer: its ``MasterWeightOptimizer``; None, or another torch optimizer, means no
            masters (weights are upcast from the model).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``optimizer`` not an optimizer.
        ValueError: ``optimizer`` is a ``MasterWeightOptimizer`` over another model's params.

    Example:
        >>> model = nn.Linear(2, 2).to(torch.bfloat16)
        >>> fp32_state_dict(model)["weight"].dtype
        torch.float32
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be None or a torch.optim.Optimizer; got {type(optimizer).__name__}"
        )
    masters = optimizer.masters_by_param() if isinstance(optimizer, MasterWeightOptimizer) else {}
    source = model.state_dict(keep_vars=True)
    if masters and not any(torch.is_tensor(v) and v in masters for v in source.values()):
        raise ValueError("optimizer holds none of this model's parameters; pass the optimizer "
                         "that was built over this model")
    out: OrderedDict[str, Any] = OrderedDict()
    with torch.no_grad():
        for name, value in source.items():
            if not torch.is_tensor(value):
                out[name] = value  # extra state
                continue
            value = masters.get(value, value).detach()
            out[name] = (value.to(torch.float32, copy=True) if value.is_floating_point()
                         else value.clone())
    out._metadata = getattr(source, "_metadata", None)  # type: ignore[attr-defined]
    return out
