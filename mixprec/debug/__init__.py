"""Numerics diagnostics: ``mp.debug.trace_nonfinite``, ``mp.debug.op_stats``,
``mp.debug.grad_report``.

* :func:`trace_nonfinite` finds the first op whose output holds inf or NaN, in the forward and
  in the backward pass, and names the module it belongs to.
* :func:`op_stats` counts executed ops by (op, output dtype, pass), with the op-list name of
  the Python-level function each ran beneath and the dtypes it read: the evidence that a
  precision level does what it says, and the names ``fp32_ops``/``low_precision_ops`` accept.
* :func:`grad_report` tells which gradients a format loses, and at which loss scale.
* :func:`fp8_stats` records, per FP8 layer, what FP8 does to its inputs, weights and output
  gradients while training (amax, scale, saturation, underflow), on the device.
"""

from .fp8stats import FP8RangeWarning, FP8Stats, fp8_stats
from .gradreport import GradReport, ParamGradStats, grad_report
from .nonfinite import (
                        NonFiniteError,
                        NonFiniteEvent,
                        NonFiniteReport,
                        NonFiniteTracer,
                        TensorStats,
                        trace_nonfinite,
)
from .opstats import OpRecord, OpStats, op_stats

__all__ = ["trace_nonfinite", "NonFiniteTracer", "NonFiniteReport", "NonFiniteEvent",
           "TensorStats", "NonFiniteError", "op_stats", "OpStats", "OpRecord", "grad_report",
           "GradReport", "ParamGradStats", "fp8_stats", "FP8Stats",
           "FP8RangeWarning"]
