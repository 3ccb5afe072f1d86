"""The optimizer a master method's parameters are stepped by (:func:`wrap_optimizer`), and its
step path on the CPU (:func:`compile_master_step`).

A method (:mod:`mixprec.masters`) says what it keeps; this module, above it, picks the optimizer
that keeps it: fp32 masters (:attr:`~mixprec.masters.MasterMethod.compact` False) a
:class:`~.optimizer.MasterWeightOptimizer`, the compact methods a
:class:`~.compact.CompactMasterOptimizer`, which asks the method for its buffer and its
``load_lists``/``store_lists``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..masters import MasterMethod
from .compact import CompactMasterOptimizer
from .kernels import is_compilable
from .optimizer import MasterWeightOptimizer, is_master_optimizer

__all__ = ["wrap_optimizer", "compile_master_step"]


def wrap_optimizer(method: MasterMethod, optimizer: torch.optim.Optimizer, *, state_dtype,
                   initial_values: Mapping[torch.Tensor, torch.Tensor] | None = None,
                   sharded: bool = False) -> torch.optim.Optimizer:
    """``optimizer`` wrapped to step 16-bit parameters with ``method``.

    Args:
        method: a :mod:`mixprec.masters` method.
        optimizer: a torch optimizer over the model's parameters.
        state_dtype: the moments' dtype (fp32 or bf16).
        initial_values: 16-bit parameter -> its fp32 value before the cast.
        sharded: the parameters are FSDP2 shards (fp32 ones when the method is not
            :attr:`~mixprec.masters.MasterMethod.compact`: those shards are the masters).
    """
    if method.compact:
        return CompactMasterOptimizer(optimizer, method, state_dtype=state_dtype,
                                      initial_values=initial_values)
    if not sharded:
        return MasterWeightOptimizer(optimizer, initial_masters=initial_values,
                                     state_dtype=state_dtype)
    if state_dtype == torch.float32:  # the fp32 shards are the masters
        return optimizer
    return MasterWeightOptimizer(optimizer, fused=False, state_dtype=state_dtype)


def compile_master_step(optimizer) -> None:
    """Turn on the compiled master step (``fused="compile"``) of a CPU master optimizer that
    supports it. Not on CUDA, where the compiled step's one launch per parameter costs more than
    torch's fused multi-tensor kernels (the default) save (docs/benchmarks.md, "nine-linear and
    transformer on a GPU")."""
    if (is_master_optimizer(optimizer) and is_compilable(optimizer.inner)
            and optimizer.state_dtype == torch.float32):
        optimizer.fused = "compile"
