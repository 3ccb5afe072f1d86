"""Gradient passes for the loss scalers: unscale + inf/NaN check, a read-only check, norms,
and the names of parameters whose gradients are not finite.

Every pass works on lists of tensors grouped by (device, dtype), with torch's fused foreach
kernels where they accept the group's device and dtype (chosen by :mod:`mixprec.kernel_table`);
none of them syncs with the host, except :func:`nonfinite_param_names`.
A sparse gradient takes part through its values (it must be coalesced).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from .. import kernel_table
from ..shards import replicated

__all__ = ["check_and_unscale_", "unscale_", "found_nonfinite", "total_norm",
           "unscale_and_check_", "nonfinite_param_names", "clip_norm_", "clip_value_", "divide_"]


def _values(t: torch.Tensor) -> torch.Tensor:
    return t._values() if t.is_sparse else t


def _by_device_dtype(tensors: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        v = _values(t)
        if v.is_floating_point():
            groups[(v.device, v.dtype)].append(v)
    return groups


def _flag(flags: dict[torch.device, torch.Tensor], device=None) -> torch.Tensor:
    """One 0-d flag from per-device flags (on ``device``, else the first flag's device): 0 or
    1, as torch's fused optimizers read a ``found_inf`` (they skip at exactly 1)."""
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    if device is None:
        device = next(iter(flags))
    moved = [f.to(device) for f in flags.values()]
    return moved[0] if len(moved) == 1 else torch.stack(moved).amax()


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(dev: torch.device) -> torch.Tensor:
    """A 0-d float32 1 on ``dev``, made once (the check kernel's factor; it is only read)."""
    one = _ONES.get(dev)
    if one is None:
        one = _ONES[dev] = torch.ones((), dtype=torch.float32, device=dev)
    return one


def _raise_(found: torch.Tensor, flag: torch.Tensor) -> None:
    """``found = max(found, flag)`` in place: flags stay 0 or 1."""
    torch.maximum(found, flag, out=found)


def _inf_norm_flag(group: list[torch.Tensor], dev) -> torch.Tensor:
    """A 0-d float32 flag, 1 when some value of ``group`` is inf or NaN: the largest magnitude
    of each tensor (one ``torch._foreach_norm(ord=inf)``; inf and NaN propagate, nothing
    overflows), for dtypes torch's fused check kernel refuses (bf16 on CUDA)."""
    nonempty = [t for t in group if t.numel()]
    if not nonempty:
        return torch.zeros((), dtype=torch.float32, device=dev)
    norms = torch._foreach_norm(nonempty, float("inf"))
    # FSDP2 shards (DTensors): the flag of all shards, as a plain tensor (as torch's fused
    # kernel gives for them), so it adds to the other groups' flags
    return replicated((~torch.isfinite(torch.stack(norms))).any().float())


def check_and_unscale_(tensors: list[torch.Tensor], inv_scale: torch.Tensor | None,
                       device=None) -> torch.Tensor:
    """Multiply ``tensors`` by ``inv_scale`` in place (None: 1) and return a 0-d inf/NaN flag.

    Per (device, dtype) group, the path :meth:`KernelTable.unscale_path
    <mixprec.kernel_table.KernelTable.unscale_path>` picks: one
    ``torch._amp_foreach_non_finite_check_and_unscale_`` (the values are read once, checked and
    written) where the kernel takes the dtype, else one inf-norm check and one foreach multiply.
    The flag (float32) is 1 when any value is inf or NaN before the multiplication (those stay
    non-finite), else 0; it lives on ``device`` (default: the first tensor's).

    Raises:
        TypeError: a gradient of a dtype none of these kernels accepts (float8).
    """
    table = kernel_table.TABLE
    flags: dict[torch.device, torch.Tensor] = {}
    for (dev, dtype), group in _by_device_dtype(tensors).items():
        found = flags.setdefault(dev, torch.zeros((), dtype=torch.float32, device=dev))
        if table.unscale_path(dev.type, dtype) == "amp":
            inv = _one(dev) if inv_scale is None else inv_scale.to(dev, torch.float32)
            table.kernel("amp_check_and_unscale")(group, found, inv)
            continue
        _raise_(found, _inf_norm_flag(group, dev))
        if inv_scale is not None:
            torch._foreach_mul_(group, inv_scale.to(dev, torch.float32))
    return _flag(flags, device)


def unscale_(tensors: list[torch.Tensor], inv_scale: torch.Tensor) -> None:
    """Multiply ``tensors`` by the 0-d ``inv_scale`` in place (sparse ones by their values)."""
    for (dev, _), group in _by_device_dtype(tensors).items():
        torch._foreach_mul_(group, inv_scale.to(dev, torch.float32))


def divide_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Divide ``tensors`` by the 0-d ``scale`` in place, as torch's fused optimizer kernels
    divide the gradients they read by their ``grad_scale`` (sparse ones by their values)."""
    for (dev, _), group in _by_device_dtype(tensors).items():
        torch._foreach_div_(group, scale.to(dev))


def found_nonfinite(tensors: list[torch.Tensor], device=None) -> torch.Tensor:
    """A 0-d float32 flag, 1 when any value of ``tensors`` is inf or NaN, else 0; changes no
    value.

    Per (device, dtype) group, the path :meth:`KernelTable.check_path
    <mixprec.kernel_table.KernelTable.check_path>` picks: the fused check kernel with a factor of
    1 (one launch; it writes the same values back) where it takes the dtype, else one inf-norm
    check (bf16 on CUDA). Every group of a device sets one flag.

    Raises:
        TypeError: a gradient of a dtype none of these kernels accepts (float8).
    """
    table = kernel_table.TABLE
    flags: dict[torch.device, torch.Tensor] = {}
    for (dev, dtype), group in _by_device_dtype(tensors).items():
        found = flags.setdefault(dev, torch.zeros((), dtype=torch.float32, device=dev))
        if table.check_path(dev.type, dtype) == "amp":
            table.kernel("amp_check_and_unscale")(group, found, _one(dev))
        else:
            _raise_(found, _inf_norm_flag(group, dev))
    return _flag(flags, device)


def total_norm(tensors: list[torch.Tensor], norm_type: float = 2.0, device=None) -> torch.Tensor:
    """The ``norm_type``-norm of all values of ``tensors`` together, accumulated in float32 (a
    sparse tensor's coalesced: an index given twice is one value), one ``_foreach_norm`` per
    device and dtype (each tensor's norm as ``torch.linalg.vector_norm``'s).

    Inf or NaN in any tensor makes it inf or NaN. A 0-d float32 tensor on ``device`` (default:
    the first tensor's; the CPU when there are none).
    """
    norm_type = float(norm_type)
    per_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    coalesced = [t.coalesce() if t.is_sparse else t for t in tensors]  # duplicates summed first
    for (dev, _), group in _by_device_dtype(coalesced).items():  # one launch per group
        per_device[dev] += torch._foreach_norm(group, norm_type, dtype=torch.float32)
    if not per_device:
        return torch.zeros((), dtype=torch.float32, device=device)
    if device is None:
        device = next(iter(per_device))
    norms = [n.to(device) for ns in per_device.values() for n in ns]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_norm_(grads: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s arithmetic on gradient tensors rather than on
    parameters (a compact optimizer's fp32 copies of fp16 gradients): the total norm, then each
    gradient times ``min(max_norm / (norm + 1e-6), 1)``; returns the norm. No host sync. The
    norm of 16-bit gradients is accumulated in float32 (:func:`total_norm`: torch's, in their
    dtype, overflows fp16 beyond 65504, and a clip by it zeroes every gradient)."""
    low = any(g.dtype in (torch.float16, torch.bfloat16) for g in grads)
    total = (total_norm(grads, norm_type) if low
             else torch.nn.utils.get_total_norm(grads, norm_type))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (device, _), group in _by_device_dtype(grads).items():
        torch._foreach_mul_(group, coef.to(device))
    return total


def clip_value_(grads: list[torch.Tensor], clip_value: float) -> None:
    """``torch.nn.utils.clip_grad_value_``'s clamp on gradient tensors rather than on
    parameters (a compact optimizer's fp32 copies of fp16 gradients): each value into
    ``[-clip_value, clip_value]``, in place. No host sync."""
    for _, group in _by_device_dtype(grads).items():
        torch._foreach_clamp_min_(group, -clip_value)
        torch._foreach_clamp_max_(group, clip_value)


def unscale_and_check_(param_groups, inv_scale: torch.Tensor, out_device) -> torch.Tensor:
    """Unscale every gradient of ``param_groups`` in place; return the 0-d inf/NaN flag.

    Sparse gradients are coalesced first (duplicate indices summed), so the check sees the
    values the step will use.
    """
    grads = []
    for group in param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse and not param.grad.is_coalesced():
                param.grad = param.grad.coalesce()
            grads.append(param.grad)
    return check_and_unscale_(grads, inv_scale, out_device)


def nonfinite_param_names(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                          names: dict[int, str]) -> list[str]:
    """Describe the parameters whose gradients hold inf/NaN (syncs once per parameter).

    Args:
        pairs: ``(parameter, gradient)`` pairs.
        names: ``id(parameter)`` -> qualified name; unnamed ones are described by position.
    """
    found = []
    for i, (param, grad) in enumerate(pairs):
        values = _values(grad.coalesce() if grad.is_sparse else grad)
        n_inf = int(torch.isinf(values).sum().item())
        n_nan = int(torch.isnan(values).sum().item())
        if n_inf or n_nan:
            label = names.get(id(param)) or f"parameter {i}"
            found.append(f"{label} shape {tuple(param.shape)} ({n_inf} inf, {n_nan} NaN)")
    return found
