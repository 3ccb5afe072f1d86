"""The one step of compact masters: a bounded piece at a time, load, torch's own step, store.

:class:`~mixprec.optim.compact.CompactMasterOptimizer` steps every optimizer this way:

1. **cut** the 16-bit parameters with gradients into pieces (:mod:`.pieces`: at most
   :func:`.pieces.piece_limit` elements of one device and weight dtype, larger tensors cut into
   slices for torch's per-parameter optimizers). Any other optimizer (a global statistic) gets
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
element (values, gradients), 8 more for bf16 Adam moments, in buffers the optimizer holds
while a step runs (:class:`.buckets.Scratch`). For torch's SGD/Adam/AdamW, steps once the state
exists (Adam's and AdamW's from the first: :func:`.compact_lists.make_state`) skip the inner
``step()`` and call torch's functional fused kernel on lists made once (:mod:`.compact_lists`):
the same values, keys and order, so the same bits (a NaN moment aside: that module says why).
"""

from __future__ import annotations

import contextlib

import torch

from ..masters.rounding import BF16_NAN, round_into_lists
from ..scaling.unscale import unscale_
from ..shards import like_shard, local
from . import states
from .buckets import is_per_parameter
from .kernels import complete_momentum, torch_fused, torch_fused_problem
from .pieces import (
    Slice,
    cut,
    flat_buffer,
    piece_limit,
    positions,
    shifts,
    slice_view,
    spare_for,
)
from .states import OWN_KEYS
from .steps import amp_arguments
from .wrapper import reevaluating

__all__ = ["draw_keys", "step", "step_own"]

_KEYS = 3  # rounding keys per tensor and step: the weight's, two moments' (a third shares)
_unflatten = torch._C._nn.unflatten_dense_tensors


def _moment(key, value, param: torch.Tensor) -> bool:
    """:func:`.states.is_moment`, the cheap refusals first (a 0-d tensor is a moment of a 0-d
    parameter only: a learned scalar's moments, not a step count)."""
    return (isinstance(value, torch.Tensor) and (value.dim() > 0 or param.dim() == 0)
            and states.is_moment(key, value, param))


def _narrow(values: torch.Tensor, outs: list[torch.Tensor], keys: torch.Tensor,
            nan: int | None = BF16_NAN) -> None:
    """The flat fp32 ``values`` (overwritten) into ``outs``: bf16 ones rounded stochastically
    (``keys``: per out, shifted; ``nan``: as :func:`~mixprec.masters.rounding.round_into_lists`
    takes it), others copied."""
    if outs[0].dtype == torch.bfloat16:
        round_into_lists(values, outs, keys, nan)
    else:
        torch._foreach_copy_(outs, _unflatten(values, outs))


class _Run:
    """The slices of a piece on one device and of one weight dtype, loaded: their fp32 values
    (``temps``) and what the optimizer steps (``params``: the values, or, for an optimizer that
    reads several parameters at once (``whole``), FSDP2 shards' values placed as the shards)
    with gradients and swapped-in state."""

    def __init__(self, opt, slices: list[Slice], keys: torch.Tensor, saved: dict,
                 whole: bool) -> None:
        self.opt, self.slices, self.keys, self.whole = opt, slices, keys, whole
        self.weights = [slice_view(local(s.param), s) for s in slices]
        self.bufs = (None if slices[0].buf is None
                     else [slice_view(local(s.buf), s) for s in slices])
        self.device = self.weights[0].device
        total = sum(s.numel for s in slices)
        self.kept = not whole and total <= piece_limit(opt, self.device)
        self.values = flat_buffer(opt, self.device, "values", total, self.kept)
        self.grads = flat_buffer(opt, self.device, "grads", total, self.kept)
        # the gradients' buffer is spare until they are copied in, and again after the step
        self.spare = spare_for(opt.master, self.grads, self.weights[0].dtype)
        opt.master.load_lists(self.values, self.weights, self.bufs, **self.spare)
        self.temps = list(_unflatten(self.values, self.weights))
        self.params = [self._placed(t, s) for t, s in zip(self.temps, slices)]
        views = _unflatten(self.grads, self.weights)
        dense = [(v, slice_view(local(s.grad), s)) for v, s in zip(views, slices)
                 if not s.grad.is_sparse]
        if dense:
            torch._foreach_copy_([v for v, _ in dense], [g for _, g in dense])
        self.sparse = []
        for temp, view, s in zip(self.params, views, slices):
            temp.grad = (s.grad.float().coalesce() if s.grad.is_sparse  # (rows summed in fp32,
                         else self._placed(view, s))                      # as fp32 masters')
            if s.grad.is_sparse:
                self.sparse.append(temp.grad)
        self._swap_in(saved)

    def show(self) -> None:
        """The fp32 values into the weights with torch's cast, for a re-evaluation (the
        buffers are left as they are: the store writes them after the step)."""
        torch._foreach_copy_(self.weights, self.temps)

    def reload_grads(self) -> None:
        """The gradients a re-evaluation made into the values' gradient buffers (a parameter
        it left without one reads zeros, as torch's LBFGS reads it)."""
        views = list(_unflatten(self.grads, self.weights))
        for view, temp, s in zip(views, self.params, self.slices):
            grad = s.param.grad
            if grad is None:
                view.zero_()
            else:
                view.copy_(slice_view(local(grad.to_dense() if grad.is_sparse else grad), s))
            if temp.grad is None or temp.grad.is_sparse:  # loaded sparse: now the dense view
                temp.grad = self._placed(view, s)

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
                    region = slice_view(local(value), s)
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
            flat = flat_buffer(self.opt, self.device, f"wide {key}",
                               sum(r.numel() for r in regions), self.kept)
            views = list(_unflatten(flat, regions))
            torch._foreach_copy_(views, regions)
            for (i, _), view in zip(found, views):
                view = self._placed(view, self.slices[i])
                state[self.params[i]][key] = self.given[i][key] = view
            self.wide[key] = (flat, [i for i, _ in found], regions)

    def store(self) -> None:
        """The values into the weights and buffers, the moments back, the state swapped out."""
        opt = self.opt
        keys = (self.keys[:, 0] + shifts(self.slices, positions(self.slices), 'cpu')
                if opt.master.draws_bits else None)
        opt.master.store_lists(self.values, self.weights, self.bufs, keys, **self.spare)
        state = opt.inner.state
        entries = [state.pop(temp) for temp in self.params]

        def column(i: int, key: str) -> int:  # of the name among the tensor's moments, sorted
            names = sorted(k for k, v in entries[i].items() if _moment(k, v, self.params[i]))
            return 1 + names.index(key) % (_KEYS - 1)

        for key, (flat, idx, regions) in self.wide.items():
            slices = [self.slices[i] for i in idx]
            shift = shifts(slices, positions(slices), 'cpu')
            _narrow(flat, regions, None if self.keys is None  # (fp32 moments: copied back)
                    else self.keys[idx, [column(i, key) for i in idx]] + shift)
        for i, (s, entry) in enumerate(zip(self.slices, entries)):
            held = state[s.param] if entry else {}  # no empty entry left behind
            for key, value in entry.items():
                if key in self.given[i] and self.given[i][key] is value:  # (None is a value
                    continue  # too: optimi keeps "kahan_comp": None, and re-makes what lacks it)
                if _moment(key, value, self.params[i]):  # made by this step: state dtype
                    bits = None if self.keys is None else self.keys[i, column(i, key)].view(1)
                    self._adopt(s, held, key, local(value), bits)
                else:
                    held[key] = self._owned(value)

    def _owned(self, value):
        """``value``, or a copy where it shares memory with the step scratch."""
        if torch.is_tensor(value) and self.kept and self.opt.scratch.holds(value):
            return value.clone()
        return value

    def _adopt(self, s: Slice, held: dict, key: str, value: torch.Tensor,
               key_bits: torch.Tensor | None) -> None:
        param, dtype = local(s.param), self.opt.state_dtype
        if not s.index and dtype == torch.float32 and value.stride() == param.stride():
            held[key] = like_shard(self._owned(value), s.param)
            return
        full = held.get(key)
        if full is None or not states.is_moment(key, full, s.param):
            full = held[key] = like_shard(torch.zeros_like(param, dtype=dtype), s.param)
        region = slice_view(local(full), s)
        _narrow(value.reshape(-1), [region],  # (no keys: fp32 moments, copied)
                None if key_bits is None else key_bits + shifts([s], [0], 'cpu'))


def draw_keys(opt, items: list[Slice]) -> torch.Tensor | None:
    """The step's rounding keys: :data:`_KEYS` per 16-bit parameter with a gradient (row
    ``item.row``), drawn from ``opt.rounding`` (one draw per step, whichever path steps); None,
    drawing nothing, where nothing rounds stochastically (an exact method with fp32 moments:
    its generator stays as it was, whether a step is applied or skipped on the device)."""
    if not items or (not opt.master.draws_bits and opt.state_dtype == torch.float32):
        return None
    return opt.rounding.draw(_KEYS * len(items), opt.salt).view(-1, _KEYS)


@torch.no_grad()
def step(opt, items: list[Slice], fp32_params: list[list[torch.Tensor]],
         grad_scale: torch.Tensor | None, inv: torch.Tensor | None,
         keys: torch.Tensor | None, closure=None) -> None:
    """Step ``opt`` (a :class:`~mixprec.optim.compact.CompactMasterOptimizer`) as the module
    docstring says.

    Args:
        items: the 16-bit parameters with gradients, whole (``row``: their place in order).
        fp32_params: per param group, its fp32 parameters (stepped as they are).
        grad_scale: the factor the gradients carry (a 0-d tensor), or None.
        inv: its reciprocal, or None.
        keys: :func:`draw_keys`'s.
        closure: ``(closure, loss)`` for an optimizer that calls its closure again inside its
            step (one piece holding everything; ``loss`` the evaluation before the step), or
            None.
    """
    inner = opt.inner
    whole = not is_per_parameter(inner)
    if whole:  # a global statistic: everything in one step
        _step_piece(opt, items, fp32_params, keys, grad_scale, inv, {}, whole, closure)
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


@torch.no_grad()
def step_own(opt, fp32_params: list[list[torch.Tensor]], keys, grad_scale, inv,
             found_inf: torch.Tensor | None = None) -> None:
    """The groups' fp32 parameters, through the inner optimizer's own step (which always runs,
    so schedulers and hooks see a step); ``found_inf`` goes to torch's fused kernel with
    ``grad_scale`` (given only where every tensor takes it: ``skips_on_device``)."""
    _step_piece(opt, [], fp32_params, keys, grad_scale, inv, {}, False, found_inf=found_inf)


def _step_piece(opt, piece, fp32_params, keys, grad_scale, inv, saved, whole,
                closure=None, found_inf=None) -> None:
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
            # on the CPU: the noise table is sliced at them
            rows = None if keys is None else keys[[s.row for s in slices]]
            runs.append(_Run(opt, slices, rows, saved, whole))
            for s, temp in zip(slices, runs[-1].params):
                lists[s.group].append(temp)
        if whole:  # an optimizer reading a group as one (LBFGS's flat vector): its order kept
            temp_of = {id(s.param): t for run in runs for s, t in zip(run.slices, run.params)}
            held = [{id(t) for t in ts} for ts in lists]
            lists = [[t for t in (temp_of.get(id(p), p) for p in group["params"]) if id(t) in ids]
                     for group, ids in zip(inner.param_groups, held)]
        tensors = [t for ts in lists for t in ts]
        fused = (opt.fused is not False and torch_fused_problem(inner, tensors) is None
                 and complete_momentum(inner, lists))
        if inv is not None and not fused:
            grads = [r.grads for r in runs] + [g for r in runs for g in r.sparse]
            unscale_(grads + [p.grad for p in own if p.grad is not None], inv)
        with opt.only(lists), states.fp32_moments(inner, own, opt.state_dtype, opt.rounding), \
                (torch_fused(inner) if fused else contextlib.nullcontext()), \
                amp_arguments(inner, grad_scale if fused else None, found_inf):
            opt.inner_step(None if closure is None else reevaluating(
                *closure, lambda: [run.show() for run in runs],
                lambda: [run.reload_grads() for run in runs]))
        for run in runs:
            run.store()
    finally:
        for run in runs:
            for temp in run.params:
                inner.state.pop(temp, None)
