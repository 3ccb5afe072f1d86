"""Gradient passes for the loss scalers: fused unscale + inf/NaN check, naming bad parameters."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..master import is_master_optimizer

__all__ = ["is_master_optimizer", "unscale_and_check_", "nonfinite_param_names"]




def _grad_values(param) -> torch.Tensor | None:
    """The dense tensor holding a parameter's gradient values (sparse grads are coalesced first)."""
    grad = param.grad
    if grad is None:
        return None
    if grad.is_sparse:
        if not grad.is_coalesced():
            # Duplicate indices are summed here, so the check sees the values the step will use.
            param.grad = grad = grad.coalesce()
        return grad._values()
    return grad


def unscale_and_check_(param_groups, inv_scale: torch.Tensor, out_device) -> torch.Tensor:
    """Multiply every gradient by ``inv_scale`` in place; return a 0-d inf/NaN flag.

    One fused foreach kernel per (device, dtype) group; no host sync. The flag is > 0 when any
    gradient value is inf or NaN (those values stay non-finite).
    """
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for group in param_groups:
        for param in group["params"]:
            values = _grad_values(param)
            if values is not None and values.is_floating_point():
                groups[(values.device, values.dtype)].append(values)
    per_device: dict[torch.device, torch.Tensor] = {}
    for (device, _dtype), grads in groups.items():
        found = per_device.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
    flags = [f.to(out_device) for f in per_device.values()]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=out_device)
    return torch.stack(flags).sum() if len(flags) > 1 else flags[0]


def nonfinite_param_names(optimizer, names: dict[int, str]) -> list[str]:
    """Describe the parameters of ``optimizer`` whose gradients hold inf/NaN (syncs per parameter).

    ``names`` maps ``id(param)`` to a qualified name; masters of a MasterWeightOptimizer are
    looked up through ``optimizer.model_param``. Unnamed ones are described by position.
    """
    master = is_master_optimizer(optimizer)
    found = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            values = _grad_values(param)
            if values is None:
                continue
            n_inf = int(torch.isinf(values).sum().item())
            n_nan = int(torch.isnan(values).sum().item())
            if n_inf or n_nan:
                label = _name(optimizer, param, names, master) or f"param_groups[{g}][{i}]"
                found.append(f"{label} shape {tuple(param.shape)} ({n_inf} inf, {n_nan} NaN)")
    return found


def _name(optimizer, param, names: dict[int, str], master: bool) -> str | None:
    if master:
        try:
            param = optimizer.model_param(param)
        except (KeyError, ValueError, LookupError):
            pass
    return names.get(id(param))
