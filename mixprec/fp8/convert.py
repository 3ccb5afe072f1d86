"""Turning a model's chosen layers into low-bit layers, and finding them again.

:func:`convert` is what :func:`mixprec.prepare` calls for a policy with ``fp8`` set: the
policy's format (:mod:`mixprec.lowbit`) loads its engine and converts. :func:`fp8_modules`
needs no torchao.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..casting import module_device
from ..lowbit.base import FP8_ATTR
from ..policy import Policy
from . import speed
from .choice import gemm_dims

__all__ = ["convert", "fp8_modules", "all_gather_in_fp8", "unwrap"]


def convert(model: nn.Module, policy: Policy) -> None:
    """Swap the layers ``policy.modules`` gives a low-bit format (by qualified name, as
    :func:`mixprec.fp8.choice.with_modules` records them) for layers of that format, in
    place.

    On a CUDA device, warns once (:class:`mixprec.fp8.speed.FP8SpeedWarning`) listing the
    shapes of the chosen layers that FP8 is not expected to speed up there; on a CPU, once per
    process (:class:`mixprec.fp8.speed.FP8EmulatedWarning`) that the format is emulated there.

    Raises:
        ImportError: torchao is not installed (the message names ``mixprec[fp8]``).
        RuntimeError: a device the format cannot run on (FP8: a CUDA GPU of compute capability
            below 8.9), or a format mixprec does not train in (NVFP4).
    """
    fmt = policy.fp8
    if fmt is None:
        return
    fmt.require()  # even with nothing chosen: the engine must be there
    names = policy.modules.gemm_names()
    if names:
        device = module_device(model)
        fmt.check_device(device)
        speed.warn_if_emulated(len(names), device, str(fmt), stacklevel=5)
        if fmt.name == "float8":  # the speed model is dynamic-scaled FP8's (mixprec.fp8.speed)
            modules = dict(model.named_modules())
            shapes = {n: gemm_dims(modules[n]) for n in names if gemm_dims(modules[n])}
            speed.warn_if_slow(shapes, device, stacklevel=5)
        fmt.convert(model, names)


def fp8_modules(model: nn.Module) -> list[str]:
    """The qualified names (as ``named_modules()`` gives them) of the layers of ``model`` that
    run their GEMMs in FP8.

    Works on a prepared model, one wrapped in DDP (names without the ``module.`` prefix) and an
    FSDP2-sharded one; an empty list for a model without FP8 layers.

    Example:
        >>> fp8_modules(nn.Linear(4, 4))
        []
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8_modules expects an nn.Module; got {type(model).__name__}")
    return [name for name, mod in unwrap(model).named_modules()
            if getattr(mod, FP8_ATTR, None) is not None]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (else ``model``)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def all_gather_in_fp8(model: nn.Module) -> list[str]:
    """Prepare the model's low-bit layers for FSDP2 (call before ``fully_shard``): each format
    adjusts its layers (:meth:`mixprec.lowbit.LowBitFormat.before_sharding`; the tensorwise
    Float8 recipe has FSDP2 all-gather its weights in FP8). Returns the names of the layers
    whose weights are gathered in a low-bit format."""
    by_format: dict = {}
    for name, mod in model.named_modules():
        fmt = getattr(mod, FP8_ATTR, None)
        if fmt is not None:
            by_format.setdefault(fmt, []).append(name)
    return [n for fmt, names in by_format.items() for n in fmt.before_sharding(model, names)]
