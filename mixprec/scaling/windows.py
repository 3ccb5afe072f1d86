"""What a loss scaler keeps of each optimizer across ``update()``: accumulation windows left open,
and the records of optimizers unscaled or clipped but not yet stepped.

* **An open window** is an optimizer the scaler knows (:meth:`Windows.known`: watched by
  ``amp.setup``, or unscaled, clipped or stepped before) that was not stepped or unscaled since
  a scaled backward: a second optimizer stepped every other micro-batch while the first one's
  steps update the scale. An update records the scale its gradients carry
  (:meth:`Windows.record_open`); the next scaled loss multiplies them by the scale then over
  that one, before its backward adds to them (:meth:`Windows.rescale_open`), so the window's
  step unscales every micro-batch by the scale it carries. A window stepped before another
  backward is not touched: its step divides by the recorded scale.
* **A record kept across an update**: an optimizer unscaled or clipped in an iteration that an
  update ends before its step (``amp.clip_grad_norm_(o2); amp.step(o1); amp.step(o2)``: each
  ``amp.step`` updates the scale; Lightning's manual optimization clipping both optimizers
  before stepping them) keeps its record until its step, as long as no loss is scaled and its
  gradients stay as they were (:func:`unchanged`): its step then is the one a single
  ``amp.step(o1, o2)`` takes (the record went with the update: a plain optimizer's gradients
  were unscaled a second time, an update ``scale`` times too small, as
  ``torch.amp.GradScaler`` does, and a clip folded into the step was lost). New gradients
  end it; so does the next scaled loss where the gradients were zeroed or made anew, and where
  they were not, it becomes a record of the new iteration: the backward adding to them is then
  refused at the step under a loss scale, as within an iteration. An optimizer without
  gradients keeps none.

Nothing here reads the device (no host sync); a scaler pickles without it (its optimizers are
not its own).
"""

from __future__ import annotations

import weakref

import torch

from ..shards import grad_version
from .protocol import owns_gradients
from .unscale import unscale_

__all__ = ["Windows", "grads_of", "unchanged", "versions", "written_grads"]


def versions(grads) -> list:
    """A weak reference to each gradient, with its version: :func:`unchanged` tells whether they
    are the same tensors, unwritten (a backward since makes new ones or adds into them; the id
    of a freed tensor is reused, so ids can't tell)."""
    return [(weakref.ref(g), grad_version(g)) for g in grads]


def unchanged(recorded: list, grads) -> bool:
    """Whether ``grads`` are the gradients :func:`versions` ``recorded``, as they were."""
    grads = list(grads)
    return len(recorded) == len(grads) and all(
        ref() is g and version == grad_version(g) for (ref, version), g in zip(recorded, grads))


def grads_of(optimizer) -> list:
    """The gradients ``optimizer``'s step reads."""
    if owns_gradients(optimizer):
        return [g for _, g in optimizer.grads_for_step()]
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def written_grads(optimizer) -> list:
    """The gradients a backward writes for ``optimizer``: the model's (a master optimizer's fp32
    copies stay as they were made)."""
    if owns_gradients(optimizer):
        return [p.grad for p, _ in optimizer.grads_for_step()]
    return grads_of(optimizer)


class Windows:
    """A scaler's optimizers between its updates (see the module docstring)."""

    def __init__(self) -> None:
        self.known = weakref.WeakSet()  # optimizers watched, unscaled, clipped or stepped
        self._carried: dict[int, torch.Tensor] = {}  # id -> the scale its gradients carry

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def handled(self, optimizer) -> None:
        """Know ``optimizer``, its window closed: its gradients were unscaled, stepped or
        settled, or it is newly watched (an id a collected optimizer had is not its past)."""
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

    # -- records kept across an update -----------------------------------------------------
    def end_iteration(self, stages, scaled: int) -> None:
        """An update ends the iteration: ``stages``' records go, but an optimizer unscaled or
        clipped and not yet stepped keeps its own, with its gradients' versions and ``scaled``
        (the losses scaled so far); one kept by an earlier update and ended since is not kept
        again; an optimizer without gradients keeps none."""
        kept = stages.unstepped()
        if kept:
            for opt in list(self.known):  # (unscaled or clipped: known)
                record = kept.get(id(opt))
                if record is None or (record.kept_on is not None
                                      and self.record(stages, opt, scaled) is None):
                    continue
                grads = written_grads(opt) if record.kept_on is None else None
                if grads:
                    record.kept_on = (scaled, versions(grads))
            kept = {key: r for key, r in kept.items()
                    if r.kept_on is not None and stages.get_by_id(key) is r}
        stages.clear(kept)

    def settle_kept(self, stages) -> None:
        """A loss is about to be scaled: each kept record ends where its optimizer's gradients
        were zeroed or made anew since, and is an ordinary record of this iteration where they
        are still the ones it unscaled or clipped (a backward adding to them is then refused at
        the step, as within an iteration: the mixed sum was stepped silently)."""
        kept = stages.kept()
        if not kept:
            return
        for opt in list(self.known):
            record = kept.pop(id(opt), None)
            if record is None:
                continue
            if unchanged(record.kept_on[1], written_grads(opt)):
                record.kept_on = None
            else:
                _end(stages, opt)
        for key in kept:  # (optimizers collected since)
            stages.discard_id(key)

    def record(self, stages, optimizer, scaled: int):
        """``optimizer``'s record in ``stages``, or None; one kept across an update ends (a
        master optimizer's unscaled fp32 copies dropped) where a loss was scaled since or its
        gradients are no longer the same tensors, unwritten."""
        record = stages.get(optimizer)
        if record is not None and record.kept_on is not None:
            then, grads = record.kept_on
            if then != scaled or not unchanged(grads, written_grads(optimizer)):
                _end(stages, optimizer)
                return None
        return record


def _end(stages, optimizer) -> None:
    """Forget ``optimizer``'s kept record, and its unscaled fp32 copies with it."""
    stages.discard(optimizer)
    if owns_gradients(optimizer):
        optimizer.drop_master_grads()
