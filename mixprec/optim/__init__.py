"""The master-weight optimizers: :class:`MasterWeightOptimizer` (fp32 masters, which
``mp.fp32_state_dict`` reads) and :class:`CompactMasterOptimizer` (split, Kahan, stochastic).

This package sits above :mod:`mixprec.masters` (the methods: their buffers, ``load``/``store``,
split and rounding arithmetic) and imports it; nothing there imports this package.

* :mod:`.build`: :func:`wrap_optimizer`, the optimizer a method's parameters are stepped by.

* :mod:`.optimizer`: the optimizer wrapper that keeps fp32 masters of low-precision parameters.
* :mod:`.params`: the master parameter, whose ``.grad`` is its model parameter's gradient.
* :mod:`.buckets`: which optimizers are stepped in buckets; the fp32 gradient scratch.
* :mod:`.steps`: the step paths (bucketed, compiled, closure).
* :mod:`.kernels`: fused update kernels.
* :mod:`.checkpoint`: masters in the optimizer's ``state_dict``.
* :mod:`.wrapper`: what every master optimizer shares; :mod:`.hooks` (torch's optimizer hooks
  run once per step, over every parameter); :mod:`.loadcheck` (a loaded ``state_dict`` checked
  against the parameters).
* :mod:`.compact`: :class:`CompactMasterOptimizer`, 16-bit weights stepped in place through
  their method's load and store; :mod:`.family` (its one step: a bounded piece at a time,
  torch's own step between load and store), :mod:`.compact_state`, :mod:`.states` (bf16
  moments), :mod:`.guard` (compiled kernels checked against eager ones).
"""

from .build import compile_master_step, wrap_optimizer
from .compact import CompactMasterOptimizer
from .optimizer import MasterWeightOptimizer, is_master_optimizer
from .params import MasterParameter

__all__ = ["MasterWeightOptimizer", "MasterParameter", "is_master_optimizer",
           "CompactMasterOptimizer", "wrap_optimizer",
           "compile_master_step"]
