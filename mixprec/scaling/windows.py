"""What a loss scaler keeps of each optimizer across ``update()``: accumulation windows left open,
and iterations that ended before an optimizer's step.

* **An open window** is an optimizer the scaler knows (:meth:`Windows.known`: watched by
  ``amp.setup``, or unscaled, clipped or stepped before) that was not stepped or unscaled since
  a scaled backward: a second optimizer stepped every other micro-batch while the first one's
  steps update the scale. An update records the scale its gradients carry
  (:meth:`Windows.record_open`); the next scaled loss multiplies them by the scale then over
  that one, before its backward adds to them (:meth:`Windows.rescale_open`), so the window's
  step unscales every micro-batch by the scale it carries. A window stepped before another
  backward is not touched: its step divides by the recorded scale.
* **A dropped iteration**: an update that ends an iteration in which an optimizer was unscaled
  or had a clip folded into its step, and not stepped, takes that record with it
  (:meth:`Windows.drop`); a later unscale, clip or step of that optimizer on the same gradients
  is refused (:meth:`Windows.check_not_dropped`).

Nothing here reads the device (no host sync); a scaler pickles without it (its optimizers are
not its own).
"""

from __future__ import annotations

import weakref

import torch

from ..shards import grad_version
from .protocol import owns_gradients
from .unscale import unscale_

__all__ = ["Windows", "grads_of", "versions"]


def versions(grads) -> list:
    """The (id, version) of each gradient: a backward since changes them."""
    return [(id(g), grad_version(g)) for g in grads]


def grads_of(optimizer) -> list:
    """The gradients ``optimizer``'s step reads."""
    if owns_gradients(optimizer):
        return [g for _, g in optimizer.grads_for_step()]
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


class Windows:
    """A scaler's optimizers between its updates (see the module docstring)."""

    def __init__(self) -> None:
        self.known = weakref.WeakSet()  # optimizers watched, unscaled, clipped or stepped
        self._carried: dict[int, torch.Tensor] = {}  # id -> the scale its gradients carry
        self._dropped: dict[int, tuple] = {}  # id -> (losses scaled, gradient versions)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def handled(self, optimizer) -> None:
        """``optimizer``'s gradients were unscaled, stepped or settled: its window is closed."""
        self._carried.pop(id(optimizer), None)
        self.known.add(optimizer)

    def carried(self, optimizer) -> torch.Tensor | None:
        """The scale an update recorded for ``optimizer``'s open window, or None."""
        return self._carried.get(id(optimizer)) if self._carried else None

    def record_open(self, handled: dict, scaled: int, scale_of) -> None:
        """Before an update changes the scale: record ``scale_of(opt)`` for each open window
        (``handled``: id -> losses scaled when it was last unscaled or stepped)."""
        for opt in list(self.known):
            if handled.get(id(opt), 0) < scaled:
                self._carried[id(opt)] = scale_of(opt)

    def new_backward(self, scale: torch.Tensor) -> None:
        """A loss is scaled by ``scale``: the recorded windows are rescaled to it
        (:meth:`rescale_open`), and the dropped iterations are forgotten."""
        self.rescale_open(scale)
        self._dropped.clear()

    def rescale_open(self, scale: torch.Tensor) -> None:
        """Multiply the gradients of each recorded window by ``scale`` over the one they carry
        (on the device; 1 where the scale did not change; each gradient once, a parameter two
        optimizers share too). A master optimizer's fp32 gradients made by a read of ``.grad``
        are dropped (made again from the model's when read)."""
        if not self._carried:
            return
        seen: set[int] = set()
        for opt in list(self.known):
            old = self._carried.get(id(opt))
            if old is None:
                continue
            if owns_gradients(opt):
                opt.drop_master_grads()
            grads = [g for g in grads_of(opt) if id(g) not in seen and not seen.add(id(g))]
            if grads:
                unscale_(grads, (scale.double() / old.to(scale.device).double()).float())
        self._carried.clear()

    def drop(self, unstepped: set[int], scaled: int) -> None:
        """An update ends the iteration: the optimizers unscaled or clipped in it and not
        stepped (``unstepped``: their ids) are remembered with their gradients' versions; a
        master optimizer's unscaled fp32 copies go with the iteration."""
        for opt in list(self.known) if unstepped else ():  # (unscaled or clipped: known)
            if id(opt) in unstepped:
                if owns_gradients(opt):
                    opt.drop_master_grads()
                self._dropped[id(opt)] = (scaled, versions(grads_of(opt)))

    def check_not_dropped(self, optimizer, what: str, scaled: int) -> None:
        """Refuse ``what`` on an optimizer whose unscale_ or clip an update dropped before its
        step, with no backward since: the step would unscale its gradients again (a plain
        optimizer's, unscaled in place: an update ``scale`` times too small;
        ``torch.amp.GradScaler`` does so) or lose the clip folded into it."""
        dropped = self._dropped.pop(id(optimizer), None)
        if dropped == (scaled, versions(grads_of(optimizer))):
            raise RuntimeError(
                f"{what} on an optimizer whose gradients were unscaled or clipped before the "
                f"last update(), which ended the iteration before this optimizer was stepped: "
                f"that unscaling or clip went with it. Step every optimizer you unscale or clip "
                f"before update(): with mp.MixedPrecision, amp.step(opt1, opt2) in one call "
                f"(each step updates the scale), or clip inside it with "
                f"amp.step(opt, max_grad_norm=...); by hand, scaler.step(opt) for each, then "
                f"scaler.update()")
