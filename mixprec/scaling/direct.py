"""A direct ``optimizer.step()`` on gradients that carry the loss scale: refused.

``scaler.scale(loss).backward(); optimizer.step()`` (the scaler's ``step`` left out) applies an
update ``scale`` times too large (x65536 by default); ``torch.amp.GradScaler`` lets it through.
An optimizer :class:`mixprec.MixedPrecision` sets up (or ``mp.parallel.fsdp`` with it) is
watched by its scaler: torch's global step pre-hook (installed once, mixprec's own: it does not
count as a user's hook) refuses its ``step()`` when it does not come from the scaler and a loss
was scaled since the scaler last unscaled or stepped its gradients
(:meth:`~mixprec.scaling.base.LossScaler.direct_step_problem`), unless the optimizer holds no
gradient (a frozen part: the step does nothing). A step with a closure makes its own gradients:
the closure is wrapped, and one that scales a loss is refused before the optimizer reads them.
After ``unscale_`` (or the engine's clip) a direct step is taken, as torch takes it. Under a
loss scale only: bf16 has none.

Whatever the loss scale, a direct ``step()`` of an optimizer the engine stepped, on the very
gradients its ``amp.step`` read (no backward since), is refused too: it would apply that update
a second time (``scaler.step(opt); opt.step()`` does with ``torch.amp.GradScaler``).
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .protocol import INTERNAL, owns_gradients
from .windows import grads_of

__all__ = ["watch"]

_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> ref(scaler)
_HOOK: list = []


def watch(optimizer, scaler, order=None) -> None:
    """Refuse ``optimizer.step()`` called around ``scaler`` where it would train on wrong
    numbers (see the module docstring). ``order``: the engine's record of what each optimizer's
    last ``amp.step`` read (its ``repeats(optimizer, grads)``), or None."""
    _WATCHED[optimizer] = (weakref.ref(scaler), None if order is None else weakref.ref(order))
    scaler._handled.pop(id(optimizer), None)  # (an id a collected optimizer had: not its past)
    scaler._windows.handled(optimizer)  # (its accumulation kept across a scale update)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_direct_step))


def _refuse_direct_step(optimizer, args, kwargs):
    ref, order = _WATCHED.get(optimizer, (None, None))
    scaler = ref() if ref is not None else None
    if scaler is None or optimizer is scaler._stepping:  # (the scaler's own step)
        return None
    closure = kwargs.get("closure")
    at = next((i for i, a in enumerate(args[1:], 1) if callable(a)), None)  # (self, *args)
    order = None if order is None else order()
    if (closure is None and at is None and order is not None
            and order.repeats(optimizer, lambda: iter(grads_of(optimizer)))):
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() called directly after amp.step(optimizer), on "
            f"the same gradients: amp.step applied their update (or skipped it: inf/NaN "
            f"gradients), and this step would apply it again. Per iteration: "
            f"amp.backward(loss), amp.step(optimizer), optimizer.zero_grad(); leave out "
            f"optimizer.step()")
    if not scaler.is_enabled():  # (no loss scale: nothing to carry)
        return None
    if closure is not None or at is not None:  # it makes its own gradients: checked as it runs
        return _checked_closure(scaler, optimizer, args, kwargs, at)
    if scaler.direct_step_problem(optimizer) and _holds_gradients(optimizer):
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() called directly after a scaled backward: a "
            f"loss was scaled (x{scaler.get_scale():g}) since the scaler last unscaled or "
            f"stepped this optimizer's gradients, and the step would apply an update that many "
            f"times too large. Step through the engine, amp.step(opt) (it unscales, skips a "
            f"step whose gradients hold inf/NaN and updates the scale), or scaler.step(opt) "
            f"then scaler.update(); or call amp.unscale_(opt) first")
    return None


def _checked_closure(scaler, optimizer, args, kwargs, at):
    """``(args, kwargs)`` with the closure wrapped: one that scales a loss (``amp.backward``)
    is refused before the optimizer reads its gradients (GradScaler refuses closures too)."""
    closure = kwargs["closure"] if at is None else args[at]

    def checked():
        before = scaler.losses_scaled
        loss = closure()
        if scaler.losses_scaled != before:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(closure) whose closure scaled a loss "
                f"(amp.backward): the optimizer would step on gradients that carry the loss "
                f"scale. A step that re-evaluates the loss (LBFGS) cannot run under a loss "
                f"scale, as torch.amp.GradScaler refuses a closure: train in bf16 (no loss "
                f"scale), or call loss.backward() in the closure at O0/O1 without scaling")
        return loss
    if at is None:
        return args, {**kwargs, "closure": checked}
    return (*args[:at], checked, *args[at + 1:]), kwargs


def _holds_gradients(optimizer) -> bool:
    if owns_gradients(optimizer):
        return bool(optimizer.grads_for_step())
    return any(p.grad is not None for g in optimizer.param_groups for p in g["params"])


setattr(_refuse_direct_step, INTERNAL, True)
