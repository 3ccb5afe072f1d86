"""The fused master-weight step behind ``MasterWeightOptimizer(optimizer, fused=True)``.

One compiled elementwise kernel per low-precision parameter reads its gradient (the model's
bf16/fp16 gradient, or the fp32 master gradient after ``sync_grads()``), the fp32 master and the
optimizer state, and writes the new master, the new state and the rounded low-precision copy in
one pass. The unfused path makes three passes instead (gradient copy into an fp32 buffer, the
inner optimizer's step, the write-back).

The arithmetic follows torch's single-tensor SGD and Adam/AdamW (same operations on the same
fp32 values, so results agree to a few fp32 ulps: the compiled kernel may round differently, e.g.
fuse a multiply-add). State keys and layouts are torch's own (``momentum_buffer``; ``step``,
``exp_avg``, ``exp_avg_sq``), so state dicts move freely between the fused and unfused paths.

Hyper-parameters travel as one small fp32 tensor per call, never as Python numbers, so a learning
rate scheduler does not trigger recompiles. The kernels are compiled with dynamic shapes over
flattened tensors: one compile per kernel and (parameter dtype, gradient dtype) pair, plus
torch's usual specialisation of size-0/1 tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["SUPPORTED", "check_supported", "is_supported", "fused_step"]

SUPPORTED = ("torch.optim.SGD (momentum, dampening, nesterov, weight_decay; not maximize or "
             "differentiable) or torch.optim.Adam / torch.optim.AdamW (betas, eps, weight_decay; "
             "not amsgrad, maximize, capturable or differentiable)")

_SGD_OFF = ("maximize", "differentiable")
_ADAM_OFF = ("amsgrad", "maximize", "capturable", "differentiable")


def _off_options(optimizer: torch.optim.Optimizer) -> tuple[str, ...] | None:
    if type(optimizer) is torch.optim.SGD:
        return _SGD_OFF
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return _ADAM_OFF
    return None


def _problem(optimizer: torch.optim.Optimizer) -> str | None:
    off = _off_options(optimizer)
    if off is None:
        return f"got {type(optimizer).__module__}.{type(optimizer).__name__}"
    for i, group in enumerate(optimizer.param_groups):
        on = [k for k in off if group.get(k)]
        if on:
            return f"param_groups[{i}] of {type(optimizer).__name__} sets {', '.join(on)}=True"
    return None


def is_supported(optimizer: torch.optim.Optimizer) -> bool:
    """True when the fused master step can run ``optimizer`` (see :data:`SUPPORTED`)."""
    return _problem(optimizer) is None


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless the fused master step supports ``optimizer``."""
    problem = _problem(optimizer)
    if problem is not None:
        raise ValueError(f"fused=True supports {SUPPORTED}; {problem}. Use fused=False for "
                         "other optimizers or options")


# -- the kernels (compiled lazily, once per process) -------------------------------------------
def _round_into(master, param, new):
    master.copy_(new)
    param.copy_(new)  # rounds to nearest even, as the unfused write-back does


def _sgd_plain(master, param, grad, hp):
    # hp: -lr, weight_decay, buffer decay (momentum; 0 at the first step), gradient weight
    #     (1 - dampening; 1 at the first step), momentum
    g = grad.float() + hp[1] * master
    _round_into(master, param, master + hp[0] * g)


def _sgd_momentum(master, param, grad, buf, hp):
    g = grad.float() + hp[1] * master
    b = buf * hp[2] + hp[3] * g
    buf.copy_(b)
    _round_into(master, param, master + hp[0] * b)


def _sgd_nesterov(master, param, grad, buf, hp):
    g = grad.float() + hp[1] * master
    b = buf * hp[2] + hp[3] * g
    buf.copy_(b)
    _round_into(master, param, master + hp[0] * (g + hp[4] * b))


def _adam(master, param, grad, exp_avg, exp_avg_sq, hp):
    # hp: L2 weight decay, decoupled decay factor, 1 - beta1, beta2, 1 - beta2,
    #     sqrt(bias correction 2), eps, -step size
    g = grad.float() + hp[0] * master
    m = master * hp[1]
    ea = exp_avg + hp[2] * (g - exp_avg)
    eas = exp_avg_sq * hp[3] + hp[4] * g * g
    exp_avg.copy_(ea)
    exp_avg_sq.copy_(eas)
    _round_into(master, param, m + hp[7] * (ea / (eas.sqrt() / hp[5] + hp[6])))


_KERNELS = {"sgd_plain": _sgd_plain, "sgd_momentum": _sgd_momentum,
            "sgd_nesterov": _sgd_nesterov, "adam": _adam}
_compiled: dict[str, object] = {}
# Dynamic shapes: inductor would pick serial or parallel loops from the size of the first tensor
# it compiled for (a bias: serial, for every tensor after). Let OpenMP decide at run time instead.
_OPTIONS = {"cpp.dynamic_threads": True}


def _kernel(name: str):
    fn = _compiled.get(name)
    if fn is None:
        fn = _compiled[name] = torch.compile(_KERNELS[name], dynamic=True, options=_OPTIONS)
    return fn


def _flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if all(t.is_contiguous() for t in tensors):
        return tuple(t.view(-1) for t in tensors)
    return tensors


def _hp(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _cached(cache: dict, key, values) -> torch.Tensor:
    """The hyper-parameter tensor for ``key`` (its first element is the device), made once."""
    hp = cache.get(key)
    if hp is None:
        dev = key[0] if isinstance(key, tuple) else key
        hp = cache[key] = _hp(values(), dev)
    return hp


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


# -- one step ----------------------------------------------------------------------------------
def _sgd_group(optimizer, group: dict, items: list) -> None:
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    momentum, damp = float(group["momentum"]), float(group["dampening"])
    if group["nesterov"] and (momentum <= 0 or damp != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    hps: dict = {}
    for master, param, grad in items:
        dev = master.device
        if momentum == 0:
            hp = _cached(hps, dev, lambda: [-lr, wd, 0.0, 1.0, 0.0])
            _kernel("sgd_plain")(*_flat(master, param, grad), hp)
            continue
        state = optimizer.state[master]
        buf = state.get("momentum_buffer")
        first = buf is None  # torch starts the buffer at the first gradient: 0 * m + 1 * g
        if first:
            buf = state["momentum_buffer"] = torch.zeros_like(master)
        hp = _cached(hps, (dev, first),
                     lambda: [-lr, wd, 0.0 if first else momentum, 1.0 if first else 1.0 - damp,
                              momentum])
        name = "sgd_nesterov" if group["nesterov"] else "sgd_momentum"
        _kernel(name)(*_flat(master, param, grad, buf), hp)


def _adam_state(optimizer, master: torch.Tensor) -> dict:
    state = optimizer.state[master]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def _adam_group(optimizer, group: dict, items: list) -> None:
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    decoupled = bool(group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW))
    l2, decay = (0.0, 1.0 - lr * wd) if decoupled else (wd, 1.0)
    states = [_adam_state(optimizer, master) for master, _, _ in items]
    torch._foreach_add_([s["step"] for s in states], 1)
    hps: dict = {}
    for (master, param, grad), state in zip(items, states):
        step = float(state["step"])  # a host read: a sync only if the step lives on a GPU
        key = (master.device, step)
        hp = hps.get(key)
        if hp is None:
            bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
            hp = hps[key] = _hp([l2, decay, 1 - beta1, beta2, 1 - beta2, bc2 ** 0.5, eps,
                                 -lr / bc1], master.device)
        _kernel("adam")(*_flat(master, param, grad, state["exp_avg"], state["exp_avg_sq"]), hp)


def fused_step(optimizer: torch.optim.Optimizer, model_of: Mapping, master_grads: bool) -> None:
    """Step ``optimizer``: masters (in ``model_of``) fused, every other parameter by its step.

    Args:
        optimizer: the inner optimizer (its ``param_groups`` hold the masters).
        model_of: master -> low-precision model parameter.
        master_grads: read the masters' fp32 ``.grad`` (after ``sync_grads()``) instead of the
            model parameters' gradients.
    """
    check_supported(optimizer)
    group_step = _sgd_group if type(optimizer) is torch.optim.SGD else _adam_group
    rest_lists = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            items, rest = [], []
            for p in group["params"]:
                param = model_of.get(p)
                if param is None:
                    rest.append(p)
                    continue
                grad = p.grad if master_grads else param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("fused=True does not support sparse gradients; use "
                                       "fused=False")
                items.append((p, param, grad))
            if items:
                group_step(optimizer, group, items)
            rest_lists.append(rest)
    _step_rest(optimizer, rest_lists)


def _step_rest(optimizer: torch.optim.Optimizer, rest_lists: list) -> None:
    """The inner step over the parameters that are their own masters (fp32), groups intact.

    Always runs (even over empty lists) so step hooks and schedulers see a step.
    """
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group, rest in zip(optimizer.param_groups, rest_lists):
            group["params"] = rest
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
