"""Argument checks of the loss scalers (clear errors naming what was received), and what they
ask of an optimizer: its gradients, its parameters' names, whether it skips on the device."""

from __future__ import annotations

import math

import torch
from torch.optim import optimizer as torch_optimizer

from .protocol import INTERNAL, owns_gradients
from .state import positive_scale

__all__ = ["check_clip_args", "as_number", "check_optimizer", "describe", "param_names",
           "grad_pairs", "skips_on_device", "torch_skips_on_device"]

#: torch optimizers whose fused kernel takes ``found_inf`` (and skips on it) when built with
#: ``fused=True``, for every floating dtype (exact types: a subclass may step otherwise; fused
#: Adagrad refuses a float32 flag beside bf16 parameters).
_FUSED_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


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


def torch_skips_on_device(optimizer) -> bool:
    """Whether a torch optimizer (not a master optimizer) can take the overflow flag with its
    step, as ``torch.amp.GradScaler`` hands it to a fused optimizer (``optimizer.found_inf``):
    torch's fused kernel for every group (Adam, AdamW, SGD built with ``fused=True``),
    dense gradients, state made for every parameter with a gradient (a first step makes it, on a
    skipped step too: fused SGD's momentum buffers start as ``empty_like``), and no step hooks
    (they must not run on a skipped step), and no caller that tells a skipped step by
    ``step()`` not being called (``optimizer.skip_on_device = False``, set by the Accelerate
    seam). Its kernel then skips on the device and takes back
    its step count: parameters and state stay bitwise as they were, with no host read before."""
    if (type(optimizer) not in _FUSED_TYPES
            or not getattr(optimizer, "_step_supports_amp_scaling", False)
            or not getattr(optimizer, "skip_on_device", True)  # (the Accelerate seam: see below)
            or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
            or torch_optimizer._global_optimizer_post_hooks
            or any(not getattr(h, INTERNAL, False)
                   for h in torch_optimizer._global_optimizer_pre_hooks.values())):
        return False
    state, sgd = optimizer.state, type(optimizer) is torch.optim.SGD
    for group in optimizer.param_groups:
        if not group.get("fused"):
            return False
        key = ("momentum_buffer" if group["momentum"] else None) if sgd else "step"
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse or (key is not None and key not in state.get(p, ())):
                return False
    return True
