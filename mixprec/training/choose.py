"""Which strategy a :class:`mixprec.Trainer` runs: ``Trainer(strategy=..., reduce_dtype=...)``.

The one place that knows every strategy (:mod:`.strategy` for one process and DDP,
:mod:`.sharded` for FSDP2), so neither of those imports the other's chooser.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from .. import distenv as env
from ..parallel import reduce_dtype_of
from .sharded import FSDPStrategy
from .strategy import DDPStrategy, Strategy

__all__ = ["STRATEGIES", "resolve_strategy", "make_strategy", "warn_single_of_many"]

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


def make_strategy(strategy: str = "auto", reduce_dtype: Any = "fp32",
                  ddp_kwargs: dict | None = None) -> "Strategy":
    """The :class:`Strategy` for a Trainer's ``strategy``, ``reduce_dtype`` and ``ddp_kwargs``
    arguments (``"single"`` in a run of several processes warns: :func:`warn_single_of_many`).

    Raises:
        ValueError: an unknown strategy or reduce dtype; ``ddp_kwargs`` for a strategy that is
            not DDP.
        TypeError: ``ddp_kwargs`` is not a dict.
    """
    reduce = reduce_dtype_of(reduce_dtype)
    name = resolve_strategy(strategy)
    if ddp_kwargs is not None:
        if not isinstance(ddp_kwargs, dict):
            raise TypeError(f"ddp_kwargs must be a dict of DistributedDataParallel's options, "
                            f"e.g. {{'find_unused_parameters': True}}; got {ddp_kwargs!r}")
        if name != "ddp":
            raise ValueError(f"ddp_kwargs are DistributedDataParallel's options; this Trainer's "
                             f"strategy is {name!r}: pass strategy='ddp' (under torchrun)")
        ddp = DDPStrategy(reduce)
        ddp.ddp_kwargs = dict(ddp_kwargs)
        return ddp
    if name == "single":
        warn_single_of_many()
        return Strategy(reduce)
    if name == "ddp":
        return DDPStrategy(reduce)
    return FSDPStrategy(reduce)


def _processes() -> tuple[int, str]:
    """(how many processes this run has, where that was read), 1 for one process."""
    if env.is_initialized():
        return dist.get_world_size(), "a default process group"
    if env.launched_by_torchrun():
        return env.world_size(), "WORLD_SIZE"
    return 1, ""


def warn_single_of_many(stacklevel: int = 4) -> bool:
    """Warn when ``strategy="single"`` runs in one of several processes (torchrun with
    ``WORLD_SIZE`` > 1, or a default process group of more than one rank): each rank would train
    its own copy on all the data and write the same checkpoint and log paths. Returns whether it
    warned."""
    world, source = _processes()
    if world <= 1:
        return False
    warnings.warn(f"strategy='single' in a run of {world} processes ({source}; this is rank "
                  f"{env.rank()}): every rank trains its own copy of the model on all of the "
                  f"data and writes the same checkpoint and log paths. Pass strategy='ddp' or "
                  f"'fsdp' (or 'auto') to train one model across the ranks, or start one "
                  f"process (python train.py, not torchrun)", UserWarning,
                  stacklevel=stacklevel)
    return True
