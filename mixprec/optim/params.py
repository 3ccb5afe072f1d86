"""``MasterParameter``: the fp32 master of a low-precision model parameter.

A master lives in its optimizer's ``param_groups`` in place of the 16-bit model parameter, so
code that walks ``param_groups`` (``clip_grad_norm_`` over the optimizer's parameters, Lightning's
gradient clipping and norm tracking, the optimizer's own ``step``) reads ``master.grad``. That
gradient is derived, not stored between steps: reading ``.grad`` returns the model parameter's
current gradient in fp32 (made on first read, in the master's own memory layout, and kept while
the model's gradient is unchanged). So the optimizer's parameters always carry the gradient torch
code expects, with no fp32 gradient of the whole model held between backward and step unless
someone reads it.

The derived gradient carries the factor the model's gradient carries: before a loss scaler
unscales, the scaled values (as with ``torch.amp``, where the gradients in ``param_groups`` are
scaled until ``unscale_``); after ``scaler.unscale_(optimizer)`` the true ones. An in-place change
to it (clipping) is kept and used by the step. When the model's gradient changes afterwards (a new
backward, ``clip_grad_norm_(model.parameters())``), the next read derives it again from the model's
gradient, which is then the source of truth.
"""

from __future__ import annotations

import copy
import weakref
from collections import defaultdict

import torch
from torch import nn

from ..shards import grad_version
from .buckets import widened

__all__ = ["MasterParameter", "MasterState", "GradCarry", "is_master", "valid_grad", "is_stale",
           "held_grad", "set_grad", "drop_grad", "derive_grad", "derive_grads", "show_master_grads"]

_GRAD = torch.Tensor.grad  # torch's own .grad slot (a C-level descriptor)
_NO_SOURCE = (None, -1)


class GradCarry:
    """The factor an optimizer's model gradients still carry, shared by its masters.

    ``inv`` is None (they carry nothing, or an unknown factor, e.g. an un-unscaled loss scale
    before a scaler's step) or a 0-d tensor they must be multiplied by to read as the true
    gradients (set after a step that unscaled them on the fly, so reads after ``step()`` see the
    true gradients, as with ``torch.amp``). :meth:`carry` records the scale itself: its inverse
    is made when first read (no kernel on a step nobody reads a gradient after).

    ``held`` is False while no master sharing it holds an fp32 gradient (set when one is given
    one; cleared by its optimizer once it dropped them all): a step then reads every model
    gradient as it is, with no look at the masters one by one.
    """

    __slots__ = ("_inv", "_scale", "held")

    def __init__(self):
        self._inv: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None
        self.held = False

    @property
    def inv(self) -> torch.Tensor | None:
        if self._inv is None and self._scale is not None:
            self._inv, self._scale = self._scale.double().reciprocal().float(), None
        return self._inv

    @inv.setter
    def inv(self, value: torch.Tensor | None) -> None:
        self._inv, self._scale = value, None

    def carry(self, scale: torch.Tensor) -> None:
        """The gradients carry ``scale`` (a 0-d tensor, not changed in place afterwards)."""
        self._inv, self._scale = None, scale

    def __reduce__(self):  # a copy starts carrying nothing (the gradients are not copied)
        return (GradCarry, ())


def _source_key(grad: torch.Tensor | None) -> tuple:
    return _NO_SOURCE if grad is None else (weakref.ref(grad), grad_version(grad))


def _is_current(key: tuple | None, grad: torch.Tensor | None) -> bool:
    if key is None:
        return False
    if grad is None:
        return key == _NO_SOURCE
    return key[0] is not None and key[0]() is grad and key[1] == grad_version(grad)


_REQUIRES_GRAD = torch._C.TensorBase.requires_grad  # the tensor's own flag


class MasterParameter(nn.Parameter):
    """An fp32 master weight whose ``.grad`` is its model parameter's gradient in fp32.

    Built by :class:`mixprec.MasterWeightOptimizer`; see the module docstring. ``model_param``
    is the low-precision parameter it masters.
    """

    def _link(self, param: torch.Tensor, carry: GradCarry) -> MasterParameter:
        self._mp_param = param
        self._mp_carry = carry
        self._mp_source = None
        return self

    @property
    def model_param(self) -> torch.Tensor:
        """The low-precision model parameter this master belongs to."""
        return self._mp_param

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        """Its model parameter's: code that freezes the optimizer's parameters (Lightning's
        ``toggle_optimizer``) freezes the model's, whose gradients the step reads."""
        param = self.__dict__.get("_mp_param")
        return _REQUIRES_GRAD.__get__(self) if param is None else param.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        _REQUIRES_GRAD.__set__(self, value)
        param = self.__dict__.get("_mp_param")
        if param is not None:
            param.requires_grad = value

    def requires_grad_(self, requires_grad: bool = True) -> MasterParameter:
        self.requires_grad = requires_grad
        return self

    @property
    @torch._disable_dynamo  # read eagerly inside a compiled function (dynamo recursed into it)
    def grad(self) -> torch.Tensor | None:  # type: ignore[override]
        """The model parameter's gradient in fp32 (see the module docstring)."""
        cached = valid_grad(self)
        if cached is not None:
            return cached
        if self._mp_param.grad is None:
            drop_grad(self)
            return None
        return derive_grad(self, self._mp_carry.inv)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if value is None:  # its gradient is the model's: gone for both (torch's zero_grad)
            del self.grad
        else:
            set_grad(self, value)

    @grad.deleter
    def grad(self) -> None:
        drop_grad(self)
        self._mp_param.grad = None

    def __reduce_ex__(self, proto):
        return (_rebuild_master, (self.data, self.requires_grad, self._mp_param, self._mp_carry))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = MasterParameter(self.data.clone(memory_format=torch.preserve_format),
                              self.requires_grad)
        memo[id(self)] = new
        return new._link(copy.deepcopy(self._mp_param, memo), copy.deepcopy(self._mp_carry, memo))

    def __repr__(self) -> str:
        return "MasterParameter containing:\n" + torch.Tensor.__repr__(self)


def _rebuild_master(data, requires_grad, param, carry) -> MasterParameter:
    return MasterParameter(data, requires_grad)._link(param, carry)


def is_master(tensor: torch.Tensor) -> bool:
    """True for a :class:`MasterParameter`."""
    return isinstance(tensor, MasterParameter)


def valid_grad(master: MasterParameter) -> torch.Tensor | None:
    """The master's fp32 gradient if one is held and still matches the model's, else None
    (never derives one)."""
    cached = _GRAD.__get__(master)
    if cached is not None and _is_current(master._mp_source, master._mp_param.grad):
        return cached
    return None


def is_stale(master: MasterParameter) -> bool:
    """True when the master holds an fp32 gradient made from a model gradient that has changed
    since (a new backward, or an in-place change such as clipping the model's gradients)."""
    return _GRAD.__get__(master) is not None and not _is_current(master._mp_source,
                                                                  master._mp_param.grad)


def held_grad(master: MasterParameter) -> torch.Tensor | None:
    """The fp32 gradient tensor the master holds right now, current or not (None: none); what
    its memory footprint counts. Never derives one."""
    return _GRAD.__get__(master)


def set_grad(master: MasterParameter, grad: torch.Tensor | None) -> None:
    """Give ``master`` a gradient made from its model parameter's current gradient."""
    _GRAD.__set__(master, grad)
    master._mp_source = None if grad is None else _source_key(master._mp_param.grad)
    if grad is not None:
        master._mp_carry.held = True


def drop_grad(master: MasterParameter) -> None:
    """Drop the master's fp32 gradient."""
    _GRAD.__set__(master, None)
    master._mp_source = None


def derive_grad(master: MasterParameter, inv: torch.Tensor | None) -> torch.Tensor | None:
    """Make the master's fp32 gradient from its model parameter's: a copy in the master's layout
    (coalesced when sparse), times ``inv`` (a 0-d tensor) when given."""
    source = master._mp_param.grad
    if source is None:
        drop_grad(master)
        return None
    with torch.no_grad():
        if source.is_sparse:
            grad = source.to(torch.float32, copy=True).coalesce()
            if inv is not None:
                grad._values().mul_(inv)
        else:
            grad = torch.empty_like(master, memory_format=torch.preserve_format)
            grad.copy_(source)
            if inv is not None:
                grad.mul_(inv)
    set_grad(master, grad)
    return grad


def derive_grads(masters: list[MasterParameter]) -> list[tuple[MasterParameter, torch.Tensor]]:
    """:func:`derive_grad` (no factor) for ``masters`` at once: the dense copies in the master's
    layout by :func:`~mixprec.optim.buckets.widened` (one ``_foreach_copy_`` per device and
    dtype), not a copy per tensor. Returns the ``(master, fp32 gradient)`` pairs made (masters
    whose model gradient is None drop theirs)."""
    with torch.no_grad():
        dense = [m for m in masters if m._mp_param.grad is not None
                 and not m._mp_param.grad.is_sparse]
        copies = dict(zip(map(id, dense), widened([m._mp_param.grad for m in dense],
                                                  like=dense)))
        made = [(m, copies[id(m)] if id(m) in copies else derive_grad(m, None))
                for m in masters]
    made = [(m, g) for m, g in made if g is not None]
    for master, grad in made:
        set_grad(master, grad)
    return made


def show_master_grads(param_groups) -> None:
    """Write the fp32 gradient each master of ``param_groups`` holds (current, dense) into its
    model parameter's gradient, rounded to that gradient's dtype, and keep the master's as the
    one the step uses (exact): after an in-place change to the masters' gradients (clipping),
    code reading ``model.parameters()`` sees the values the step will use."""
    pairs = [(m, valid_grad(m)) for group in param_groups for m in group["params"]
             if is_master(m)]
    pairs = [(m, g) for m, g in pairs if g is not None and not g.is_sparse
             and not m._mp_param.grad.is_sparse]
    if not pairs:
        return
    with torch.no_grad():
        torch._foreach_copy_([m._mp_param.grad for m, _ in pairs], [g for _, g in pairs])
    for master, grad in pairs:  # the model gradients changed version: made from them still
        set_grad(master, grad)


class MasterState(defaultdict):
    """torch's optimizer ``state`` (tensor -> its state) where a model parameter stands for its
    master: ``optimizer.state[model_param]`` is its master's entry, as on a torch optimizer
    stepping the model parameter itself (a lookup made an empty entry keyed by the model
    parameter, which ``state_dict()`` then failed on): indexing, ``in``, ``get``,
    ``setdefault``, ``update``, ``pop`` and ``del``. Iteration shows the masters' keys (the
    optimizer's parameters). Pickles and copies as torch's plain ``defaultdict`` (the optimizer
    maps it again when rebuilt).

    ``masters``: model parameter -> master, the optimizer's own (live) mapping.
    """

    def __init__(self, entries, masters: dict) -> None:
        super().__init__(dict, entries)
        self.masters = masters

    def _key(self, key):
        return self.masters.get(key, key) if isinstance(key, torch.Tensor) else key

    def __missing__(self, key):
        master = self.masters.get(key) if isinstance(key, torch.Tensor) else None
        if master is not None:
            return self[master]
        return super().__missing__(key)

    def __setitem__(self, key, value) -> None:  # (``state[model_param] = {}``: a reset)
        super().__setitem__(self._key(key), value)

    def __delitem__(self, key) -> None:
        super().__delitem__(self._key(key))

    def pop(self, key, *default):
        return super().pop(self._key(key), *default)

    def __contains__(self, key) -> bool:
        return super().__contains__(self._key(key))

    def get(self, key, default=None):
        return super().get(self._key(key), default)

    def setdefault(self, key, default=None):
        return super().setdefault(self._key(key), default)

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __reduce__(self):
        return (defaultdict, (dict,), None, None, iter(self.items()))
