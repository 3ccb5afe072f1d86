"""torch's module casts (``.float()``, ``.half()``, ``.bfloat16()``, ``.to(dtype)``, ``.type()``)
on a model prepared with master weights.

torch casts a module's parameters in place (``param.data = fn(param)``): on an O2 model whose
16-bit weights have fp32 companions (the masters of the optimizer ``prepare`` wrapped, or the
Kahan-compensated values), ``model.float()`` would store the *rounded* 16-bit weights as fp32,
and the next ``state_dict()`` would take those as the truth: the masters silently lost. So every
module of such a model gets a :class:`CastGuard` as its ``_apply`` (the one method all of
torch's casts and moves go through), which looks at what the cast would do to each floating
parameter before anything changes:

* a parameter widened to fp32 (``.float()``, ``.to(torch.float32)``) takes its exact fp32
  value (the master), and the optimizer is told: from then on the parameter is stored wide and
  is stepped exactly (fp32 masters keep being written into it; a Kahan compensation, folded
  into it, is dropped). The forward still follows the policy (O2 computes in 16 bits under
  autocast): ``.float()`` changes storage, not compute;
* a parameter narrowed, or moved between 16-bit formats (``.half()`` on a bf16 model,
  ``.bfloat16()`` rounding the fp32 norm layers, ``.to(torch.float16)``), would lose what the
  optimizer keeps in fp32: the cast is refused with a ``RuntimeError`` saying what to do, and the
  model is left as it was; so is ``.double()`` (the policy's autocast does not take fp64
  weights);
* device moves and layout changes (``.to("cuda")``, ``.cpu()``, ``.to(memory_format=...)``) pass
  through untouched.

What a cast does is read by applying it to an empty tensor of each (dtype, device) the module
holds; a function that cannot be probed that way is passed through as torch would run it.
"""

from __future__ import annotations

import inspect
import threading

import torch
from torch import nn

from .dtypes import TRAINING_DTYPES, dtype_name

__all__ = ["CastGuard", "guard_casts"]

_STATE = threading.local()  # set while a guard runs: the guards of sub-modules pass through


def _width(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def _refused(old: torch.dtype, new: torch.dtype) -> bool:
    """True when casting a training-dtype ``old`` to ``new`` can round (narrower, or another
    format as wide), or leaves the training dtypes (fp64: autocast does not take it)."""
    return (old in TRAINING_DTYPES and new.is_floating_point and new != old
            and (_width(new) <= _width(old) or new not in TRAINING_DTYPES))


class CastGuard:
    """A prepared module's ``_apply``: torch's casts, keeping the fp32 masters (see the module
    docstring). ``link`` is the model's :class:`mixprec.statedict.Companions`."""

    def __init__(self, module: nn.Module, link) -> None:
        self.module = module
        self.link = link

    def __call__(self, fn, *args, **kwargs):
        # arguments after ``fn`` go on as given: torch's ``_apply(fn, recurse=True)``, or a
        # subclass's own (torchmetrics' ``Metric._apply(fn, exclude_state="")``)
        apply = type(self.module)._apply
        if getattr(_STATE, "active", False):
            return apply(self.module, fn, *args, **kwargs)
        plan = self._plan(fn, _recurse(apply, self.module, fn, args, kwargs))
        _STATE.active = True
        try:
            out = apply(self.module, fn, *args, **kwargs)
        finally:
            _STATE.active = False
        if plan:
            self._take_masters(plan)
        return out

    def _plan(self, fn, recurse: bool) -> dict[torch.Tensor, torch.Tensor]:
        """Widened parameter -> its exact fp32 value; raise RuntimeError for a lossy cast."""
        params = list(self.module.named_parameters(recurse=recurse))
        probed: dict[tuple, torch.dtype] = {}
        changed = []
        for name, p in params:
            if not p.is_floating_point():
                continue
            key = (p.dtype, p.device)
            if key not in probed:
                try:
                    probed[key] = fn(torch.empty(0, dtype=p.dtype, device=p.device)).dtype
                except Exception:  # not a plain cast: run it as torch would
                    return {}
            if probed[key] != p.dtype:
                changed.append((name, p, probed[key]))
        lossy = [(n, p.dtype, new) for n, p, new in changed if _refused(p.dtype, new)]
        if lossy:
            raise RuntimeError(_refusal(lossy))
        if not changed:
            return {}
        pairs = self.link.pairs()
        return {p: pairs[p] for _, p, _ in changed if p in pairs}

    def _take_masters(self, plan: dict[torch.Tensor, torch.Tensor]) -> None:
        with torch.no_grad():
            for param, value in plan.items():
                param.copy_(value.to(param.device))
        for optimizer in self.link.optimizers():
            optimizer.params_widened(list(plan))


def _recurse(apply, module: nn.Module, fn, args: tuple, kwargs: dict) -> bool:
    """The ``recurse`` of a call to ``apply`` (True when its signature has none: the cast
    reaches the sub-modules, as torch's default)."""
    try:
        bound = inspect.signature(apply).bind(module, fn, *args, **kwargs)
    except (TypeError, ValueError):  # a call the method will refuse itself, or no signature
        return True
    return bool(bound.arguments.get("recurse", True))


def _refusal(lossy: list[tuple[str, torch.dtype, torch.dtype]]) -> str:
    shown = ", ".join(f"{n!r} ({dtype_name(old)} -> {dtype_name(new)})"
                      for n, old, new in lossy[:3])
    more = f" and {len(lossy) - 3} more" if len(lossy) > 3 else ""
    if all(new not in TRAINING_DTYPES and _width(new) > _width(old) for _, old, new in lossy):
        return (
            f"a model prepared with master weights computes under its policy (autocast), which "
            f"does not take {dtype_name(lossy[0][2])} weights: {shown}{more}. Call model.float() "
            "for fp32 storage (it keeps the masters exact); for a float64 copy, load "
            "mp.fp32_state_dict(model) into an unprepared model and cast that one")
    return (
        f"this cast would round {len(lossy)} parameter(s) of a model prepared with master "
        f"weights: {shown}{more}. The optimizer keeps their fp32 values (the masters, or the "
        "fp32 weights of layers kept in fp32), and a 16-bit copy would replace them silently. "
        "The prepared model already computes in its policy's 16-bit dtype; call model.float() "
        "for fp32 storage (it keeps the masters exact); to train in another dtype, load "
        "mp.fp32_state_dict(model) into a fresh fp32 model and prepare that one")


def guard_casts(model: nn.Module, link) -> None:
    """Give every module of a prepared ``model`` a :class:`CastGuard` (``link``: its
    companions)."""
    for module in model.modules():
        module._apply = CastGuard(module, link)
