"""``op_stats``: which dtype each executed ATen op really ran in, forward and backward.

A ``TorchDispatchMode`` watches the ops that actually execute, below autocast and autograd, so it
sees the casts autocast inserts and the ops of the backward pass: the evidence that a precision
level does what it says. A ``TorchFunctionMode`` beside it records the Python-level torch
function each op ran beneath, by the name op lists accept (``addmm`` ran beneath ``linear``:
``mp.autocast(fp32_ops=["linear"])`` moves it, ``fp32_ops=["addmm"]`` does not), and each op's
floating inputs are described next to its output dtype (an O2 LayerNorm on CPU reads bf16
activations with fp32 parameters: "bf16 in, fp32 params").
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..dtypes import dtype_name, to_dtype
from ..oplists import op_list_name
from ._common import PHASES, current_phase, op_name, tensors_in

__all__ = ["op_stats", "OpStats", "OpRecord"]

_MAX_NODES = 256  # bound on the autograd nodes attributed to one Python-level call


class OpRecord(NamedTuple):
    """One kind of executed op, the key of :attr:`OpStats.records`.

    Attributes:
        op: the ATen op ("addmm", "native_layer_norm", "_to_copy", ...).
        dtype: the dtype of its first floating output (None without tensor outputs).
        phase: "forward" or "backward".
        list_name: the Python-level torch function it ran beneath, by its op-list name
            ("linear", "layer_norm", "add", "to"); in the backward pass, the function whose
            forward made the autograd node ("a/b" when several did); None when unknown.
        inputs: its floating inputs: "bf16" (all of one dtype, as the output), "fp32 -> bf16"
            (one dtype, another output dtype: a cast), "bf16 in, fp32 params" (activations and
            ``nn.Parameter`` inputs of different dtypes), "mixed bf16+fp32"; None without
            floating inputs.
    """

    op: str
    dtype: torch.dtype | None
    phase: str
    list_name: str | None
    inputs: str | None


def _names(dtypes) -> str:
    return "+".join(dtype_name(d) for d in dtypes)


def inputs_label(args, kwargs, out: torch.dtype | None) -> str | None:
    """Describe an op's floating inputs against its output dtype (see :class:`OpRecord`)."""
    acts: list[torch.dtype] = []
    params: list[torch.dtype] = []
    for t in tensors_in((args, kwargs)):
        if t.is_floating_point():
            bucket = params if isinstance(t, nn.Parameter) else acts
            if t.dtype not in bucket:
                bucket.append(t.dtype)
    every = acts + [d for d in params if d not in acts]
    if not every:
        return None
    if out is None or set(every) == {out}:
        return _names(every) if out is None else dtype_name(out)
    if len(every) == 1:
        return f"{dtype_name(every[0])} -> {dtype_name(out)}"
    if acts and params and not set(params) <= set(acts):
        label = f"{_names(acts)} in, {_names(params)} params"
    else:
        label = f"mixed {_names(every)}"
    return label if out in acts else f"{label} -> {dtype_name(out)}"


def _node_names(stop: list, outputs) -> set[str]:
    """Names of the autograd nodes between ``outputs`` and the nodes in ``stop``."""
    stack = [t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None]
    visited: list = []  # kept alive, so identity checks stay valid during the walk
    names = set()
    while stack and len(visited) < _MAX_NODES:
        node = stack.pop()
        if any(node is n for n in stop) or any(node is n for n in visited):
            continue
        visited.append(node)
        names.add(node.name())
        stack.extend(n for n, _ in node.next_functions
                     if n is not None and n.name() != "torch::autograd::AccumulateGrad")
    return names


class _SourceMode(TorchFunctionMode):
    """Records the outermost Python-level torch function being run, and the autograd nodes it
    creates (so backward ops can be named by the function whose forward made them)."""

    def __init__(self, stats: OpStats):
        super().__init__()
        self.stats = stats

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_list_name(func)
        stop = None
        if name is not None and torch.is_grad_enabled():
            stop = [t.grad_fn for t in tensors_in((args, kwargs)) if t.grad_fn is not None]
        self.stats._sources.append(name)
        try:
            out = func(*args, **kwargs)
        finally:
            self.stats._sources.pop()
        if stop is not None:
            for node in _node_names(stop, out):
                self.stats._node_sources[node].add(name)
        return out


class _CountMode(TorchDispatchMode):
    def __init__(self, stats: OpStats):
        super().__init__()
        self.stats = stats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.stats.include_views or not func.is_view:
            tensors = tensors_in(out)
            floating = [t for t in tensors if t.is_floating_point()]
            dtype = (floating or tensors)[0].dtype if tensors else None
            phase, op = current_phase(), op_name(func)
            self.stats.counts[(op, dtype, phase)] += 1
            record = OpRecord(op, dtype, phase, self.stats._list_name(phase),
                              inputs_label(args, kwargs, dtype))
            self.stats.records[record] += 1
        return out


def _short_op(op: str) -> str:
    """``"aten.mm.default"``, ``"aten.mm"``, ``"mm"`` -> ``"mm"``."""
    parts = op.split(".")
    if parts[0] == "aten" and len(parts) > 1:
        return parts[1]
    return op


class OpStats:
    """Counts of executed ATen ops by (op, output dtype, pass); made by :func:`op_stats`.

    ``counts`` is a ``Counter`` keyed by ``(op, dtype, phase)``, e.g. ``("addmm",
    torch.bfloat16, "forward")``; ``dtype`` is the first floating output's (None for ops
    without tensor outputs). ``records`` counts the same ops in more detail, keyed by
    :class:`OpRecord` (adding the op-list name and the inputs' dtypes).
    """

    def __init__(self, include_views: bool = False):
        self.include_views = bool(include_views)
        self.counts: collections.Counter = collections.Counter()
        self.records: collections.Counter = collections.Counter()
        self._modes: list[tuple[_SourceMode, _CountMode]] = []
        self._sources: list[str | None] = []
        self._node_sources: dict[str, set[str]] = collections.defaultdict(set)

    def __enter__(self) -> OpStats:
        modes = (_SourceMode(self), _CountMode(self))
        for mode in modes:
            mode.__enter__()
        self._modes.append(modes)
        return self

    def __exit__(self, *exc):
        source, count = self._modes.pop()
        count.__exit__(*exc)
        return source.__exit__(*exc)

    def _list_name(self, phase: str) -> str | None:
        if phase == "forward":
            return self._sources[-1] if self._sources else None
        node = torch._C._current_autograd_node()
        names = self._node_sources.get(node.name()) if node is not None else None
        return "/".join(sorted(names)) if names else None

    def _match(self, op, dtype, phase, list_name=None):
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase must be 'forward', 'backward' or None; got {phase!r}")
        op = None if op is None else _short_op(op)
        dtype = None if dtype is None else to_dtype(dtype)
        return [(key, n) for key, n in self.records.items()
                if (op is None or key.op == op) and (dtype is None or key.dtype == dtype)
                and (phase is None or key.phase == phase)
                and (list_name is None or list_name in (key.list_name or "").split("/"))]

    def count(self, op: str | None = None, dtype=None, phase: str | None = None,
              list_name: str | None = None) -> int:
        """How many ops ran matching all given filters.

        Args:
            op: "mm", "aten.mm" or "aten.mm.default".
            dtype: output dtype ("bf16", torch.bfloat16, ...).
            phase: "forward" or "backward".
            list_name: the op-list name of the Python-level function the op ran beneath
                ("linear", "layer_norm", ...).

        Raises:
            ValueError: an unknown phase or dtype name.
        """
        return sum(n for _, n in self._match(op, dtype, phase, list_name))

    def by_dtype(self, phase: str | None = None) -> dict:
        """``{output dtype: op count}`` (None for ops without tensor outputs)."""
        out: collections.Counter = collections.Counter()
        for key, n in self._match(None, None, phase):
            out[key.dtype] += n
        return dict(out)

    def ops(self, dtype=None, phase: str | None = None) -> list[str]:
        """Sorted names of the ops that ran (with output ``dtype``, in ``phase``)."""
        return sorted({key.op for key, _ in self._match(None, dtype, phase)})

    def list_names(self, op: str | None = None, phase: str | None = None) -> dict[str, list[str]]:
        """``{ATen op: sorted op-list names it ran beneath}``: what to name in
        ``mp.autocast(low_precision_ops=..., fp32_ops=...)`` to move it (``{"addmm":
        ["linear"]}``). Ops with no known name map to an empty list."""
        out: dict[str, set[str]] = collections.defaultdict(set)
        for key, _ in self._match(op, None, phase):
            out[key.op].update(filter(None, (key.list_name or "").split("/")))
        return {k: sorted(v) for k, v in sorted(out.items())}

    def inputs(self, op: str | None = None, dtype=None, phase: str | None = None) -> dict:
        """``{inputs label: op count}`` for the matching ops (see :class:`OpRecord`), e.g.
        ``{"bf16 in, fp32 params": 1}`` for an O2 LayerNorm on CPU."""
        out: collections.Counter = collections.Counter()
        for key, n in self._match(op, dtype, phase):
            out[key.inputs] += n
        return dict(out)

    @property
    def total(self) -> int:
        """The number of ops counted."""
        return sum(self.counts.values())

    def table(self) -> str:
        """A text table: one row per (op, output dtype, op-list name, inputs) with forward,
        backward and total counts. "op list name" is what ``low_precision_ops``/``fp32_ops``
        accept to move the op ("-": not reachable by name); "inputs" says what it read."""
        rows: dict = collections.defaultdict(lambda: [0, 0])
        for key, n in self.records.items():
            dt = "-" if key.dtype is None else dtype_name(key.dtype)
            row = (key.op, dt, key.list_name or "-", key.inputs or "-")
            rows[row][PHASES.index(key.phase)] += n
        width = max([len(k[0]) for k in rows] + [2])
        lwidth = max([len(k[2]) for k in rows] + [len("op list name")])
        lines = [f"{'op':<{width}}  {'dtype':<8} {'forward':>8} {'backward':>8} {'total':>8}  "
                 f"{'op list name':<{lwidth}}  inputs"]
        for (op, dt, via, ins), (fw, bw) in sorted(rows.items()):
            lines.append(f"{op:<{width}}  {dt:<8} {fw:>8} {bw:>8} {fw + bw:>8}  "
                         f"{via:<{lwidth}}  {ins}")
        lines.append(f"{'total':<{width}}  {'':<8} {self.count(phase='forward'):>8} "
                     f"{self.count(phase='backward'):>8} {self.total:>8}")
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"OpStats(total={self.total}, by_dtype={self.by_dtype()})"


def op_stats(include_views: bool = False) -> OpStats:
    """Count the ATen ops executed in the block by (op, output dtype, forward/backward).

    Each op is also recorded with the op-list name of the Python-level torch function it ran
    beneath (what ``mp.autocast(low_precision_ops=..., fp32_ops=...)`` accepts to move it) and a
    description of its floating inputs (see :class:`OpRecord`); :meth:`OpStats.table` shows
    both.

    Args:
        include_views: also count view and alias ops (``t``, ``view``, ``detach``, ...), which
            compute nothing.

    Returns:
        An :class:`OpStats` (a context manager) filled in as the block runs.

    Example:
        >>> import torch
        >>> with op_stats() as stats, torch.autocast("cpu", dtype=torch.bfloat16):
        ...     _ = torch.nn.Linear(4, 4)(torch.ones(2, 4))
        >>> stats.count(op="addmm", dtype="bf16")
        1
        >>> stats.list_names("addmm")
        {'addmm': ['linear']}
    """
    return OpStats(include_views)
