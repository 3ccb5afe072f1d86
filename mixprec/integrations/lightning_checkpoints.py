"""Lightning checkpoints of the compact master methods that resume bitwise under every
strategy :class:`~mixprec.integrations.lightning.MixprecPrecision` runs under.

``ModelParallelStrategy`` (FSDP2) saves through torch's distributed state-dict functions: a
one-file checkpoint (``save_distributed_checkpoint=False``) gathers every optimizer state to
rank 0, and resuming from it broadcasts each state from rank 0 to the ranks' shards; a sharded
one writes each rank's shards. Two things would keep such a resume from being bitwise:

* ``master="split"``: gloo (the CPU backend) has no int16 collectives. The compact optimizer
  itself gives its int16 remainder as int32 in its ``state_dict``, sharded or not, and narrows
  it back on load (``mixprec.master.compact_state``), so one-file and sharded checkpoints
  resume bitwise, also in one process, and a one-process checkpoint resumes at several ranks:
  nothing Lightning-specific is needed.
* ``master="kahan"``: Lightning loads an FSDP2 model one sub-module at a time, then, before
  loading the optimizer's state, steps the optimizer once with zero gradients and a zero
  learning rate so that its state exists (torch's ``set_optimizer_state_dict``). That step
  adds each weight's compensation to it: a compensation left from before the load (the
  initial weights') would move the loaded weight. So each module holding a Kahan weight gets a
  load pre-hook that sets the pair from the loaded value, as the prepared model's own hook
  does when it is loaded whole.

Under ``ModelParallelStrategy`` the checkpoint's ``state_dict`` of a compact master method
holds the 16-bit weights (in fp32); the remainder or compensation that makes each an exact
or near-fp32 master is in the optimizer state (``mp.fp32_state_dict(model, optimizer)`` joins
them).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..master.states import COMPENSATION_KEY
from ..shards import is_dtensor
from . import lightning_strategies as strategies

__all__ = ["register"]

_HOOKED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose hooks are registered


def register(module: nn.Module, optimizers: list) -> None:
    """Register the hooks above on each compact master optimizer of ``module``'s run (once)."""
    sharded = strategies.kind_of(strategies.strategy_of(module)) == "fsdp2"
    for optimizer in optimizers:
        key = getattr(optimizer, "_buffer_key", None)
        if key != COMPENSATION_KEY or not sharded or optimizer in _HOOKED:
            continue
        _HOOKED.add(optimizer)
        _compensations_follow_loads(module, optimizer)


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
