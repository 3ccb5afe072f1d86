"""Low-bit GEMM formats for Linear layers, one typed component each, registered by name.

* :class:`Float8`: torchao's FP8 recipes (``Float8("tensorwise" | "rowwise" |
  "rowwise_gw_hp")``);
* :class:`MXFP8`: block-scaled FP8 (blocks of 32, E8M0 scales) through torchao, emulated off
  sm100 GPUs;
* :class:`NVFP4`: 4-bit block-scaled (blocks of 16), measured by the advisor, not trained.

Wherever ``fp8=`` is accepted (``prepare``, ``MixedPrecision``, ``Trainer``, ``parallel.fsdp``,
``Policy``), a format or its shorthand is: "tensorwise", "rowwise", "rowwise_gw_hp", "mxfp8",
"nvfp4". :mod:`.base` says what a format owns, and how to add one (docs/extending.md).
"""

from .base import LowBitFormat, formats, register, resolve, shorthands
from .float8 import Float8
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4

__all__ = ["LowBitFormat", "Float8", "MXFP8", "NVFP4", "register", "resolve", "shorthands",
           "formats"]
