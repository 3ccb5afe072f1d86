"""fp32 master weights: :class:`MasterWeightOptimizer` (``mp.fp32_state_dict`` reads them).

* :mod:`.optimizer`: the optimizer wrapper that keeps fp32 masters of low-precision parameters.
* :mod:`.params`: the master parameter, whose ``.grad`` is its model parameter's gradient.
* :mod:`.buckets`: which optimizers are stepped in buckets; the fp32 gradient scratch.
* :mod:`.steps`: the step paths (bucketed, compiled, closure).
* :mod:`.kernels`: fused update kernels.
* :mod:`.checkpoint`: masters in the optimizer's ``state_dict``.
* :mod:`.wrapper`: what every master optimizer shares; :mod:`.hooks` (torch's optimizer hooks
  run once per step, over every parameter); :mod:`.loadcheck` (a loaded ``state_dict`` checked
  against the parameters, and Kahan pairs split the saved way).
* :mod:`.compact`: :class:`CompactMasterOptimizer`, 16-bit weights with Kahan compensation or
  stochastic rounding instead of fp32 masters; :mod:`.compact_kernels` (its one-pass kernels),
  :mod:`.rounding` (stochastic rounding and its generator), :mod:`.states` (bf16 moments).
"""

from .compact import CompactMasterOptimizer, is_compact_optimizer
from .optimizer import MasterWeightOptimizer, is_master_optimizer
from .params import MasterParameter

__all__ = ["MasterWeightOptimizer", "MasterParameter", "is_master_optimizer",
           "CompactMasterOptimizer", "is_compact_optimizer"]
