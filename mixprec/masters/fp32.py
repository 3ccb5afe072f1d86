"""``FP32``: an fp32 master copy of every 16-bit parameter (4 bytes each), stepped by the
optimizer; the 16-bit weight is its rounded copy (:class:`mixprec.MasterWeightOptimizer`; not
:attr:`~mixprec.masters.MasterMethod.compact`: no load or store of its own).

Under FSDP2 the fp32 shards are the masters (FSDP casts them to 16 bits when it gathers), so
the optimizer over them is plain, or wrapped only to keep bf16 moments.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .base import MasterMethod, register

__all__ = ["FP32"]


@dataclasses.dataclass(frozen=True, eq=False)
class FP32(MasterMethod):
    """fp32 master weights: any 16-bit dtype, 4 bytes per parameter.

    Example:
        >>> FP32() == "fp32", FP32().master_bytes(2)
        (True, 4)
    """

    name: ClassVar[str] = "fp32"
    compact: ClassVar[bool] = False

    def master_bytes(self, param_bytes: int) -> int:
        return 4

    @property
    def needs_initial_values(self) -> bool:
        return True  # the masters are the fp32 originals


register(FP32, {"fp32": {}})
