"""The state of a :class:`~mixprec.optim.compact.CompactMasterOptimizer` and its
``state_dict()`` hooks.

Compact masters draw the keys of their stochastic roundings (Kahan compensations, stochastic
weights, bf16 moments) from a generator whose state travels in ``state_dict()`` (in the first
parameter entry of ``state``, key ``"rounding_generator"``, so DCP and FSDP2 carry it too), so
a resumed run continues bitwise.

The optimizer steps the model's own parameters: ``param_groups`` hold them (no masters), and
``state`` is keyed by them, with the Kahan compensation under ``state[p]["compensation"]`` (in
the weight's dtype) or the split remainder under ``state[p]["remainder"]`` (int16; int32 in
``state_dict()``, which gloo's collectives carry), so torch's, DCP's and FSDP2's state-dict
machinery carry it like any moment.
fp32 parameters in the groups (norm layers kept in fp32) are stepped by the inner optimizer as
they are. ``state_dtype="bf16"`` stores the moments in bf16 (:mod:`mixprec.optim.states`).
"""

from __future__ import annotations

import torch

from ..shards import local
from . import hooks, states
from .params import _is_current, _source_key

__all__ = ["save_pending", "load_generator", "share_with_inner", "hold_unstepped", "register",
           "widen_int16", "narrow_wide"]


def save_pending(optimizer, state: dict) -> dict:
    """state_dict post-hook: buffers not in the state (no step taken yet, or a state cleared
    since the last) are saved too, so a checkpoint taken then resumes exactly."""
    _save_generator(optimizer, state)
    aside = optimizer.set_aside()
    if not aside:
        return state
    index, start = {}, 0
    for group in optimizer.param_groups:  # torch's numbering: first occurrence, group by group
        for i, p in enumerate(group["params"], start):
            index.setdefault(id(p), i)
        start += len(group["params"])
    for p, comp in aside.items():
        entry = state["state"].setdefault(index[id(p)], {})
        entry.setdefault(optimizer._buffer_key, comp)
    return state


def _save_generator(optimizer, state: dict) -> None:
    """A state cleared since the last step holds no rounding generator: it goes in the first
    parameter's entry, so a run resumed from this checkpoint rounds as the uninterrupted one."""
    if not getattr(optimizer, "_stepped", False) or any(
            isinstance(e, dict) and states.GENERATOR_KEY in e for e in state["state"].values()):
        return
    if not optimizer.master.draws_bits and optimizer.state_dtype == torch.float32:
        return  # (nothing rounded stochastically: the generator never moves)
    first = state["param_groups"][0]["params"][0] if state["param_groups"] else None
    if first is not None:
        state["state"].setdefault(first, {})[states.GENERATOR_KEY] = \
            optimizer.rounding.state_dict()


def load_generator(optimizer) -> None:
    """load_state_dict post-hook: the rounding generator continues from the saved state."""
    states.restore_generator(optimizer, optimizer.rounding)


def share_with_inner(optimizer) -> None:
    """load_state_dict post-hook: torch made new groups and state; the inner optimizer shares
    them again."""
    optimizer.inner.param_groups = optimizer.param_groups
    optimizer.inner.state = optimizer.state
    optimizer._rebuild()
    optimizer.drop_master_grads()


def hold_unstepped(optimizer) -> None:
    """load_state_dict post-hook (the last): buffers loaded for parameters never stepped (a
    state saved before the first step, or a host's ``state_dict()``/``load_state_dict()``
    round trip when it wraps the optimizer, as Accelerate's does) are held aside again, so an
    optimizer that has not stepped still has an empty ``state``: torch's distributed
    checkpointing takes a non-empty state for a laid-out one and would load into too few
    entries. A parameter whose loaded state holds no buffer (a plain torch optimizer's state
    dict) keeps its own, as fp32 masters keep their masters: torch's load sets the moments,
    never the parameters."""
    key = getattr(optimizer, "_buffer_key", None)
    if key is None:
        return
    before, optimizer._kept = optimizer._kept, {}
    for p in optimizer._low:
        entry = optimizer.state.get(p)
        if entry is not None and set(entry) == {key}:
            optimizer._pending[p] = entry[key]
            del optimizer.state[p]
        elif entry is not None and key in entry:
            optimizer._kept[p] = entry[key]
            optimizer._pending.pop(p, None)  # the buffer made before the load: not kept twice
        elif p in before and p not in optimizer._pending:  # (set aside; the next step puts
            optimizer._kept[p] = before[p]                  # it in the state)


def widen_int16(optimizer, state: dict) -> dict:
    """state_dict post-hook: an int16 buffer (the split remainder), sharded by FSDP2 or not, is
    given as int32, the same integers (a copy: 4 bytes per element while the state dict is
    held). gloo cannot all-gather or broadcast int16 ("Invalid scalar type"), and torch's
    distributed state-dict functions move every tensor of a state dict through a collective:
    a full state dict gathers each shard, and a full one loaded at several ranks (Lightning's
    one-file checkpoint, saved in one process or several) is broadcast from the first rank.
    NCCL could carry int16, but one format serves every host and backend.
    :func:`narrow_wide` makes it int16 again on load."""
    key = getattr(optimizer, "_buffer_key", None)  # the hooks are shared with the inner one
    if key is None:
        return state
    for index, entry in list(state["state"].items()):
        value = entry.get(key) if isinstance(entry, dict) else None  # a user's hook's entries
        if torch.is_tensor(value) and value.dtype == torch.int16:
            state["state"][index] = {**entry, key: value.to(torch.int32)}  # the live entry
    return state                                                           # stays int16


def narrow_wide(optimizer, state_dict: dict) -> dict:
    """load_state_dict pre-hook (the first): an int32 buffer that :func:`widen_int16` gave
    is int16 again, before the buffer checks and torch's load.

    Raises:
        ValueError: an int32 buffer holding a value outside int16 (not one this hook's
            counterpart wrote).
    """
    key, saved = getattr(optimizer, "_buffer_key", None), state_dict.get("state")
    if key is None or not isinstance(saved, dict):
        return state_dict
    narrowed = dict(saved)
    for index, entry in saved.items():
        value = entry.get(key) if isinstance(entry, dict) else None
        if not torch.is_tensor(value) or value.dtype != torch.int32:
            continue
        shard = local(value)
        if shard.numel() and (shard.min() < -2 ** 15 or shard.max() >= 2 ** 15):
            raise ValueError(f"the optimizer state's {key!r} of parameter {index} is int32 with "
                             f"values outside int16; a {key!r} is an int16 (saved widened to "
                             f"int32): this state was not written by mixprec")
        narrowed[index] = {**entry, key: value.to(torch.int16)}
    return {**state_dict, "state": narrowed}


def register(optimizer) -> None:
    """Install the hooks above that are not installed one by one: :func:`widen_int16`
    (after :func:`save_pending`), :func:`narrow_wide` (first of the load pre-hooks) and
    :func:`hold_unstepped` (last of the load post-hooks)."""
    optimizer.register_state_dict_post_hook(widen_int16)
    optimizer.register_load_state_dict_pre_hook(hooks.own(narrow_wide), prepend=True)
    optimizer.register_load_state_dict_post_hook(hold_unstepped)


def show_held(optimizer) -> None:
    """After the fp32 copies a compact optimizer holds of fp16 gradients changed in place (a
    clip), the model's gradients read as them (rounded to fp16), and the copies stay the ones
    the step uses: code reading ``model.parameters()`` sees the values the step will use."""
    held = getattr(optimizer, "_grads32", None)
    pairs = [(p, copy) for p, (copy, key) in (held or {}).items() if _is_current(key, p.grad)]
    if not pairs:
        return
    with torch.no_grad():  # (FSDP2 shards: their local tensors; DTensor has no foreach copy)
        torch._foreach_copy_([local(p.grad) for p, _ in pairs], [local(c) for _, c in pairs])
    for p, copy in pairs:  # the model's gradients changed version: the copies still current
        held[p] = (copy, _source_key(p.grad))
