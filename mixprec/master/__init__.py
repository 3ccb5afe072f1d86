"""fp32 master weights: :class:`MasterWeightOptimizer` and :func:`fp32_state_dict`.

* :mod:`.optimizer`: the optimizer wrapper that keeps fp32 masters of low-precision parameters.
* :mod:`.kernels`: its fused update kernels.
* :mod:`.export`: fp32 state dicts.
"""

from .export import fp32_state_dict
from .optimizer import MasterWeightOptimizer, is_master_optimizer

__all__ = ["MasterWeightOptimizer", "fp32_state_dict", "is_master_optimizer"]
