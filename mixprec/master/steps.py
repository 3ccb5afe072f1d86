"""The master optimizer's three step paths: bucketed (default), compiled, and with a closure.

Each one reads, for every master, its fp32 gradient if one is held and current (made by
``unscale_grads_`` or by someone reading ``master.grad``; see :mod:`mixprec.master.params`),
else its model parameter's gradient; divides what it reads by ``grad_scale`` when the gradients
still carry a loss scale; steps the inner optimizer on the masters; and writes the masters back
into the model parameters, rounded to nearest even. fp32 parameters in the groups are their own
masters: their gradients are unscaled in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..masters.split_bits import round_into_
from ..scaling.unscale import unscale_
from . import kernels, states
from .params import derive_grad, drop_grad, is_master, set_grad, valid_grad

__all__ = ["bucketed_step", "compiled_step", "closure_step"]


def bucketed_step(opt, grad_scale: torch.Tensor | None) -> None:
    """Step the masters bucket by bucket (one bucket unless the inner optimizer is
    per-parameter; see :mod:`mixprec.master.buckets`)."""
    inv = None if grad_scale is None else grad_scale.reciprocal()
    buckets = opt.buckets()
    try:
        for bucket in buckets:
            _step_bucket(opt, bucket, inv, alone=len(buckets) == 1)
    finally:
        opt.scratch.release()  # transient: the fp32 gradients do not outlive the step


def _step_bucket(opt, bucket: list[list[torch.Tensor]], inv, alone: bool) -> None:
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
        if inv is not None:
            unscale_(own + held + views + made, inv)
        tensors = [t for ts in bucket for t in ts]
        fused = (opt.fused == "auto"
                 and kernels.torch_fused_problem(opt.inner, tensors) is None)
        with (contextlib.nullcontext() if alone else opt.only(bucket)), \
                (kernels.torch_fused(opt.inner) if fused else contextlib.nullcontext()), \
                states.fp32_moments(opt.inner, tensors, opt.state_dtype, opt.rounding):
            opt.inner_step()
        if stepped:
            round_into_([t.model_param for t in stepped], stepped)
    for t in stepped:
        drop_grad(t)


def compiled_step(opt, grad_scale: torch.Tensor | None) -> None:
    """One compiled pass per master (see :func:`mixprec.master.kernels.compiled_step`)."""
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


def closure_step(opt, closure: Callable[[], Any]) -> Any:
    """Step with a closure that re-evaluates the model (e.g. LBFGS): every evaluation sees the
    current masters and gives them fresh fp32 gradients."""
    calls = 0

    def evaluate() -> Any:
        nonlocal calls
        if calls:  # the inner optimizer moved the masters: show them to the model first
            opt.write_back()
        calls += 1
        loss = closure()
        opt.unscale_grads_(None)
        return loss

    tensors = [t for g in opt.param_groups for t in g["params"]]
    with states.fp32_moments(opt.inner, tensors, opt.state_dtype, opt.rounding):
        loss = opt.inner_step(evaluate)
    opt.write_back()
    opt.drop_master_grads()
    return loss
