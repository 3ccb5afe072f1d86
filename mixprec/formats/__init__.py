"""Floating-point formats: their constants, how one value is stored, and range reports.

* :mod:`.table`: :class:`FloatFormat`, the known formats (fp64, fp32, fp16, bf16, fp8_e4m3,
  fp8_e5m2) with every constant derived from the bit layout; :func:`get`, :func:`names`.
* :mod:`.rounding`: the formats' rounding rule (round-to-nearest-even, exact in float64).
* :mod:`.decomposition`: :func:`decompose` and :class:`Decomposition`: one value, bit by bit,
  beside torch's own cast.
* :mod:`.ranges`: :func:`range_report` and :class:`RangeReport`: how a tensor's values would
  overflow, underflow or round in a format.

Example:
    >>> import mixprec as mp
    >>> mp.formats.get("fp16").max, mp.formats.decompose(65504, "fp16").bits
    (65504.0, '0 11110 1111111111')
"""

from .decomposition import Decomposition, decompose
from .ranges import RangeReport, check_scale, range_report
from .table import FloatFormat, get, names

__all__ = ["FloatFormat", "Decomposition", "RangeReport", "get", "names", "decompose",
           "range_report", "check_scale"]
