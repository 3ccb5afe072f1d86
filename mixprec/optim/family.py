"""The one step of compact masters: a bounded piece at a time, load, torch's own step, store.

:class:`~mixprec.optim.compact.CompactMasterOptimizer` steps every optimizer this way:

1. **cut** the 16-bit parameters with gradients into pieces of at most :data:`PIECE` elements
   (``bucket_mb`` MiB of fp32 values when set) per device and weight dtype, in order. For
   torch's per-parameter optimizers (Adafactor and SparseAdam aside: their state is not
   element-wise) a larger tensor is cut into slices: flat ranges of multiples of 64 elements
   (torch's fused CPU kernel then groups the elements for its vector loop as for the whole
   tensor), or, for a strided tensor, row ranges. Any other optimizer (a global statistic) gets
   one piece holding everything, its fp32 parameters too;
2. **load** a piece into flat fp32 values (the method's
   :meth:`~mixprec.masters.MasterMethod.load_lists`) and gradients (one ``_foreach_copy_``);
   the values, shaped as the slices, stand in for the parameters, with their ``state``: fp32
   moments as views of the parameter's, bf16 or strided ones widened into a flat buffer,
   ``step`` and other scalars the parameter's own (a copy per slice of a cut tensor, written
   back once: torch's layout, one ``step`` per parameter);
3. **step**: the inner optimizer's own ``step()`` over them: torch's fused kernel where torch
   has one (``fused="auto"`` or ``"compile"``: it divides the gradients by a loss scale as it
   reads them, as for fp32 masters), else as configured (foreach or single-tensor, gradients
   unscaled first). No Adam or SGD arithmetic of mixprec's own; nothing compiled;
4. **store** with :meth:`~mixprec.masters.MasterMethod.store_lists` (split exactly,
   Kahan-compensated, or rounded stochastically); widened moments go back (bf16: rounded
   stochastically), and moments the step made are stored in ``state_dtype``.

Then the groups' fp32 parameters (norm layers kept in fp32) are stepped as they are (that step
always runs, so schedulers see one). So ``master="split"`` steps its masters bit for bit as fp32
masters do, and a cut tensor as a whole one: element ``i`` of a tensor with key ``k`` draws the
bits of ``(k, i)`` whatever piece it lies in (the keys are shifted by each slice's place in its
piece and its tensor, and an FSDP2 shard's in the full tensor). Per piece: a fixed number of
launches besides torch's (per list, fused or foreach); no host sync; about 8 bytes per piece
element (values, gradients), 8 more for bf16 Adam moments, in buffers the optimizer keeps
(:class:`Scratch`). For torch's SGD/Adam/AdamW, steps after the first skip the inner ``step()``
and call torch's functional fused kernel on lists made once (:mod:`.compact_lists`): the same
values, keys and order, so the same bits.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import NamedTuple

import torch

from .. import kernel_table
from ..masters.rounding import KEY_STRIDE, TABLE_SIZE, round_into_lists, shard_key
from ..scaling.unscale import unscale_
from ..shards import is_dtensor, like_shard, local
from . import states
from .buckets import PER_PARAMETER_OPTIMIZERS, is_per_parameter
from .kernels import torch_fused, torch_fused_problem
from .states import OWN_KEYS
from .steps import amp_arguments

__all__ = ["PIECE", "Slice", "Scratch", "draw_keys", "step", "step_own", "cut", "piece_limit"]

#: Elements of one piece (4 MiB of fp32 values): the step's fp32 buffers are bounded by it.
PIECE = 1 << 20
#: torch's optimizers whose update of an element reads that element and per-parameter scalars.
_CUT = tuple(t for t in PER_PARAMETER_OPTIMIZERS if t.__name__ not in ("Adafactor", "SparseAdam"))
_KEYS = 3  # rounding keys per tensor and step: the weight's, two moments' (a third shares)
# slices of a flat tensor start at multiples of this: torch's fused CPU kernels group elements
# for their vector loops by cache lines from a tensor's start, so a slice's are the whole one's
_ALIGN = 64
_unflatten = torch._C._nn.unflatten_dense_tensors
_NAN = 0x7FC0  # a NaN moment's bf16 pattern


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


def _view(tensor: torch.Tensor, s: Slice) -> torch.Tensor:
    if not s.index:
        return tensor
    return (tensor.view(-1) if s.flat else tensor)[s.index]


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
    for a in range(0, shape[0], rows):
        b = min(a + rows, shape[0])
        yield (*prefix, slice(a, b)), start + a * inner, (b - a) * inner


def _parts(item: Slice, limit: int, state: dict):
    """``(index, start, numel, flat)`` of the slices of ``item``: runs of the flat tensors where
    the weight, gradient, buffer and moments are contiguous, else of rows."""
    param = local(item.param)
    tensors = [param, item.grad, item.buf, *(v for k, v in state.get(item.param, {}).items()
                                             if states.is_moment(k, v, item.param))]
    if all(local(t).is_contiguous() for t in tensors if t is not None):
        return ((*run, True) for run in _runs((param.numel(),), limit))
    return ((*run, False) for run in _runs(param.shape, limit))


def _pieces(items: list[Slice], limit: int, cut: bool, state: dict):
    """``items`` (whole tensors) in pieces of at most ``limit`` elements per device and dtype,
    tensors larger than that cut into slices when ``cut`` (else alone)."""
    kinds: dict[tuple, list[Slice]] = {}
    for item in items:
        kinds.setdefault((local(item.param).device, item.param.dtype), []).append(item)
    for kind in kinds.values():
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


def _shifts(slices: list[Slice], positions: list[int], device) -> torch.Tensor:
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


def _moment(key, value, param: torch.Tensor) -> bool:
    """:func:`.states.is_moment`, the cheap refusals first."""
    return (isinstance(value, torch.Tensor) and value.dim() > 0
            and states.is_moment(key, value, param))


def _positions(slices: list[Slice]) -> list[int]:
    return list(itertools.accumulate((s.numel for s in slices), initial=0))[:-1]


def _narrow(values: torch.Tensor, outs: list[torch.Tensor], keys: torch.Tensor) -> None:
    """The flat fp32 ``values`` (overwritten) into ``outs``: bf16 ones rounded stochastically
    (``keys``: per out, shifted), others copied."""
    if outs[0].dtype == torch.bfloat16:
        round_into_lists(values, outs, keys, _NAN)
    else:
        torch._foreach_copy_(outs, _unflatten(values, outs))


class Scratch:
    """The flat fp32 buffers a bounded piece's step writes (values, gradients, widened
    moments), one per device and use, kept by the optimizer from piece to piece and from step
    to step, and grown to the largest piece: at most :data:`PIECE` (or ``bucket_mb``) elements
    each, so 8 bytes per piece element (16 with widened Adam moments) held between steps.
    Transient in size, but kept (counted in the optimizer's ``held_tensors()["scratch"]``):
    fresh buffers would free and take the same few MiB every piece of every step, and the
    cached lists (:mod:`.compact_lists`) hold views of them. A whole-model piece (an optimizer
    reading several parameters at once) or a tensor alone above the piece size takes fresh
    buffers instead."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.version = 0  # moves when a buffer is replaced (views of the old one are stale)

    def take(self, device: torch.device, use: str, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the ``use`` buffer on ``device`` (uninitialised)."""
        buf = self.buffers.get((device, use))
        if buf is None or buf.numel() < numel:
            buf = self.buffers[device, use] = torch.empty(numel, device=device)
            self.version += 1
        return buf[:numel]

    def holds(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` shares memory with a buffer (state must not keep it)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in self.buffers.values())

    def tensors(self) -> list[torch.Tensor]:
        return list(self.buffers.values())


def piece_limit(opt) -> int:
    """The most elements of a bounded piece of ``opt``'s step."""
    limit = PIECE if opt.bucket_mb is None else int(opt.bucket_mb * 2 ** 18)
    return max(_ALIGN, limit - limit % _ALIGN)


def _flat(opt, device, use: str, numel: int, kept: bool) -> torch.Tensor:
    """A piece's flat fp32 buffer: the kept scratch, or (``kept`` False: a whole-model piece, a
    tensor alone above the limit) a fresh one."""
    return opt.scratch.take(device, use, numel) if kept else torch.empty(numel, device=device)


class _Run:
    """The slices of a piece on one device and of one weight dtype, loaded: their fp32 values
    (``temps``) and what the optimizer steps (``params``: the values, or, for an optimizer that
    reads several parameters at once (``whole``), FSDP2 shards' values placed as the shards)
    with gradients and swapped-in state."""

    def __init__(self, opt, slices: list[Slice], keys: torch.Tensor, saved: dict,
                 whole: bool) -> None:
        self.opt, self.slices, self.keys, self.whole = opt, slices, keys, whole
        self.weights = [_view(local(s.param), s) for s in slices]
        self.bufs = (None if slices[0].buf is None
                     else [_view(local(s.buf), s) for s in slices])
        self.device = self.weights[0].device
        total = sum(s.numel for s in slices)
        self.kept = not whole and total <= piece_limit(opt)
        self.values = _flat(opt, self.device, "values", total, self.kept)
        self.grads = _flat(opt, self.device, "grads", total, self.kept)
        # the gradients' buffer is spare until they are copied in, and again after the step
        self.spare = spare_for(opt.master, self.grads, self.weights[0].dtype)
        opt.master.load_lists(self.values, self.weights, self.bufs, **self.spare)
        self.temps = list(_unflatten(self.values, self.weights))
        self.params = [self._placed(t, s) for t, s in zip(self.temps, slices)]
        views = _unflatten(self.grads, self.weights)
        dense = [(v, _view(local(s.grad), s)) for v, s in zip(views, slices)
                 if not s.grad.is_sparse]
        torch._foreach_copy_([v for v, _ in dense], [g for _, g in dense])
        self.sparse = []
        for temp, view, s in zip(self.params, views, slices):
            temp.grad = s.grad.float() if s.grad.is_sparse else self._placed(view, s)
            if s.grad.is_sparse:
                self.sparse.append(temp.grad)
        self._swap_in(saved)

    def _placed(self, tensor: torch.Tensor, s: Slice) -> torch.Tensor:
        return like_shard(tensor, s.param) if self.whole else tensor

    def _swap_in(self, saved: dict) -> None:
        """Each value's ``state``: the parameter's, moments as views or widened copies."""
        state = self.opt.inner.state
        self.given, wide = [], {}
        for i, (s, temp) in enumerate(zip(self.slices, self.params)):
            entry, given = {}, {}
            source = saved[id(s.param)] if s.index else state.get(s.param, {})
            for key, value in source.items():
                if key in OWN_KEYS:
                    continue
                if _moment(key, value, s.param):
                    region = _view(local(value), s)
                    if region.dtype == torch.float32 and region.is_contiguous():
                        entry[key] = given[key] = self._placed(region, s)
                    else:
                        wide.setdefault(key, []).append((i, region))
                else:  # step and other scalars; a slice of a cut tensor steps a copy
                    entry[key] = value.clone() if s.index and torch.is_tensor(value) else value
            state[temp] = entry
            self.given.append(given)
        self.wide = {}
        for key, found in wide.items():
            regions = [r for _, r in found]
            flat = _flat(self.opt, self.device, f"wide {key}", sum(r.numel() for r in regions),
                         self.kept)
            views = list(_unflatten(flat, regions))
            torch._foreach_copy_(views, regions)
            for (i, _), view in zip(found, views):
                view = self._placed(view, self.slices[i])
                state[self.params[i]][key] = self.given[i][key] = view
            self.wide[key] = (flat, [i for i, _ in found], regions)

    def store(self) -> None:
        """The values into the weights and buffers, the moments back, the state swapped out."""
        opt = self.opt
        keys = (self.keys[:, 0] + _shifts(self.slices, _positions(self.slices), 'cpu')
                if opt.master.draws_bits else None)
        opt.master.store_lists(self.values, self.weights, self.bufs, keys, **self.spare)
        state = opt.inner.state
        entries = [state.pop(temp) for temp in self.params]

        def column(i: int, key: str) -> int:  # of the name among the tensor's moments, sorted
            names = sorted(k for k, v in entries[i].items() if _moment(k, v, self.params[i]))
            return 1 + names.index(key) % (_KEYS - 1)

        for key, (flat, idx, regions) in self.wide.items():
            slices = [self.slices[i] for i in idx]
            shift = _shifts(slices, _positions(slices), 'cpu')
            _narrow(flat, regions, self.keys[idx, [column(i, key) for i in idx]] + shift)
        for i, (s, entry) in enumerate(zip(self.slices, entries)):
            held = state[s.param] if entry else {}  # no empty entry left behind
            for key, value in entry.items():
                if self.given[i].get(key) is value:
                    continue
                if _moment(key, value, self.params[i]):  # made by this step: state dtype
                    self._adopt(s, held, key, local(value), self.keys[i, column(i, key)].view(1))
                else:
                    held[key] = self._owned(value)

    def _owned(self, value):
        """``value``, or a copy where it shares memory with the kept scratch."""
        if torch.is_tensor(value) and self.kept and self.opt.scratch.holds(value):
            return value.clone()
        return value

    def _adopt(self, s: Slice, held: dict, key: str, value: torch.Tensor,
               key_bits: torch.Tensor) -> None:
        param, dtype = local(s.param), self.opt.state_dtype
        if not s.index and dtype == torch.float32 and value.stride() == param.stride():
            held[key] = like_shard(self._owned(value), s.param)
            return
        full = held.get(key)
        if full is None or not states.is_moment(key, full, s.param):
            full = held[key] = like_shard(torch.zeros_like(param, dtype=dtype), s.param)
        region = _view(local(full), s)
        _narrow(value.reshape(-1), [region], key_bits + _shifts([s], [0], 'cpu'))


def draw_keys(opt, items: list[Slice]) -> torch.Tensor | None:
    """The step's rounding keys: :data:`_KEYS` per 16-bit parameter with a gradient (row
    ``item.row``), drawn from ``opt.rounding`` (one draw per step, whichever path steps)."""
    if not items:
        return None
    # RoundingGenerator.keys' numbers, as one tensor (its list holds a tensor object per key:
    # 1,200 of them for 400 tensors cost more than the update of their elements)
    drawn = torch.randint(0, TABLE_SIZE, (_KEYS * len(items),),
                          generator=opt.rounding.generator, dtype=torch.int32)
    salt = opt.salt % TABLE_SIZE
    return (drawn ^ salt if salt else drawn).view(-1, _KEYS)


@torch.no_grad()
def step(opt, items: list[Slice], fp32_params: list[list[torch.Tensor]],
         grad_scale: torch.Tensor | None, inv: torch.Tensor | None,
         keys: torch.Tensor | None) -> None:
    """Step ``opt`` (a :class:`~mixprec.optim.compact.CompactMasterOptimizer`) as the module
    docstring says.

    Args:
        items: the 16-bit parameters with gradients, whole (``row``: their place in order).
        fp32_params: per param group, its fp32 parameters (stepped as they are).
        grad_scale: the factor the gradients carry (a 0-d tensor), or None.
        inv: its reciprocal, or None.
        keys: :func:`draw_keys`'s.
    """
    inner = opt.inner
    whole = not is_per_parameter(inner)
    if whole:  # a global statistic: everything in one step
        _step_piece(opt, items, fp32_params, keys, grad_scale, inv, {}, whole)
        return
    pieces = list(cut(opt, items))
    saved = {}  # the state before the step of the tensors cut into slices
    for piece in pieces:
        for s in piece:
            if s.index and id(s.param) not in saved:
                saved[id(s.param)] = dict(inner.state.get(s.param, {}))
    for piece in pieces:
        _step_piece(opt, piece, None, keys, grad_scale, inv, saved, whole)
    step_own(opt, fp32_params, keys, grad_scale, inv)


def cut(opt, items: list[Slice]):
    """The pieces of a per-parameter optimizer's step (step 1 of the module docstring)."""
    return _pieces(items, piece_limit(opt), type(opt.inner) in _CUT, opt.inner.state)


@torch.no_grad()
def step_own(opt, fp32_params: list[list[torch.Tensor]], keys, grad_scale, inv) -> None:
    """The groups' fp32 parameters, through the inner optimizer's own step (which always runs,
    so schedulers and hooks see a step)."""
    _step_piece(opt, [], fp32_params, keys, grad_scale, inv, {}, False)


def _step_piece(opt, piece, fp32_params, keys, grad_scale, inv, saved, whole) -> None:
    inner = opt.inner
    kinds: dict[tuple, list[Slice]] = {}
    for s in piece:
        kinds.setdefault((local(s.param).device, s.param.dtype), []).append(s)
    runs: list[_Run] = []
    lists = [[] for _ in inner.param_groups] if fp32_params is None else [
        list(ps) for ps in fp32_params]
    own = [p for ps in lists for p in ps]
    try:
        for slices in kinds.values():
            rows = keys[[s.row for s in slices]]  # on the CPU: the noise table is sliced at them
            runs.append(_Run(opt, slices, rows, saved, whole))
            for s, temp in zip(slices, runs[-1].params):
                lists[s.group].append(temp)
        tensors = [t for ts in lists for t in ts]
        fused = opt.fused is not False and torch_fused_problem(inner, tensors) is None
        if inv is not None and not fused:
            grads = [r.grads for r in runs] + [g for r in runs for g in r.sparse]
            unscale_(grads + [p.grad for p in own if p.grad is not None], inv)
        with opt.only(lists), states.fp32_moments(inner, own, opt.state_dtype, opt.rounding), \
                (torch_fused(inner) if fused else contextlib.nullcontext()), \
                amp_arguments(inner, grad_scale if fused else None, None):
            opt.inner_step()
        for run in runs:
            run.store()
    finally:
        for run in runs:
            for temp in run.params:
                inner.state.pop(temp, None)
