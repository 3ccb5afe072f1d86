"""One-pass update kernels for compact masters: SGD and Adam/AdamW on 16-bit weights.

Each kernel reads a 16-bit weight and its buffer through the master method's
:meth:`~mixprec.masters.MasterMethod.load` (the exact split master, weight + Kahan
compensation, or the weight), its gradient in any dtype, and its moments (fp32 or bf16);
computes the update in fp32 with torch's single-tensor arithmetic (as
:mod:`mixprec.optim.kernels`); and writes the result back through the method's
:meth:`~mixprec.masters.MasterMethod.store`, and bf16 moments stochastically rounded
(:mod:`mixprec.optim.states` says why).

The same Python functions run eagerly (``fused=False``) or compiled by ``torch.compile``
(``fused="compile"``, or ``"auto"`` where :mod:`.family`'s group update can't run): one pass
over memory per tensor, the random bits made inside the kernel from a key per tensor (so eager
and compiled rounding draw the same bits). Compiled kernels are checked against their eager
twins before they are trusted (:mod:`.guard`). With ``fused="auto"`` (default) torch's fused
kernel steps a whole param group instead (:func:`fast_step`, :mod:`.family`).
Hyper-parameters travel as tensors, so a scheduler never recompiles; each kernel compiles once
per combination of master method, moment dtype and gradient dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..masters import MasterMethod
from ..masters.rounding import RoundingGenerator, shard_key, stochastic_round
from ..shards import like_shard, local
from . import family
from .guard import GuardedKernel, can_compile
from .kernels import (
    PerDevice,
    adam_hparams,
    compile_options,
    flat,
    hp_tensor,
    options_problem,
    sgd_hparams,
)

__all__ = ["FAST_TYPES", "fast_problem", "can_compile", "fast_step", "value_of",
           "compensation"]

FAST_TYPES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_OFF = ("maximize", "differentiable", "capturable", "amsgrad")


# -- the arithmetic (eager or compiled), per master method: its load/store around the update ----
def _store_state(buf: torch.Tensor, new: torch.Tensor, key: torch.Tensor) -> None:
    if buf.dtype == torch.float32:
        buf.copy_(new)
    else:
        buf.copy_(stochastic_round(new, key))


def _arithmetic(load: Callable, store: Callable) -> dict[str, Callable]:
    """The SGD and Adam/AdamW kernels of a method whose ``load``/``store`` these are."""

    def sgd(weight, comp, grad, buf, s, hp, keys, nesterov: bool):
        # hp: -lr, weight_decay, buffer decay, gradient weight, momentum (kernels.sgd_hparams)
        p = load(weight, comp)
        g = grad.float() * s + hp[1] * p
        if buf is not None:
            b = buf.float() * hp[2] + hp[3] * g
            _store_state(buf, b, keys[1])
            g = g + hp[4] * b if nesterov else b
        store(weight, comp, p + hp[0] * g, keys[0])

    def adam(weight, comp, grad, exp_avg, exp_avg_sq, s, hp, keys):
        # hp: see kernels.adam_hparams
        p = load(weight, comp)
        g = grad.float() * s + hp[0] * p
        ea = exp_avg.float()
        ea = ea + hp[2] * (g - ea)
        eas = exp_avg_sq.float() * hp[3] + hp[4] * g * g
        _store_state(exp_avg, ea, keys[1])
        _store_state(exp_avg_sq, eas, keys[2])
        store(weight, comp, p * hp[1] + hp[7] * (ea / (eas.sqrt() / hp[5] + hp[6])), keys[0])

    return {"sgd": sgd, "adam": adam}


# the compensation is new - float(bf16(new)): inductor must not drop that round trip
_OPTIONS = {**compile_options, "emulate_precision_casts": True}
# variants (master method, split paired or not, moment dtype, momentum, gradient dtype, and each
# parameter's rank and size-1 dims: guards on the flat views' bases) each compile once. Past the
# limit dynamo runs the step eagerly, an ulp apart from the compiled one (and, under FSDP, on
# some ranks only): one rank of the two-rank FSDP checkpoint tests compiles 68
_RECOMPILE_LIMIT = 512


@functools.lru_cache(maxsize=None)
def _kernels(method: type[MasterMethod]) -> tuple[dict, dict]:
    """The eager kernels of a method class, and their compiled twins, each checked against its
    eager one before it is trusted (:mod:`.guard`) on what the weights hold, the moments and the
    momentum buffer (not the bits of a split pair or Kahan compensation: the fp32 arithmetic
    before them may round an ulp apart)."""
    eager = _arithmetic(method.load, method.store)

    def outcome(args, _):
        return [method.load(args[0], args[1]),
                *(t for t in args[2:5] if isinstance(t, torch.Tensor)
                  and t.is_floating_point() and t.shape == args[2].shape)]

    guarded = {name: GuardedKernel(f"compact {name} ({method.name})", fn, _OPTIONS,
                                   recompile_limit=_RECOMPILE_LIMIT, outcome=outcome,
                                   rel_tol=2.0 ** -16)
               for name, fn in eager.items()}
    return eager, guarded


def _kernel(method: MasterMethod, name: str, compiled: bool) -> Callable:
    eager, guarded = _kernels(type(method))
    return guarded[name] if compiled else eager[name]


# -- which optimizers and devices ----------------------------------------------------------------
def fast_problem(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the one-pass kernels can't step ``optimizer`` (None when they can)."""
    return options_problem(optimizer, {t: _OFF for t in FAST_TYPES})


def _paired(method: MasterMethod, tensors: tuple) -> tuple:
    """The flat kernel arguments ``(weight, comp, ...)``, the weight and buffer as the method's
    kernels read them (:meth:`~mixprec.masters.MasterMethod.kernel_views`: a CPU split pair as
    int32 words)."""
    return (*method.kernel_views(*tensors[:2]), *tensors[2:])


def value_of(method: MasterMethod, weight: torch.Tensor,
             buf: torch.Tensor | None) -> torch.Tensor:
    """The fp32 value a compact ``weight`` and its buffer hold (a new tensor; an FSDP2 shard's
    is placed as the shard: the method's arithmetic runs on this rank's part)."""
    return like_shard(method.load(local(weight), local(buf)), weight)


# -- stepping the groups --------------------------------------------------------------------------
def _zeros(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)


def _sgd_group(optimizer, method, group, items, inv, keys, compiled, state_dtype) -> None:
    first_values, later_values, momentum = sgd_hparams(group)
    first_hp = PerDevice(lambda d: hp_tensor(first_values, d))
    later_hp = PerDevice(lambda d: hp_tensor(later_values, d))
    for (param, grad, comp), key in zip(items, keys):
        state = optimizer.state[param]
        buf = None
        is_first = True
        if momentum != 0:
            buf = state.get("momentum_buffer")
            is_first = buf is None  # torch starts the buffer at the first gradient
            if is_first:
                buf = state["momentum_buffer"] = _zeros(param, state_dtype)
        hp = (first_hp if is_first else later_hp)(param.device)
        tensors = flat(*map(local, (param, comp, grad, buf)))
        _kernel(method, "sgd", compiled)(*_paired(method, tensors), inv(param.device), hp, key,
                                         bool(group["nesterov"]))


def _adam_group(optimizer, method, group, items, inv, keys, compiled, state_dtype) -> None:
    states = []
    for param, _, _ in items:
        state = optimizer.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = _zeros(param, state_dtype)
            state["exp_avg_sq"] = _zeros(param, state_dtype)
        states.append(state)
    torch._foreach_add_([s["step"] for s in states], 1)
    hps: dict = {}
    for (param, grad, comp), state, key in zip(items, states, keys):
        step = float(state["step"])  # a host read: a sync only if the step lives on a GPU
        hp = hps.get((param.device, step))
        if hp is None:
            hp = hps[(param.device, step)] = hp_tensor(adam_hparams(optimizer, group, step),
                                                       param.device)
        tensors = (param, comp, grad, state["exp_avg"], state["exp_avg_sq"])
        _kernel(method, "adam", compiled)(*_paired(method, flat(*map(local, tensors))),
                                          inv(param.device), hp, key)


def fast_step(optimizer: torch.optim.Optimizer, method: MasterMethod,
              items_by_group: list[list[tuple]],
              inv_scale: torch.Tensor | None, rounding: RoundingGenerator, compiled: bool,
              state_dtype: torch.dtype, salt: int = 0, grouped: bool = False,
              grad_scale: torch.Tensor | None = None) -> None:
    """Update compact weights with the one-pass kernels, or a param group at a time with torch's
    fused kernel between the methods' load and store (``grouped``, :mod:`.family`).

    Args:
        optimizer: the inner SGD/Adam/AdamW (its ``state`` is keyed by the model parameters).
        method: the compact master method (its load/store read and write the weights).
        items_by_group: per param group, ``(parameter, gradient, compensation or None)``.
        inv_scale: a 0-d tensor the gradients are multiplied by first (None: 1).
        rounding: where the rounding keys come from (three per tensor, drawn every step).
        compiled: run the ``torch.compile``-d kernels, else the same functions eagerly.
        state_dtype: dtype new moment buffers are made in.
        salt: mixed into the keys (DTensor shards need none: their keys are shifted to their
            place in the full tensor, :func:`mixprec.masters.rounding.shard_key`).
        grouped: step each param group (per device and dtypes) at once where torch has a
            fused kernel for it (:func:`.family.group_ready`); the rest per tensor.
        grad_scale: the factor the gradients carry (``1 / inv_scale``), or None: a group step
            hands it to torch's fused kernel, which divides by it (as for fp32 masters).
    """
    group_step = _sgd_group if type(optimizer) is torch.optim.SGD else _adam_group
    scale = 1.0 if inv_scale is None else inv_scale
    inv = PerDevice(lambda d: torch.as_tensor(scale, dtype=torch.float32, device=d))
    count = sum(len(items) for items in items_by_group)
    drawn = torch.stack(rounding.keys(3 * count, salt)).view(-1, 3) if count else None
    start = 0
    with torch.no_grad():
        for group, items in zip(optimizer.param_groups, items_by_group):
            if not items:
                continue
            rows = drawn[start:start + len(items)]
            start += len(items)
            if grouped and family.group_ready(optimizer, items):
                _grouped(optimizer, method, group, items, grad_scale, rows, state_dtype,
                         compiled)
                continue
            keys = [shard_key(rows[i], p).to(p.device) for i, (p, _, _) in enumerate(items)]
            group_step(optimizer, method, group, items, inv, keys, compiled, state_dtype)


#: Elements of one piece of the group step (a few MiB of fp32 values): its transient flat buffers
#: are bounded by this (or by the largest tensor), not by the size of the param group.
PIECE = 1 << 20


def _pieces(items: list[tuple], idx: list[int]):
    """``idx`` cut, in order, into runs of at most :data:`PIECE` elements (a larger tensor
    alone)."""
    piece, size = [], 0
    for i in idx:
        n = local(items[i][0]).numel()
        if piece and size + n > PIECE:
            yield piece
            piece, size = [], 0
        piece.append(i)
        size += n
    if piece:
        yield piece


def _grouped(optimizer, method, group, items, grad_scale, rows, state_dtype, compiled) -> None:
    """:func:`.family.group_step` per (device, weight dtype, buffer dtype) of one group, a piece
    of at most :data:`PIECE` elements at a time (each tensor's rounding bits are its own key's,
    whatever piece it is in)."""
    kinds: dict[tuple, list[int]] = {}
    for i, (p, _, buf) in enumerate(items):
        kinds.setdefault((p.device, p.dtype, None if buf is None else buf.dtype), []).append(i)
    for (device, _, _), idx in kinds.items():
        scale = None if grad_scale is None else grad_scale.to(device, torch.float32)
        for piece in _pieces(items, idx):
            family.group_step(optimizer, method, group, [items[i] for i in piece], scale,
                              rows[piece], state_dtype, compiled and can_compile(device.type))


def compensation(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                 key: str | None) -> torch.Tensor | None:
    """``param``'s buffer under the state ``key`` (a Kahan compensation, a split remainder), or
    None."""
    return None if key is None else optimizer.state.get(param, {}).get(key)
