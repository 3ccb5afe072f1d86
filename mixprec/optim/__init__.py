"""The master-weight optimizers: :class:`MasterWeightOptimizer` (fp32 masters, which
``mp.fp32_state_dict`` reads) and :class:`CompactMasterOptimizer` (split, Kahan, stochastic:
16-bit weights stepped in place through their method's ``load_lists``/``store_lists``), and
:func:`wrap_optimizer`, which picks one for a method.

This package sits above :mod:`mixprec.masters` (the methods) and imports it; nothing there
imports this package. Besides the optimizers (:mod:`.optimizer`, :mod:`.compact`), their shared
base (:mod:`.wrapper`) and their step paths (:mod:`.steps`, :mod:`.kernels`, :mod:`.compiled`,
:mod:`.family`):
:mod:`.params` (the master parameter), :mod:`.buckets`, :mod:`.hooks` (torch's optimizer hooks
run once a step), :mod:`.states` (bf16 moments), :mod:`.checkpoint`, :mod:`.compact_state` and
:mod:`.loadcheck` (state dicts), :mod:`.guard` (compiled kernels checked against eager ones),
:mod:`.refusals` (argument checks and the step's refusals).
"""

from .build import compile_master_step, wrap_optimizer
from .compact import CompactMasterOptimizer
from .optimizer import MasterWeightOptimizer, is_master_optimizer
from .params import MasterParameter

__all__ = ["MasterWeightOptimizer", "MasterParameter", "is_master_optimizer",
           "CompactMasterOptimizer", "wrap_optimizer", "compile_master_step"]
