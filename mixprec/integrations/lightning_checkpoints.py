"""Lightning checkpoints of the compact master methods that resume bitwise under every
strategy :class:`~mixprec.integrations.lightning.MixprecPrecision` runs under.

``ModelParallelStrategy`` (FSDP2) saves through torch's distributed state-dict functions: a
one-file checkpoint (``save_distributed_checkpoint=False``) gathers every optimizer state to
rank 0, and resuming from it broadcasts each state from rank 0 to the ranks' shards; a sharded
one writes each rank's shards. Two things would keep such a resume from being bitwise:

* ``master="split"``: gloo (the CPU backend) has no int16 collectives. The compact optimizer
  itself gives its int16 remainder as int32 in its ``state_dict``, sharded or not, and narrows
  it back on load (``mixprec.optim.compact_state``), so one-file and sharded checkpoints
  resume bitwise, also in one process, and a one-process checkpoint resumes at several ranks:
  nothing Lightning-specific is needed.
* ``master="kahan"``: Lightning loads an FSDP2 model one sub-module at a time, then, before
  loading the optimizer's state, steps the optimizer once with zero gradients and a zero
  learning rate so that its state exists (torch's ``set_optimizer_state_dict``). That step
  adds each weight's compensation to it: a compensation left from before the load (the
  initial weights') would move the loaded weight. So each module holding a Kahan weight gets a
  load pre-hook that sets the pair from the loaded value (a sharded model has no fp32
  companions linked to it, which the prepared model's own load hooks set).

The plugin's own state carries every rank's RNG states (:func:`rank_rng_states`): Lightning
saves none, and a model with dropout resumes exactly only when each rank continues from its own.

Under ``ModelParallelStrategy`` the checkpoint's ``state_dict`` of a compact master method
holds the 16-bit weights (in fp32); the remainder or compensation that makes each an exact
or near-fp32 master is in the optimizer state (``mp.fp32_state_dict(model, optimizer)`` joins
them).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from .. import distenv as env
from ..optim.states import COMPENSATION_KEY
from ..shards import is_dtensor
from ..statedict import companions_of
from ..training.state import capture_rng, restore_rng
from . import lightning_strategies as strategies

__all__ = ["register", "rank_rng_states", "restore_rank_rng"]

_HOOKED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose hooks are registered


def register(module: nn.Module, optimizers: list) -> None:
    """Register the hooks above on each compact master optimizer of ``module``'s run (once)."""
    sharded = strategies.kind_of(strategies.strategy_of(module)) == "fsdp2"
    if companions_of(module) is not None:  # the prepared model's own load hooks set the pairs
        return
    for optimizer in optimizers:
        key = getattr(optimizer, "_buffer_key", None)
        if key != COMPENSATION_KEY or not sharded or optimizer in _HOOKED:
            continue
        _HOOKED.add(optimizer)
        _compensations_follow_loads(module, optimizer)


def rank_rng_states() -> list[dict]:
    """Every rank's global RNG states (:func:`mixprec.training.state.capture_rng`), in rank
    order; gathered under a process group of several ranks (a collective)."""
    mine = capture_rng()
    if not env.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def restore_rank_rng(states: list[dict]) -> None:
    """Set this rank's RNG states from :func:`rank_rng_states` (rank ``r`` takes entry ``r``
    modulo their number).

    Raises:
        ValueError: not a list of RNG states.
    """
    if not isinstance(states, list) or not states or not all(isinstance(s, dict) for s in states):
        raise ValueError(f"the plugin's RNG states are a list of one dict per rank; got "
                         f"{type(states).__name__}")
    restore_rng(states[env.rank() % len(states)])


def _compensations_follow_loads(model: nn.Module, optimizer) -> None:
    """A load_state_dict pre-hook on each module holding a Kahan weight of ``optimizer``: the
    pair takes the loaded fp32 value (the weight rounded to nearest, the compensation the rest),
    also where the module is loaded alone, as Lightning loads FSDP2 models."""
    ref = weakref.ref(optimizer)

    def load(module, state_dict, prefix, *args) -> None:
        opt = ref()
        for name, param in module.named_parameters(recurse=False):
            value = state_dict.get(prefix + name)
            if (opt is not None and torch.is_tensor(value) and value.shape == param.shape
                    and is_dtensor(value) == is_dtensor(param)
                    and opt.compensation(param) is not None):
                opt.load_fp32_(param, value)

    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in model.modules():
        if any(id(p) in held for p in module.parameters(recurse=False)):
            module.register_load_state_dict_pre_hook(load)
