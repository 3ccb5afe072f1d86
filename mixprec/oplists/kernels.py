"""Op-list casts at the dispatcher: kernels under torch's Autocast dispatch keys for the few ops
whose list changes, so that no other op leaves C++.

A ``TorchFunctionMode`` sees every torch call of a forward in Python, a few microseconds each,
to move a handful of ops (on the CPU: softmax, log_softmax, logsumexp and the norms, which
mixprec keeps in fp32). Here each moved op gets a kernel under ``AutocastCPU`` /
``AutocastCUDA`` -- the place where torch's own autocast casts -- that casts its floating inputs
like the mode does and runs the op with autocast off. Every other op dispatches as under plain
``torch.autocast``.

Only ops torch's autocast has no kernel for on that device are handled here (:func:`split`):
their Autocast slot is a fallthrough, so a kernel there replaces nothing of torch's. A kernel
is registered the first time a block needs it (:class:`active`) and stays; it reads the
innermost block's targets from thread-local state, so any other thread, and code outside such
blocks, computes as before. What they pay once a kernel is registered: a call of that op under
plain ``torch.autocast`` passes through the kernel (a Python call, ~5 us) on its way on.

Traced code (``torch.compile``) keeps the mode: dynamo inlines it into the graph as explicit
casts, so a compiled forward is one graph with the same casts as before.
"""

from __future__ import annotations

import threading

import torch

from .tables import TORCH_DEFAULTS

__all__ = ["ATEN_OVERLOADS", "split", "active", "targets_in_force", "block_in_force"]

#: Op-list name -> the ATen overloads its Python-level functions, methods and modules reach.
ATEN_OVERLOADS: dict[str, tuple[str, ...]] = {
    "softmax": ("softmax.int",),
    "log_softmax": ("log_softmax.int",),
    "logsumexp": ("logsumexp.default",),
    "layer_norm": ("layer_norm.default",),
    "group_norm": ("group_norm.default",),
    "rms_norm": ("rms_norm.default",),
    "matrix_exp": ("matrix_exp.default",),
    "linalg_matrix_exp": ("linalg_matrix_exp.default",),
}
_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_LOW, _PROMOTE = "low", "promote"  # the markers of mixprec.autocast
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def split(device_type: str, ops: tuple) -> tuple[tuple, tuple]:
    """``(op name, target)`` pairs -> (those cast here, those left to the mode)."""
    if device_type not in _KEYS:
        return (), tuple(ops)
    listed = frozenset().union(*TORCH_DEFAULTS[device_type].values())
    here = tuple((n, t) for n, t in ops if n in ATEN_OVERLOADS and n not in listed)
    return here, tuple((n, t) for n, t in ops if (n, t) not in here)


class _Blocks(threading.local):
    """Per thread, ``stack``: the blocks entered (their targets: {op name: target}), made with
    the thread's first look (a compiled forward reads it: an attribute made only by an eager
    one's first block made its guard fail, and the model compile again)."""

    def __init__(self) -> None:
        self.stack: list[active] = []


_state = _Blocks()


def targets_in_force() -> dict | None:
    """The targets of the innermost block entered on this thread, or None."""
    stack = _state.stack
    return stack[-1].targets if stack else None


def block_in_force() -> active | None:
    """The innermost :class:`active` block entered on this thread, or None."""
    stack = _state.stack
    return stack[-1] if stack else None


def _cast_to(device_type: str, target, args, kwargs) -> torch.dtype | None:
    if target == _LOW:
        return torch.get_autocast_dtype(device_type)
    if target == _PROMOTE:
        dtypes = {a.dtype for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                  and a.dtype in _CASTABLE and a.device.type == device_type}
        return torch.float32 if len(dtypes) > 1 else None
    return target


def _cast(value, dtype: torch.dtype, device_type: str):
    if (isinstance(value, torch.Tensor) and value.dtype in _CASTABLE and value.dtype != dtype
            and value.device.type == device_type):
        return value.to(dtype)
    return value


def _kernel(name: str, op, device_type: str):
    key = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _KEYS[device_type]))

    def kernel(*args, **kwargs):
        targets = targets_in_force()
        target = None if targets is None else targets.get(name)
        dtype = None if target is None else _cast_to(device_type, target, args, kwargs)
        if dtype is not None:
            args = tuple(_cast(a, dtype, device_type) for a in args)
            kwargs = {k: _cast(v, dtype, device_type) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(key):  # the op itself runs with autocast off
            return op(*args, **kwargs)
    return kernel


class _Registry:
    """The library holding the kernels: each op's kernel registered the first time a block
    needs it, and kept (registering costs milliseconds inside a deep call stack; a kernel
    outside any block passes its op on, as the fallthrough it replaced would)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.registered: set[tuple[str, str]] = set()
        self.library: torch.library.Library | None = None

    def acquire(self, device_type: str, names) -> None:
        if all((device_type, n) in self.registered for n in names):
            return
        with self.lock:
            if self.library is None:
                self.library = torch.library.Library("aten", "IMPL")
            for n in names:
                if (device_type, n) in self.registered:
                    continue
                for overload in ATEN_OVERLOADS[n]:
                    base, _, variant = overload.partition(".")
                    op = getattr(getattr(torch.ops.aten, base), variant)
                    self.library.impl(base if variant == "default" else overload,
                                      _kernel(n, op, device_type), _KEYS[device_type])
                self.registered.add((device_type, n))


_registry = _Registry()


class active:
    """Inside this block, autocast runs the ops of ``targets`` (op name -> ``"low"``, a dtype
    or ``"promote"``, names of :func:`split`'s first part) with those casts, and mixprec's
    op-list modes entered by this block or an enclosing one cast ``mode_targets`` (callable ->
    target; None: their own), so that the innermost block's lists apply, as the innermost
    ``torch.autocast``'s do."""

    __slots__ = ("device_type", "targets", "mode_targets")

    def __init__(self, device_type: str, targets: dict, mode_targets: dict | None = None):
        self.device_type, self.targets, self.mode_targets = device_type, targets, mode_targets

    def __enter__(self):
        _registry.acquire(self.device_type, self.targets)
        _state.stack.append(self)
        return self

    def __exit__(self, *exc):
        _state.stack.pop()
        return False
