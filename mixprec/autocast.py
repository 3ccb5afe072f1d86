"""``mp.autocast``: torch.autocast with op lists you can change.

torch's autocast keeps its cast policies in C++ tables that cannot be edited. mixprec enters
``torch.autocast`` for the default lists and, only when some op must change list, a
``TorchFunctionMode`` that catches exactly those ops (as functions, ``Tensor`` methods and
operators alike), casts their floating inputs and runs them with autocast off.

:class:`PrecisionContext` is the same thing as plain data, decided once: what a prepared model's
forward runs under. It pickles with the model and compiles into one ``torch.compile`` graph
(``torch.autocast`` and the modes are entered inside the traced code).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode_stack,
)
from torch.utils._pytree import SUPPORTED_NODES, _get_node_type, tree_flatten

from . import oplists
from .dtypes import CASTABLE_DTYPES
from .emulation import Fp16EmulationMode, should_emulate
from .oplists import kernels
from .policy import resolve_dtype

__all__ = ["autocast", "cast_floating", "PrecisionContext", "is_mixprec_mode", "context_active"]

_LOW = "low"  # marker: "the autocast dtype in force at call time"
_PROMOTE = "promote"  # marker: "the widest floating dtype among the inputs"


def cast_floating(tree, dtype: torch.dtype, device_type: str | None = None):
    """Cast every tensor of a castable dtype (fp32/fp16/bf16, see :mod:`mixprec.dtypes`) in a
    pytree to ``dtype``, and in the fields of a ``@dataclass`` within it (a model's output
    class: not a pytree node, it would pass as it is; a shallow copy with the cast fields, so
    fields set after ``__init__`` stay); fp64, fp8 and integer tensors are left untouched. A
    container (list, dict, tuple, ...) with nothing to cast is returned as it is, not rebuilt:
    a forward that appends to a list argument or sets a key of a dict argument writes into the
    caller's (one holding a tensor that is cast is a new container, as the tensor is new)."""
    return _cast(tree, dtype, device_type)[0]


def _cast(tree, dtype: torch.dtype, device_type: str | None) -> tuple:
    """``(cast tree, whether anything was cast)``: told by dtypes, never by comparing objects,
    which ``torch.compile`` cannot trace for containers."""
    if isinstance(tree, torch.Tensor):
        if (tree.dtype in CASTABLE_DTYPES and tree.dtype != dtype
                and (device_type is None or tree.device.type == device_type)):
            return tree.to(dtype), True
        return tree, False
    node = SUPPORTED_NODES.get(_get_node_type(tree))
    if node is not None:
        children, context = node.flatten_fn(tree)
        cast = [_cast(c, dtype, device_type) for c in children]
        if not any(changed for _, changed in cast):
            return tree, False
        return node.unflatten_fn([c for c, _ in cast], context), True
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {}
        for f in dataclasses.fields(tree):
            value, changed = _cast(getattr(tree, f.name, None), dtype, device_type)
            if changed:
                changes[f.name] = value
        if not changes:
            return tree, False
        out = copy.copy(tree)  # (no __init__ or __post_init__ run again; frozen ones too)
        for name, value in changes.items():
            object.__setattr__(out, name, value)
        return out, True
    return tree, False


class _OpListMode(TorchFunctionMode):
    """Runs the named ops in a fixed list, whatever torch.autocast's own table says."""

    def __init__(self, device_type: str, targets: dict):
        super().__init__()
        self.device_type = device_type
        self.targets = targets
        self.passing = 0  # > 0: an inner block's call passes through (_past_outer_lists)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.passing:
            return func(*args, **kwargs)
        try:
            target = self.targets.get(func)
        except TypeError:  # an unhashable callable is never one of ours
            target = None
        if (target is None or not torch.is_autocast_enabled(self.device_type)
                or kwargs.get("out") is not None):  # out=: the caller's tensor's dtype, as
            if torch.compiler.is_compiling():       # torch.autocast leaves such a call
                return _past_outer_lists(func, args, kwargs)
            return func(*args, **kwargs)
        if not torch.compiler.is_compiling():  # an inner block's lists, not this one's (an op
            block = kernels.block_in_force()   # it moves is cast by its own mode, first)
            if block is not None and block.mode_targets is not None:
                target = block.mode_targets.get(func)
                if target is None:
                    return func(*args, **kwargs)
        if target == _PROMOTE:
            dtype = _widest((args, kwargs), self.device_type)
        else:
            dtype = torch.get_autocast_dtype(self.device_type) if target == _LOW else target
        if dtype is not None:
            args, kwargs = cast_floating((args, kwargs), dtype, self.device_type)
        with torch.autocast(self.device_type, enabled=False):
            return func(*args, **kwargs)


def _past_outer_lists(func, args, kwargs):
    """``func(*args, **kwargs)`` with the enclosing blocks' op-list modes passing it on: in
    traced code (``torch.compile``) a block's lists apply to what it runs, as in eager code
    (where :func:`mixprec.oplists.kernels.block_in_force`, which a trace cannot read, names
    the innermost block); an enclosing mode that saw the call cast it to its own targets
    (``fp32_ops=["linear"]`` outside reached a prepared model's forward inside). Other modes
    on the stack (fp16 emulation, the user's own) still see it."""
    outer = [m for m in _get_current_function_mode_stack() if isinstance(m, _OpListMode)]
    for mode in outer:
        mode.passing += 1
    try:
        return func(*args, **kwargs)
    finally:
        for mode in outer:
            mode.passing -= 1


def is_mixprec_mode(mode) -> bool:
    """True for a torch function mode mixprec enters (op lists, fp16 emulation)."""
    return isinstance(mode, (_OpListMode, Fp16EmulationMode))


def context_active() -> bool:
    """True inside a block that casts ops with mixprec's kernels or modes (this thread)."""
    return (kernels.targets_in_force() is not None
            or any(is_mixprec_mode(m) for m in _get_current_function_mode_stack()))


def _widest(tree, device_type: str) -> torch.dtype | None:
    """fp32 when the fp32/fp16/bf16 tensors of ``device_type`` in ``tree`` mix dtypes, else None."""
    dtypes = {t.dtype for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)
              and t.dtype in CASTABLE_DTYPES and t.device.type == device_type}
    return torch.float32 if len(dtypes) > 1 else None


def _target_names(device_type: str, low_ops, fp32_ops, promote_ops,
                  extend_defaults: bool) -> tuple[tuple[str, object], ...]:
    """The op names that must change list, each with its target: ``_LOW``, fp32 or
    ``_PROMOTE``."""
    defaults = oplists.TORCH_DEFAULTS[device_type]
    wanted: dict[str, object] = {}
    if extend_defaults:
        for name in sorted(oplists.MIXPREC_FP32_ADDITIONS - defaults["fp32"]):
            wanted[name] = torch.float32
    for name in low_ops:
        wanted[name] = None if name in defaults["low_precision"] else _LOW
    for name in fp32_ops:
        wanted[name] = None if name in defaults["fp32"] else torch.float32
    for name in promote_ops:
        wanted[name] = None if name in defaults["promote"] else _PROMOTE
    return tuple((name, target) for name, target in wanted.items() if target is not None)


def _resolve(ops: tuple[tuple[str, object], ...]) -> dict:
    """Map each Python callable the op names stand for to its target."""
    return {fn: target for name, target in ops for fn in oplists.resolve_op(name)}


@dataclasses.dataclass(frozen=True, eq=False)
class PrecisionContext:
    """What a block of code computes in: autocast (with op lists) or one fixed dtype.

    Attributes:
        device_type: "cpu", "cuda", ...
        dtype: the compute dtype (the autocast dtype, or the fixed dtype).
        autocast: True runs ``torch.autocast(device_type, dtype)`` with the op-list
            interceptions; False runs with autocast off, every op in the dtype of its inputs.
        cache_enabled: torch.autocast's weight-cast cache.
        ops: ``(op name, target)`` for the ops that change list: the dtype their inputs are cast
            to, ``"low"`` (the autocast dtype) or ``"promote"`` (the widest input dtype).
        emulate: run fp16 GEMM/conv through the fp16 emulation (see :mod:`mixprec.emulation`).
        targets: the Python callables the op names stand for, resolved once (not pickled: a
            context pickles by op names and resolves them again when loaded): what traced code
            (``torch.compile``) intercepts.
        kernels: op name -> target for the ops cast at the dispatcher in eager code (see
            :mod:`mixprec.oplists.kernels`); ``mode_targets``: the callables of the others, the
            only ones the eager mode intercepts (empty: no mode at all).
    """

    device_type: str
    dtype: torch.dtype
    autocast: bool
    cache_enabled: bool = True
    ops: tuple = ()
    emulate: bool = False
    targets: dict = dataclasses.field(init=False, repr=False)
    kernels: dict = dataclasses.field(init=False, repr=False)
    mode_targets: dict = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "targets", _resolve(self.ops))
        here, rest = kernels.split(self.device_type, self.ops)
        object.__setattr__(self, "kernels", dict(here))
        object.__setattr__(self, "mode_targets", _resolve(rest))

    def __reduce__(self):
        return (PrecisionContext, (self.device_type, self.dtype, self.autocast,
                                   self.cache_enabled, self.ops, self.emulate))

    @classmethod
    def fixed(cls, dtype: torch.dtype, device_type: str, emulate_fp16="auto") -> PrecisionContext:
        """Autocast off: every op computes in exactly ``dtype`` (with fp16 emulation if needed)."""
        return cls(device_type, dtype, False,
                   emulate=should_emulate(device_type, dtype, emulate_fp16))

    def run(self, fn, args: tuple, kwargs: dict):
        """``fn(*args, **kwargs)`` under this context."""
        with self._autocast():
            if self._eager_block():
                with self._block():
                    return self._with_modes(self.mode_targets, fn, args, kwargs)
            return self._with_modes(self.targets, fn, args, kwargs, traced=self.autocast)

    def _eager_block(self) -> bool:
        # eager code casts the kernels' ops at the dispatcher and intercepts only the others in
        # Python, under a block that also makes any enclosing block's lists give way to this
        # one's; traced code intercepts them all (dynamo inlines the mode into the graph)
        return self.autocast and not torch.compiler.is_compiling()

    def _block(self) -> kernels.active:
        return kernels.active(self.device_type, self.kernels, self.mode_targets)

    def _with_modes(self, targets: dict, fn, args, kwargs, traced: bool = False):
        # traced: a mode even without targets, which passes calls past enclosing blocks' modes
        if (targets or traced) and self.emulate:  # the op lists innermost: they see each
            with Fp16EmulationMode(self.device_type), _OpListMode(self.device_type, targets):
                return fn(*args, **kwargs)  # call first
        if targets or traced:
            with _OpListMode(self.device_type, targets):
                return fn(*args, **kwargs)
        if self.emulate:
            with Fp16EmulationMode(self.device_type):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    def enter(self, stack: contextlib.ExitStack, autocast: bool = True) -> None:
        """Enter this context on ``stack`` (for code that is not one function call);
        ``autocast=False``: its lists and modes only, the autocast state left as it is (a
        recomputation, where torch's checkpoint restored the state of its call)."""
        if autocast:
            stack.enter_context(self._autocast())
        targets = self.targets
        if self._eager_block():
            stack.enter_context(self._block())
            targets = self.mode_targets
        if self.emulate:
            stack.enter_context(Fp16EmulationMode(self.device_type))
        if targets or (self.autocast and not self._eager_block()):  # (see _with_modes)
            stack.enter_context(_OpListMode(self.device_type, targets))

    def _autocast(self) -> torch.autocast:
        if self.autocast:
            return torch.autocast(self.device_type, dtype=self.dtype,
                                  cache_enabled=self.cache_enabled)
        return torch.autocast(self.device_type, enabled=False)


class autocast(contextlib.ContextDecorator):
    """Autocast with custom op lists; a context manager and a decorator.

    Args:
        dtype: the low-precision dtype ("bf16", "fp16", a torch dtype) or "auto" (the fast
            16-bit type of the device, see :func:`mixprec.device_capabilities`). fp32 disables.
        enabled: False makes the block a no-op (user code keeps one shape).
        device_type: "cpu" or "cuda"; default "cuda" when available, else "cpu".
        low_precision_ops: op names ("add", "gelu", "softmax", ...) to run in ``dtype``.
        fp32_ops: op names to run in fp32 (e.g. "linear" to keep a matmul exact).
        promote_ops: op names to run in the widest dtype of their floating inputs (fp32 when
            fp32, fp16 and bf16 tensors mix; unchanged otherwise), never cast down (apex's
            "promote" list: ``cat``, ``stack``, ``mul``, ``atan2``, ...).
        cache_enabled: torch.autocast's weight-cast cache.
        extend_defaults: also keep softmax, log_softmax, logsumexp and the norms in fp32 where
            torch's own list for the device does not (CPU). False gives torch.autocast's lists
            exactly, with no Python-level interception when no custom list is given.
        emulate_fp16: "auto" (default) emulates fp16 GEMM/conv with fp32 arithmetic on
            fp16-rounded values where fp16 has no fast kernel (see :mod:`mixprec.emulation`);
            True forces it, False runs torch's native fp16 kernels.

    Raises:
        ValueError: an unknown dtype or op name, an op named in two lists.

    Example:
        >>> import torch, mixprec as mp
        >>> with mp.autocast("bf16", device_type="cpu", low_precision_ops=["softmax"]):
        ...     y = torch.softmax(torch.ones(2, 2), dim=-1)
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(self, dtype="auto", *, enabled: bool = True, device_type: str | None = None,
                 low_precision_ops=(), fp32_ops=(), cache_enabled: bool = True,
                 extend_defaults: bool = True, emulate_fp16="auto", promote_ops=()):
        for name, flag in (("enabled", enabled), ("cache_enabled", cache_enabled),
                           ("extend_defaults", extend_defaults)):
            if not isinstance(flag, bool):  # (bool("no") is True)
                raise TypeError(f"mp.autocast({name}=...) must be True or False; got {flag!r}")
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        oplists.check_device_type(device_type)
        low, fp32, promote = oplists.validate_custom_lists(low_precision_ops, fp32_ops,
                                                           promote_ops)
        self.device_type = device_type
        self.dtype = resolve_dtype(dtype, device_type, warn=bool(enabled))
        self.enabled = bool(enabled) and self.dtype != torch.float32
        self.cache_enabled = cache_enabled
        self.low_precision_ops, self.fp32_ops, self.promote_ops = low, fp32, promote
        self.extend_defaults = bool(extend_defaults)
        self.emulate_fp16 = emulate_fp16
        ops = (_target_names(device_type, low, fp32, promote, self.extend_defaults)
               if self.enabled else ())
        self.context = PrecisionContext(
            device_type, self.dtype, self.enabled, cache_enabled, ops,
            self.enabled and should_emulate(device_type, self.dtype, emulate_fp16))
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self):
        stack = contextlib.ExitStack()
        self.context.enter(stack)
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self._stacks.pop().__exit__(*exc)

    def _recreate_cm(self):  # ContextDecorator: each decorated call gets its own stack
        clone = copy.copy(self)
        clone._stacks = []
        return clone

    def op_lists(self) -> dict[str, list[str]]:
        """The effective lists in force inside this block."""
        return oplists.op_lists(self.device_type, self.dtype, extend_defaults=self.extend_defaults,
                                low_precision_ops=self.low_precision_ops, fp32_ops=self.fp32_ops,
                                promote_ops=self.promote_ops)

    def __repr__(self) -> str:
        return (f"mixprec.autocast(dtype={self.dtype}, device_type={self.device_type!r}, "
                f"enabled={self.enabled}, low_precision_ops={self.low_precision_ops}, "
                f"fp32_ops={self.fp32_ops}, promote_ops={self.promote_ops})")
