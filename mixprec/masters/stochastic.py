"""``Stochastic``: no buffer; the updated fp32 value is written into the bf16 weight with
stochastic rounding (:mod:`mixprec.masters.rounding`), unbiased in expectation. 0 extra bytes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .base import MasterMethod, register
from .rounding import BF16_NAN, round_into_lists

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
    def load_lists(out, weights, buf):
        torch._foreach_copy_(list(torch._C._nn.unflatten_dense_tensors(out, weights)), weights)

    @staticmethod
    def store_lists(values, weights, buf, keys):
        round_into_lists(values, weights, keys, BF16_NAN)

    def assign(self, weight, buf, value):
        weight.copy_(value.to(device=weight.device, dtype=torch.float32))


register(Stochastic, {"stochastic": {}})
