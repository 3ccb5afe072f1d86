"""Checks the engine makes of what it is given: a clip norm, a saved policy, a monitor, and a
prepared model's policy against the run's."""

from __future__ import annotations

import dataclasses
import math

from .policy import Policy
from .precision_map import PrecisionMap

__all__ = ["EngineObserver", "check_max_norm", "check_policy", "check_monitor", "positive_finite",
           "same_apart_from_marks"]


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
    else:
        same = Policy.from_state_dict(saved) == policy
    if not same:
        shown = "none" if saved is None else str(Policy.from_state_dict(saved))
        raise ValueError(f"{where} was made under the policy {shown}, but this run uses "
                         f"{policy}: load it into a run with the same policy")


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
