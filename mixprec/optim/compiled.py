"""The compiled fp32-master step (``fused="compile"``): torch's single-tensor SGD/Adam/AdamW
between a widening of the 16-bit gradient and torch's cast of the master into the weight,
compiled by ``torch.compile`` into one pass per parameter, each kernel checked against its eager
twin (:mod:`.guard`). Which optimizers and options it takes, and the numbers it gives:
:mod:`.kernels`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
from torch.optim import adam as torch_adam
from torch.optim import sgd as torch_sgd

from .guard import GuardedKernel, quiet_compile
from .kernels import check_compilable

__all__ = ["compiled_step", "PerDevice", "flat", "compile_options"]


# -- the compiled step: torch's own arithmetic, compiled ----------------------------------------
def _adam(master, param, grad, exp_avg, exp_avg_sq, step, inv, lr, beta1, beta2, weight_decay,
          eps, decoupled):
    """torch's single-tensor Adam/AdamW over ``master`` from ``grad`` (any dtype) times ``inv``
    (``lr`` and ``inv`` 0-d tensors), then torch's cast of the master into ``param``."""
    torch_adam.adam([master], [grad.float() * inv], [exp_avg], [exp_avg_sq], [], [step],
                    foreach=False, fused=False, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                    weight_decay=weight_decay, eps=eps, maximize=False,
                    decoupled_weight_decay=decoupled)
    param.copy_(master)


def _sgd(master, param, grad, buf, inv, lr, weight_decay, momentum, dampening, nesterov):
    """torch's single-tensor SGD, as :func:`_adam`; returns the momentum buffer torch made when
    ``buf`` is None (its first step with momentum), else None."""
    bufs = [buf]
    torch_sgd.sgd([master], [grad.float() * inv], bufs, foreach=False, fused=False,
                  weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
                  nesterov=nesterov, maximize=False)
    param.copy_(master)
    return bufs[0] if buf is None else None


# Dynamic shapes: inductor would pick serial or parallel loops from the size of the first tensor
# it compiled for (a bias: serial, for every tensor after). Let OpenMP decide at run time instead.
compile_options = {"cpp.dynamic_threads": True}
# each compiled kernel is checked against its eager twin before it is trusted (.guard)
_GUARDED = {torch.optim.SGD: GuardedKernel("fp32-master SGD", _sgd, compile_options),
            torch.optim.Adam: GuardedKernel("fp32-master Adam", _adam, compile_options)}


def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as flat views when all are contiguous (one kernel shape per numel), else as
    they are; None entries stay None."""
    if all(t is None or t.is_contiguous() for t in tensors):
        return tuple(None if t is None else t.view(-1) for t in tensors)
    return tensors


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class PerDevice:
    """One small tensor per device (hyper-parameters, inverse scales), made once per step."""

    def __init__(self, make: Callable[[torch.device], torch.Tensor]):
        self._make, self._made = make, {}

    def __call__(self, device: torch.device) -> torch.Tensor:
        t = self._made.get(device)
        if t is None:
            t = self._made[device] = self._make(device)
        return t


def _lr(group: dict) -> PerDevice:
    """The group's learning rate as a 0-d tensor per device: a scheduler's change recompiles
    nothing (torch's step takes a tensor lr; a Python float would be specialised on)."""
    return PerDevice(lambda d: torch.as_tensor(group["lr"], dtype=torch.float64, device=d))


def _detached(*tensors):
    """Flat views (:func:`flat`) that require no grad, as the check's copies: one compile."""
    return flat(*(None if t is None else t.detach() for t in tensors))


def _sgd_group(optimizer, group: dict, items: list, inv: PerDevice) -> None:
    kernel, lr, momentum = _GUARDED[torch.optim.SGD], _lr(group), group["momentum"]
    options = (float(group["weight_decay"]), float(momentum), float(group["dampening"]),
               bool(group["nesterov"]))
    for master, param, grad in items:
        state = optimizer.state[master]
        buf = state.get("momentum_buffer")
        # torch makes the buffer at the first step: that step runs eagerly (one compile)
        run = kernel.fn if buf is None and momentum else functools.partial(_run, kernel)
        dev = master.device
        made = run(*_detached(master, param, grad, buf), inv(dev), lr(dev), *options)
        if made is not None:
            state["momentum_buffer"] = made.view_as(master)  # made from the flat gradient


def _adam_state(optimizer, master: torch.Tensor) -> dict:
    state = optimizer.state[master]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def _adam_group(optimizer, group: dict, items: list, inv: PerDevice) -> None:
    beta1, beta2 = group["betas"]
    lr = _lr(group)
    options = (float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"]),
               bool(group["decoupled_weight_decay"]))
    for master, param, grad in items:
        state, dev = _adam_state(optimizer, master), master.device
        _run(_GUARDED[torch.optim.Adam], *_detached(master, param, grad, state["exp_avg"],
                                                    state["exp_avg_sq"]), state["step"],
             inv(dev), lr(dev), *options)


def _run(kernel: GuardedKernel, *args):
    """``kernel(*args)``, inside the warning filter :func:`compiled_step` sets once for all its
    calls (a filter per call costs more than a small tensor's update). A one-element master (a
    learned scalar) steps eagerly: compiled, size 1 is specialised (a graph of its own, and the
    next size's guard failed inside torch: three graphs where one serves)."""
    if args[0].numel() < 2:
        return kernel.fn(*args)
    return kernel.compiled()(*args) if kernel.trusted(*args) else kernel.fn(*args)


def compiled_step(optimizer: torch.optim.Optimizer, model_of: Mapping,
                  grad_of: Callable[[torch.Tensor], torch.Tensor | None],
                  inv_scale: torch.Tensor | None) -> list[torch.Tensor]:
    """Update every master of ``optimizer`` (keys of ``model_of``) in one compiled pass each.

    Args:
        optimizer: the inner optimizer (its ``param_groups`` hold the masters).
        model_of: master -> low-precision model parameter (written, rounded).
        grad_of: master -> the gradient to read (any floating dtype), or None to skip it.
        inv_scale: a 0-d tensor the gradients are multiplied by first (None: 1).

    Returns:
        Per param group, the tensors that are not masters (fp32 parameters): the caller steps
        them with the optimizer's own step.
    """
    check_compilable(optimizer)
    group_step = _sgd_group if type(optimizer) is torch.optim.SGD else _adam_group
    scale = 1.0 if inv_scale is None else inv_scale
    inv = PerDevice(lambda d: torch.as_tensor(scale, dtype=torch.float32, device=d))
    rest_lists = []
    # hyper-parameters other than lr as constants of the compiled kernel (a change recompiles;
    # as inputs each call would wrap each of them in a tensor)
    with torch.no_grad(), quiet_compile(), torch._dynamo.config.patch(specialize_float=True):
        for group in optimizer.param_groups:
            items, rest = [], []
            for p in group["params"]:
                param = model_of.get(p)
                if param is None:
                    rest.append(p)
                    continue
                grad = grad_of(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("fused='compile' does not support sparse gradients; use "
                                       "fused='auto' or False")
                items.append((p, param, grad))
            if items:
                group_step(optimizer, group, items, inv)
            rest_lists.append(rest)
    return rest_lists

