"""Master methods: how 16-bit parameters keep fp32-quality updates, one typed component each,
registered by name.

* :class:`FP32`: an fp32 master copy (4 bytes per parameter), any 16-bit dtype;
* :class:`Split`: the bf16 weight plus an int16 remainder, an exact fp32 master (2 bytes);
* :class:`Kahan`: a 16-bit compensation buffer (2 bytes), bf16 or fp16;
* :class:`Stochastic`: stochastic rounding into the bf16 weight (0 bytes).

Wherever ``master=`` is accepted (``prepare``, ``Policy``, ``MixedPrecision``, ``Trainer``,
``parallel.fsdp``, ``plan``), a method or its shorthand is: "fp32", "split", "kahan",
"stochastic". :mod:`.base` says what a method owns, and how to add one (docs/extending.md).
"""

from .base import MasterMethod, methods, register, resolve, shorthands
from .fp32 import FP32
from .kahan import Kahan
from .split import Split
from .stochastic import Stochastic

__all__ = ["MasterMethod", "FP32", "Split", "Kahan", "Stochastic", "register", "resolve",
           "shorthands", "methods"]
