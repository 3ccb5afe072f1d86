"""``op_stats``: which dtype each executed ATen op really ran in, forward and backward.

A ``TorchDispatchMode`` watches the ops that actually execute, below autocast and autograd, so it
sees the casts autocast inserts and the ops of the backward pass: the evidence that a precision
level does what it says.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..dtypes import dtype_name, to_dtype
from ._common import PHASES, current_phase, op_name, tensors_in

__all__ = ["op_stats", "OpStats"]


class _CountMode(TorchDispatchMode):
    def __init__(self, stats: OpStats):
        super().__init__()
        self.stats = stats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.stats.include_views or not func.is_view:
            tensors = tensors_in(out)
            floating = [t for t in tensors if t.is_floating_point()]
            dtype = (floating or tensors)[0].dtype if tensors else None
            self.stats.counts[(op_name(func), dtype, current_phase())] += 1
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
    without tensor outputs).
    """

    def __init__(self, include_views: bool = False):
        self.include_views = bool(include_views)
        self.counts: collections.Counter = collections.Counter()
        self._modes: list[_CountMode] = []

    def __enter__(self) -> OpStats:
        mode = _CountMode(self)
        mode.__enter__()
        self._modes.append(mode)
        return self

    def __exit__(self, *exc):
        return self._modes.pop().__exit__(*exc)

    def _match(self, op, dtype, phase):
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase must be 'forward', 'backward' or None; got {phase!r}")
        op = None if op is None else _short_op(op)
        dtype = None if dtype is None else to_dtype(dtype)
        return [(key, n) for key, n in self.counts.items()
                if (op is None or key[0] == op) and (dtype is None or key[1] == dtype)
                and (phase is None or key[2] == phase)]

    def count(self, op: str | None = None, dtype=None, phase: str | None = None) -> int:
        """How many ops ran matching all given filters.

        Args:
            op: "mm", "aten.mm" or "aten.mm.default".
            dtype: output dtype ("bf16", torch.bfloat16, ...).
            phase: "forward" or "backward".

        Raises:
            ValueError: an unknown phase or dtype name.
        """
        return sum(n for _, n in self._match(op, dtype, phase))

    def by_dtype(self, phase: str | None = None) -> dict:
        """``{output dtype: op count}`` (None for ops without tensor outputs)."""
        out: collections.Counter = collections.Counter()
        for (_, dtype, _), n in self._match(None, None, phase):
            out[dtype] += n
        return dict(out)

    def ops(self, dtype=None, phase: str | None = None) -> list[str]:
        """Sorted names of the ops that ran (with output ``dtype``, in ``phase``)."""
        return sorted({key[0] for key, _ in self._match(None, dtype, phase)})

    @property
    def total(self) -> int:
        """The number of ops counted."""
        return sum(self.counts.values())

    def table(self) -> str:
        """A text table: one row per (op, dtype) with forward, backward and total counts."""
        rows: dict = collections.defaultdict(lambda: [0, 0])
        for (op, dtype, phase), n in self.counts.items():
            rows[(op, "-" if dtype is None else dtype_name(dtype))][PHASES.index(phase)] += n
        width = max([len(op) for op, _ in rows] + [2])
        lines = [f"{'op':<{width}}  {'dtype':<8} {'forward':>8} {'backward':>8} {'total':>8}"]
        for (op, dt), (fw, bw) in sorted(rows.items()):
            lines.append(f"{op:<{width}}  {dt:<8} {fw:>8} {bw:>8} {fw + bw:>8}")
        lines.append(f"{'total':<{width}}  {'':<8} {self.count(phase='forward'):>8} "
                     f"{self.count(phase='backward'):>8} {self.total:>8}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"OpStats(total={self.total}, by_dtype={self.by_dtype()})"


def op_stats(include_views: bool = False) -> OpStats:
    """Count the ATen ops executed in the block by (op, output dtype, forward/backward).

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
    """
    return OpStats(include_views)
