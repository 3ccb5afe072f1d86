"""How each compact master method reads the fp32 value of a 16-bit weight and writes it back:
:func:`load`, :func:`store` and :func:`assign` (the split pair, the Kahan pair, or the weight
alone, told apart by the buffer's dtype: int16 remainder, 16-bit compensation, none). The same
functions run eagerly and compiled, per tensor (:mod:`.compact_kernels`) and over a param group's
flat buffers (:mod:`.family`).
"""

from __future__ import annotations

import torch

from ..shards import dtensor_class, is_dtensor, local
from .rounding import round_stochastically, stochastic_round, weyl16
from .split_bits import (
    split_load,
    split_load_pairs,
    split_of,
    split_pairs_of,
    split_store,
    split_store_pairs,
)

__all__ = ["load", "store", "stored", "assign", "store_state"]


def load(weight: torch.Tensor, comp: torch.Tensor | None) -> torch.Tensor:
    """The fp32 value a compact weight stands for: weight + compensation, the exact master of a
    weight and its int16 remainder (``master="split"``; both as int32 pairs when the weight is
    int32, :func:`_paired`), or the weight."""
    if comp is None:
        return weight.float()
    if weight.dtype == torch.int32:
        return split_load_pairs(weight, comp)
    if comp.dtype == torch.int16:
        return _on_local(split_load, weight, comp)
    return weight.float() + comp.float()


def _on_local(fn, weight: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` of plain tensors, or of FSDP2 shards (re-wrapped like ``weight``: bitcasts need
    this rank's own tensor)."""
    if not is_dtensor(weight):
        return fn(weight, *tensors)
    out = fn(weight.to_local(), *map(local, tensors))
    return dtensor_class().from_local(out, weight.device_mesh, weight.placements,
                                      shape=weight.shape, stride=weight.stride())


def store(weight: torch.Tensor, comp: torch.Tensor | None, new: torch.Tensor,
          key: torch.Tensor) -> None:
    """Write the fp32 ``new`` into a compact weight: compensated (``comp`` given) or rounded
    stochastically with the bits of ``key``.

    Compensated, the weight takes ``new`` rounded to nearest and the compensation what that
    lost (exact in fp32), rounded stochastically with ``key``'s bits: rounded to nearest, the
    compensation of a weight receiving many small updates of one sign drifts (an update of
    1/700 of an ulp a step moved bf16 weights 11% too far in 2000 steps); stochastic rounding
    is unbiased, so weight + compensation follows the fp32 sum in expectation. Its random
    numbers are a Weyl sequence (:func:`.rounding.weyl16`: one multiply-add per element).

    With an int16 ``comp`` (``master="split"``) the pair takes ``new`` exactly
    (:mod:`.split_bits`: the weight is ``new`` rounded to nearest, ties away from zero); an int32
    ``weight`` is such a pair as int32 pairs (:func:`_paired`)."""
    if comp is None:
        weight.copy_(stochastic_round(new, key))
    elif weight.dtype == torch.int32:
        split_store_pairs(weight, comp, new)
    elif comp.dtype == torch.int16:  # exact: no rounding bits needed
        split_store(weight, comp, new)
    else:
        hi = new.to(weight.dtype)
        weight.copy_(hi)
        comp.copy_(round_stochastically(new - hi.float(), key, comp.dtype, weyl16))


def stored(weight: torch.Tensor, comp: torch.Tensor | None, new: torch.Tensor,
           key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What :func:`store` writes, as new tensors ``(weight, buffer or None)`` (plain tensors, in
    the dtypes of ``weight`` and ``comp``): the form the compiled group kernels take, which
    write into none of their inputs (no in-place mutation of inputs or their views inside a
    compiled graph, the part of a compiled kernel most exposed to compiler changes)."""
    if comp is None:
        return stochastic_round(new, key), None
    if weight.dtype == torch.int32:
        return split_pairs_of(new)
    if comp.dtype == torch.int16:
        return split_of(new)
    hi = new.to(weight.dtype)
    return hi, round_stochastically(new - hi.float(), key, comp.dtype, weyl16)


def assign(weight: torch.Tensor, comp: torch.Tensor | None, value: torch.Tensor) -> None:
    """Set a compact weight to the fp32 ``value``, exactly where its buffer can hold it: split
    (int16 ``comp``), or rounded to nearest with the compensation taking what that lost (to
    nearest: no rounding bits are drawn), or rounded to nearest (no buffer)."""
    value = value.to(device=weight.device, dtype=torch.float32)
    if comp is not None and comp.dtype == torch.int16:
        split_store(*map(local, (weight.detach(), comp, value)))
        return
    weight.copy_(value)
    if comp is not None:
        comp.copy_(value - weight.float())


def store_state(buf: torch.Tensor, new: torch.Tensor, key: torch.Tensor) -> None:
    if buf.dtype == torch.float32:
        buf.copy_(new)
    else:
        buf.copy_(stochastic_round(new, key))


