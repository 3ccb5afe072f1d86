"""The master optimizer's two step paths: bucketed (default: each bucket from its cached lists
through torch's fused kernel, else through the inner optimizer's own ``step``) and compiled.

A closure runs before either (making the gradients the step reads); an inner optimizer that
calls it again inside its step (LBFGS: one bucket) gets
:func:`~mixprec.optim.wrapper.reevaluating`'s, which shows the model the current masters before
each re-evaluation.

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
import logging

import torch

from .. import kernel_table
from ..scaling.unscale import divide_, unscale_
from ..shards import is_dtensor
from . import compiled, hooks, kernels, master_lists, states
from .master_lists import step_grad
from .params import derive_grad, drop_grad, is_master, set_grad, valid_grad

__all__ = ["bucketed_step", "compiled_step", "keeps_compiling", "skips_on_device", "folds_scale",
           "settle_grads", "amp_arguments"]

_LOG = logging.getLogger("mixprec")


def device_plan(opt, fused=None) -> tuple[bool, bool]:
    """``(folds, ready)`` for master optimizer ``opt``: ``folds``, the step hands the loss scale
    to torch's fused kernel for every tensor (``fused="auto"``, a fused kernel for every
    tensor's device and dtype, no sparse gradient, no FSDP2 shard: those are unscaled apart, as
    before); ``ready``, every tensor the step reads a gradient for already has its optimizer
    state (Adam's ``step``; SGD's ``momentum_buffer`` when it has momentum). What depends only
    on the param groups and the kernel table is worked out once per layout
    (:func:`_layout`); a step walks the gradients and the state (no function call per tensor:
    a 400-tensor model's check took 0.85 ms when it did). ``fused``: in place of ``opt.fused``
    (a compact optimizer steps ``"compile"`` as ``"auto"``)."""
    inner = opt.inner
    if ((opt.fused if fused is None else fused) != "auto"
            or kernels.torch_fused_problem(inner, ()) is not None):
        return False, False
    fused, sources = _layout(opt)
    if not fused:
        return False, False
    state, ready = inner.state, True
    sgd = type(inner) is torch.optim.SGD
    held = opt.held_grads()
    for group, pairs in zip(inner.param_groups, sources):
        key = ("momentum_buffer" if group["momentum"] else None) if sgd else "step"
        for t, source in pairs:
            grad = step_grad(t) if held else source.grad
            if grad is None:
                continue
            if grad.is_sparse:
                return False, False
            if ready and key is not None and key not in dict.get(state, t, ()):  # (its own
                # keys: not MasterState's mapping, a Python call per tensor per step)
                ready = False
    return True, ready


def _layout(opt) -> tuple[bool, list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """``(fused, sources)`` for ``opt``'s param groups under the kernel table in use, kept until
    either changes: ``fused``, torch's fused kernel takes every tensor's device and dtype and no
    tensor is an FSDP2 shard; ``sources``, per group, each tensor with the tensor whose
    ``.grad`` the step reads when no fp32 gradient is held (a master's model parameter)."""
    table, cached = kernel_table.TABLE, opt.__dict__.get("_device_layout")
    if cached is not None and cached[0] == opt.layout_version and cached[1] is table:
        return cached[2], cached[3]
    fused_ok: dict[tuple, bool] = {}
    fused, sources = True, []
    for group in opt.inner.param_groups:
        sources.append([(t, t.model_param if is_master(t) else t) for t in group["params"]])
        for t in group["params"]:
            kind = (t.device.type, t.dtype)
            if kind not in fused_ok:
                fused_ok[kind] = table.fused_optimizer(*kind)
            fused = fused and fused_ok[kind] and not is_dtensor(t)
    opt._device_layout = (opt.layout_version, table, fused, sources)
    return fused, sources


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
        divide_([g for _, g in made] + own, grad_scale)
        unscale_([t.model_param.grad for t, _ in made], inv)
    for t, grad in made:  # the model gradients changed version: made from them still
        set_grad(t, grad)
    return found


def bucketed_step(opt, grad_scale: torch.Tensor | None,
                  found_inf: torch.Tensor | None = None, closure=None) -> None:
    """Step the masters bucket by bucket (one bucket unless the inner optimizer is
    per-parameter; see :mod:`mixprec.optim.buckets`): each through torch's fused kernel on its
    cached lists (:func:`.master_lists.fused_bucket`) where it can, else through the inner
    optimizer's own ``step`` (:func:`_step_bucket`)."""
    # one rule for all buckets (and settle_grads); a found_inf the step took implies it
    folds = grad_scale is not None and (found_inf is not None or folds_scale(opt))
    inv = None if folds or grad_scale is None else grad_scale.reciprocal()
    scale = grad_scale if folds else None
    buckets = opt.buckets()
    lists = closure is None and master_lists.cached_lists_apply(opt)
    pieces = opt.pieces if lists else [None] * len(buckets)
    # a first step, after a load: buckets with torch's fused kernel not yet ready for the lists
    if any(p is not None and not p.ready for p in opt.pieces):
        master_lists.make_state(opt)  # whichever path steps: the same state, the same numbers
        for bucket, piece in zip(buckets, opt.pieces):
            if piece is not None and not piece.ready:
                piece.ready = master_lists.state_ready(opt, bucket)
    try:
        for bucket, piece in zip(buckets, pieces):
            if piece is None or not piece.ready or not master_lists.fused_bucket(
                    opt, piece, scale, found_inf, inv):
                fused = _step_bucket(opt, bucket, scale, found_inf, inv, len(buckets) == 1,
                                     closure)
                if piece is not None:
                    piece.ready = fused
    finally:
        opt.scratch.release()  # transient: the fp32 gradients do not outlive the step
        opt.drop_master_grads()


def _step_bucket(opt, bucket: list[list[torch.Tensor]], grad_scale, found_inf, inv,
                 alone: bool, closure=None) -> bool:
    """Step one bucket through the inner optimizer's ``step``: the kernel divides by
    ``grad_scale`` (folded) or the gradients are multiplied by ``inv`` first (at most one of
    them is given); ``closure`` (:func:`~mixprec.optim.wrapper.reevaluating`'s) goes to an
    inner step that re-evaluates (the whole model is one bucket then). Returns whether torch's
    fused kernel ran."""
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
        if fused and not kernels.complete_momentum(opt.inner, bucket, step_grad):
            fused = False  # SGD with dampening, some buffers made: its own kernel this step
            if grad_scale is not None and found_inf is None:
                inv, grad_scale = grad_scale.reciprocal(), None
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


_HYPER = ("momentum", "dampening", "nesterov", "weight_decay", "betas", "eps",
          "decoupled_weight_decay")
#: Steps in a row whose hyper-parameters changed (each change recompiles) after which a master
#: optimizer steps with torch's fused kernel instead: a scheduler drives them.
HYPER_CHANGES = 2


def keeps_compiling(opt) -> bool:
    """Whether ``fused="compile"`` still compiles ``opt``'s step: its hyper-parameters other
    than the learning rate are constants of the compiled kernel, so each new value recompiles
    (about a second on a CPU), and where they changed on more than :data:`HYPER_CHANGES` steps
    in a row (a scheduler cycling the momentum or betas every step: ``OneCycleLR``'s and
    ``CyclicLR``'s ``cycle_momentum``) torch's compiler would recompile every step until its
    limit, then run eagerly without a word. The optimizer is set to ``fused="auto"`` instead,
    logged once (logger ``"mixprec"``), and the count dropped: setting ``fused="compile"``
    again starts it afresh. A group added since the last step is no change."""
    now = [tuple(repr(g.get(k)) for k in _HYPER) for g in opt.inner.param_groups]
    seen = opt.__dict__.get("_compiled_hyper")
    if seen is None:
        opt._compiled_hyper = [now, 0]
        return True
    before, seen[0] = seen[0], now
    changed = any(a != b for a, b in zip(before, now))
    seen[1] = seen[1] + 1 if changed else 0
    if seen[1] > HYPER_CHANGES:
        opt.fused = "auto"
        del opt._compiled_hyper
        _LOG.warning("mixprec: fused='compile' recompiles the master step for each new "
                     "momentum, betas or weight decay, and these changed on %d steps in a row "
                     "(a scheduler cycling them, as OneCycleLR's and CyclicLR's cycle_momentum "
                     "do): this optimizer steps with torch's fused kernel (fused='auto') from "
                     "now on", seen[1])
        return False
    return True


def compiled_step(opt, grad_scale: torch.Tensor | None) -> None:
    """One compiled pass per master (see :func:`mixprec.optim.compiled.compiled_step`)."""
    inv = None if grad_scale is None else grad_scale.reciprocal()
    masters = [t for g in opt.param_groups for t in g["params"] if is_master(t)]
    model_of = {t: t.model_param for t in masters}

    def grad_of(master):
        grad = valid_grad(master)
        return grad if grad is not None else master.model_param.grad

    rest = compiled.compiled_step(opt.inner, model_of, grad_of, inv)
    scaled = [t.grad for ts in rest for t in ts if t.grad is not None]
    if inv is not None:
        with torch.no_grad():
            unscale_(scaled, inv)
    with opt.only(rest):
        opt.inner_step()  # always runs, so hooks and schedulers see a step
    for master in masters:
        drop_grad(master)
