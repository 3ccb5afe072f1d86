"""Turning a model's chosen layers into FP8 layers, and finding them again.

:func:`convert` is what :func:`mixprec.prepare` calls for a policy with ``fp8`` set; it loads
torchao (through :mod:`mixprec.fp8.layers`) only then. :func:`fp8_modules` needs no torchao.
"""

from __future__ import annotations

import importlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..casting import module_device
from ..policy import Policy
from . import backend
from .choice import FP8_ATTR

__all__ = ["convert", "fp8_modules", "all_gather_in_fp8", "unwrap"]


def _layers():
    backend.require()  # the ImportError that names the extra, before torchao's own
    return importlib.import_module(".layers", __package__)


def convert(model: nn.Module, policy: Policy) -> None:
    """Swap the layers ``policy.fp8_modules`` names (resolved names) for FP8 layers, in place.

    Raises:
        ImportError: torchao is not installed (the message names ``mixprec[fp8]``).
        RuntimeError: a CUDA GPU without FP8 GEMMs (compute capability below 8.9).
    """
    if policy.fp8 is None or not policy.fp8_modules:
        if policy.fp8 is not None:
            backend.require()  # fp8 asked for with nothing chosen: still needs the engine
        return
    backend.check_device(module_device(model))
    _layers().convert(model, tuple(policy.fp8_modules), policy.fp8)


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
    """Have FSDP2 all-gather the weights of the model's tensorwise FP8 layers in FP8 (torchao's
    float8 all-gather); call before ``fully_shard``. Returns the layers' names."""
    if not any(getattr(m, FP8_ATTR, None) == "tensorwise" for m in model.modules()):
        return []
    return _layers().cast_weights_for_all_gather(model)
