"""Mixed precision beyond one process: DDP and FSDP2 glue, rank helpers, a memory planner.

* ``env`` (:mod:`mixprec.distenv`, below the packages that prepare models): rank, world size,
  creating the process group from torchrun's environment.
* :mod:`.ddp`: :func:`ddp`, a prepared model in ``DistributedDataParallel`` with the gradient
  reduction in a chosen dtype.
* :mod:`.sharding`: :func:`fsdp`, prepare-and-shard with FSDP2; the fp32 shards are the masters.
  Loaded on first use of ``mp.parallel.fsdp``: importing FSDP2 takes about 0.8 s, half of
  ``import mixprec``.
* ``fp32_state_dict`` for plain, DDP and FSDP models (from :mod:`mixprec.statedict`).
* :mod:`.plan`: bytes per rank and traffic per step on paper (``mixprec plan``).
"""

import importlib

from .. import distenv as env
from ..distenv import init_from_env, is_fsdp, is_main_process, local_rank, rank, unwrap, world_size
from ..fp32export import fp32_state_dict
from .ddp import REDUCE_DTYPES, ddp, reduce_dtype_of
from .plan import MemoryPlan, plan, plan_table

__all__ = ["ddp", "fsdp", "world_size", "rank", "local_rank", "is_main_process", "init_from_env",
           "fp32_state_dict", "unwrap", "is_fsdp", "plan", "plan_table", "MemoryPlan",
           "reduce_dtype_of", "REDUCE_DTYPES", "env"]


def __getattr__(name: str):
    if name == "fsdp":  # FSDP2's import cost (see the module docstring)
        return importlib.import_module(".sharding", __name__).fsdp  # lazy: PEP 562
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
