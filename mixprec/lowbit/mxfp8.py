"""``MXFP8``: block-scaled FP8 GEMMs (the OCP Microscaling format) through torchao.

Each GEMM operand is cast along the GEMM's reduction dimension in blocks of 32 values, each
block with its own power-of-two (E8M0) scale and e4m3 elements, so a large value coarsens only
its own 32-value block (per-tensor FP8 lets it coarsen the whole tensor). torchao's
``MXFP8TrainingOpConfig`` recipes run the three GEMMs of a Linear layer this way (its
``mx_mm`` autograd function, RCEIL scales): on Blackwell GPUs (sm100) with its native kernels,
elsewhere (a CPU, older GPUs) emulated: the same casts, the GEMM on the dequantized values.
See :mod:`mixprec.lowbit.mx_layers` for the layer, :mod:`mixprec.lowbit.blocks` for the cast.

Eligibility: both GEMM dimensions multiples of 32. The token count need not be: the layer
pads it with zero rows (which change no block's scale) and drops them again. Weights are stored
and all-gathered by FSDP2 in their policy's dtype; the layers quantize after the gather.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from . import backend, blocks
from .base import LowBitFormat, register
from .stats import LayerStats

__all__ = ["MXFP8"]

_NATIVE_CAPABILITY = (10, 0)  # MX tensor cores: Blackwell (sm100)


@dataclasses.dataclass(frozen=True, eq=False)
class MXFP8(LowBitFormat):
    """MXFP8 GEMMs through torchao (``pip install mixprec[fp8]``).

    Args:
        wgrad_hp: compute the weight gradient's GEMM in high precision (torchao's
            ``MXFP8_RCEIL_WGRAD_WITH_HP`` recipe) rather than in MXFP8.
        emulate: None: torchao's native kernels on an sm100 GPU, emulated elsewhere; True:
            emulated everywhere; False: native kernels (refused on other devices).

    Example:
        >>> MXFP8() == "mxfp8", MXFP8().block
        (True, 32)
    """

    wgrad_hp: bool = False
    emulate: bool | None = None

    name: ClassVar[str] = "mxfp8"
    block: ClassVar[int] = 32
    advisor_format: ClassVar[str] = "mxfp8"
    bits_per_value: ClassVar[float] = 8 + 8 / 32  # e4m3 elements, one E8M0 scale per 32
    compute_dtypes: ClassVar[tuple[str, ...]] = ("bf16",)  # torchao's MX: no fp16 yet

    def __post_init__(self):
        if not isinstance(self.wgrad_hp, bool):
            raise TypeError(f"MXFP8's wgrad_hp must be True or False; got {self.wgrad_hp!r}")
        if self.emulate not in (None, True, False):
            raise TypeError(f"MXFP8's emulate must be None, True or False; got "
                            f"{self.emulate!r}")

    def describe(self) -> str:
        return f"MXFP8 GEMMs (blocks of {self.block})"

    def native(self, device: torch.device) -> bool:
        """Whether torchao's native MX kernels run the GEMMs on ``device``."""
        if self.emulate or device.type != "cuda":
            return False
        return torch.cuda.get_device_capability(device) >= _NATIVE_CAPABILITY

    # -- preparing ---------------------------------------------------------------------------
    def require(self) -> None:
        backend.require("MXFP8 layers", "torchao.prototype.moe_training.mxfp8_linear")

    def check_device(self, device) -> None:
        if self.emulate is False and not self.native(torch.device(device)):
            raise RuntimeError(f"MXFP8(emulate=False) asks for torchao's native MX kernels, "
                               f"which need an sm100 (Blackwell) GPU; this model is on "
                               f"{device}. Use MXFP8() (emulated off sm100)")

    def convert(self, model, names: tuple[str, ...]) -> None:
        from . import mx_layers  # optional: imports torchao
        mx_layers.convert(model, names, self)

    # -- measuring ---------------------------------------------------------------------------
    def recorder(self, module):
        e4m3 = torch.float8_e4m3fn
        return LayerStats(dict.fromkeys(blocks.AXES, e4m3), dict(blocks.AXES), block=blocks.MX)

    def simulate(self, x, w_t):
        return blocks.matmul(x, w_t, blocks.MX, weight_grad_lowbit=not self.wgrad_hp)

    def ranges(self, x, w_t, grad) -> dict[str, tuple]:
        return blocks.operand_ranges(blocks.MX, x, w_t, grad)


register(MXFP8, {"mxfp8": {}})
