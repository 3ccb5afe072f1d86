"""Memory traffic of a stretch of eager PyTorch, counted op by op.

:class:`ByteCounter` is a ``TorchDispatchMode``: every aten op dispatched while it is active is
counted by the rule below, by the op's schema (its alias annotations), not by a guess of what
its kernel does:

* an op **reads** each tensor argument (tensor lists and optional tensors included) once;
* it **writes** each tensor it returns fresh (a return with no alias annotation) and each
  argument its schema marks as mutated (``Tensor(a!)``): an in-place op reads and writes
  its mutated argument (``a.add_(b)`` on fp32 reads ``a`` and ``b``, writes ``a``: 12 bytes per
  element);
* the destination of a copy is written, not read (``out=`` arguments, and ``self`` of
  :data:`DESTINATION_ONLY`'s ops: ``copy_``, ``fill_``, ``zero_`` and the random fills);
* views (``func.is_view``: ``view``, ``t``, ``slice``, ``detach``, ...) and allocations
  (``empty``, ``empty_like``, ``empty_strided``, ...) move nothing and launch nothing;
* ops outside the ``aten`` namespace (the profiler's record-function markers) are left out;
* every other op is one **launch** (a kernel on a GPU).

A tensor's bytes are ``numel * element_size``. A tensor passed twice to one op is counted
twice. What this measures is the traffic an op's interface implies with no caching between
ops: the figure a GPU's DRAM sees for a memory-bound step, and what a fused kernel saves.

The counter also follows the memory the ops allocate: each fresh result's storage (allocations
included) is live from the op that makes it until it is freed (a ``weakref.finalize`` on the
storage, which torch keeps as long as the memory lives), and ``peak_live`` is the most such
bytes alive at once while the counter is active: the transient buffers of a step (state it
creates and keeps counts too, so count a step after the first).
"""

from __future__ import annotations

import collections
import dataclasses
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Ops that overwrite ``self`` without reading it (their ``Tensor(a!) self`` is a destination).
DESTINATION_ONLY = frozenset({
    "aten::copy_", "aten::fill_", "aten::zero_", "aten::_foreach_copy_", "aten::_foreach_zero_",
    "aten::_copy_from", "aten::uniform_", "aten::normal_", "aten::random_", "aten::exponential_",
})

#: Ops that only allocate (no traffic, no kernel).
ALLOCATIONS = frozenset({
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
    "aten::new_empty_strided", "aten::empty_permuted", "aten::resize_",
})


def _tensors(value):
    """The tensors in an argument value: a tensor, or a list/tuple of (optional) tensors."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclasses.dataclass
class Traffic:
    """Bytes read and written, and launches, in all and per op name."""

    read: int = 0
    written: int = 0
    launches: int = 0
    by_op: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    launches_by_op: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    live: int = 0  # bytes allocated by the counted ops and alive now
    peak_live: int = 0  # the most of them alive at once

    @property
    def total(self) -> int:
        return self.read + self.written


def op_traffic(func, args, kwargs, out) -> tuple[int, int] | None:
    """``(read, written)`` bytes of one dispatched op by the rule above; None for a view, an
    allocation or an op outside ``aten``."""
    name = func._schema.name
    if func.namespace != "aten" or func.is_view or name in ALLOCATIONS:
        return None
    schema = func._schema
    read = written = 0
    bound = dict(zip((a.name for a in schema.arguments), args))
    bound.update(kwargs)
    for arg in schema.arguments:
        tensors = _tensors(bound.get(arg.name))
        if not tensors:
            continue
        size = _nbytes(tensors)
        mutated = arg.alias_info is not None and arg.alias_info.is_write
        destination = arg.is_out or (arg.name == "self" and name in DESTINATION_ONLY)
        if not destination:
            read += size
        if mutated:
            written += size
    outs = out if isinstance(out, (list, tuple)) else [out]
    for ret, value in zip(schema.returns, outs):
        if ret.alias_info is None:  # a fresh result; aliased returns were counted as arguments
            written += _nbytes(_tensors(value))
    return read, written


class ByteCounter(TorchDispatchMode):
    """Counts the bytes every aten op reads and writes while active (see the module docstring);
    ``traffic`` holds the sums. Use as a context manager."""

    def __init__(self):
        super().__init__()
        self.traffic = Traffic()
        self._storages: set[int] = set()  # data pointers of the live storages followed

    def _follow(self, func, out) -> None:
        """Counts the storages of ``func``'s fresh results as live until they are freed."""
        if func.is_view:
            return
        outs = out if isinstance(out, (list, tuple)) else [out]
        for ret, value in zip(func._schema.returns, outs):
            if ret.alias_info is not None:
                continue
            for t in _tensors(value):
                storage = t.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
                if ptr == 0 or ptr in self._storages:
                    continue
                self._storages.add(ptr)
                self.traffic.live += size
                self.traffic.peak_live = max(self.traffic.peak_live, self.traffic.live)
                weakref.finalize(storage, self._freed, ptr, size)

    def _freed(self, ptr: int, size: int) -> None:
        self._storages.discard(ptr)
        self.traffic.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._follow(func, out)
        counted = op_traffic(func, args, kwargs, out)
        if counted is not None:
            name = str(func.overloadpacket)
            t = self.traffic
            t.read += counted[0]
            t.written += counted[1]
            t.launches += 1
            t.by_op[name] += counted[0] + counted[1]
            t.launches_by_op[name] += 1
        return out


def count(fn, *args, **kwargs) -> Traffic:
    """The traffic of ``fn(*args, **kwargs)``."""
    with ByteCounter() as counter:
        fn(*args, **kwargs)
    return counter.traffic
