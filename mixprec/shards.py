"""Tensors that may be FSDP2 shards (``DTensor``): this rank's part, or the global value."""

from __future__ import annotations

import sys

import torch

__all__ = ["local", "replicated", "is_dtensor", "dtensor_class", "like_shard", "grad_version"]

_DTENSOR = "torch.distributed.tensor"


def is_dtensor(t) -> bool:
    """True for a ``DTensor`` (an FSDP2 shard), checked without importing
    ``torch.distributed.tensor`` (half a second; ``import mixprec`` does not load it): a process
    that holds a DTensor has imported it."""
    module = sys.modules.get(_DTENSOR)
    return module is not None and isinstance(t, module.DTensor)


def dtensor_class() -> type:
    """``torch.distributed.tensor.DTensor``, where a DTensor exists (:func:`is_dtensor`)."""
    return sys.modules[_DTENSOR].DTensor


def like_shard(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out`` (this rank's part) placed as the DTensor ``like`` is; ``out`` itself where
    ``like`` is a plain tensor."""
    if not is_dtensor(like):
        return out
    return dtensor_class().from_local(out, like.device_mesh, like.placements, shape=like.shape,
                                      stride=like.stride())


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (the tensor itself otherwise)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def grad_version(grad: torch.Tensor) -> int:
    """A gradient's version counter; an FSDP2 shard's local tensor's (FSDP adds a micro-batch's
    gradient into it in place, which leaves the DTensor's own counter as it was)."""
    return getattr(grad, "_local_tensor", grad)._version


def replicated(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding the global value of ``value`` (a norm computed over FSDP-sharded
    gradients is a DTensor, partial on each rank: reduced here)."""
    full = getattr(value, "full_tensor", None)
    return full() if full is not None else value
