"""``Stochastic``: no buffer; the updated fp32 value is written into the bf16 weight with
stochastic rounding (:mod:`mixprec.master.rounding`), unbiased in expectation. 0 extra bytes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .base import MasterMethod, register

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


register(Stochastic, {"stochastic": {}})
