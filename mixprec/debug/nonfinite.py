"""``trace_nonfinite``: which op made the first inf/NaN, in the forward and the backward pass.

It watches the ATen ops that actually execute (a ``TorchDispatchMode``), below autocast and
autograd, and names the module each op belongs to.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import torch
from torch.nn.modules import module as _module_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..distenv import unwrap
from ..dtypes import dtype_name
from ._common import PHASES, current_phase, tensors_in

__all__ = ["trace_nonfinite", "NonFiniteTracer", "NonFiniteReport", "NonFiniteEvent",
           "TensorStats", "NonFiniteError"]

_MODULE_KEY = "mixprec.module"  # autograd-node metadata: the module whose forward made the node


def _floating(tree) -> list[torch.Tensor]:
    """The non-empty dense floating tensors whose values can be read (no sparse, no meta)."""
    return [t for t in tensors_in(tree) if t.is_floating_point() and t.numel() > 0
            and t.layout == torch.strided and t.device.type != "meta"]


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """One fused reduction per tensor (max |x|, which propagates NaN) and one host sync."""
    with torch.no_grad():
        peaks = [torch.linalg.vector_norm(t.detach(), math.inf).float() for t in tensors]
        return bool(torch.isfinite(torch.stack(peaks)).all()) if peaks else True


# ----------------------------------------------------------------------------- trace_nonfinite


@dataclasses.dataclass(frozen=True)
class TensorStats:
    """Value range of one tensor: min/max/absmax over its finite values, counts of inf and NaN."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    n_inf: int
    n_nan: int
    min: float | None
    max: float | None
    absmax: float | None

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorStats:
        """Summarise ``t`` (forces one host-device sync)."""
        with torch.no_grad():
            x = t.detach().float()
            finite = torch.isfinite(x)
            n_inf, n_nan = int(torch.isinf(x).sum()), int(torch.isnan(x).sum())
            vals = x[finite]
            lo, hi = (vals.min().item(), vals.max().item()) if vals.numel() else (None, None)
        absmax = None if lo is None else max(abs(lo), abs(hi))
        return cls(t.dtype, tuple(t.shape), n_inf, n_nan, lo, hi, absmax)

    @property
    def finite(self) -> bool:
        """True when the tensor holds no inf and no NaN."""
        return self.n_inf == 0 and self.n_nan == 0

    def __str__(self) -> str:
        head = f"{dtype_name(self.dtype)}{list(self.shape)}"
        text = head if self.absmax is None else (
            f"{head} min {self.min:.3g} max {self.max:.3g} absmax {self.absmax:.3g}")
        if not self.finite:
            text += f" ({self.n_inf} inf, {self.n_nan} NaN)"
        return text


@dataclasses.dataclass(frozen=True)
class NonFiniteEvent:
    """The first op of one pass whose output held inf or NaN.

    Attributes:
        phase: "forward" or "backward".
        module: qualified name of the module that ran the op (in backward: the module whose
            forward created the autograd node), or None outside any module.
        op: the ATen op, e.g. "aten.mm.default".
        node: in backward, the autograd node that ran the op (e.g. "MmBackward0").
        created: True when the op turned finite inputs into inf (overflow) or NaN; False when
            the non-finite values came in through an input (the data, a parameter, a constant
            such as a -inf mask) and no op of the pass created any.
        inputs: stats of the floating tensor inputs (for an in-place op, as it left them), or
            the float itself for a scalar input.
        outputs: stats of the floating tensor outputs.
    """

    phase: str
    module: str | None
    op: str
    node: str | None
    created: bool
    inputs: tuple
    outputs: tuple[TensorStats, ...]

    def __str__(self) -> str:
        where = self.module or "(outside any module)"
        node = f", node {self.node}" if self.node else ""
        how = "" if self.created else " [came in through an input]"
        outs = "; ".join(str(o) for o in self.outputs if not o.finite)
        ins = ", ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in self.inputs)
        return (f"first non-finite in {self.phase}: {where} ({self.op}{node}){how}\n"
                f"  output {outs}\n  inputs {ins or '(none)'}")


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """What :func:`trace_nonfinite` found: the first event of each pass (None where clean)."""

    forward: NonFiniteEvent | None
    backward: NonFiniteEvent | None

    @property
    def first(self) -> NonFiniteEvent:
        """The earliest event: the forward one if any, else the backward one."""
        return self.forward or self.backward

    def __str__(self) -> str:
        return "\n".join(str(e) for e in (self.forward, self.backward) if e is not None)


class NonFiniteError(RuntimeError):
    """Raised by ``trace_nonfinite(raise_on_first=True)`` at the op that created inf/NaN."""

    def __init__(self, event: NonFiniteEvent):
        super().__init__(str(event))
        self.event = event


def _incoming(args, kwargs, in_stats, scalars, inputs_were_finite) -> tuple[bool, bool]:
    """Did inf / NaN come into the op through an input (tensor or scalar)?"""
    in_inf = any(math.isinf(x) for x in scalars)
    in_nan = any(math.isnan(x) for x in scalars)
    floating = [t for t in tensors_in((args, kwargs)) if t.is_floating_point() and t.numel()]
    if inputs_were_finite is False or len(in_stats) < len(floating):
        return True, True  # overwritten in place or unreadable (sparse): call it inherited
    if inputs_were_finite is None:
        in_inf = in_inf or any(s.n_inf for s in in_stats)
        in_nan = in_nan or any(s.n_nan for s in in_stats)
    return in_inf, in_nan


# Ops that return uninitialised memory: garbage bits may read as inf/NaN and mean nothing
# (FSDP2's copy-in returns the all-gather's output buffer, which the collective fills after it).
_UNINITIALIZED = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided",
                            "aten::new_empty", "aten::new_empty_strided", "aten::empty_permuted",
                            "fsdp::all_gather_copy_in"})
# Collectives: an output is filled when the collective completes, after the op returns (its
# ``wait``), so it is read where it is consumed; ``wait_tensor``'s own output is complete.
_COLLECTIVES = ("c10d::", "_c10d_functional::")


def _unread(name: str) -> bool:
    """Whether an op's outputs are not checked (uninitialised, or a collective's, not yet
    complete)."""
    return name in _UNINITIALIZED or (name.startswith(_COLLECTIVES)
                                      and not name.endswith("::wait_tensor"))


class _NonFiniteMode(TorchDispatchMode):
    def __init__(self, tracer: NonFiniteTracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.tracer._run(func, args, kwargs or {})


class NonFiniteTracer:
    """Context manager returned by :func:`trace_nonfinite`; read ``.report`` after the block."""

    def __init__(self, model: torch.nn.Module | None = None, *, raise_on_first: bool = False):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None; got {type(model).__name__}")
        self.raise_on_first = bool(raise_on_first)
        inner = None if model is None else unwrap(model)  # DDP's and compile's wrappers:
        self._names = {} if model is None else {          # the user's module names
            id(m): name or type(inner).__name__ for name, m in inner.named_modules()}
        if model is not inner:
            self._names[id(model)] = type(inner).__name__
        self._created: dict[str, NonFiniteEvent] = {}
        self._inherited: dict[str, NonFiniteEvent] = {}
        self._stack: list[tuple[int, str, set]] = []
        self._thread = None
        self._handles: list = []
        self._mode = None

    @property
    def report(self) -> NonFiniteReport | None:
        """The first non-finite op of the forward and backward pass, or None if all was finite."""
        events = {p: self._created.get(p) or self._inherited.get(p) for p in PHASES}
        return NonFiniteReport(**events) if any(events.values()) else None

    def __enter__(self) -> NonFiniteTracer:
        if self._mode is not None:
            raise RuntimeError("this trace_nonfinite() tracer is already active; use a new one")
        self._thread = threading.get_ident()
        self._handles = [
            _module_hooks.register_module_forward_pre_hook(self._pre_hook),
            _module_hooks.register_module_forward_hook(self._post_hook, always_call=True)]
        self._mode = _NonFiniteMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        mode, self._mode = self._mode, None
        for handle in self._handles:
            handle.remove()
        self._handles, self._stack = [], []
        return mode.__exit__(*exc)

    # module stack (forward) and module tags on autograd nodes (backward)
    def _pre_hook(self, module, args):
        if threading.get_ident() == self._thread:
            stop = {t.grad_fn for t in tensors_in(args) if t.grad_fn is not None}
            name = self._names.get(id(module), type(module).__name__)
            self._stack.append((id(module), name, stop))

    def _post_hook(self, module, args, output):
        mine = threading.get_ident() == self._thread
        if not (mine and self._stack and self._stack[-1][0] == id(module)):
            return
        _, name, stop = self._stack.pop()
        todo = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        while todo:  # tag the nodes this module's own ops created (inner modules tagged theirs)
            node = todo.pop()
            if node is None or node in stop or _MODULE_KEY in node.metadata:
                continue
            node.metadata[_MODULE_KEY] = name
            todo.extend(fn for fn, _ in node.next_functions)

    def _where(self, phase: str) -> tuple[str | None, str | None]:
        if phase == "forward":
            return (self._stack[-1][1] if self._stack else None), None
        node = torch._C._current_autograd_node()
        return node.metadata.get(_MODULE_KEY), node.name()

    # the per-op check
    def _run(self, func, args, kwargs):
        phase = current_phase()
        if phase in self._created or func.is_view or _unread(func._schema.name):
            return func(*args, **kwargs)
        # an in-place op overwrites its inputs: note whether they were finite before it ran
        inputs_were_finite = None
        if func._schema.is_mutable:
            inputs_were_finite = _all_finite(_floating((args, kwargs)))
        out = func(*args, **kwargs)
        outs = _floating(out)
        if outs and not _all_finite(outs):
            self._record(phase, func, args, kwargs, outs, inputs_were_finite)
        return out

    def _record(self, phase, func, args, kwargs, outs, inputs_were_finite):
        out_stats = tuple(TensorStats.of(t) for t in outs)
        in_stats = [TensorStats.of(t) for t in _floating((args, kwargs))]  # after an in-place op
        scalars = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, float)]
        in_inf, in_nan = _incoming(args, kwargs, in_stats, scalars, inputs_were_finite)
        created = (any(s.n_inf for s in out_stats) and not in_inf) or (
            any(s.n_nan for s in out_stats) and not in_nan)
        if not created and phase in self._inherited:
            return
        module, node = self._where(phase)
        event = NonFiniteEvent(phase, module, str(func), node, created,
                               tuple(in_stats) + tuple(scalars), out_stats)
        if not created:
            self._inherited[phase] = event
            return
        self._created[phase] = event
        if self.raise_on_first:
            raise NonFiniteError(event)


def trace_nonfinite(model: torch.nn.Module | None = None, *, raise_on_first: bool = False):
    """Find the first op whose output holds inf or NaN, in the forward and the backward pass.

    Every ATen op run in the block is checked (one fused reduction and one host sync per op,
    so expect a slow block: use it to diagnose one batch). The op reported for a pass is the
    first that *created* a non-finite value from finite inputs (an overflow, or a NaN such as
    0 * inf); ops that only pass along infs that came in (a ``-inf`` attention mask, data
    holding NaN) are reported only when no op of that pass created any.

    Args:
        model: the model, to report qualified module names ("encoder.fc2"); without it,
            modules are named by class. Modules outside ``model`` (a loss module) are named
            by class.
        raise_on_first: raise :class:`NonFiniteError` at the op that creates the first
            inf/NaN (forward or backward) instead of only recording it.

    Returns:
        A :class:`NonFiniteTracer`; after the block, ``tracer.report`` is a
        :class:`NonFiniteReport` or None when everything stayed finite.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4)).half()
        >>> with torch.no_grad():
        ...     _ = model[0].weight.fill_(3e4)
        >>> with trace_nonfinite(model) as tracer:
        ...     _ = model(torch.ones(1, 4, dtype=torch.float16))
        >>> tracer.report.forward.module, tracer.report.forward.op
        ('0', 'aten.addmm.default')
    """
    return NonFiniteTracer(model, raise_on_first=raise_on_first)
