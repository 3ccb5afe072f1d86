"""The fp32-master step on cached lists: torch's functional fused SGD/Adam/AdamW called straight
on each bucket's masters, the model's gradients widened into kept scratch, and the masters cast
back into the model, with the lists made once per change of the param groups (:class:`Piece`).

:func:`fused_bucket` steps a bucket so; a master larger than a piece steps a slice at a time
(:func:`_sliced_bucket`); bf16 moments are widened around the kernel and rounded back with the
keys the inner optimizer's step would draw. :func:`make_state` makes Adam's and AdamW's state
before a first step and :func:`state_ready` says when a bucket can take it here. Every bucket
steps bitwise as through the inner optimizer's own ``step`` (:mod:`.steps`), which takes over
wherever the lists do not apply.
"""

from __future__ import annotations

import itertools

import torch

from .. import kernel_table
from ..masters.rounding import BF16_NAN, TABLE_SIZE, round_into_lists
from ..scaling.unscale import unscale_
from . import hooks, kernels, states
from .params import is_master, valid_grad

__all__ = ["Piece", "plan", "make_state", "state_ready", "cached_lists_apply", "fused_bucket",
           "step_grad"]


def step_grad(t: torch.Tensor) -> torch.Tensor | None:
    """The gradient the step reads for ``t`` (a master's fp32 one if current, else its model
    parameter's), or None: ``t`` is not stepped."""
    if not is_master(t):
        return t.grad
    grad = valid_grad(t)
    return t.model_param.grad if grad is None else grad


class Piece:
    """One bucket's lists for torch's fused kernel, made once per change of the param groups:
    per param group (by index: its options are read at each step), its masters (a span of
    ``masters``), its fp32 tensors (``own``) and whether all are of one device and dtype; the
    masters' model parameters. ``ready`` once
    a step through the inner optimizer made the bucket's state (and put Adam's ``step`` on the
    parameters' device)."""

    __slots__ = ("key", "groups", "masters", "model", "ready")

    def __init__(self, key, groups, masters):
        self.key, self.groups, self.masters = key, groups, masters
        self.model = [m.model_param for m in masters]
        self.ready = False


def plan(opt) -> list[Piece | None]:
    """Per bucket of ``opt``, its :class:`Piece`, or None where torch's fused kernel can't step
    it (another optimizer type, a device or dtype without the kernel, an FSDP2 shard)."""
    fusable = type(opt.inner) in kernels.TORCH_FUSED_TYPES
    pieces: list[Piece | None] = []
    for i, bucket in enumerate(opt.buckets()):
        tensors = [t for ts in bucket for t in ts]
        if not fusable or kernels.torch_fused_problem(opt.inner, tensors, lambda t: None):
            pieces.append(None)
            continue
        groups, masters = [], []
        for index, ts in enumerate(bucket):  # by index: load_state_dict makes new group dicts
            ms = [t for t in ts if is_master(t)]
            groups.append((index, len(masters), len(masters) + len(ms),
                           [t for t in ts if not is_master(t)],
                           len({(t.device, t.dtype) for t in ts}) == 1))  # (kernels.fused_call)
            masters += ms
        pieces.append(Piece(i, groups, masters))
    return pieces


def make_state(opt) -> None:
    """Adam's and AdamW's state made in the state dtype before the first step that runs torch's
    fused kernel (:func:`.states.make_adam_state`), so that step runs on the cached lists too:
    torch's step would make bf16 moments in fp32 for every tensor at once, to be rounded into
    new tensors after it, a first step's peak of 4 bytes per parameter more than bf16 moments
    save."""
    inner = opt.inner
    if opt.fused != "auto" or type(inner) not in states.ADAMS:
        return
    for group in inner.param_groups:
        tensors = [t for t in group["params"] if step_grad(t) is not None]
        if tensors and kernels.torch_fused_problem(inner, tensors, step_grad) is None:
            states.make_adam_state(inner, group, tensors, opt.state_dtype)


def state_ready(opt, bucket: list[list[torch.Tensor]]) -> bool:
    """Every tensor of ``bucket`` with a gradient holds the state torch's fused Adam/AdamW
    reads, its ``step`` a float32 tensor on its device (made by :func:`make_state`, or loaded
    there), or, for SGD, every such tensor of a group has a momentum buffer or none has (torch's
    fused first step makes them): the bucket can step on its lists as the inner step would."""
    inner = opt.inner
    if type(inner) is torch.optim.SGD:  # buffers for every stepped tensor of a group, or none
        return all(len({"momentum_buffer" in dict.get(inner.state, t, ()) for t in tensors
                        if step_grad(t) is not None}) <= 1
                   for group, tensors in zip(inner.param_groups, bucket) if group["momentum"])
    for group, tensors in zip(inner.param_groups, bucket):
        names = kernels.functional_keys(type(inner), group)
        for t in tensors:
            if step_grad(t) is None:
                continue
            entry = dict.get(inner.state, t)  # (its own keys: not MasterState's mapping,
            step = entry.get("step") if entry else None  # a Python call per tensor)
            if (not torch.is_tensor(step) or step.dtype != torch.float32
                    or step.device != t.device or any(k not in entry for k in names)):
                return False
    return True


def cached_lists_apply(opt) -> bool:
    """The step may run on the cached lists: torch's fused kernels asked for, no keyword for
    the inner ``step``, no group option the fused kernels refuse."""
    return (opt.fused == "auto" and not opt.step_kwargs
            and not any(g.get("differentiable") or g.get("capturable") for g in opt.param_groups))


def fused_bucket(opt, piece: Piece, grad_scale, found_inf, inv) -> bool:
    """Step one bucket from its cached lists: widen the model's gradients into the kept
    scratch views (one ``_foreach_copy_``; a master's own fp32 gradient, made by
    ``unscale_grads_`` or a read of ``master.grad``, is read as it is), run torch's functional
    step of the inner optimizer's type (its fused kernel) per param group, and cast the masters
    into the model's parameters (one ``_foreach_copy_``). False, having changed nothing, where a
    gradient is sparse or some state is missing (the inner optimizer's own step makes it)."""
    sliced = _sliced_bucket(opt, piece, grad_scale, found_inf, inv)
    if sliced is not None:
        return sliced
    grads = ([step_grad(m) for m in piece.masters] if opt.held_grads()
             else [p.grad for p in piece.model])
    own = [[t.grad for t in ts] for *_, ts, _ in piece.groups]
    whole = True
    for g in itertools.chain(grads, *own):
        if g is None:
            whole = False
        elif g.is_sparse:
            return False
    views = opt.scratch.kept(piece.key, piece.masters)
    if views is None:
        return False
    if opt.held_grads():  # a master's own fp32 gradient is read where it is
        views = [g if g is not None and g.dtype == torch.float32 else v
                 for g, v in zip(grads, views)]
    wide = _widened_moments(opt, piece)
    if wide is None:
        return False
    calls = []
    try:
        for (index, start, end, ts, uniform), own_grads in zip(piece.groups, own):
            group = opt.param_groups[index]
            tensors = piece.masters[start:end] + ts
            step_grads = views[start:end] + own_grads
            if not whole:
                have = grads[start:end] + own_grads
                tensors, step_grads = _having(have, tensors), _having(have, step_grads)
            if tensors:
                calls.append(kernels.torch_functional(opt.inner, group, tensors, step_grads,
                                                      uniform))
        if opt.state_dtype != torch.float32 and not _all_fp32(calls):  # a moment not in the
            raise KeyError("moment")  # widened runs (a strided one: none was, wide is [])
    except KeyError:  # state not made yet
        states.unwiden(wide)
        return False
    masters, model = piece.masters, piece.model
    if not whole:
        views, masters, model = (_having(grads, ts) for ts in (views, masters, model))
        grads = _having(grads, grads)
    with torch.no_grad():
        if opt.held_grads():  # only the model's gradients are widened
            views_grads = [(v, g) for v, g in zip(views, grads) if v is not g]
            if views_grads:
                torch._foreach_copy_(*map(list, zip(*views_grads)))
        elif grads:
            torch._foreach_copy_(views, grads)
        if inv is not None:
            unscale_(views + [g for gs in own for g in gs if g is not None], inv)
        for call in calls:
            call(grad_scale=grad_scale, found_inf=found_inf)
        if model:
            torch._foreach_copy_(model, masters)
        if wide:  # no NaN pass: a NaN moment makes its master NaN (see .compact_lists)
            states._narrow_runs(opt.inner.state, wide, opt.rounding, None)
        _keep_made(opt, piece, calls)
    hooks.mark_stepped(opt.inner)
    return True


def _keep_made(opt, piece: Piece, calls: list) -> None:
    """The momentum buffers SGD's first step made into its calls' lists, kept in the state as
    torch's SGD keeps them, then stored in the state dtype as the inner step's
    :func:`.states.fp32_moments` stores moments a step made (the same keys, in bucket order)."""
    inner = opt.inner
    if type(inner) is not torch.optim.SGD:
        return
    made = [(t, b) for call in calls if call.keywords["momentum"]
            for t, b in zip(call.args[0], call.args[2]) if "momentum_buffer" not in inner.state[t]]
    for t, buf in made:
        inner.state[t]["momentum_buffer"] = buf
    if made and opt.state_dtype != torch.float32:
        for t in (t for ts in opt.buckets()[piece.key] for t in ts):
            if t in inner.state:
                states.cast_moments(inner.state[t], t, opt.state_dtype, opt.rounding)


def _sliced_bucket(opt, piece: Piece, grad_scale, found_inf, inv) -> bool | None:
    """A bucket of one master larger than a piece (the kernel table's
    :meth:`~mixprec.kernel_table.KernelTable.step_piece` elements for its device, contiguous),
    stepped from its lists a slice at a time, so its transient fp32 buffers are a slice's, not
    the tensor's: per slice the gradient widened into the kept scratch (and bf16 moments beside
    it), torch's functional fused step on the slices (each with a copy of Adam's ``step``,
    written back once), the slice cast into the model. The same bits as the whole tensor
    stepped at once: the kernel is element-wise, and a bf16 moment's slice rounds with the key
    of its place in the tensor (the keys drawn as the inner step draws them). None where this
    does not apply (:func:`fused_bucket` steps the bucket whole); False where state is missing."""
    if len(piece.masters) != 1 or piece.groups[0][3]:
        return None
    master, param = piece.masters[0], piece.model[0]
    limit = kernel_table.TABLE.step_piece(master.device.type, opt.elements)
    grad = step_grad(master)
    if (master.numel() <= limit or not master.is_contiguous() or not param.is_contiguous()
            or (grad is not None and (grad.is_sparse or not grad.is_contiguous()))):
        return None
    inner, group = opt.inner, opt.param_groups[piece.groups[0][0]]
    names = kernels.functional_keys(type(inner), group)
    adam = type(inner) is not torch.optim.SGD
    state = inner.state.get(master, {})
    dtype = opt.state_dtype
    moments = [state.get(k) for k in names]
    if not adam and names and moments[0] is None:  # SGD's first step: torch makes the buffer
        if found_inf is not None:
            return False
        return _first_sgd_slices(opt, master, param, grad, limit, group, grad_scale, inv)
    if (any(m is None or m.shape != master.shape or not m.is_contiguous() or m.dtype != dtype
            for m in moments) or (adam and not torch.is_tensor(state.get("step")))):
        return False
    wide = dtype != torch.float32
    keys = {}
    if wide:  # one key per moment, in the state's order, as the inner step draws them
        for k in [k for k, v in state.items() if states.is_moment(k, v, master)]:
            keys[k] = int(opt.rounding.draw(1, salt=1)[0])
    if grad is None:
        return True
    flat = opt.scratch.take(master.device, "grads", limit * (1 + len(names) * wide))
    step = state.get("step")
    steps = []
    with torch.no_grad():
        for start in range(0, master.numel(), limit):
            stop = min(master.numel(), start + limit)
            size = stop - start
            g = flat[:size]
            g.copy_(grad.view(-1)[start:stop])
            if inv is not None:
                unscale_([g], inv)
            parts = [m.view(-1)[start:stop] for m in moments]
            held = parts
            if wide:
                held = [flat[(1 + i) * limit:(1 + i) * limit + size] for i in range(len(parts))]
                torch._foreach_copy_(held, parts)
            steps = [step.clone()] if adam else []
            kernels.fused_call(type(inner), group, [master.view(-1)[start:stop]], [g],
                               {k: [h] for k, h in zip(names, held)}, steps, True)(
                grad_scale=grad_scale, found_inf=found_inf)
            param.view(-1)[start:stop].copy_(master.view(-1)[start:stop])
            for k, h, part in zip(names, held, parts) if wide else ():
                shifted = torch.tensor([(keys[k] + start) % TABLE_SIZE], dtype=torch.int32)
                round_into_lists(h, [part], shifted, None)  # no NaN pass, as fused_bucket
        if steps:
            step.copy_(steps[0])
    hooks.mark_stepped(inner)
    return True


def _first_sgd_slices(opt, master, param, grad, limit: int, group: dict, grad_scale,
                      inv) -> bool:
    """SGD's first step of a master larger than a piece, a slice at a time: per slice torch's
    functional fused step makes the momentum buffer of the slice (its first step: the
    gradient), which goes into the tensor's buffer, in the state dtype (bf16: rounded with one
    key, drawn as the inner step's :func:`.states.fp32_moments` draws it, shifted by the
    slice's place: the bits of the whole tensor rounded at once)."""
    if grad is None:
        return True
    dtype = opt.state_dtype
    full = torch.empty(master.shape, dtype=dtype, device=master.device)
    key = None if dtype == torch.float32 else int(opt.rounding.draw(1, salt=1)[0])
    flat = opt.scratch.take(master.device, "grads", limit)
    with torch.no_grad():
        for start in range(0, master.numel(), limit):
            stop = min(master.numel(), start + limit)
            g = flat[:stop - start]
            g.copy_(grad.view(-1)[start:stop])
            if inv is not None:
                unscale_([g], inv)
            made = [None]
            kernels.fused_call(torch.optim.SGD, group, [master.view(-1)[start:stop]], [g],
                               {"momentum_buffer": made}, [], True)(grad_scale=grad_scale,
                                                                    found_inf=None)
            param.view(-1)[start:stop].copy_(master.view(-1)[start:stop])
            if key is None:
                full.view(-1)[start:stop].copy_(made[0])
            else:
                shifted = torch.tensor([(key + start) % TABLE_SIZE], dtype=torch.int32)
                round_into_lists(made[0], [full.view(-1)[start:stop]], shifted, BF16_NAN)
    opt.inner.state[master]["momentum_buffer"] = full
    hooks.mark_stepped(opt.inner)
    return True


def _widened_moments(opt, piece: Piece) -> list | None:
    """With bf16 moments, the bucket's moments widened into fp32 buffers standing in for them
    in the state (:func:`.states._widen_runs`, over the bucket's tensors as the inner step's
    ``fp32_moments`` widens them: the same rounding keys after the step); [] with fp32
    moments; None where a master holds other state (its Adam ``step``... not made yet)."""
    if opt.state_dtype == torch.float32:
        return []
    tensors = [t for ts in opt.buckets()[piece.key] for t in ts]  # in the inner step's order
    return states._widen_runs(opt.inner.state, tensors, opt.state_dtype, opt.scratch.take)


def _all_fp32(calls: list) -> bool:
    """Every moment list the functional calls read holds fp32 tensors (widened views)."""
    return all(v is None or v.dtype == torch.float32 for call in calls
               for value in call.args[2:] for v in value)


def _having(grads: list, tensors: list) -> list:
    """The entries of ``tensors`` whose gradient in ``grads`` is not None."""
    return [t for t, g in zip(tensors, grads) if g is not None]
