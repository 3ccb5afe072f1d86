"""``Stochastic``: no buffer; the updated fp32 value is written into the bf16 weight with
stochastic rounding (:mod:`mixprec.masters.rounding`), unbiased in expectation. 0 extra bytes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .base import MasterMethod, register
from .rounding import stochastic_round

__all__ = ["Stochastic"]


@dataclasses.dataclass(frozen=True, eq=False)
class Stochastic(MasterMethod):
    """Stochastic rounding into bf16 weights (no buffer, 0 extra bytes).

    Example:
        >>> Stochastic() == "stochastic", Stochastic().master_bytes(2)
        (True, 0)
    """

    name: ClassVar[str] = "stochastic"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16,)

    def holds(self) -> str:
        return "rounds into"

    # -- load and store: the weight itself, written back rounded stochastically -------------
    @staticmethod
    def load(weight, buf):
        return weight.float()

    @staticmethod
    def store(weight, buf, new, key):
        weight.copy_(stochastic_round(new, key))

    @staticmethod
    def stored(weight, buf, new, key):
        return stochastic_round(new, key), None

    def assign(self, weight, buf, value):
        weight.copy_(value.to(device=weight.device, dtype=torch.float32))


register(Stochastic, {"stochastic": {}})
