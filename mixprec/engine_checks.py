"""Checks the engine makes of what it is given: a clip norm, a saved policy, a monitor, and a
prepared model's policy against the run's."""

from __future__ import annotations

import dataclasses
import itertools
import math
import weakref

import torch

from .policy import Policy
from .precision_map import PrecisionMap
from .scaling import owns_gradients

__all__ = ["EngineObserver", "StepOrder", "check_masters", "check_max_norm", "check_policy",
           "check_monitor", "positive_finite", "same_apart_from_marks"]

#: What one iteration of a loop on the engine writes, quoted by the errors about its order.
ITERATION = ("per iteration: amp.backward(loss), then amp.step(optimizer), then "
             "optimizer.zero_grad()")


class EngineObserver:
    """What :class:`mixprec.MixedPrecision` accepts as ``monitor=``
    (:class:`mixprec.PrecisionMonitor` derives from it). The engine calls ``watch(model,
    engine)`` when it prepares a model, ``observe_loss(loss)`` on each backward,
    ``before_step(optimizer, norm)`` and ``after_step(optimizer, stepped)`` around each step
    while ``recording``, and ``end_step(applied)``. The engine sits below the monitor: it knows
    this base and never imports the monitor (``import mixprec`` does not load it)."""


def check_max_norm(max_grad_norm) -> None:
    """Raise ValueError unless ``max_grad_norm`` is None or a positive finite number."""
    if max_grad_norm is not None and not positive_finite(max_grad_norm):
        raise ValueError(f"max_grad_norm must be None or a positive finite number; "
                         f"got {max_grad_norm!r}")


def positive_finite(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value < math.inf)


def check_policy(saved: dict | None, policy: Policy | None, where: str = "this checkpoint"):
    """Refuse a saved policy (a :meth:`Policy.state_dict`) that differs from ``policy`` in
    value (the ``level`` label aside: see :class:`Policy`)."""
    if saved is None or policy is None:
        same = saved is None and policy is None
    else:  # as saved first: a module type defined in a function can't be imported back
        same = (_labelless(saved) == _labelless(policy.state_dict())
                or Policy.from_state_dict(saved) == policy)
    if not same:
        shown = "none" if saved is None else str(Policy.from_state_dict(saved))
        raise ValueError(f"{where} was made under the policy {shown}, but this run uses "
                         f"{policy}: load it into a run with the same policy")


def _labelless(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "level"}


def check_monitor(monitor):
    """``monitor`` itself when it is None or a :class:`mixprec.PrecisionMonitor` (an
    :class:`EngineObserver`)."""
    if monitor is not None and not isinstance(monitor, EngineObserver):
        raise TypeError(f"monitor must be a mixprec.PrecisionMonitor or None; "
                        f"got {type(monitor).__name__}")
    return monitor


def same_apart_from_marks(prepared: Policy, policy: Policy) -> bool:
    """A prepared model's policy adds to the run's modules map the model's to_float marks, and
    the names of the low-bit layers chosen for it when the map left the choice to prepare."""
    blank = PrecisionMap()
    if dataclasses.replace(prepared, modules=blank) != dataclasses.replace(policy, modules=blank):
        return False
    kept = all(prepared.modules.get(k) == v for k, v in policy.modules.items() if v.gemm is None)
    by_type = any(not isinstance(k, str) and v.lowbit for k, v in policy.modules.items())
    names = None if by_type else policy.fp8_modules
    return kept and (names is None or set(prepared.fp8_modules or ()) == set(names))


class StepOrder:
    """What ran since each optimizer's last ``amp.step``: the engine counts ``amp.backward``
    (``scale``) calls, and each step keeps a weak reference to a gradient it read and that
    gradient's version (every gradient, after a step with no ``amp.backward`` before it: a loop
    that calls ``loss.backward()`` itself, fine without a loss scale), so that a step on the
    very same gradients is told apart from one after a new backward."""

    def __init__(self) -> None:
        self.backwards = 0
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict:  # pickled with the engine (spawned ranks): counts only
        return {"backwards": self.backwards}

    def __setstate__(self, state: dict) -> None:
        self.backwards = state["backwards"]
        self._last = weakref.WeakKeyDictionary()

    def check(self, optimizer, grads, scaler) -> None:
        """Refuse a step with no new gradients, or (under a loss scale) gradients that did not
        come through ``amp.backward``. ``grads()``: an iterator over the gradients the step
        reads.

        Raises:
            RuntimeError: saying what to write instead.
        """
        last = self._last.get(optimizer)
        if last is None:
            if self.backwards == 0 and scaler.is_enabled():
                raise _unscaled(scaler)
            return
        if self.backwards > last[0]:
            return
        if self.repeats(optimizer, grads):
            raise RuntimeError(
                "amp.step(optimizer) again with no amp.backward(loss) since this optimizer's "
                "last step: on the same gradients its update would be applied twice "
                "(torch.amp.GradScaler refuses a second step() before update() too); "
                f"{ITERATION}")
        if scaler.is_enabled():
            raise _unscaled(scaler)

    def repeats(self, optimizer, grads) -> bool:
        """Whether ``optimizer``'s gradients are the very ones its last ``amp.step`` read, as it
        read them (no backward since; ``grads()``: as for :meth:`check`): a step now would apply
        that update again. False for an optimizer no ``amp.step`` has stepped."""
        last = self._last.get(optimizer)
        if last is None or self.backwards > last[0] or not last[1]:
            return False
        seen = last[1]
        now = list(grads()) if len(seen) != 1 else list(itertools.islice(grads(), 1))
        return len(now) == len(seen) and all(r() is g and v == g._version
                                             for (r, v), g in zip(seen, now))

    def stepped(self, optimizer, grads) -> None:
        """Record a step of ``optimizer`` (``grads()``: as for :meth:`check`)."""
        last = self._last.get(optimizer)
        fresh = self.backwards > (0 if last is None else last[0])
        read = itertools.islice(grads(), 1) if fresh else grads()
        self._last[optimizer] = (self.backwards, [(weakref.ref(g), g._version) for g in read])


def _unscaled(scaler) -> RuntimeError:
    return RuntimeError(
        f"amp.step(optimizer) with no amp.backward(loss) since its last step: this run scales "
        f"the loss (fp16, scale {scaler.get_scale()}) in amp.backward, and gradients from "
        f"loss.backward() would be divided by the scale all the same, an update that many "
        f"times too small. Write amp.backward(loss) (or amp.scale(loss).backward()) instead of "
        f"loss.backward(); {ITERATION}")


def check_masters(policy: Policy | None, models, optimizer) -> None:
    """Refuse, under a master-weight policy, an optimizer that steps the models' 16-bit
    parameters themselves (made after ``setup``, it was never given fp32 masters).

    Raises:
        RuntimeError: naming a parameter and what to write instead.
    """
    if policy is None or not policy.master_weights or owns_gradients(optimizer):
        return
    low = {id(p): name for m in models for name, p in m.named_parameters()
           if p.dtype in (torch.float16, torch.bfloat16)}
    held = [low[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in low]
    if held:
        where = f"at {policy.level}" if policy.level else "under a master-weight policy"
        raise RuntimeError(
            f"this {type(optimizer).__name__} steps {len(held)} of the model's 16-bit "
            f"parameters themselves ({held[0]}, ...): {where} an optimizer steps fp32 masters, "
            f"and one made after setup(model) has none (16-bit moments, small updates lost). "
            f"Make the optimizer before setup and pass it: model, opt = amp.setup(model, opt) "
            f"(mp.prepare(model, opt) likewise); or wrap this one: "
            f"opt = mp.MasterWeightOptimizer(opt)")
