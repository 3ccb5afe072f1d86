"""A direct ``optimizer.step()`` on gradients that carry the loss scale, or that the scaler
stepped already: refused.

``scaler.scale(loss).backward(); optimizer.step()`` (the scaler's ``step`` left out) applies an
update ``scale`` times too large (x65536 by default), and a direct step after the scaler's, on
the same gradients, applies the update twice (at O2, from gradients that still carry the
scale); ``torch.amp.GradScaler`` lets both through. An optimizer :class:`mixprec.MixedPrecision`
sets up (or ``mp.parallel.fsdp`` with it) is watched by its scaler: torch's global step
pre-hook (installed once, mixprec's own: it does not count as a user's hook) refuses its
``step()`` when it does not come from the scaler and
:meth:`~mixprec.scaling.base.LossScaler.direct_step_problem` names a problem, unless the
optimizer holds no gradient (a frozen part: the step does nothing) or the step takes a closure
(which makes its own gradients). After ``unscale_`` (or the engine's clip) a direct step is
taken, as torch takes it. Under a loss scale only: bf16 has none.
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .protocol import INTERNAL, owns_gradients

__all__ = ["watch"]

_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> ref(scaler)
_HOOK: list = []


def watch(optimizer, scaler) -> None:
    """Refuse ``optimizer.step()`` called around ``scaler`` where it would train on wrong
    numbers (see the module docstring)."""
    _WATCHED[optimizer] = weakref.ref(scaler)
    scaler._handled.pop(id(optimizer), None)  # (an id a collected optimizer had: not its past)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_direct_step))


def _refuse_direct_step(optimizer, args, kwargs) -> None:
    ref = _WATCHED.get(optimizer)
    scaler = ref() if ref is not None else None
    if scaler is None or kwargs.get("closure") is not None or any(map(callable, args[1:])):
        return  # (torch's hook gets (self, *args): a closure makes its own gradients)
    problem = scaler.direct_step_problem(optimizer)
    if problem is None or not _holds_gradients(optimizer):
        return
    name = type(optimizer).__name__
    if problem == "scaled":
        raise RuntimeError(
            f"{name}.step() called directly after a scaled backward: the gradients still carry "
            f"the loss scale (x{scaler.get_scale():g}), and the step would apply an update that "
            f"many times too large. Step through the engine, amp.step(opt) (it unscales, skips "
            f"a step whose gradients hold inf/NaN and updates the scale), or scaler.step(opt) "
            f"then scaler.update(); or call amp.unscale_(opt) first")
    raise RuntimeError(
        f"{name}.step() called directly after amp.step(opt) (or scaler.step(opt)) on the same "
        f"gradients: the update would be applied twice (at O2 from gradients that still carry "
        f"the loss scale). Per iteration: amp.backward(loss), then amp.step(opt), then "
        f"opt.zero_grad()")


def _holds_gradients(optimizer) -> bool:
    if owns_gradients(optimizer):
        return bool(optimizer.grads_for_step())
    return any(p.grad is not None for g in optimizer.param_groups for p in g["params"])


setattr(_refuse_direct_step, INTERNAL, True)
