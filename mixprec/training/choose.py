"""Which strategy a :class:`mixprec.Trainer` runs: ``Trainer(strategy=..., reduce_dtype=...)``.

The one place that knows every strategy (:mod:`.strategy` for one process and DDP,
:mod:`.sharded` for FSDP2), so neither of those imports the other's chooser.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.distributed as dist

from ..parallel import env, reduce_dtype_of
from .strategy import DDPStrategy, Strategy

__all__ = ["STRATEGIES", "resolve_strategy", "make_strategy"]

STRATEGIES = ("auto", "single", "ddp", "fsdp")


def resolve_strategy(strategy: str) -> str:
    """The concrete strategy for ``strategy`` ("auto": "ddp" under torchrun or a >1-rank group).

    Raises:
        ValueError: an unknown strategy.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}; "
                         f"got {strategy!r}")
    if strategy != "auto":
        return strategy
    if env.is_initialized():
        return "ddp" if dist.get_world_size() > 1 else "single"
    return "ddp" if env.launched_by_torchrun() and env.world_size() > 1 else "single"


def make_strategy(strategy: str = "auto", reduce_dtype: Any = "fp32") -> "Strategy":
    """The :class:`Strategy` for a Trainer's ``strategy`` and ``reduce_dtype`` arguments.

    Raises:
        ValueError: an unknown strategy or reduce dtype.
    """
    reduce = reduce_dtype_of(reduce_dtype)
    name = resolve_strategy(strategy)
    if name == "single":
        return Strategy(reduce)
    if name == "ddp":
        return DDPStrategy(reduce)
    # FSDP2 takes ~0.8 s to import: load the FSDP strategy only when it is asked for.
    return importlib.import_module(".sharded", __package__).FSDPStrategy(reduce)
