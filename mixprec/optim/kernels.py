"""The update kernels behind ``MasterWeightOptimizer``: torch's fused ones, and a compiled pass.

Two ways to run SGD and Adam/AdamW on fp32 masters faster than the inner optimizer's default
(foreach) step:

* ``fused="auto"``: torch's own fused kernels (``torch._fused_sgd_``/``_fused_adam_``/
  ``_fused_adamw_``, one pass per bucket of tensors, on CPU and CUDA), run by the inner
  optimizer itself with its param groups' ``fused`` switched on for the call
  (:func:`torch_fused`). They need gradients of the masters' dtype, so the master optimizer feeds
  them transient fp32 copies, one bucket at a time.
* ``fused="compile"``: one ``torch.compile``-d elementwise kernel per low-precision parameter
  (:func:`compiled_step`) that reads its low-precision gradient directly, unscales it, and
  writes the master, the optimizer state and the rounded model parameter in one pass: no fp32
  gradient at all.

The compiled arithmetic follows torch's single-tensor SGD and Adam/AdamW (same operations on the
same fp32 values, so results agree to a few fp32 ulps: the compiled kernel may fuse a
multiply-add). State keys and layouts are torch's own (``momentum_buffer``; ``step``,
``exp_avg``, ``exp_avg_sq``), so state dicts move freely between the three paths.
Hyper-parameters and the gradient's inverse scale travel as tensors, never as Python numbers, so
a learning-rate scheduler or a changing loss scale does not recompile. The kernels are compiled
with dynamic shapes over flattened tensors: one compile per kernel and (parameter dtype,
gradient dtype) pair.
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
from .guard import GuardedKernel

__all__ = ["options_problem", "COMPILED_SUPPORTED", "check_compilable", "is_compilable",
           "torch_fused_problem", "torch_fused", "compiled_step", "sgd_hparams", "adam_hparams",
           "PerDevice", "hp_tensor", "flat", "compile_options"]

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


def torch_functional(optimizer: torch.optim.Optimizer, group: dict, params: list, grads: list
                     ) -> Callable:
    """What ``optimizer.step()`` runs for ``group`` with ``fused=True``, over ``params`` and
    ``grads``: torch's functional SGD or Adam/AdamW (:data:`TORCH_FUSED_TYPES`) with the
    group's options and the state the inner step made, as a call ``(grad_scale, found_inf)``.

    Raises:
        KeyError: some of that state is not made yet (a first step makes it).
    """
    state = optimizer.state
    if type(optimizer) is torch.optim.SGD:
        momentum = group["momentum"]
        bufs = [state[p]["momentum_buffer"] for p in params] if momentum else [None] * len(params)
        if momentum and any(b is None for b in bufs):
            raise KeyError("momentum_buffer")
        return functools.partial(
            _sgd_call, params, grads, bufs, weight_decay=group["weight_decay"],
            momentum=momentum, lr=group["lr"], dampening=group["dampening"],
            nesterov=group["nesterov"], maximize=group["maximize"])
    held = [state[p] for p in params]
    amsgrad = group["amsgrad"]
    beta1, beta2 = group["betas"]
    return functools.partial(
        _adam_call, params, grads, [s["exp_avg"] for s in held],
        [s["exp_avg_sq"] for s in held], [s["max_exp_avg_sq"] for s in held] if amsgrad else [],
        [s["step"] for s in held], decoupled_weight_decay=group["decoupled_weight_decay"],
        amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])


def _sgd_call(*lists, grad_scale, found_inf, **options) -> None:
    torch_sgd.sgd(*lists, fused=True, grad_scale=grad_scale, found_inf=found_inf, **options)


def _adam_call(*lists, grad_scale, found_inf, **options) -> None:
    torch_adam.adam(*lists, fused=True, grad_scale=grad_scale, found_inf=found_inf,
                          **options)


# -- the compiled kernels (compiled lazily, once per process) -----------------------------------
def _round_into(master, param, new):
    master.copy_(new)
    param.copy_(new)  # torch's cast, as every write-back of fp32 masters


def _sgd_plain(master, param, grad, s, hp):
    # s: the gradient's inverse scale. hp: -lr, weight_decay, buffer decay (momentum; 0 at the
    # first step), gradient weight (1 - dampening; 1 at the first step), momentum
    g = grad.float() * s + hp[1] * master
    _round_into(master, param, master + hp[0] * g)


def _sgd_momentum(master, param, grad, buf, s, hp):
    g = grad.float() * s + hp[1] * master
    b = buf * hp[2] + hp[3] * g
    buf.copy_(b)
    _round_into(master, param, master + hp[0] * b)


def _sgd_nesterov(master, param, grad, buf, s, hp):
    g = grad.float() * s + hp[1] * master
    b = buf * hp[2] + hp[3] * g
    buf.copy_(b)
    _round_into(master, param, master + hp[0] * (g + hp[4] * b))


def _adam(master, param, grad, exp_avg, exp_avg_sq, s, hp):
    # hp: L2 weight decay, decoupled decay factor, 1 - beta1, beta2, 1 - beta2,
    #     sqrt(bias correction 2), eps, -step size
    g = grad.float() * s + hp[0] * master
    m = master * hp[1]
    ea = exp_avg + hp[2] * (g - exp_avg)
    eas = exp_avg_sq * hp[3] + hp[4] * g * g
    exp_avg.copy_(ea)
    exp_avg_sq.copy_(eas)
    _round_into(master, param, m + hp[7] * (ea / (eas.sqrt() / hp[5] + hp[6])))


_KERNELS = {"sgd_plain": _sgd_plain, "sgd_momentum": _sgd_momentum,
            "sgd_nesterov": _sgd_nesterov, "adam": _adam}
# Dynamic shapes: inductor would pick serial or parallel loops from the size of the first tensor
# it compiled for (a bias: serial, for every tensor after). Let OpenMP decide at run time instead.
compile_options = {"cpp.dynamic_threads": True}
# each compiled kernel is checked against its eager twin before it is trusted (.guard)
_GUARDED = {name: GuardedKernel(f"fp32-master {name}", fn, compile_options)
            for name, fn in _KERNELS.items()}


def _kernel(name: str) -> Callable:
    return _GUARDED[name]


def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as flat views when all are contiguous (one kernel shape per numel), else as
    they are; None entries stay None."""
    if all(t is None or t.is_contiguous() for t in tensors):
        return tuple(None if t is None else t.view(-1) for t in tensors)
    return tensors


def hp_tensor(values, device: torch.device) -> torch.Tensor:
    """Hyper-parameters as an fp32 tensor on ``device`` (tensors, so a change never
    recompiles)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


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


def sgd_hparams(group: dict) -> tuple[list[float], list[float], float]:
    """SGD's kernel hyper-parameters at the first step and later ones (see ``_sgd_plain``),
    and the momentum.

    Raises:
        ValueError: Nesterov without momentum or with dampening (as torch).
    """
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    momentum, damp = float(group["momentum"]), float(group["dampening"])
    if group["nesterov"] and (momentum <= 0 or damp != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    return [-lr, wd, 0.0, 1.0, momentum], [-lr, wd, momentum, 1.0 - damp, momentum], momentum


def adam_hparams(optimizer, group: dict, step: float) -> list[float]:
    """Adam/AdamW's kernel hyper-parameters at ``step`` (see ``_adam``)."""
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    decoupled = bool(group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW))
    l2, decay = (0.0, 1.0 - lr * wd) if decoupled else (wd, 1.0)
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    return [l2, decay, 1 - beta1, beta2, 1 - beta2, bc2 ** 0.5, eps, -lr / bc1]


def _sgd_group(optimizer, group: dict, items: list, inv: PerDevice) -> None:
    first_values, later_values, momentum = sgd_hparams(group)
    first_hp = PerDevice(lambda d: hp_tensor(first_values, d))
    later_hp = PerDevice(lambda d: hp_tensor(later_values, d))
    for master, param, grad in items:
        dev = master.device
        if momentum == 0:
            _kernel("sgd_plain")(*flat(master, param, grad), inv(dev), first_hp(dev))
            continue
        state = optimizer.state[master]
        buf = state.get("momentum_buffer")
        first = buf is None  # torch starts the buffer at the first gradient: 0 * m + 1 * g
        if first:
            buf = state["momentum_buffer"] = torch.zeros_like(master)
        name = "sgd_nesterov" if group["nesterov"] else "sgd_momentum"
        hp = first_hp(dev) if first else later_hp(dev)
        _kernel(name)(*flat(master, param, grad, buf), inv(dev), hp)


def _adam_state(optimizer, master: torch.Tensor) -> dict:
    state = optimizer.state[master]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def _adam_group(optimizer, group: dict, items: list, inv: PerDevice) -> None:
    states = [_adam_state(optimizer, master) for master, _, _ in items]
    torch._foreach_add_([s["step"] for s in states], 1)
    hps: dict = {}
    for (master, param, grad), state in zip(items, states):
        step = float(state["step"])  # a host read: a sync only if the step lives on a GPU
        key = (master.device, step)
        hp = hps.get(key)
        if hp is None:
            hp = hps[key] = hp_tensor(adam_hparams(optimizer, group, step), master.device)
        _kernel("adam")(*flat(master, param, grad, state["exp_avg"], state["exp_avg_sq"]),
                        inv(master.device), hp)


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
    with torch.no_grad():
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

