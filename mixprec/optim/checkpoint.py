"""The master optimizer's checkpoint hooks: fp32 masters travel in its ``state_dict``.

torch's own ``Optimizer.state_dict``/``load_state_dict`` do the work (state and groups by
parameter index); these hooks add the masters under :data:`MASTERS_KEY`, check them on load, and
write them back into the model's parameters, so a resumed run continues bitwise. A plain torch
optimizer's ``state_dict`` (no masters) loads too: the masters keep their values.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping

import torch

from . import hooks, states
from .params import is_master

__all__ = ["MASTERS_KEY", "register", "indexed_masters"]

#: Key of the fp32 master weights in ``MasterWeightOptimizer.state_dict()``.
MASTERS_KEY = "master_weights"

# the masters a load_state_dict call brought, from its pre-hook to its post-hook
_INCOMING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def indexed_masters(optimizer) -> dict[int, torch.Tensor]:
    """Masters by their flat index over ``param_groups`` (torch's state_dict numbering)."""
    out: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    start = 0
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"], start):
            if is_master(p) and id(p) not in seen:
                out[i] = p
                seen.add(id(p))
        start += len(group["params"])
    return out


def register(optimizer) -> None:
    """Install the hooks on a ``MasterWeightOptimizer``."""
    optimizer.register_state_dict_post_hook(_save_masters)
    optimizer.register_load_state_dict_pre_hook(hooks.own(_take_masters))
    optimizer.register_load_state_dict_post_hook(_restore_masters)


def _save_masters(optimizer, state: dict) -> dict:
    """state_dict post-hook: the fp32 masters travel under ``"master_weights"``.

    Raises:
        RuntimeError: called by torch's ``get_state_dict``/``get_optimizer_state_dict``
            (``torch.distributed.checkpoint.state_dict``), which map an optimizer's
            parameters to the model's by identity: fp32 masters are other tensors, and torch
            failed on them with a bare ``KeyError: 0``.
    """
    masters = indexed_masters(optimizer)
    if masters and _from_torch_state_dict_functions():
        raise RuntimeError(
            "torch.distributed.checkpoint.state_dict's get_state_dict/"
            "get_optimizer_state_dict (and set_state_dict) look an optimizer's parameters up "
            "among the model's, and this optimizer steps fp32 masters, other tensors. Save "
            "model.state_dict() and optimizer.state_dict() (torch.distributed.checkpoint's "
            "save/load take them; the masters travel in the optimizer's), or prepare with "
            "master='split', whose optimizer steps the model's own parameters; under FSDP2 "
            "(mp.parallel.fsdp) the masters are the shards and these functions work")
    state[MASTERS_KEY] = {i: m.detach() for i, m in masters.items()}
    return state


def _from_torch_state_dict_functions() -> bool:
    """Whether torch's distributed state-dict functions called this ``state_dict()``."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "_get_optim_state_dict"
                and frame.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict"):
            return True
        frame = frame.f_back
    return False


def _take_masters(optimizer, state_dict: Mapping) -> dict:
    """load_state_dict pre-hook: check and set aside the saved masters."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict; got {type(state_dict).__name__}")
    state_dict = dict(state_dict)
    saved = state_dict.pop(MASTERS_KEY, None)
    if saved is not None:
        _check_saved_masters(saved, indexed_masters(optimizer))
    _INCOMING[optimizer] = saved
    return state_dict


def _restore_masters(optimizer) -> None:
    """load_state_dict post-hook: share the new groups and state with the inner optimizer,
    copy the saved masters in, and write them back into the model parameters."""
    optimizer.inner.param_groups = optimizer.param_groups
    optimizer.inner.state = optimizer.state
    saved = _INCOMING.pop(optimizer, None)
    masters = indexed_masters(optimizer)
    if saved:
        with torch.no_grad():
            torch._foreach_copy_(list(masters.values()), [saved[i] for i in masters])
    optimizer.write_back()
    optimizer.drop_master_grads()
    states.restore_generator(optimizer, optimizer.rounding)


def _check_saved_masters(saved: Mapping[int, torch.Tensor],
                         masters: dict[int, torch.Tensor]) -> None:
    if set(saved) != set(masters):
        raise ValueError(
            f"state_dict holds fp32 masters for parameter indices {sorted(saved)}, but this "
            f"optimizer's low-precision parameters are at {sorted(masters)}; load it into an "
            "optimizer built the same way over the same model (same groups, same dtypes)")
    for i, master in masters.items():
        if tuple(saved[i].shape) != tuple(master.shape):
            raise ValueError(
                f"saved master {i} has shape {tuple(saved[i].shape)}, but the parameter has "
                f"shape {tuple(master.shape)}")
