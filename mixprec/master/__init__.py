"""fp32 master weights: :class:`MasterWeightOptimizer` and :func:`fp32_state_dict`.

* :mod:`.optimizer`: the optimizer wrapper that keeps fp32 masters of low-precision parameters.
* :mod:`.params`: the master parameter, whose ``.grad`` is its model parameter's gradient.
* :mod:`.buckets`: which optimizers are stepped in buckets; the fp32 gradient scratch.
* :mod:`.steps`: the step paths (bucketed, compiled, closure).
* :mod:`.kernels`: fused update kernels.
* :mod:`.checkpoint`: masters in the optimizer's ``state_dict``.
* :mod:`.export`: fp32 state dicts.
"""

from .export import fp32_state_dict
from .optimizer import MasterWeightOptimizer, is_master_optimizer
from .params import MasterParameter

__all__ = ["MasterWeightOptimizer", "MasterParameter", "fp32_state_dict", "is_master_optimizer"]
