"""A direct ``optimizer.step()`` while the gradients still carry the loss scale: refused.

``scaler.scale(loss).backward(); optimizer.step()`` (the scaler's ``step`` left out) applies an
update ``scale`` times too large (x65536 by default); ``torch.amp.GradScaler`` lets it through.
An optimizer :class:`mixprec.MixedPrecision` sets up is watched by its scaler: torch's global
step pre-hook (installed once, mixprec's own: it does not count as a user's hook) refuses its
``step()`` when it does not come from the scaler and the gradients carry the scale, whole or
with a clip folded in (:meth:`~mixprec.scaling.base.LossScaler.carries_scale`). After
``unscale_`` a direct step is taken, as torch takes it.
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .protocol import INTERNAL

__all__ = ["watch"]

_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> ref(scaler)
_HOOK: list = []


def watch(optimizer, scaler) -> None:
    """Refuse ``optimizer.step()`` called around ``scaler`` while its gradients carry the scale."""
    _WATCHED[optimizer] = weakref.ref(scaler)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_scaled_step))


def _refuse_scaled_step(optimizer, args, kwargs) -> None:
    ref = _WATCHED.get(optimizer)
    scaler = ref() if ref is not None else None
    if scaler is None or not scaler.carries_scale(optimizer):
        return
    raise RuntimeError(
        f"{type(optimizer).__name__}.step() called directly after a scaled backward: the "
        f"gradients still carry the loss scale (x{scaler.get_scale():g}), and the step would "
        f"apply an update that many times too large. Step through the engine, amp.step(opt) "
        f"(it unscales, skips a step whose gradients hold inf/NaN and updates the scale), or "
        f"scaler.step(opt) then scaler.update(); or call amp.unscale_(opt) first")


setattr(_refuse_scaled_step, INTERNAL, True)
