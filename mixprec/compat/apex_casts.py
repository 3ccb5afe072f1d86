"""apex's O1 casts: the forward context of an O1 model, the functions registered for O1, the cast
decorators and ``disable_casts``.

An O1 model's forward runs under :class:`O1Casts`, the context object of its
:class:`mixprec.regions.Entry`: :class:`mixprec.autocast` with apex's O1 lists
(:mod:`mixprec.compat.apex_lists`) plus the registrations, on the model's device, with the
low-precision dtype published in :data:`~mixprec.compat.apex_state.AMP` ``.cast_dtype`` for the
cast decorators. Nothing in torch is patched.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from .. import oplists
from ..autocast import autocast, cast_floating
from .apex_lists import APEX_O1_LISTS
from .apex_state import AMP

__all__ = ["O1Casts", "o1_lists", "register", "cast_wrapper", "disable_casts"]

_TORCH_NAMESPACES = ((torch, ""), (F, ""), (torch.Tensor, ""), (torch.linalg, "linalg_"),
                     (torch.fft, "fft_"), (torch.special, "special_"))
_ORIGINAL_ATTR = "__mixprec_apex_original__"


def o1_lists() -> dict[str, tuple[str, ...]]:
    """apex's O1 lists with the registered op names moved to their lists."""
    registered = AMP.registrations
    lists = {k: [n for n in v if n not in registered] for k, v in APEX_O1_LISTS.items()}
    for name, policy in registered.items():
        lists[policy].append(name)
    return {k: tuple(v) for k, v in lists.items()}


class O1Casts:
    """apex's O1 for one model (the context of its forward :class:`~mixprec.regions.Entry`):
    the O1 lists through :class:`mixprec.autocast` on the model's device, and the cast
    decorators switched on, while the forward runs.

    Args:
        device_type: the model's device type.
        low_dtype: the low-precision dtype (fp16, or bf16 with ``dtype="bf16"``).
    """

    def __init__(self, device_type: str, low_dtype: torch.dtype):
        self.low_dtype = low_dtype
        lists = o1_lists()
        self.context = autocast(low_dtype, device_type=device_type, extend_defaults=False,
                                low_precision_ops=lists["low_precision"], fp32_ops=lists["fp32"],
                                promote_ops=lists["promote"]).context

    def run(self, fn, args: tuple, kwargs: dict):
        """``fn(*args, **kwargs)`` under apex's O1 lists."""
        token = AMP.cast_dtype.set(self.low_dtype)
        try:
            return self.context.run(fn, args, kwargs)
        finally:
            AMP.cast_dtype.reset(token)


def register(module, name, policy: str) -> None:
    """``register_*_function``: a function of torch joins the O1 lists; any other module's
    function is replaced by :func:`cast_wrapper` of it (apex's behaviour).

    Raises:
        TypeError: ``name`` is not a string, or names something not callable.
        ValueError: ``module`` has no attribute ``name``.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a string; got {type(name).__name__}")
    if not hasattr(module, name):
        raise ValueError(f"no function named {name!r} in module {module!r}")
    prefix = next((p for ns, p in _TORCH_NAMESPACES if module is ns), None)
    if prefix is not None:
        op = prefix + name
        oplists.resolve_op(op)
        AMP.registrations[op] = policy
        return
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{module!r}.{name} is not callable")
    setattr(module, name, cast_wrapper(getattr(fn, _ORIGINAL_ATTR, fn), policy))


def cast_wrapper(fn, policy: str):
    """``fn`` with its floating tensor arguments cast per ``policy`` inside an O1 forward
    ("low_precision", "fp32" or "promote": the widest of their dtypes); elsewhere ``fn``."""
    if not callable(fn):
        raise TypeError(f"expected a function to decorate; got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        low = AMP.cast_dtype.get()
        if low is None:
            return fn(*args, **kwargs)
        if policy == "promote":
            dtypes = {t.dtype for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.is_floating_point()
                      and t.dtype != torch.float64}
            if len(dtypes) < 2:
                return fn(*args, **kwargs)
        dtype = low if policy == "low_precision" else torch.float32
        args, kwargs = cast_floating((args, kwargs), dtype)
        return fn(*args, **kwargs)

    setattr(wrapper, _ORIGINAL_ATTR, fn)
    return wrapper


@contextlib.contextmanager
def disable_casts():
    """Inside this block, O1's op lists and the cast decorators do nothing (autocast is off)."""
    token = AMP.cast_dtype.set(None)
    try:
        with contextlib.ExitStack() as stack:
            for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        AMP.cast_dtype.reset(token)
