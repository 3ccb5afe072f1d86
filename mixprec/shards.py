"""Tensors that may be FSDP2 shards (``DTensor``): this rank's part, or the global value."""

from __future__ import annotations

import torch

__all__ = ["local", "replicated"]


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (the tensor itself otherwise)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def replicated(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding the global value of ``value`` (a norm computed over FSDP-sharded
    gradients is a DTensor, partial on each rank: reduced here)."""
    full = getattr(value, "full_tensor", None)
    return full() if full is not None else value
