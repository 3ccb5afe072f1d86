"""Low-bit GEMMs for chosen Linear layers, with torchao as the engine (``pip install
mixprec[fp8]``); the formats themselves (Float8, MXFP8, NVFP4) are :mod:`mixprec.lowbit`.

* :mod:`.choice`: which layers can run in the format, the default choice, names and callables;
* :mod:`.convert`: the conversion ``mp.prepare(..., fp8=...)`` runs, :func:`fp8_modules`;
* :mod:`.layers`: the Float8 layers (imports torchao; loaded only when they are asked for);
* :mod:`.stats`: per-layer FP8 statistics kept on the device (:func:`mixprec.debug.fp8_stats`);
* :mod:`.backend`: importing torchao, recipes, device checks;
* :mod:`.speed`: the expected speed of a layer in FP8 from its shape, and the warning when
  ``fp8=`` converts layers too small to gain.

FP8 on a CPU runs (``torch._scaled_mm`` has CPU kernels) for numerics, never speed.
"""

from ..lowbit.float8 import RECIPES
from .backend import EXTRA_HINT, require
from .choice import eligible_layers
from .convert import all_gather_in_fp8, convert, fp8_modules
from .speed import FP8SpeedWarning

__all__ = ["fp8_modules", "convert", "eligible_layers", "all_gather_in_fp8", "require",
           "RECIPES", "EXTRA_HINT", "FP8SpeedWarning"]
