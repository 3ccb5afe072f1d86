"""``NVFP4``: 4-bit block-scaled GEMMs (e2m1 elements, an e4m3 scale per 16 values and one fp32
scale per tensor), for the advisor.

mixprec measures NVFP4 (``mp.advise(..., formats=(..., "nvfp4"))``, simulated exactly in fp32
by :mod:`mixprec.lowbit.blocks`) but does not train in it: torchao 0.18's NVFP4 training path
(``torchao.prototype.moe_training.nvfp4_training``) runs Triton kernels only, on CUDA GPUs,
with every GEMM dimension a multiple of 128, and no emulated path; ``prepare`` refuses it and
says so.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from . import blocks
from .base import LowBitFormat, register

__all__ = ["NVFP4"]

REFUSAL = ("NVFP4 is measured by mp.advise but not trained by mixprec: torchao 0.18's NVFP4 "
           "training path runs Triton kernels on CUDA GPUs only (every GEMM dimension a "
           "multiple of 128) and has no emulated path. Train with fp8='mxfp8' or a Float8 "
           "recipe")


@dataclasses.dataclass(frozen=True, eq=False)
class NVFP4(LowBitFormat):
    """NVFP4 GEMMs, measured by the advisor (training in it is refused: see the module
    docstring).

    Example:
        >>> NVFP4() == "nvfp4", NVFP4().bits_per_value
        (True, 4.5)
    """

    name: ClassVar[str] = "nvfp4"
    block: ClassVar[int] = 16
    advisor_format: ClassVar[str] = "nvfp4"
    bits_per_value: ClassVar[float] = 4 + 8 / 16  # e2m1 elements, one e4m3 scale per 16
    compute_dtypes: ClassVar[tuple[str, ...]] = ("bf16",)  # torchao quantizes bf16/fp32 only
    advisor_limits: ClassVar[tuple[float, float]] = (0.4, 0.6)  # 3 significant bits

    def describe(self) -> str:
        return f"NVFP4 GEMMs (blocks of {self.block})"

    def require(self) -> None:
        raise RuntimeError(REFUSAL)

    def convert(self, model, names: tuple[str, ...]) -> None:
        raise RuntimeError(REFUSAL)

    def recorder(self, module):
        raise RuntimeError(REFUSAL)

    def simulate(self, x, w_t):
        """The three GEMMs on NVFP4-cast operands (round to nearest; the GPU recipes add
        stochastic rounding of gradients and Hadamard transforms, not simulated)."""
        return blocks.matmul(x, w_t, blocks.NVFP4)

    def ranges(self, x, w_t, grad) -> dict[str, tuple]:
        return blocks.operand_ranges(blocks.NVFP4, x, w_t, grad)


register(NVFP4, {"nvfp4": {}})
