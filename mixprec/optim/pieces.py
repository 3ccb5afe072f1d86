"""The plan of a compact step: its pieces and slices, where each slice's rounding bits start,
and the scratch a piece is loaded into (:mod:`.family` steps them).

A piece holds at most :func:`piece_limit` elements (the kernel table's
:meth:`~mixprec.kernel_table.KernelTable.step_piece` for its device: 2^20 on the CPU, on CUDA
1/16 of the model up to 2^25; ``bucket_mb`` MiB of fp32 values when set) of one device and
weight dtype. For torch's
per-parameter optimizers (Adafactor and SparseAdam aside: their state is not element-wise) a
larger tensor is cut into slices: flat ranges of multiples of 64 elements (torch's fused CPU
kernel then groups the elements for its vector loop as for the whole tensor), or, for a weight,
buffer or moment that is strided, row ranges of multiples of 64 elements where a row's length
allows (a gradient laid out apart from its weight is read by value into the flat ranges).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from .. import kernel_table
from ..dtypes import is_low_precision
from ..masters.rounding import KEY_STRIDE, shard_key
from ..shards import is_dtensor, local
from . import states
from .buckets import PER_PARAMETER_OPTIMIZERS

__all__ = ["Slice", "cut", "piece_limit", "shifts", "positions", "items_of",
           "slice_view", "spare_for", "flat_buffer"]

#: torch's optimizers whose update of an element reads that element and per-parameter scalars.
_CUT = tuple(t for t in PER_PARAMETER_OPTIMIZERS if t.__name__ not in ("Adafactor", "SparseAdam"))
# slices of a flat tensor start at multiples of this: torch's fused CPU kernels group elements
# for their vector loops by cache lines from a tensor's start, so a slice's are the whole one's
_ALIGN = 64


class Slice(NamedTuple):
    """A 16-bit parameter, or a slice of one, in a piece."""

    group: int               # its param group
    param: torch.Tensor      # the optimizer's parameter (an FSDP2 shard's DTensor)
    grad: torch.Tensor
    buf: torch.Tensor | None  # its split remainder or Kahan compensation
    row: int                 # its row of the step's rounding keys
    index: tuple = ()        # of the local tensors: consecutive elements; (): the whole tensor
    start: int = 0           # the flat offset of its first element in the local tensor
    numel: int = 0
    flat: bool = False       # ``index`` is of the flat (contiguous) tensors


def slice_view(tensor: torch.Tensor, s: Slice) -> torch.Tensor:
    """``tensor``'s part for slice ``s``: a view of the weight, its buffer and moments (flat
    slices are cut only where they are contiguous); of a gradient laid out otherwise, its
    values (read, never written)."""
    if not s.index:
        return tensor
    return (tensor.reshape(-1) if s.flat else tensor)[s.index]


def _runs(shape, limit: int, prefix: tuple = (), start: int = 0):
    """``(index, start, numel)`` of runs of at most ``limit`` consecutive elements covering a
    tensor of ``shape`` (more than ``limit`` elements), in order: ranges of rows, or of a last
    dimension."""
    inner = math.prod(shape[1:])
    if inner > limit:
        for i in range(shape[0]):
            yield from _runs(shape[1:], limit, (*prefix, i), start + i * inner)
        return
    rows = max(1, limit // inner)
    whole = _ALIGN // math.gcd(inner, _ALIGN)  # rows per multiple of _ALIGN elements
    if rows >= whole:  # each slice a multiple of _ALIGN elements: where the tensor's rows are
        rows -= rows % whole  # its memory's, torch's fused CPU kernel groups them as whole
    for a in range(0, shape[0], rows):
        b = min(a + rows, shape[0])
        yield (*prefix, slice(a, b)), start + a * inner, (b - a) * inner


def _parts(item: Slice, limit: int, state: dict):
    """``(index, start, numel, flat)`` of the slices of ``item``: runs of the flat tensors where
    the weight, buffer and moments (what the step writes) are contiguous, a gradient laid out
    otherwise read by value; else of rows."""
    param = local(item.param)
    tensors = [param, item.buf, *(v for k, v in state.get(item.param, {}).items()
                                  if states.is_moment(k, v, item.param))]
    if all(local(t).is_contiguous() for t in tensors if t is not None):
        return ((*run, True) for run in _runs((param.numel(),), limit))
    return ((*run, False) for run in _runs(param.shape, limit))


def _pieces(opt, items: list[Slice], cut: bool, state: dict):
    """``items`` (whole tensors) in pieces of at most :func:`piece_limit` elements per device and
    dtype, tensors larger than that cut into slices when ``cut`` (else alone)."""
    kinds: dict[tuple, list[Slice]] = {}
    for item in items:
        kinds.setdefault((local(item.param).device, item.param.dtype), []).append(item)
    for (device, _), kind in kinds.items():
        limit = piece_limit(opt, device)
        piece, size = [], 0
        for item in kind:
            n = item.numel
            parts = ([((), 0, n, False)] if n <= limit or not cut or item.grad.is_sparse
                     else _parts(item, limit, state))
            for index, start, numel, flat in parts:
                if piece and size + numel > limit:
                    yield piece
                    piece, size = [], 0
                piece.append(item._replace(index=index, start=start, numel=numel, flat=flat))
                size += numel
        if piece:
            yield piece


def _wrap(value: int) -> int:
    value %= 2 ** 32
    return value - 2 ** 32 if value >= 2 ** 31 else value


def shifts(slices: list[Slice], positions: list[int], device) -> torch.Tensor:
    """Per slice, what its tensor's key is shifted by so that the element at flat ``position +
    j`` of a buffer draws the bits of element ``start + j`` of its (full) tensor."""
    shifts = []
    zero = torch.zeros((), dtype=torch.int32)
    for s, position in zip(slices, positions):
        offset = position - s.start
        shift = int(shard_key(zero, s.param)) if is_dtensor(s.param) else 0
        shifts.append(_wrap(shift - offset * KEY_STRIDE))
    return torch.tensor(shifts, dtype=torch.int32, device=device)


def spare_for(method, spare: torch.Tensor, dtype: torch.dtype) -> dict:
    """The keyword that hands ``spare`` (a flat fp32 buffer of the piece's size, free while the
    method loads or stores) to a method that takes one (``uses_spare``), where an in-place fp32
    op would copy its ``dtype`` operands first (:mod:`mixprec.kernel_table`: the CPU)."""
    if method.uses_spare and not kernel_table.TABLE.reads_mixed_operands(spare.device.type,
                                                                          dtype):
        return {"spare": spare}
    return {}


def positions(slices: list[Slice]) -> list[int]:
    return list(itertools.accumulate((s.numel for s in slices), initial=0))[:-1]


def piece_limit(opt, device: torch.device) -> int:
    """The most elements of a bounded piece of ``opt``'s step on ``device``: ``bucket_mb`` MiB
    of fp32 values when set, else the kernel table's piece for the device type."""
    limit = (kernel_table.TABLE.step_piece(device.type, opt.elements) if opt.bucket_mb is None
             else int(opt.bucket_mb * 2 ** 18))
    return max(_ALIGN, limit - limit % _ALIGN)


def flat_buffer(opt, device, use: str, numel: int, kept: bool) -> torch.Tensor:
    """A piece's flat fp32 buffer: the step scratch, or (``kept`` False: a whole-model piece, a
    tensor alone above the limit) a fresh one."""
    return opt.scratch.take(device, use, numel) if kept else torch.empty(numel, device=device)


def cut(opt, items: list[Slice]):
    """The pieces of a per-parameter optimizer's step (step 1 of the module docstring)."""
    return _pieces(opt, items, type(opt.inner) in _CUT, opt.inner.state)


def items_of(opt) -> tuple[list[Slice], list[list[torch.Tensor]]]:
    """``opt``'s 16-bit parameters with gradients (in order), and each group's fp32 ones. Per
    tensor per step: what depends only on the param groups is kept per layout."""
    items, fp32 = [], []
    state, key, held = opt.state, opt._buffer_key, opt._grads32
    pending, make = opt._pending, Slice._make
    for g, (low, own) in enumerate(_layout_of(opt)):
        fp32.append(list(own))
        for p, numel in low:
            grad = p.grad
            if grad is None:
                continue
            buf = None if key is None else (state.get(p) or {}).get(key)
            items.append(make((g, p, opt._grad_of(p) if held else grad,
                               pending.get(p) if buf is None else buf, len(items), (), 0,
                               numel, False)))
    return items, fp32


def _layout_of(opt) -> list[tuple[list[tuple[torch.Tensor, int]], list[torch.Tensor]]]:
    """Per param group, its 16-bit parameters with their (local) sizes and its fp32 ones,
    worked out once per layout."""
    cached = opt.__dict__.get("_layout_items")
    if cached is None or cached[0] != opt.layout_version:
        layout = []
        for group in opt.param_groups:
            low = [(p, local(p).numel()) for p in group["params"] if is_low_precision(p)]
            layout.append((low, [p for p in group["params"] if not is_low_precision(p)]))
        cached = opt._layout_items = (opt.layout_version, layout)
    return cached[1]
