"""``Kahan``: a 16-bit compensation buffer per 16-bit weight (Kahan summation, as in
"Revisiting BFloat16 Training" and the optimi library): weight + compensation is the value the
optimizer steps, about 16 significant bits with bf16 (22 with fp16), 2 bytes per parameter.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .base import MasterMethod, register

__all__ = ["Kahan", "COMPENSATION_KEY"]

#: The optimizer ``state`` key of a parameter's compensation (in the weight's dtype).
COMPENSATION_KEY = "compensation"


@dataclasses.dataclass(frozen=True, eq=False)
class Kahan(MasterMethod):
    """Kahan-compensated 16-bit weights (bf16 or fp16; a buffer of the weight's dtype).

    Example:
        >>> Kahan() == "kahan", Kahan().master_bytes(2)
        (True, 2)
    """

    name: ClassVar[str] = "kahan"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16)
    buffer_key: ClassVar[str | None] = COMPENSATION_KEY

    def master_bytes(self, param_bytes: int) -> int:
        return param_bytes

    def buffer_dtype(self, param_dtype: torch.dtype) -> torch.dtype | None:
        return param_dtype

    def make_buffer(self, param, initial):
        comp = torch.zeros_like(param, memory_format=torch.preserve_format)
        if initial is not None:  # what the cast lost
            comp.copy_(initial.to(param.device) - param.float())
        return comp

    def register_load_hooks(self, optimizer) -> None:
        from ..master import loadcheck

        loadcheck.register_kahan(optimizer)


register(Kahan, {"kahan": {}})
