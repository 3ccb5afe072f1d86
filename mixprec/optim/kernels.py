"""The update kernels behind ``MasterWeightOptimizer``: torch's own SGD and Adam/AdamW, fused
(here) or compiled (:mod:`.compiled`); no arithmetic of mixprec's own.

* ``fused="auto"``: torch's fused kernels (``torch._fused_sgd_``/``_fused_adam_``/
  ``_fused_adamw_``, one pass per bucket of tensors, on CPU and CUDA). The inner optimizer's own
  ``step`` runs them with its groups' ``fused`` switched on for the call (:func:`torch_fused`)
  where it must make state; every other step calls torch's functional ``sgd``/``adam`` with
  ``fused=True`` on lists made once (:func:`torch_functional`). They need gradients of the
  masters' dtype: the master optimizer widens the 16-bit ones into fp32 scratch a bucket at a
  time.
* ``fused="compile"``: torch's single-tensor SGD/Adam/AdamW (its functional API with
  ``foreach=False``) between a widening of the 16-bit gradient and torch's cast of the master
  into the weight, compiled by ``torch.compile``: inductor fuses the three into one pass per
  parameter that reads the 16-bit gradient and writes the 16-bit weight
  (:func:`.compiled.compiled_step`).
  Each compiled kernel is checked against the same function run eagerly (:mod:`.guard`, which
  logs once what it compiled and how long it took). Results are what ``torch.compile`` of
  torch's own step gives: SGD within a few fp32 ulps of the eager step (inductor may fuse a
  multiply-add: Nesterov's, up to about 30 ulps), Adam/AdamW's update up to about 7e-6 relative
  off the eager fused kernel's, which computes the bias corrections in double where the
  compiled step computes them in fp32 (measured 6.6e-6, and 6.9e-6 for ``torch.compile`` of a
  plain fp32 AdamW step).

State keys and layouts are torch's own (``momentum_buffer``; ``step``, ``exp_avg``,
``exp_avg_sq``), so state dicts move freely between the paths. The compiled kernels take flat
views and dynamic shapes (one compile per gradient dtype, not per tensor), the learning rate and
the gradient's inverse scale as 0-d tensors (a scheduler or a changing loss scale recompiles
nothing); a change of another hyper-parameter (momentum, betas, weight decay) recompiles, and
where they keep changing (a scheduler cycling the momentum, as ``OneCycleLR`` and ``CyclicLR``
do by default) the optimizer steps with torch's fused kernel instead
(:func:`.steps.keeps_compiling`). A one-element master steps eagerly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping

import torch
from torch.optim import adam as torch_adam
from torch.optim import sgd as torch_sgd

from .. import kernel_table
from ..shards import is_dtensor

__all__ = ["options_problem", "COMPILED_SUPPORTED", "check_compilable", "is_compilable",
           "torch_fused_problem", "torch_fused", "torch_functional", "functional_keys",
           "fused_call", "TORCH_FUSED_TYPES", "complete_momentum"]

COMPILED_SUPPORTED = (
    "torch.optim.SGD (momentum, dampening, nesterov, weight_decay; not maximize or "
    "differentiable) or torch.optim.Adam / torch.optim.AdamW (betas, eps, weight_decay; not "
    "amsgrad, maximize, capturable or differentiable)")

_SGD_OFF = ("maximize", "differentiable")
_ADAM_OFF = ("amsgrad", "maximize", "capturable", "differentiable")
TORCH_FUSED_TYPES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


# -- which optimizers each path runs --------------------------------------------------------------
def options_problem(optimizer: torch.optim.Optimizer,
                    off: dict[type, tuple[str, ...]]) -> str | None:
    """Why a one-pass kernel can't step ``optimizer``: its type is not a key of ``off``, or a
    param group turns on one of the options ``off`` lists for it (None when it can)."""
    names = off.get(type(optimizer))
    if names is None:
        return f"got {type(optimizer).__module__}.{type(optimizer).__name__}"
    for i, group in enumerate(optimizer.param_groups):
        on = [k for k in names if group.get(k)]
        if on:
            return f"param_groups[{i}] of {type(optimizer).__name__} sets {', '.join(on)}=True"
    return None


_COMPILED_OFF = {torch.optim.SGD: _SGD_OFF, torch.optim.Adam: _ADAM_OFF,
                 torch.optim.AdamW: _ADAM_OFF}


def _compile_problem(optimizer: torch.optim.Optimizer) -> str | None:
    return options_problem(optimizer, _COMPILED_OFF)


def is_compilable(optimizer: torch.optim.Optimizer) -> bool:
    """True when the compiled master step can run ``optimizer`` (see :data:`COMPILED_SUPPORTED`)."""
    return _compile_problem(optimizer) is None


def check_compilable(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless the compiled master step supports ``optimizer``."""
    problem = _compile_problem(optimizer)
    if problem is not None:
        raise ValueError(f"fused='compile' supports {COMPILED_SUPPORTED}; {problem}. Use "
                         "fused='auto' or False for other optimizers or options")


def torch_fused_problem(optimizer: torch.optim.Optimizer, tensors,
                        grad_of: Callable | None = None) -> str | None:
    """Why torch's fused kernel can't step ``tensors`` with ``optimizer`` (None when it can);
    ``grad_of(t)`` is the gradient the step reads for ``t`` (default: ``t.grad``)."""
    if type(optimizer) not in TORCH_FUSED_TYPES:
        return f"{type(optimizer).__name__} has no fused kernel in torch"
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable"):
            return "differentiable/capturable param groups"
    for t in tensors:
        if not kernel_table.TABLE.fused_optimizer(t.device.type, t.dtype):
            return f"a {t.dtype} tensor on {t.device}"
        table = kernel_table.TABLE
        if is_dtensor(t) and not table.fused_optimizer_on_shards(type(optimizer)):
            return f"an FSDP2 shard: torch's fused {type(optimizer).__name__} takes no DTensor"
        grad = t.grad if grad_of is None else grad_of(t)
        if grad is not None and grad.is_sparse:
            return "a sparse gradient"
    return None


def complete_momentum(optimizer: torch.optim.Optimizer, groups: list[list[torch.Tensor]],
                      grad_of: Callable | None = None) -> bool:
    """Make ``optimizer``'s momentum buffers whole for a fused SGD step of ``groups`` (per param
    group, the tensors stepped; ``grad_of(t)``: the gradient the step reads, default ``t.grad``).

    torch's fused SGD makes the buffers only in a call where no tensor has one (its first step)
    and fails where some tensors of a group have one and others not: a parameter whose first
    gradient comes after the optimizer's first step (unfrozen later, a branch unused at first).
    With ``dampening`` 0 the missing buffers are made as zeros (the dtype of the group's other
    buffers, the tensor's layout): the kernel's update of a zero buffer is ``0 * momentum +
    grad``, exactly the gradient torch's first step makes it. Returns False where a group with
    ``dampening`` needs that (its first step is not what the kernel makes of any buffer): step
    it without the fused kernel. True otherwise (any other optimizer: nothing to do)."""
    if type(optimizer) is not torch.optim.SGD:
        return True
    state = optimizer.state
    for group, tensors in zip(optimizer.param_groups, groups):
        if not group["momentum"]:
            continue
        stepped = [t for t in tensors if (t.grad if grad_of is None else grad_of(t)) is not None]
        made = [state[t]["momentum_buffer"] for t in stepped
                if state.get(t, {}).get("momentum_buffer") is not None]
        if not made or len(made) == len(stepped):
            continue
        if group["dampening"]:
            return False
        for t in stepped:
            if state.get(t, {}).get("momentum_buffer") is None:
                state[t]["momentum_buffer"] = torch.zeros_like(t, dtype=made[0].dtype)
    return True


@contextlib.contextmanager
def torch_fused(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside the block, ``optimizer.step()`` runs torch's fused kernel for every param group.

    The groups' ``fused``/``foreach`` options are switched for the block and restored after, so
    the optimizer's own ``state_dict()`` keeps what its user configured. torch's fused kernels
    keep Adam's ``step`` on the parameter's device; a ``step`` loaded onto the CPU is moved there.
    """
    saved = [(g.get("fused"), g.get("foreach")) for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if torch.is_tensor(step) and step.device != p.device:
                optimizer.state[p]["step"] = step.to(p.device, torch.float32)
    try:
        yield
    finally:
        for group, (fused, foreach) in zip(optimizer.param_groups, saved):
            group["fused"], group["foreach"] = fused, foreach


def torch_functional(optimizer: torch.optim.Optimizer, group: dict, params: list, grads: list,
                     uniform: bool = False) -> Callable:
    """What ``optimizer.step()`` runs for ``group`` with ``fused=True``, over ``params`` and
    ``grads``: torch's functional SGD or Adam/AdamW (:data:`TORCH_FUSED_TYPES`) with the
    group's options and the state the inner step made, as a call ``(grad_scale, found_inf)``
    (``uniform``: see :func:`fused_call`). SGD's first step with momentum (no buffer yet) makes
    the buffers into the call's list (``call.args[2]``), as torch's makes them for its ``step``
    to keep.

    Raises:
        KeyError: some of that state is not made yet (a first step makes it).
    """
    held = [optimizer.state[p] for p in params]
    moments = {k: [s.get(k) for s in held] if k == "momentum_buffer" else [s[k] for s in held]
               for k in functional_keys(type(optimizer), group)}
    bufs = moments.get("momentum_buffer", ())
    if any(b is None for b in bufs) and not all(b is None for b in bufs):
        raise KeyError("momentum_buffer")  # torch's first step makes all of them or none
    steps = [s["step"] for s in held] if type(optimizer) is not torch.optim.SGD else []
    return fused_call(type(optimizer), group, params, grads, moments, steps, uniform)


def functional_keys(kind: type, group: dict) -> tuple[str, ...]:
    """The state keys of the moments torch's functional ``kind`` (SGD, Adam, AdamW) reads for
    ``group`` (besides Adam's ``step``)."""
    if kind is torch.optim.SGD:
        return ("momentum_buffer",) if group["momentum"] else ()
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())


def fused_call(kind: type, group: dict, params: list, grads: list, moments: Mapping,
               steps: list, uniform: bool = False) -> Callable:
    """torch's functional SGD or Adam/AdamW (``kind``) with ``fused=True`` and ``group``'s
    options over the lists given (``moments``: :func:`functional_keys` -> a list per key;
    ``steps``: Adam's step tensors), as a call ``(grad_scale, found_inf)``. ``uniform``: every
    tensor of ``params`` is of one device and dtype (a piece's, a bucket's group known so): the
    call is what torch's functional step runs for its one device and dtype (:func:`_sgd_on` and
    :func:`_adam_on`: the step counts, the kernel, the counts taken back on ``found_inf``),
    without torch's grouping of the lists by device and dtype, which on a few hundred small
    tensors takes longer than the kernel."""
    if kind is torch.optim.SGD:
        momentum = group["momentum"]
        bufs = moments["momentum_buffer"] if momentum else [None] * len(params)
        return functools.partial(
            _sgd_on if uniform else torch_sgd.sgd, params, grads, bufs, fused=True,
            weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
            dampening=group["dampening"], nesterov=group["nesterov"],
            maximize=group["maximize"])
    amsgrad = group["amsgrad"]
    beta1, beta2 = group["betas"]
    plain = uniform and not any(isinstance(b, torch.Tensor) for b in (beta1, beta2))
    return functools.partial(
        _adam_on if plain else torch_adam.adam, params, grads, moments["exp_avg"],
        moments["exp_avg_sq"], moments["max_exp_avg_sq"] if amsgrad else [], steps, fused=True,
        decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=amsgrad, beta1=beta1,
        beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
        maximize=group["maximize"])


def _on(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``tensor`` on ``device``, as torch's fused steps move a scale, flag or learning rate."""
    if tensor is None or tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=True)


def _sgd_on(params, grads, bufs, *, fused, weight_decay, momentum, lr, dampening, nesterov,
            maximize, grad_scale=None, found_inf=None) -> None:
    """torch's fused SGD over tensors of one device and dtype (what its functional ``sgd``
    with ``fused=True`` runs for each): a first step with momentum makes the buffers into
    ``bufs``."""
    if not params:
        return
    first = momentum != 0 and all(b is None for b in bufs)
    if first:
        bufs[:] = [torch.empty_like(g) for g in grads]
    device = params[0].device
    torch._fused_sgd_(params, grads, [] if momentum == 0 else bufs, weight_decay=weight_decay,
                      momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                      maximize=maximize, is_first_step=first,
                      grad_scale=_on(grad_scale, device), found_inf=_on(found_inf, device))


def _adam_on(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, fused,
             decoupled_weight_decay, amsgrad, beta1, beta2, lr, weight_decay, eps, maximize,
             grad_scale=None, found_inf=None) -> None:
    """torch's fused Adam/AdamW over tensors of one device and dtype (what its functional
    ``adam`` with ``fused=True`` runs for each): the step counts up by one, the kernel, and the
    counts back down by ``found_inf``."""
    if not params:
        return
    device = params[0].device
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        lr = _on(lr, device)
    found_inf = _on(found_inf, device)
    torch._foreach_add_(steps, 1)
    (torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_)(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=amsgrad, lr=lr,
        beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, maximize=maximize,
        grad_scale=_on(grad_scale, device), found_inf=found_inf)
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))
