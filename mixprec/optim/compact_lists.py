"""The compact step on cached lists: torch's functional fused SGD/Adam/AdamW called straight on
each piece's fp32 values, gradients and moments.

The step of :mod:`.family` runs the inner optimizer's own ``step()`` over each piece: a state
dict swapped in per value, torch's grouping of the tensors, the state swapped out again, all
Python work per tensor per step. For torch's ``SGD``, ``Adam`` and ``AdamW`` (options that
torch's fused kernel takes: no ``amsgrad``, ``maximize``, ``capturable`` or ``differentiable``;
a device and dtype with the kernel; every moment and Adam's ``step`` made by an earlier step),
what that ``step()`` runs is torch's functional ``sgd``/``adam`` with ``fused=True`` on lists
(:func:`mixprec.optim.kernels.fused_call`). :class:`Plan` makes those lists once per layout:
per piece, the views of the weights, buffers and moments it reads, views of the step scratch
(:class:`.buckets.Scratch`) for the values, gradients and widened moments, the rounding keys'
rows and shifts. Each step then loads, calls torch's kernel per param group, and stores, with
the same rounding keys, in the same order, on the same values as :func:`.family.step`: bit for
bit the same result, a NaN moment aside. bf16 moments are rounded back without the pass that
keeps a NaN one NaN: in torch's SGD, Adam and AdamW a moment that is NaN after a step makes
that step's update of the weight NaN (``param -= lr * m / (sqrt(v) + eps)``; ``param -= lr *
buf``), and a weight is always stored NaN-safe, so the model shows the NaN whatever its moment
is rounded to (a carry out of a NaN's low half can make
it an infinity or a zero). The step through :func:`.family.step`, which serves any optimizer,
keeps the pass.

A plan holds while the layout does: the same parameters with gradients in the same groups, the
same state tensors, buffers and group options. Anything else (a first step, a parameter without
a gradient this step, ``add_param_group``, ``load_state_dict``, a sparse gradient, another
optimizer) steps through :func:`.family.step`, and a plan for the new layout is made after it.
"""

from __future__ import annotations

import torch

from ..shards import is_dtensor, local
from . import kernels
from .family import _KEYS, _moment, _narrow, _unflatten
from .pieces import Slice, positions, shifts, slice_view, spare_for
from .pieces import cut as cut_pieces
from .states import ADAMS, OWN_KEYS, make_adam_state

__all__ = ["Plan", "step", "prepare", "make_state"]


class _Wide:
    """The moments of one key that are not fp32 and contiguous: widened into the step scratch."""

    __slots__ = ("flat", "views", "regions", "rows", "cols", "shift")

    def __init__(self, flat, regions, rows, cols, shift):
        self.flat, self.regions = flat, regions
        self.views = list(_unflatten(flat, regions))
        self.rows, self.cols, self.shift = rows, cols, shift


class _Piece:
    """One piece's lists (see the module docstring)."""

    def __init__(self, opt, slices: list[Slice], names: list[tuple], steps: dict) -> None:
        state, device = opt.inner.state, local(slices[0].param).device
        self.slices = [s._replace(grad=None) for s in slices]  # not this step's gradients
        self.weights = [slice_view(local(s.param), s) for s in slices]
        self.bufs = None if slices[0].buf is None else [slice_view(local(s.buf), s) for s in slices]
        total = sum(s.numel for s in slices)
        self.values = opt.scratch.take(device, "values", total)
        temps = list(_unflatten(self.values, self.weights))
        self.grads = opt.scratch.take(device, "grads", total)
        self.grad_views = list(_unflatten(self.grads, self.weights))
        self.rows = torch.tensor([s.row for s in slices], dtype=torch.long)
        # gradients read as they are: whole tensors, no FSDP2 shard
        self.plain = not any(s.index or is_dtensor(s.param) for s in slices)
        self.shift = shifts(slices, positions(slices), 'cpu')
        moments: list[dict] = []
        wide: dict[str, list] = {}
        for i, s in enumerate(slices):
            entry, held = state.get(s.param, {}), {}
            for key in names[s.group]:
                region = slice_view(local(entry[key]), s)
                if region.dtype == torch.float32 and region.is_contiguous():
                    held[key] = region
                else:
                    wide.setdefault(key, []).append((i, region))
            moments.append(held)
        self.wide = []
        for key, found in wide.items():
            regions = [r for _, r in found]
            if len({r.dtype for r in regions}) > 1:
                raise _NoPlan
            some = [slices[i] for i, _ in found]
            column = 1 + sorted(names[slices[found[0][0]].group]).index(key) % (_KEYS - 1)
            flat = opt.scratch.take(device, f"wide {key}", sum(r.numel() for r in regions))
            self.wide.append(_Wide(flat, regions, torch.tensor([s.row for s in some]),
                                   torch.full((len(some),), column),
                                   shifts(some, positions(some), 'cpu')))
            for (i, _), view in zip(found, self.wide[-1].views):
                moments[i][key] = view
        self.calls = []  # per param group with slices here: its lists for torch's kernel
        for g, keys in enumerate(names):
            idx = [i for i, s in enumerate(slices) if s.group == g]
            if idx:
                self.calls.append((g, [temps[i] for i in idx], [self.grad_views[i] for i in idx],
                                   {k: [moments[i][k] for i in idx] for k in keys},
                                   [steps[s.row, s.start] for s in (slices[i] for i in idx)]
                                   if steps else []))

    def step(self, opt, items: list[Slice], keys: torch.Tensor, grad_scale, found_inf) -> None:
        method, kind, groups = opt.master, type(opt.inner), opt.inner.param_groups
        spare = spare_for(method, self.grads, self.weights[0].dtype)  # until the
        method.load_lists(self.values, self.weights, self.bufs, **spare)  # gradients are in
        torch._foreach_copy_(self.grad_views, [items[s.row].grad for s in self.slices]
                             if self.plain else
                             [slice_view(local(items[s.row].grad), s) for s in self.slices])
        for w in self.wide:
            torch._foreach_copy_(w.views, w.regions)
        for g, params, grads, moments, steps in self.calls:
            kernels.fused_call(kind, groups[g], params, grads, moments, steps, True)(
                grad_scale=grad_scale, found_inf=found_inf)
        method.store_lists(self.values, self.weights, self.bufs,
                           keys[self.rows, 0] + self.shift if method.draws_bits else None,
                           **spare)  # the step read the gradients
        for w in self.wide:  # no NaN pass: a moment's NaN makes the weight's (module docstring)
            _narrow(w.flat, w.regions, None if keys is None else keys[w.rows, w.cols] + w.shift,
                    None)  # (no keys: fp32 moments, copied back)


class _NoPlan(Exception):
    """The layout is not one the lists can step (the generic step keeps stepping it)."""


class Plan:
    """The lists of every piece of a layout (see the module docstring), and what it checks
    before each step that the layout still holds."""

    def __init__(self, opt, items: list[Slice]) -> None:
        inner = opt.inner
        self.names = _names(opt)
        self.records = []  # per item: what must be the same for the lists to hold
        steps, self.cut_steps = {}, {}
        _size_scratch(opt, [list(p) for p in cut_pieces(opt, items)], self.names)
        for version in range(2):  # a second time when the scratch grew while it was made
            self.version = opt.scratch.version
            pieces = [list(p) for p in cut_pieces(opt, items)]
            slices_of: dict[int, list[Slice]] = {}
            for piece in pieces:
                if kernels.torch_fused_problem(inner, [self.probe(opt, piece)]) is not None:
                    raise _NoPlan
                for s in piece:
                    slices_of.setdefault(s.row, []).append(s)
            if version == 0:
                self.records = [self._record(opt, item, slices_of[item.row], steps)
                                for item in items]
            self.pieces = [_Piece(opt, piece, self.names, steps) for piece in pieces]
            if opt.scratch.version == self.version:
                return
        raise _NoPlan  # not reached: the buffers have their size the second time

    @staticmethod
    def probe(opt, piece: list[Slice]) -> torch.Tensor:
        """A tensor standing for the piece's fp32 values (what torch's kernel steps)."""
        return torch.empty(0, device=local(piece[0].param).device)

    def _record(self, opt, item: Slice, slices: list[Slice], steps: dict) -> tuple:
        state = opt.inner.state
        entry = state.get(item.param)
        keys = self.names[item.group]
        expected = set(keys)
        adam = type(opt.inner) is not torch.optim.SGD
        if adam:
            expected.add("step")
        found = {k for k in (entry or {}) if k not in OWN_KEYS}
        if item.grad.is_sparse or found != expected:
            raise _NoPlan
        if any(not _moment(k, entry[k], item.param) for k in keys):
            raise _NoPlan
        pairs = tuple((k, entry[k]) for k in sorted(expected))
        if adam:
            public = entry["step"]
            if (not torch.is_tensor(public) or public.dim() or public.dtype != torch.float32
                    or public.device != local(item.param).device):
                raise _NoPlan
            for s in slices:  # a slice of a cut tensor steps a copy, written back once
                steps[s.row, s.start] = public.clone() if s.index else public
            if slices[0].index:
                self.cut_steps[id(public)] = (public, [steps[s.row, s.start] for s in slices])
        flat = any(s.flat for s in slices)
        where = local(item.param).data_ptr()  # the views are of this storage
        return item.param, item.group, item.buf, entry, pairs, flat, where

    def holds(self, opt, items: list[Slice]) -> bool:
        """True when the layout is the one the lists were made for."""
        if (opt.fused is False or getattr(opt, "step_kwargs", None)
                or opt.scratch.version != self.version or len(items) != len(self.records)
                or _names(opt) != self.names):
            return False
        state = opt.inner.state
        for s, (param, group, buf, entry, pairs, flat, where) in zip(items, self.records):
            if (s.param is not param or s.group != group or s.buf is not buf
                    or s.grad.is_sparse or (flat and not s.grad.is_contiguous())
                    or state.get(param) is not entry or local(param).data_ptr() != where):
                return False  # (a .data assignment gave the weight new storage)
            for key, value in pairs:
                if entry.get(key) is not value:
                    return False
        return True

    def step(self, opt, items: list[Slice], keys: torch.Tensor, grad_scale, found_inf) -> None:
        cut = list(self.cut_steps.values())
        if cut:  # each slice's step from the tensor's
            torch._foreach_copy_([c for _, cs in cut for c in cs],
                                 [p for p, cs in cut for _ in cs])
        for piece in self.pieces:
            piece.step(opt, items, keys, grad_scale, found_inf)
        if cut:
            torch._foreach_copy_([p for p, _ in cut], [cs[-1] for _, cs in cut])


def _size_scratch(opt, pieces: list[list[Slice]], names: list[tuple]) -> None:
    """Grow the scratch to the largest piece of each device before any piece's views are made
    (grown piece by piece, every smaller buffer would stay alive until the views are made
    again: a first step's peak); widened moments' too where the state dtype is not fp32."""
    largest: dict[torch.device, int] = {}
    for piece in pieces:
        device = local(piece[0].param).device
        largest[device] = max(largest.get(device, 0), sum(s.numel for s in piece))
    uses = ["values", "grads"]
    if opt.state_dtype != torch.float32:
        uses += [f"wide {key}" for key in sorted({k for keys in names for k in keys})]
    for device, numel in largest.items():
        for use in uses:
            opt.scratch.take(device, use, numel)


def _names(opt) -> list[tuple] | None:
    """Per param group, the moment keys torch's functional step reads; None where the lists
    can't step ``opt``'s inner optimizer (another type; an option torch's fused kernel or the
    lists refuse)."""
    inner = opt.inner
    if not kernels.is_compilable(inner):  # SGD/Adam/AdamW without the options the lists skip
        return None
    if kernels.torch_fused_problem(inner, ()) is not None:
        return None
    return [kernels.functional_keys(type(inner), g) for g in inner.param_groups]


@torch.no_grad()
def step(opt, items: list[Slice], keys: torch.Tensor | None, grad_scale,
         found_inf: torch.Tensor | None = None) -> bool:
    """Step ``opt``'s 16-bit parameters on its cached lists where they hold (True); False,
    having changed nothing, where they don't. ``found_inf``: the overflow flag torch's kernel
    skips on (for a method whose store gives back what its load read: ``skips_on_device``)."""
    plan = opt.lists
    if plan is None or not items or not plan.holds(opt, items):
        return False
    plan.step(opt, items, keys, grad_scale, found_inf)
    return True


@torch.no_grad()
def make_state(opt, items: list[Slice]) -> bool:
    """Adam's and AdamW's state for the parameters in ``items`` that have none yet
    (:func:`.states.make_adam_state`, in the state dtype): the first step then runs on the lists
    too. Other optimizers make their state in their own first step (SGD's momentum buffer starts
    as the first gradient). True when it made some."""
    inner = opt.inner
    if type(inner) not in ADAMS or opt.fused is False or _names(opt) is None:
        return False
    made = False
    for g, group in enumerate(inner.param_groups):
        tensors = [s.param for s in items if s.group == g]
        made = make_adam_state(inner, group, tensors, opt.state_dtype) or made
    return made


def prepare(opt, items: list[Slice]) -> None:
    """After a step through :func:`.family.step`: the lists for this layout, where they can
    step it (else None)."""
    opt.lists = None
    if not items or _names(opt) is None or opt.fused is False:
        return
    try:
        opt.lists = Plan(opt, items)
    except (_NoPlan, KeyError):
        opt.lists = None
