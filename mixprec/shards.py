"""Tensors that may be FSDP2 shards (``DTensor``): this rank's part, or the global value."""

from __future__ import annotations

import sys

import torch

__all__ = ["local", "replicated", "dtensor_type", "is_dtensor", "like_shard"]


def dtensor_type() -> type | None:
    """torch's ``DTensor`` class once ``torch.distributed.tensor`` is loaded, else None (no
    tensor can be a DTensor before that: asking does not load it, a few seconds at import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(t) -> bool:
    """True for a ``DTensor`` (an FSDP2 shard), without loading ``torch.distributed.tensor``."""
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def like_shard(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out`` (this rank's part) placed as the DTensor ``like`` is; ``out`` itself where
    ``like`` is a plain tensor."""
    if not is_dtensor(like):
        return out
    return type(like).from_local(out, like.device_mesh, like.placements, shape=like.shape,
                                 stride=like.stride())


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (the tensor itself otherwise)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def replicated(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding the global value of ``value`` (a norm computed over FSDP-sharded
    gradients is a DTensor, partial on each rank: reduced here)."""
    full = getattr(value, "full_tensor", None)
    return full() if full is not None else value
