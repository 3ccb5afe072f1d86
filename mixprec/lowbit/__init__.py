"""Low-bit GEMM formats for Linear layers, one typed component each, registered by name.

* :class:`Float8`: torchao's FP8 recipes (``Float8("tensorwise" | "rowwise" |
  "rowwise_gw_hp")``);
* :class:`MXFP8`: block-scaled FP8 (blocks of 32, E8M0 scales) through torchao, emulated off
  sm100 GPUs;
* :class:`NVFP4`: 4-bit block-scaled (blocks of 16), measured by the advisor, not trained.

Wherever ``fp8=`` is accepted (``prepare``, ``MixedPrecision``, ``Trainer``, ``parallel.fsdp``,
``Policy``), a format or its shorthand is: "tensorwise", "rowwise", "rowwise_gw_hp", "mxfp8",
"nvfp4". :mod:`.base` says what a format owns, and how to add one (docs/extending.md).

This package is the one home of the formats and what runs them, below the policy that names
them (it imports no policy, casting or region code):

* :mod:`.base`, :mod:`.float8`, :mod:`.mxfp8`, :mod:`.nvfp4`: the formats and their registry;
* :mod:`.backend`: importing torchao, its Float8 configs, device checks;
* :mod:`.float8_layers`, :mod:`.mx_layers`: the layers on torchao (they import it: loaded only
  when a model is converted);
* :mod:`.stats`: per-layer statistics kept on the device (:func:`mixprec.debug.fp8_stats`);
* :mod:`.fp8sim`, :mod:`.blocks`: each format's GEMMs simulated in fp32, what
  :func:`mixprec.advise` measures with (no torchao needed).

Which layers of a model take a format, and the conversion ``prepare`` runs, are
:mod:`mixprec.fp8`.
"""

from .base import LowBitFormat, formats, register, resolve, shorthands
from .float8 import Float8
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4

__all__ = ["LowBitFormat", "Float8", "MXFP8", "NVFP4", "register", "resolve", "shorthands",
           "formats"]
