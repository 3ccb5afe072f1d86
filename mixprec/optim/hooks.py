"""torch's optimizer hooks on a wrapped optimizer: they run as torch runs them, once.

Hooks registered on the optimizer before or after ``mp.prepare`` (step pre/post hooks such as a
global gradient-norm clip or logging, ``state_dict``/``load_state_dict`` pre/post hooks) and
torch's global ones (``register_optimizer_step_pre_hook``) run once per ``step()``, with an
optimizer whose ``param_groups`` cover every parameter. The master optimizer steps its inner
optimizer once per bucket, so the two share one set of hook dicts (a hook registered on either
lands in the same place and its handle removes it); the wrapper's ``step()``, ``state_dict()``
and ``load_state_dict()`` run them once, as the optimizer argument, and the inner optimizer is
stepped through its class's own ``step`` without torch's hook wrapper (:func:`raw_step`).
Called directly, the inner optimizer's ``step()``, ``state_dict()`` and ``load_state_dict()``
are refused, with a message naming the wrapper.

Under a loss scale, torch's ``GradScaler`` unscales a plain optimizer's gradients before its
``step()``, so step pre-hooks (a gradient clip) see true gradients. mixprec's scalers hand a
master optimizer the scale as ``step(grad_scale=...)`` instead, to unscale while reading; when
step pre-hooks are registered (:func:`has_step_pre_hooks`), they unscale first, as torch does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from ..scaling.protocol import INTERNAL

__all__ = ["HOOK_DICTS", "share_hooks", "reshare_hooks", "raw_step", "has_step_pre_hooks",
           "has_step_hooks", "mark_stepped", "own", "own_load_hooks_last"]

#: The per-instance hook dicts of ``torch.optim.Optimizer``.
HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
              "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
              "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def share_hooks(wrapper, inner: torch.optim.Optimizer, *, refuse: bool = True) -> None:
    """Give ``wrapper`` the inner optimizer's hook dicts (``inner``'s hooks become the
    wrapper's, handles included) and, with ``refuse``, put the refusals of direct calls on
    ``inner`` first in them."""
    for name in HOOK_DICTS:
        setattr(wrapper, name, getattr(inner, name))
    if not refuse:
        return
    handle = inner.register_step_pre_hook(wrapper._refuse_direct_step)
    inner._optimizer_step_pre_hooks.move_to_end(handle.id, last=False)
    inner.register_state_dict_pre_hook(wrapper._refuse_direct_state_dict, prepend=True)
    inner.register_load_state_dict_pre_hook(wrapper._refuse_direct_load, prepend=True)


def reshare_hooks(wrapper, inner: torch.optim.Optimizer) -> None:
    """After a copy (pickle, deepcopy): torch's pickling gave ``inner`` empty hook dicts; the
    wrapper's copied dicts (the refusals included, bound to the copy) are shared again."""
    for name in HOOK_DICTS:
        setattr(inner, name, getattr(wrapper, name))


def raw_step(optimizer: torch.optim.Optimizer, closure=None, **kwargs) -> Any:
    """``optimizer``'s own ``step`` without torch's hook wrapper (no step hooks, global or
    per-instance: the wrapper's ``step()`` ran them), with ``kwargs`` (the ones the wrapper's
    ``step`` was given). An LR scheduler built on ``optimizer`` still sees that it stepped."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):  # torch's profile_hook_step around the class's step
        step = step.__wrapped__
    mark_stepped(optimizer)
    # a subclass whose step calls super().step() goes through torch's hook wrapper of the base
    # class (once any plain instance of it exists): that call is the wrapper's, not a direct one
    optimizer.__dict__[STEPPED_BY_WRAPPER] = True
    try:
        return step(optimizer, **kwargs) if closure is None else step(optimizer, closure, **kwargs)
    finally:
        optimizer.__dict__.pop(STEPPED_BY_WRAPPER, None)


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Record, for an LR scheduler built on ``optimizer``, that it stepped (what the
    scheduler's own step wrapper records), where the wrapper ran its update for it."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True


#: Set on an inner optimizer while its wrapper steps it (see :func:`raw_step`).
STEPPED_BY_WRAPPER = "_mixprec_stepped_by_wrapper"


def has_step_pre_hooks(wrapper) -> bool:
    """True when step pre-hooks other than the wrapper's own refusal would run on its
    ``step()`` (its own, its inner optimizer's, or torch's global ones)."""
    if any(not getattr(h, INTERNAL, False)
           for h in getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}).values()):
        return True
    return any(h != wrapper._refuse_direct_step
               for h in wrapper._optimizer_step_pre_hooks.values())


def has_step_hooks(wrapper) -> bool:
    """True when step pre- or post-hooks would run on the wrapper's ``step()`` (a step that
    may be skipped on the device then reads the overflow flag first: the hooks run only when
    it steps)."""
    return (has_step_pre_hooks(wrapper) or bool(wrapper._optimizer_step_post_hooks)
            or bool(getattr(torch_optimizer, "_global_optimizer_post_hooks", None)))


def own(hook):
    """Mark ``hook`` as mixprec's own (see :func:`own_load_hooks_last`); returns it."""
    setattr(hook, INTERNAL, True)
    return hook


def own_load_hooks_last(optimizer) -> None:
    """Move mixprec's own ``load_state_dict`` pre-hooks (marked by :func:`own`) behind the
    user's, in their order: a user's hook registered after ``prepare`` may return a new state
    dict (torch's contract), and mixprec's read the one torch then loads."""
    hooks = optimizer._optimizer_load_state_dict_pre_hooks
    for key in [k for k, hook in hooks.items() if getattr(hook, INTERNAL, False)]:
        hooks.move_to_end(key)
