"""The master optimizer's two step paths: bucketed (default: each bucket from its cached lists
through torch's fused kernel, else through the inner optimizer's own ``step``) and compiled.

A closure runs before either (making the gradients the step reads); an inner optimizer that
calls it again inside its step (LBFGS: one bucket) gets :func:`again`'s, which shows the model
the current masters before each re-evaluation.

Each path reads, for every master, its fp32 gradient if one is held and current (made by
``unscale_grads_`` or by someone reading ``master.grad``; see :mod:`mixprec.optim.params`), else
its model parameter's gradient; divides what it reads by ``grad_scale`` when the gradients still
carry a loss scale; steps the inner optimizer on the masters; and writes the masters back into the
model parameters with torch's cast (round to nearest, ties to even). fp32 parameters in the groups
are their own masters: their gradients are unscaled in place.

Where a bucket runs torch's fused kernel, the loss scale is handed to it (``grad_scale``: it
divides each gradient as it reads it, and writes the quotient back), and so is a scaler's
overflow flag (``found_inf``: the kernel skips on the device and takes back its step count), as
``torch.amp.GradScaler`` hands them to a fused optimizer: no unscale pass and no host read.
:func:`skips_on_device` says when a whole step can take the flag.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import Any

import torch

from .. import kernel_table
from ..masters.rounding import TABLE_SIZE, round_into_lists
from ..scaling.unscale import unscale_
from ..shards import is_dtensor
from . import hooks, kernels, pieces, states
from .params import derive_grad, drop_grad, is_master, set_grad, valid_grad

__all__ = ["bucketed_step", "compiled_step", "again", "skips_on_device", "folds_scale",
           "settle_grads", "amp_arguments"]


def _step_grad(t: torch.Tensor) -> torch.Tensor | None:
    """The gradient the step reads for ``t`` (a master's fp32 one if current, else its model
    parameter's), or None: ``t`` is not stepped."""
    if not is_master(t):
        return t.grad
    grad = valid_grad(t)
    return t.model_param.grad if grad is None else grad


def device_plan(opt) -> tuple[bool, bool]:
    """``(folds, ready)`` for master optimizer ``opt``, in one pass over its tensors: ``folds``,
    the step hands the loss scale to torch's fused kernel for every tensor (``fused="auto"``, a
    fused kernel for every tensor's device and dtype, no sparse gradient, no FSDP2 shard: those
    are unscaled apart, as before); ``ready``, every tensor the step reads a gradient for already
    has its optimizer state (Adam's ``step``; SGD's ``momentum_buffer`` when it has momentum)."""
    inner = opt.inner
    if opt.fused != "auto" or kernels.torch_fused_problem(inner, ()) is not None:
        return False, False
    table, fused_ok = kernel_table.TABLE, {}
    state, ready = inner.state, True
    sgd = type(inner) is torch.optim.SGD
    for group in inner.param_groups:
        key = ("momentum_buffer" if group["momentum"] else None) if sgd else "step"
        for t in group["params"]:
            kind = (t.device.type, t.dtype)
            ok = fused_ok.get(kind)
            if ok is None:
                ok = fused_ok[kind] = table.fused_optimizer(*kind)
            if not ok or is_dtensor(t):
                return False, False
            grad = _step_grad(t)
            if grad is None:
                continue
            if grad.is_sparse:
                return False, False
            if ready and key is not None and key not in state.get(t, ()):
                ready = False
    return True, ready


def folds_scale(opt) -> bool:
    """True when the step hands the loss scale to torch's fused kernel (``grad_scale``: it
    divides each gradient by it) for every tensor, rather than multiplying the gradients by its
    inverse first (see :func:`device_plan`)."""
    return device_plan(opt)[0]


def skips_on_device(opt) -> bool:
    """True when the next ``step(found_inf=...)`` of master optimizer ``opt`` can skip on the
    device: the loss scale folds into torch's fused kernels and every stepped tensor already has
    its optimizer state (:func:`device_plan`: a first step would make it: torch's fused SGD
    starts its momentum buffers as ``empty_like``, and Adam's state would appear on a skipped
    step), fp32 moments (bf16 ones are rounded stochastically, which would draw bits on a
    skipped step), no step hooks (they must not run on a skipped step), and no caller that
    tells a skipped step by ``step()`` not being called (``opt.skip_on_device = False``, set by
    the Accelerate seam: Accelerate's optimizer reports such a step as skipped)."""
    if not getattr(opt, "skip_on_device", True):
        return False
    if opt.state_dtype != torch.float32 or hooks.has_step_hooks(opt):
        return False
    folds, ready = device_plan(opt)
    return folds and ready


def settle_grads(opt, grad_scale: torch.Tensor) -> torch.Tensor:
    """Make ``opt``'s fp32 gradients as ``step(grad_scale=...)`` reads them (the model's read as
    them, rounded) and return the 0-d inf/NaN flag: divided by ``grad_scale`` where the step
    folds it into torch's kernel (:func:`folds_scale`), else times its inverse, so a clip
    applied before the step (``LossScaler.settle_``) steps bitwise as one inside it."""
    inv = grad_scale.reciprocal()
    if not folds_scale(opt):
        return opt.unscale_grads_(inv)
    found = opt.unscale_grads_(None)
    masters = [t for g in opt.param_groups for t in g["params"] if is_master(t)]
    made = [(t, g) for t, g in ((t, valid_grad(t)) for t in masters) if g is not None]
    own = [t.grad for g in opt.param_groups for t in g["params"]
           if not is_master(t) and t.grad is not None]
    with torch.no_grad():
        for tensors in _by_device([g for _, g in made] + own).values():
            torch._foreach_div_(tensors, grad_scale.to(tensors[0].device))
        unscale_([t.model_param.grad for t, _ in made], inv)
    for t, grad in made:  # the model gradients changed version: made from them still
        set_grad(t, grad)
    return found


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


class Piece:
    """One bucket's lists for torch's fused kernel, made once per change of the param groups:
    per param group (by index: its options are read at each step), its masters (a span of
    ``masters``) and its fp32 tensors (``own``); the masters' model parameters. ``ready`` once
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
                           [t for t in ts if not is_master(t)]))
            masters += ms
        pieces.append(Piece(i, groups, masters))
    return pieces


def bucketed_step(opt, grad_scale: torch.Tensor | None,
                  found_inf: torch.Tensor | None = None, closure=None) -> None:
    """Step the masters bucket by bucket (one bucket unless the inner optimizer is
    per-parameter; see :mod:`mixprec.optim.buckets`): each through torch's fused kernel on its
    cached lists (:func:`fused_bucket`) where it can, else through the inner optimizer's own
    ``step`` (:func:`_step_bucket`)."""
    # one rule for all buckets (and settle_grads); a found_inf the step took implies it
    folds = grad_scale is not None and (found_inf is not None or folds_scale(opt))
    inv = None if folds or grad_scale is None else grad_scale.reciprocal()
    scale = grad_scale if folds else None
    buckets = opt.buckets()
    lists = closure is None and _cached_lists_apply(opt)
    pieces = opt.pieces if lists else [None] * len(buckets)
    if not all(p is not None and p.ready for p in opt.pieces):  # a first step, after a load
        _make_state(opt)
        for bucket, piece in zip(buckets, pieces):
            if piece is not None and not piece.ready:
                piece.ready = _state_ready(opt, bucket)
    try:
        for bucket, piece in zip(buckets, pieces):
            if piece is None or not piece.ready or not fused_bucket(opt, piece, scale,
                                                                    found_inf, inv):
                fused = _step_bucket(opt, bucket, scale, found_inf, inv, len(buckets) == 1,
                                     closure)
                if piece is not None:
                    piece.ready = fused
    finally:
        opt.scratch.release()  # transient: the fp32 gradients do not outlive the step
        opt.drop_master_grads()


def _make_state(opt) -> None:
    """Adam's and AdamW's state made in the state dtype before the first step that runs torch's
    fused kernel (:func:`.states.make_adam_state`), so that step runs on the cached lists too:
    torch's step would make bf16 moments in fp32 for every tensor at once, to be rounded into
    new tensors after it, a first step's peak of 4 bytes per parameter more than bf16 moments
    save."""
    inner = opt.inner
    if opt.fused != "auto" or type(inner) not in states.ADAMS:
        return
    for group in inner.param_groups:
        tensors = [t for t in group["params"] if _step_grad(t) is not None]
        if tensors and kernels.torch_fused_problem(inner, tensors, _step_grad) is None:
            states.make_adam_state(inner, group, tensors, opt.state_dtype)


def _state_ready(opt, bucket: list[list[torch.Tensor]]) -> bool:
    """Every tensor of ``bucket`` with a gradient holds the state torch's fused Adam/AdamW
    reads, its ``step`` a float32 tensor on its device (made by :func:`_make_state`, or loaded
    there): the bucket can step on its lists without the inner step making or moving any."""
    inner = opt.inner
    if type(inner) not in states.ADAMS:  # SGD's momentum buffers start as a first gradient
        return False
    for group, tensors in zip(inner.param_groups, bucket):
        names = kernels.functional_keys(type(inner), group)
        for t in tensors:
            if _step_grad(t) is None:
                continue
            entry = inner.state.get(t)
            step = entry.get("step") if entry else None
            if (not torch.is_tensor(step) or step.dtype != torch.float32
                    or step.device != t.device or any(k not in entry for k in names)):
                return False
    return True


def _cached_lists_apply(opt) -> bool:
    """The step may read the model's gradients straight from the cached lists: torch's fused
    kernels asked for, no master holding an fp32 gradient of its own, no keyword for the inner
    ``step``, no group option the fused kernels refuse."""
    return (opt.fused == "auto" and not opt.held_grads()
            and not opt.step_kwargs
            and not any(g.get("differentiable") or g.get("capturable") for g in opt.param_groups))


def fused_bucket(opt, piece: Piece, grad_scale, found_inf, inv) -> bool:
    """Step one bucket from its cached lists: widen the model's gradients into the kept
    scratch views (one ``_foreach_copy_``), run torch's functional step of the inner optimizer's
    type (its fused kernel) per param group, and cast the masters into the model's parameters
    (one ``_foreach_copy_``). False, having changed nothing, where a gradient is sparse or some
    state is missing (the inner optimizer's own step makes it)."""
    sliced = _sliced_bucket(opt, piece, grad_scale, found_inf, inv)
    if sliced is not None:
        return sliced
    grads = [p.grad for p in piece.model]
    own = [[t.grad for t in ts] for *_, ts in piece.groups]
    whole = True
    for g in itertools.chain(grads, *own):
        if g is None:
            whole = False
        elif g.is_sparse:
            return False
    views = opt.scratch.kept(piece.key, piece.masters)
    if views is None:
        return False
    wide = _widened_moments(opt, piece)
    if wide is None:
        return False
    calls = []
    try:
        for (index, start, end, ts), own_grads in zip(piece.groups, own):
            group = opt.param_groups[index]
            tensors = piece.masters[start:end] + ts
            step_grads = views[start:end] + own_grads
            if not whole:
                have = grads[start:end] + own_grads
                tensors, step_grads = _having(have, tensors), _having(have, step_grads)
            if tensors:
                calls.append(kernels.torch_functional(opt.inner, group, tensors, step_grads))
        if wide and not _all_fp32(calls):  # a moment not in the widened runs
            raise KeyError("moment")
    except KeyError:  # state not made yet
        states.unwiden(wide)
        return False
    masters, model = piece.masters, piece.model
    if not whole:
        views, masters, model = (_having(grads, ts) for ts in (views, masters, model))
        grads = _having(grads, grads)
    with torch.no_grad():
        if grads:
            torch._foreach_copy_(views, grads)
        if inv is not None:
            unscale_(views + [g for gs in own for g in gs if g is not None], inv)
        for call in calls:
            call(grad_scale=grad_scale, found_inf=found_inf)
        if model:
            torch._foreach_copy_(model, masters)
        if wide:  # no NaN pass: a NaN moment makes its master NaN (see .compact_lists)
            states._narrow_runs(opt.inner.state, wide, opt.rounding, None)
    hooks.mark_stepped(opt.inner)
    return True


def _sliced_bucket(opt, piece: Piece, grad_scale, found_inf, inv) -> bool | None:
    """A bucket of one master larger than a piece (:data:`.pieces.PIECE` elements, contiguous),
    stepped from its lists a slice at a time, so its transient fp32 buffers are a slice's, not
    the tensor's: per slice the gradient widened into the kept scratch (and bf16 moments beside
    it), torch's functional fused step on the slices (each with a copy of Adam's ``step``,
    written back once), the slice cast into the model. The same bits as the whole tensor
    stepped at once: the kernel is element-wise, and a bf16 moment's slice rounds with the key
    of its place in the tensor (the keys drawn as the inner step draws them). None where this
    does not apply (:func:`fused_bucket` steps the bucket whole); False where state is missing."""
    limit = pieces.PIECE
    if len(piece.masters) != 1 or piece.groups[0][3]:
        return None
    master, param = piece.masters[0], piece.model[0]
    grad = param.grad
    if (master.numel() <= limit or not master.is_contiguous() or not param.is_contiguous()
            or (grad is not None and (grad.is_sparse or not grad.is_contiguous()))):
        return None
    inner, group = opt.inner, opt.param_groups[piece.groups[0][0]]
    names = kernels.functional_keys(type(inner), group)
    adam = type(inner) is not torch.optim.SGD
    state = inner.state.get(master, {})
    dtype = opt.state_dtype
    moments = [state.get(k) for k in names]
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
    flat = opt.scratch.flat(master.device, limit * (1 + len(names) * wide))
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
                               {k: [h] for k, h in zip(names, held)}, steps)(
                grad_scale=grad_scale, found_inf=found_inf)
            param.view(-1)[start:stop].copy_(master.view(-1)[start:stop])
            for k, h, part in zip(names, held, parts) if wide else ():
                shifted = torch.tensor([(keys[k] + start) % TABLE_SIZE], dtype=torch.int32)
                round_into_lists(h, [part], shifted, None)  # no NaN pass, as fused_bucket
        if steps:
            step.copy_(steps[0])
    hooks.mark_stepped(inner)
    return True


def _widened_moments(opt, piece: Piece) -> list | None:
    """With bf16 moments, the bucket's moments widened into fp32 buffers standing in for them
    in the state (:func:`.states._widen_runs`, over the bucket's tensors as the inner step's
    ``fp32_moments`` widens them: the same rounding keys after the step); [] with fp32
    moments; None where a master holds other state (its Adam ``step``... not made yet)."""
    if opt.state_dtype == torch.float32:
        return []
    tensors = [t for ts in opt.buckets()[piece.key] for t in ts]  # in the inner step's order
    return states._widen_runs(opt.inner.state, tensors, opt.state_dtype)


def _all_fp32(calls: list) -> bool:
    """Every moment list the functional calls read holds fp32 tensors (widened views)."""
    return all(v is None or v.dtype == torch.float32 for call in calls
               for value in call.args[2:] for v in value)


def _having(grads: list, tensors: list) -> list:
    """The entries of ``tensors`` whose gradient in ``grads`` is not None."""
    return [t for t, g in zip(tensors, grads) if g is not None]


def _step_bucket(opt, bucket: list[list[torch.Tensor]], grad_scale, found_inf, inv,
                 alone: bool, closure=None) -> bool:
    """Step one bucket through the inner optimizer's ``step``: the kernel divides by
    ``grad_scale`` (folded) or the gradients are multiplied by ``inv`` first (at most one of
    them is given); ``closure`` (:func:`again`'s) goes to an inner step that re-evaluates (the
    whole model is one bucket then). Returns whether torch's fused kernel ran."""
    dense, sparse, held, own, stepped = [], [], [], [], []
    for tensors in bucket:
        for t in tensors:
            if not is_master(t):
                if t.grad is not None:
                    own.append(t.grad)
                continue
            grad = valid_grad(t)
            if grad is not None:
                held.append(grad)
            elif t.model_param.grad is None:
                continue
            elif t.model_param.grad.is_sparse:
                sparse.append(t)
            else:
                dense.append(t)
            stepped.append(t)
    with torch.no_grad():
        views = opt.scratch.views(dense)
        if dense:
            torch._foreach_copy_(views, [t.model_param.grad for t in dense])
        for t, view in zip(dense, views):
            set_grad(t, view)
        made = [derive_grad(t, None) for t in sparse]
        tensors = [t for ts in bucket for t in ts]
        fused = (opt.fused == "auto"
                 and kernels.torch_fused_problem(opt.inner, tensors) is None)
        if (grad_scale is not None or found_inf is not None) and not fused:
            raise RuntimeError("step(found_inf=...) needs torch's fused kernel for every tensor; "
                               "call it only when skips_on_device() is True")
        if inv is not None:
            unscale_(own + held + views + made, inv)
        with (contextlib.nullcontext() if alone else opt.only(bucket)), \
                (kernels.torch_fused(opt.inner) if fused else contextlib.nullcontext()), \
                amp_arguments(opt.inner, grad_scale, found_inf), \
                states.fp32_moments(opt.inner, tensors, opt.state_dtype, opt.rounding):
            opt.inner_step(closure)
        if closure is not None:  # every master may have moved, with a gradient or not
            opt.write_back()
        elif stepped:
            torch._foreach_copy_([t.model_param for t in stepped], stepped)
    for t in stepped:
        drop_grad(t)
    return fused


@contextlib.contextmanager
def amp_arguments(inner, grad_scale, found_inf):
    """Inside the block, torch's fused step of ``inner`` divides the gradients by
    ``grad_scale`` and skips when ``found_inf`` is 1 (torch's optimizers read these attributes,
    which ``torch.amp.GradScaler`` sets for a fused optimizer)."""
    if grad_scale is None and found_inf is None:
        yield
        return
    inner.grad_scale, inner.found_inf = grad_scale, found_inf
    try:
        yield
    finally:
        del inner.grad_scale, inner.found_inf


def compiled_step(opt, grad_scale: torch.Tensor | None) -> None:
    """One compiled pass per master (see :func:`mixprec.optim.kernels.compiled_step`)."""
    inv = None if grad_scale is None else grad_scale.reciprocal()
    masters = [t for g in opt.param_groups for t in g["params"] if is_master(t)]
    model_of = {t: t.model_param for t in masters}

    def grad_of(master):
        grad = valid_grad(master)
        return grad if grad is not None else master.model_param.grad

    rest = kernels.compiled_step(opt.inner, model_of, grad_of, inv)
    scaled = [t.grad for ts in rest for t in ts if t.grad is not None]
    if inv is not None:
        with torch.no_grad():
            unscale_(scaled, inv)
    with opt.only(rest):
        opt.inner_step()  # always runs, so hooks and schedulers see a step
    for master in masters:
        drop_grad(master)


def again(opt, closure: Callable[[], Any], loss: Any) -> Callable[[], Any]:
    """``closure`` as an inner optimizer that re-evaluates it inside its step (LBFGS) calls it:
    the first call gives ``loss`` (the evaluation before the step made the gradients it reads);
    each later one shows the model the current masters (torch's cast), evaluates, and gives the
    masters the fresh fp32 gradients."""
    calls = 0

    def evaluate() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return loss
        opt.write_back()
        with torch.enable_grad():
            out = closure()
        opt.unscale_grads_(None)
        return out
    return evaluate
