"""``Split``: an exact fp32 master for 2 extra bytes: the bf16 weight holds the high half of
its bits (rounded), an int16 remainder the rest.

The optimizer reconstructs the fp32 master from the pair bit for bit before each update and splits
the result again after it (:mod:`mixprec.masters.split_bits`), so from the same state and gradients
the masters step exactly as fp32 masters do; the forward weight is the master rounded to nearest
bf16, torch's cast (what fp32 masters write) except at **exact ties, rounded away from zero** (a
16-bit remainder cannot hold a tie rounded to even). The idea is Transformer Engine's
``FusedAdam(store_param_remainders=True)``, the default of Megatron-LM's precision-aware
optimizer. bf16 weights only: an fp16 number is not the high half of an fp32 one (use ``"kahan"``
or ``"fp32"`` for fp16).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..shards import local
from .base import MasterMethod, register
from .split_bits import load_halves, split_load, split_store, store_halves

__all__ = ["Split", "REMAINDER_KEY"]

#: The optimizer ``state`` key of a parameter's int16 remainder.
REMAINDER_KEY = "remainder"


@dataclasses.dataclass(frozen=True, eq=False)
class Split(MasterMethod):
    """Exact fp32 masters as bf16 weight + int16 remainder (2 bytes per parameter).

    Example:
        >>> Split() == "split", Split().master_bytes(2), Split().buffer_dtype(torch.bfloat16)
        (True, 2, torch.int16)
    """

    name: ClassVar[str] = "split"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16,)
    buffer_key: ClassVar[str | None] = REMAINDER_KEY
    draws_bits: ClassVar[bool] = False  # the pair holds the master exactly
    uses_spare: ClassVar[bool] = True  # whole-word passes where strided int16 ones are slow

    def holds(self) -> str:
        return "holds the high half of the master in"

    def master_bytes(self, param_bytes: int) -> int:
        return 2

    def buffer_dtype(self, param_dtype: torch.dtype) -> torch.dtype | None:
        return torch.int16

    def make_buffer(self, param, initial):
        rem = torch.zeros_like(param, dtype=torch.int16, memory_format=torch.preserve_format)
        if initial is not None:  # the weight re-derived from the exact original
            self.assign(param, rem, initial.detach())
        return rem

    # -- load and store: the exact join and split (mixprec.masters.split_bits) ---------------
    @staticmethod
    def load(weight, rem):
        return split_load(weight, rem)

    @staticmethod
    def load_lists(out, weights, rems, spare=None):  # the halves of the fp32 words
        load_halves(out, weights, rems, spare)

    @staticmethod
    def store_lists(values, weights, rems, keys, spare=None):
        store_halves(values, weights, rems, spare)

    def assign(self, weight, rem, value):
        value = value.to(device=weight.device, dtype=torch.float32)
        if rem is None:  # not a split weight (an fp32 parameter)
            weight.copy_(value)
        else:
            split_store(*map(local, (weight.detach(), rem, value)))


register(Split, {"split": {}})
