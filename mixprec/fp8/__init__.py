"""Low-bit GEMMs for chosen layers of a model: which layers take the policy's format, and the
conversion ``mp.prepare(..., fp8=...)`` runs. The formats themselves, their torchao layers, their
statistics and their fp32 simulation are :mod:`mixprec.lowbit` (the layer below this one).

* :mod:`.choice`: which layers can run in the format, the default choice, names and callables;
* :mod:`.convert`: the conversion ``mp.prepare(..., fp8=...)`` runs, :func:`fp8_modules`;
* :mod:`.speed`: the expected speed of a layer in FP8 from its shape, and the warning when
  ``fp8=`` converts layers too small to gain.

FP8 on a CPU runs (``torch._scaled_mm`` has CPU kernels) for numerics, never speed: ``prepare``
says so once per process (:class:`FP8EmulatedWarning`).
"""

from ..lowbit.backend import EXTRA_HINT, require
from ..lowbit.float8 import RECIPES
from .choice import eligible_layers
from .convert import all_gather_in_fp8, convert, fp8_modules
from .speed import FP8EmulatedWarning, FP8SpeedWarning

__all__ = ["fp8_modules", "convert", "eligible_layers", "all_gather_in_fp8", "require",
           "RECIPES", "EXTRA_HINT", "FP8SpeedWarning", "FP8EmulatedWarning"]
