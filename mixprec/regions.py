"""Precision regions: where each module of a model computes, and the forward wrappers that make
it so.

A model is divided into regions. The prepared model's root is one (its :class:`Entry` casts the
model's inputs to the compute dtype, runs the forward under the policy's
:class:`~mixprec.autocast.PrecisionContext` and casts the outputs, see :mod:`mixprec.outputs`);
every ``to_float`` module and every module kept in fp32 starts another (its :class:`Island` casts
its floating inputs, and its parameters when they are stored in another dtype, to its dtype and
runs with autocast off). A module belongs to the innermost region around it.

Outputs are never rounded on the way out of an island: an fp32 layer's output is fp32
(MindSpore's rule, and torch's ``autocast(enabled=False)`` idiom). Its consumers compute in their
own dtype: under autocast (O1/O2) by autocast's casts and type promotion; in a region of one
fixed dtype that holds islands of another (O3 with fp32 modules, ``to_float`` regions) the forward
wrapper of each of its modules casts that module's floating inputs to the region's dtype. A
low-precision island inside wider code that has neither (a plain fp32 model, the default until a
region says otherwise) widens its floating outputs to that code's dtype, losslessly, so the fp32
layers after it can consume them.

Recomputation (activation checkpointing) runs a module's forward again during backward, outside
the prepared model's forward. torch restores the autocast state there, but not the op-list and
fp16-emulation modes a region may need; the forward wrapper of each module of such a region enters
the region's context when no mixprec mode is active, so the recomputed forward computes exactly
as the first one did.

Every wrapper is a small picklable object owned by its module: a prepared or marked
model pickles, deep-copies and compiles into one ``torch.compile`` graph.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .autocast import PrecisionContext, cast_floating, context_active
from .dtypes import TRAINING_DTYPES
from .forwards import ForwardWrapper
from .outputs import cast_outputs

__all__ = ["Region", "ForwardWrapper", "Entry", "Island", "RegionWrapper", "assign_regions",
           "island_of",
           "region_modules", "island_region", "structure_changed",
           "refresh_island", "outer_dtype", "active_casts", "cast_again"]

_generation = itertools.count(1)
_current = [next(_generation)]  # bumped whenever islands are added: islands re-derive their slots


def structure_changed() -> None:
    """Islands were added or re-marked somewhere: islands re-derive which parameters they cast."""
    _current[0] = next(_generation)


@dataclass(frozen=True)
class Region:
    """What the modules of one region compute under.

    Attributes:
        context: the region's precision context (None: plain fp32, nothing to enter).
        cast: the dtype each module's floating inputs are cast to (regions of one fixed dtype
            that hold islands of another), or None.
    """

    context: PrecisionContext | None
    cast: torch.dtype | None = None

    @property
    def restore(self) -> bool:
        """True when recomputation must re-enter this region's context (it uses modes that
        torch's checkpoint does not restore)."""
        c = self.context
        return c is not None and bool(c.targets or c.emulate)

    @property
    def needs_wrapper(self) -> bool:
        return self.restore or self.cast is not None


def _needs_cast(tree, dtype: torch.dtype) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in TRAINING_DTYPES and t.dtype != dtype
               for t in tree_flatten(tree)[0])


# -- forward wrappers ------------------------------------------------------------------------------
class Entry(ForwardWrapper):
    """The prepared model's entry: inputs to the compute dtype, the policy's context, outputs.

    ``before``: a picklable ``fn(module)`` run first on each eager call (never inside a
    ``torch.compile`` trace), in place of a forward pre-hook: ``torch.compile(model)`` runs a
    module's hooks outside its graph and traces each one as a frame of its own."""

    before = None  # (class default: an entry pickled before it existed)
    probe = None  # without autocast: a parameter cast to ``in_dtype``, whose dtype inputs follow
    cast_params = None  # a fixed-dtype root region's dtype: the root's own parameters stored in
    # another dtype are cast to it for the call, as a region wrapper casts its module's

    def __init__(self, module, in_dtype, out_dtype, context: PrecisionContext | None,
                 probe: torch.Tensor | None = None):
        super().__init__(module)
        self.in_dtype, self.out_dtype, self.context = in_dtype, out_dtype, context
        self.probe = probe

    def __call__(self, *args, **kwargs):
        if self.before is not None and not torch.compiler.is_compiling():
            self.before(self.module)
        if self.in_dtype is not None:  # (pure 16-bit cast to fp32 by model.float(): fp32 in)
            dtype = self.in_dtype if self.probe is None else self.probe.dtype
            args, kwargs = cast_floating((args, kwargs), dtype)
        other = [] if self.cast_params is None else _other_dtype(self.module, self.cast_params)
        if other:
            out = _with_params_cast(other, self.cast_params, self._run, args, kwargs)
        else:
            out = self._run(args, kwargs)
        return out if self.out_dtype is None else cast_outputs(out, self.out_dtype)

    def _run(self, args, kwargs):
        if self.context is None:
            return self.call_inner(*args, **kwargs)
        return self.context.run(self.call_inner, args, kwargs)


class Island(ForwardWrapper):
    """A module computing in one dtype (a ``to_float`` or fp32-kept module).

    Casts its floating inputs to ``dtype`` (unless ``cast_inputs`` is False: a norm kernel that
    reads 16-bit activations with fp32 parameters itself), casts for the call the parameters of
    its region stored in another dtype (``to_float`` keeps a parameter's storage), and runs with
    autocast off. Outputs are returned as computed, or widened (losslessly) to the dtype of the
    code around the island when that is wider (see :meth:`place`).
    """

    outer: torch.dtype | None = torch.float32
    widen: torch.dtype | None = None  # (class defaults: an island pickled before these existed)

    def __init__(self, module, dtype: torch.dtype, cast_inputs: bool, context: PrecisionContext):
        super().__init__(module)
        self.dtype, self.cast_inputs, self.context = dtype, cast_inputs, context
        self._slots: list[tuple[nn.Module, str]] = []
        self._seen = 0
        self.place(torch.float32)  # plain fp32 code around it, until a region says otherwise

    def place(self, outer: torch.dtype | None) -> None:
        """Set the dtype of the code around the island (None: autocast, which casts for each
        consumer): floating outputs are widened to it when it is wider than the island's."""
        self.outer = outer
        wider = outer is not None and torch.finfo(outer).bits > torch.finfo(self.dtype).bits
        self.widen = outer if wider else None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_slots": [], "_seen": 0}

    def _param_slots(self) -> list[tuple[nn.Module, str]]:
        """The (module, name) slots of the region's floating parameters: cached in eager mode
        (re-derived after :func:`structure_changed`); derived afresh while ``torch.compile``
        traces, so the compiled graph guards on the modules, never on the cache's counter (a
        guard on it recompiled the graph on the second call)."""
        if torch.compiler.is_compiling():
            return self._derive_slots()
        if self._seen != _current[0]:
            self._slots = self._derive_slots()
            self._seen = _current[0]
        return self._slots

    def _derive_slots(self) -> list[tuple[nn.Module, str]]:
        return [(m, n) for m in region_modules(self.module) for n, p in m._parameters.items()
                if p is not None and p.is_floating_point() and p.dtype != torch.float64]

    def __call__(self, *args, **kwargs):
        if self.cast_inputs:
            args, kwargs = cast_floating((args, kwargs), self.dtype)
        slots = [(m, n, m._parameters[n]) for m, n in self._param_slots()]
        slots = [(m, n, p) for m, n, p in slots if p is not None and p.dtype != self.dtype]
        out = _with_params_cast(slots, self.dtype, self.context.run, self.call_inner, args,
                                kwargs)
        return out if self.widen is None else cast_floating(out, self.widen)


_casts = threading.local()  # .active: the (slots, dtype) of the calls casting parameters now


def active_casts() -> list:
    """The parameter casts in force on this thread, outermost first (``(slots, dtype)``): what a
    recomputation re-enters (:func:`mixprec.activation_checkpoint`)."""
    return list(getattr(_casts, "active", ()))


def _with_params_cast(slots: list, dtype: torch.dtype, run, *args):
    """``run(*args)`` with the parameters in ``slots`` (``(module, name, parameter)``) cast to
    ``dtype`` for the call (a differentiable cast: their gradients reach the stored ones). A
    parameter the call replaced stays replaced; one it wrote in place (a max-norm clamp in a
    forward) gets the write, through the cast's dtype."""
    if not slots:
        return run(*args)
    cast: dict[int, torch.Tensor] = {}
    versions: dict[int, int] = {}
    active = _casts.__dict__.setdefault("active", [])
    active.append((slots, dtype))
    try:
        for m, n, p in slots:  # a tied parameter is cast once
            m._parameters[n] = cast.setdefault(id(p), p.to(dtype))
        versions = {key: c._version for key, c in cast.items()}
        return run(*args)
    finally:
        active.pop()
        for m, n, p in slots:
            if m._parameters[n] is cast.get(id(p)):  # (not replaced by the call)
                m._parameters[n] = p
        with torch.no_grad():
            for m, n, p in slots:
                c = cast.get(id(p))
                if c is not None and c._version != versions.get(id(p), c._version):
                    p.copy_(c)  # written in place during the call
                    versions[id(p)] = c._version


def _other_dtype(module: nn.Module, dtype: torch.dtype) -> list:
    """``module``'s own floating parameters stored in a dtype other than ``dtype`` (fp64 aside),
    as ``(module, name, parameter)``."""
    return [(module, n, p) for n, p in module._parameters.items()
            if p is not None and p.dtype != dtype and p.is_floating_point()
            and p.dtype != torch.float64]


def island_of(module: nn.Module) -> Island | None:
    """The island wrapper installed on ``module``, or None."""
    wrapper = module.__dict__.get("forward")
    while wrapper is not None:
        if isinstance(wrapper, Island):
            return wrapper
        wrapper = getattr(wrapper, "inner", None)
    return None


def region_modules(root: nn.Module):
    """``root`` and its sub-modules, except those inside a nested island."""
    yield root
    for child in root.children():
        if island_of(child) is None:
            yield from region_modules(child)


# -- per-module region wrappers --------------------------------------------------------------------
class RegionWrapper(ForwardWrapper):
    """The forward of one module of a region: re-enters the region's context when none is
    active (recomputation), and casts its floating inputs in a fixed-dtype region. A forward
    wrapper rather than forward hooks: a module call costs one Python call more, not torch's
    hook path."""

    def __init__(self, module: nn.Module, region: Region):
        super().__init__(module)
        self.region = region

    @property
    def region(self) -> Region:
        return self._region

    @region.setter
    def region(self, region: Region) -> None:  # decided once, not per call
        self._region, self._cast, self._restore = region, region.cast, region.restore

    def __call__(self, *args, **kwargs):
        if self._cast is not None:
            if _needs_cast((args, kwargs), self._cast):
                args, kwargs = cast_floating((args, kwargs), self._cast)
            # a parameter stored in another dtype (a frozen fp32 weight, one tied to an fp32
            # island's) is cast for the call: nothing else casts it in a fixed-dtype region
            other = _other_dtype(self.module, self._cast)
            if other:
                return _with_params_cast(other, self._cast, self._call, args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args, kwargs):
        if self._restore and not context_active():  # (traced too: torch.compile traces a
            with contextlib.ExitStack() as entered:  # checkpointed call in a subgraph of its own)
                # in a backward (a recomputation) torch's checkpoint restored the autocast
                # state of its call (off inside a torch.autocast(enabled=False) block): kept
                self._region.context.enter(entered, autocast=not _recomputing())
                return self.call_inner(*args, **kwargs)
        return self.call_inner(*args, **kwargs)


def _recomputing() -> bool:
    """Whether this is torch's checkpoint recomputing (eager code): a backward pass runs on this
    thread and ``torch.utils.checkpoint`` is on the stack. Not any backward: a forward called
    from a custom ``autograd.Function``'s backward gets the region's autocast as anywhere."""
    if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
        return False
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch.utils.checkpoint":
            return True
        frame = frame.f_back
    return False


def _region_wrapper(module: nn.Module) -> RegionWrapper | None:
    wrapper = module.__dict__.get("forward")
    while wrapper is not None and not isinstance(wrapper, RegionWrapper):
        wrapper = getattr(wrapper, "inner", None)
    return wrapper


def _unlink(module: nn.Module, wrapper: ForwardWrapper) -> None:
    """Take ``wrapper`` out of ``module``'s chain of forward wrappers."""
    outer = module.__dict__.get("forward")
    if outer is wrapper:
        if wrapper.inner is None:
            del module.__dict__["forward"]
        else:
            module.forward = wrapper.inner
        return
    while outer.inner is not wrapper:
        outer = outer.inner
    outer.inner = wrapper.inner


def _set_wrapper(module: nn.Module, region: Region | None) -> None:
    """Give ``module`` the region wrapper of ``region`` (or none, when it needs none)."""
    wrapper = _region_wrapper(module)
    if region is None or not region.needs_wrapper:
        if wrapper is not None:
            _unlink(module, wrapper)
        return
    if wrapper is not None:
        wrapper.region = region
        return
    module.forward = RegionWrapper(module, region)


def assign_regions(root: nn.Module, region: Region | None) -> None:
    """Give every module under ``root`` the wrapper of its region: ``region`` for the modules
    outside nested islands, each island's own for the modules inside it."""
    for child in root.children():
        island = island_of(child)
        if island is not None:
            _set_wrapper(child, None)  # the island's wrapper enters its context and casts inputs
            island.place(outer_dtype(region))
            assign_regions(child, island_region(child, island))
        else:
            _set_wrapper(child, region)
            assign_regions(child, region)


def outer_dtype(region: Region | None) -> torch.dtype | None:
    """The dtype the code of ``region`` computes in, as an island inside it sees it: fp32 for
    plain code, None under autocast (it casts for each consumer)."""
    context = None if region is None else region.context
    if context is None:
        return torch.float32
    return None if context.autocast else (region.cast or context.dtype)


def refresh_island(module: nn.Module) -> None:
    """``module`` just became an island (or changed dtype): it drops the wrapper of the region
    around it and its sub-modules take its region."""
    structure_changed()
    island = island_of(module)
    wrapper = _region_wrapper(module)
    if wrapper is not None:  # it sat in a region: the code around it computes in its dtype
        island.place(outer_dtype(wrapper.region))
    _set_wrapper(module, None)
    assign_regions(module, island_region(module, island))


def island_region(module: nn.Module, island: Island) -> Region:
    """An island's region: its context, and an input cast when islands of another dtype sit
    inside it (or may later: ``to_float`` regions are re-marked in any order)."""
    inner = [island_of(m) for m in module.modules() if m is not module]
    other = any(i is not None and i.dtype != island.dtype for i in inner)
    return Region(island.context, island.dtype if other or island.cast_inputs else None)


def cast_again(casts: list, run, *args):
    """``run(*args)`` under the parameter casts ``casts`` (:func:`active_casts`'s, outermost
    first), made anew from the stored parameters."""
    if not casts:
        return run(*args)
    (slots, dtype), rest = casts[0], casts[1:]
    return _with_params_cast(slots, dtype, cast_again, rest, run, *args)
