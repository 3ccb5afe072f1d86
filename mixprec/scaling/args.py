"""Argument checks of the loss scalers (clear errors naming what was received), and what they
ask of an optimizer: its gradients, its parameters' names, whether it skips on the device."""

from __future__ import annotations

import math

import torch

from .protocol import owns_gradients
from .state import positive_scale

__all__ = ["check_clip_args", "as_number", "check_optimizer", "describe", "param_names",
           "grad_pairs", "skips_on_device"]


def check_clip_args(max_norm, norm_type) -> None:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
            or not 0 < max_norm < math.inf:
        raise ValueError(f"max_norm must be a positive finite number; got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) \
            or not norm_type > 0:
        raise ValueError(f"norm_type must be a positive number or float('inf'); "
                         f"got {norm_type!r}")


def as_number(value, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what} must be a number or a 1-element tensor; got a tensor of "
                             f"shape {tuple(value.shape)}")
        value = value.item()
    return positive_scale(what, value)


def check_optimizer(optimizer) -> None:
    if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
        raise TypeError(f"expected a torch.optim.Optimizer (or MasterWeightOptimizer); "
                        f"got {describe(optimizer)}")


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of {x.dtype}"
    return f"{type(x).__name__} {x!r}"


def param_names(optimizer, modules) -> dict[int, str]:
    """id(model parameter) -> a name: the names in ``modules`` (weak references to attached
    modules), else the position in ``optimizer.param_groups``."""
    model_param = getattr(optimizer, "model_param", None)
    if not (owns_gradients(optimizer) and callable(model_param)):
        model_param = _same
    names = {id(model_param(p)): f"param_groups[{g}][{i}]"
             for g, group in enumerate(optimizer.param_groups)
             for i, p in enumerate(group["params"])}
    for ref in modules:
        module = ref()
        if module is not None:
            names.update({id(p): n for n, p in module.named_parameters()})
    return names


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def skips_on_device(optimizer) -> bool:
    skips = getattr(optimizer, "skips_on_device", None)
    return callable(skips) and bool(skips())


def grad_pairs(optimizer, owner: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if owner:
        return optimizer.grads_for_step()
    return [(p, p.grad) for g in optimizer.param_groups for p in g["params"]
            if p.grad is not None]
