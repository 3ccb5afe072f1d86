"""Checks of what :func:`mixprec.prepare` is given: the keywords that can be judged without the
model (every entry point runs that check where it takes them), names in the policy, the
optimizer's parameters, an fp16 model's Adam-style state, and ``policy=`` beside
``level=``/``dtype=``."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import vocabulary
from .callsite import user_stacklevel
from .casting import PREPARED_ATTR
from .emulation import check_mode
from .formats import get as float_format
from .oplists import validate_custom_lists
from .optim import is_master_optimizer
from .optim.hooks import INTERNAL, STEPPED_BY_WRAPPER
from .optim.wrapper import WrappedOptimizer, owner_of
from .policy import Policy
from .precision_map import keep_fp32_entries

__all__ = ["watch_masterless_steps", "check_keywords", "check_names", "check_optimizer",
           "check_fp16_state", "check_one_of"]

_FP16 = float_format("fp16")


def adam_state_underflow(beta2: float) -> float:
    """The largest |grad| whose ``(1 - beta2) * grad^2`` rounds to 0 in fp16: the product is
    rounded once, to nearest (ties to even), so it is 0 up to half the smallest subnormal,
    ``2^-25``, included: ``|grad| <= sqrt(2^-25 / (1 - beta2))`` (5.46e-03 at beta2 = 0.999)."""
    return (_FP16.min_subnormal / 2 / max(1.0 - beta2, 1e-12)) ** 0.5


def check_keywords(keep_fp32=None, low_precision_ops=(), fp32_ops=(),
                   emulate_fp16="auto") -> tuple:
    """Refuse a precision keyword whose value no model could make valid: ``keep_fp32`` entries
    that are neither module classes nor names, op lists that are not (known) op names, an
    ``emulate_fp16`` other than "auto", True or False. Every entry point calls it when it is
    given them (``prepare``, ``MixedPrecision`` and so every loop and host built on one,
    ``parallel.fsdp``); the module names ``keep_fp32`` gives are checked against the model
    where it is prepared (:func:`check_names`).

    Returns:
        ``(keep_fp32, low_precision_ops, fp32_ops)``, an iterator among them read into a tuple
        (so the caller passes on what was checked, not an exhausted generator).

    Raises:
        TypeError, ValueError: naming the keyword, what it received and what is valid.
    """
    if keep_fp32 is not None:
        keep_fp32 = keep_fp32_entries(keep_fp32)
    low_precision_ops, fp32_ops = (ops if isinstance(ops, str) or not isinstance(ops, Iterator)
                                   else tuple(ops) for ops in (low_precision_ops, fp32_ops))
    validate_custom_lists(low_precision_ops, fp32_ops)
    check_mode(emulate_fp16, "emulate_fp16")
    return keep_fp32, low_precision_ops, fp32_ops


def check_names(model: nn.Module, policy: Policy) -> None:
    policy.modules.check_names(model, "the policy's modules map (keep_fp32=, overrides=, "
                                      "fp8_modules=, to_float)")


def check_prepared_parts(model: nn.Module, optimizers, casts: bool) -> None:
    """Refuse to prepare a part of a prepared model (when either prepare casts parameters; two
    O1 prepares may nest, as apex's O1 tests do), or a model whose prepared part has parameters
    that a live master optimizer steps and that one of ``optimizers`` holds too: new masters of
    its 16-bit weights would start from their rounding (the fp32 values are the first
    optimizer's), and its ``state_dict`` would read the first one's masters. (A part shared by
    models prepared with one optimizer, apex's ``initialize([m1, m2], opt)``, is taken.)

    Raises:
        RuntimeError: one of these.
    """
    if getattr(model, PREPARED_ATTR, False) and (casts or any(
            p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())):
        raise RuntimeError("this module is part of a prepared model; prepare the whole model "
                           "once, from fresh fp32 parts (with keep_fp32= or mp.to_float for the "
                           "parts that need another precision)")
    held = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    for name, module in model.named_modules():
        if getattr(module, PREPARED_ATTR, False) and any(
                id(p) in held and owner_of(p) is not None for p in module.parameters()):
            raise RuntimeError(
                f"sub-module {name!r} was prepared already, with an optimizer that keeps its "
                "masters: new masters would start from its 16-bit weights and its state_dict "
                "would read the first optimizer's. Prepare the whole model once, from fresh fp32 "
                "parts, with one optimizer over it (param groups for the parts)")


def check_optimizer(model: nn.Module, optimizer) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None; "
                        f"got {type(optimizer).__name__}")
    owned = {id(p) for p in model.parameters()}
    params = ([optimizer.model_param(p) for g in optimizer.param_groups for p in g["params"]]
              if is_master_optimizer(optimizer) else
              [p for g in optimizer.param_groups for p in g["params"]])
    foreign = [p for p in params if id(p) not in owned]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
        raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters "
                         f"of the model (shapes {shapes}{', ...' if len(foreign) > 3 else ''}); "
                         f"build it from model.parameters() of the model you prepare")


def check_float64_model(model: nn.Module, policy: Policy) -> None:
    """A policy that stores 16-bit weights casts the fp32 ones (fp64 ones are kept, as
    ``torch.autocast`` leaves fp64 ops alone): a model whose floating parameters are all fp64
    (``model.double()``) would keep them, its policy saying 16 bits, and fail later at a matmul
    of its 16-bit inputs with its fp64 weights. Refused, saying what to write."""
    if policy.param_dtype == torch.float32:
        return
    floating = [p for p in model.parameters() if p.is_floating_point()]
    if floating and all(p.dtype == torch.float64 for p in floating):
        raise ValueError(
            f"every floating parameter of this model is float64 ({len(floating)} of them): "
            f"{policy} stores fp32 weights in {str(policy.param_dtype).split('.')[-1]} and "
            f"keeps fp64 ones as they are, so nothing would be cast. Call model.float() before "
            f"prepare (or use level='O0' or 'O1' to keep fp64)")


def check_fp16_state(optimizer, policy: Policy) -> None:
    """Without masters, an fp16 model's Adam- or RMSprop-style state is fp16 too:
    (1 - beta2) * g^2 (RMSprop's (1 - alpha) * g^2) underflows for small gradients. With an
    eps below fp16's smallest normal the update then divides by (almost) zero: refused. With a
    larger eps it stays finite but loses the normalisation there: said once, as a warning."""
    if optimizer is None or policy.master_weights or policy.param_dtype != torch.float16:
        return
    for i, group in enumerate(optimizer.param_groups):
        if "eps" not in group or not ("betas" in group or "alpha" in group):
            continue
        rate = ("betas", tuple(group["betas"])) if "betas" in group else ("alpha",
                                                                          group["alpha"])
        decay = float(group["betas"][1]) if "betas" in group else float(group["alpha"])
        eps = float(group["eps"])
        smallest = adam_state_underflow(decay)
        what = (f"{type(optimizer).__name__} (param_groups[{i}]: {rate[0]}={rate[1]}, "
                f"eps={eps:g}) keeps its second-moment estimates in fp16 under {policy} (no "
                f"master weights): (1 - {'beta2' if rate[0] == 'betas' else 'alpha'}) * grad^2 "
                f"rounds to 0 in fp16 for every |grad| <= {smallest:.2e}, and the update there "
                f"is divided by eps")
        if eps < _FP16.min_normal:
            raise ValueError(
                f"{what}, with an eps below fp16's smallest normal {_FP16.min_normal!r}: "
                f"inf/NaN weights. Use level='O2' (fp32 masters and optimizer state), "
                f"dtype='bf16' (fp32's exponent range), an SGD-style optimizer, or eps >= "
                f"{_FP16.min_normal!r} (2^-14)")
        warnings.warn(f"{what}: the normalisation is lost for those gradients. Level 'O2' "
                      f"(fp32 masters and state) or dtype='bf16' keep it", UserWarning,
                      stacklevel=user_stacklevel())


def check_one_of(policy, level, dtype) -> None:
    vocabulary.check_policy_alone(policy, level, dtype, "prepare")


#: Set on each 16-bit parameter of a model prepared with master weights.
NEEDS_MASTER = "_mixprec_needs_master"
_STEP_HOOK = []  # the global step pre-hook's handle, once registered
#: optimizer -> (models watched, its param groups' list ids and lengths) when last found clear
_WATCHED = [0]
_CLEARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def watch_masterless_steps(params) -> None:
    """Mark the 16-bit ``params`` of a model prepared with master weights, so that any torch
    optimizer stepping them itself (made after ``prepare(model)``, never wrapped: no masters,
    16-bit moments) is refused at its ``step()``. One global step pre-hook does it, registered
    by the first such model; an optimizer over none of them is checked tensor by tensor once, then
    again only when its param groups or the watched models change."""
    for p in params:
        setattr(p, NEEDS_MASTER, True)
    _WATCHED[0] += 1  # an optimizer cleared before may now hold some of them
    if not _STEP_HOOK:
        _STEP_HOOK.append(
            register_optimizer_step_pre_hook(_refuse_masterless_step))


def _refuse_masterless_step(optimizer, args, kwargs) -> None:
    if isinstance(optimizer, WrappedOptimizer) or optimizer.__dict__.get(STEPPED_BY_WRAPPER):
        return  # a master optimizer, or its inner optimizer stepped by it
    if any(isinstance(getattr(hook, "__self__", None), WrappedOptimizer)
           for hook in optimizer._optimizer_step_pre_hooks.values()):
        return  # a wrapped optimizer called directly: the wrapper's own refusal names it
    groups = (_WATCHED[0], *((id(g["params"]), len(g["params"])) for g in optimizer.param_groups))
    if _CLEARED.get(optimizer) == groups:
        return  # its groups were checked and have not changed: no per-tensor work per step
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, NEEDS_MASTER, False) and p.dtype in (torch.float16, torch.bfloat16):
                raise RuntimeError(
                    f"this {type(optimizer).__name__} steps the 16-bit weights of a model "
                    f"prepared with master weights (a {tuple(p.shape)} {p.dtype} parameter) "
                    f"itself: it was made after prepare(model) and has no fp32 masters "
                    f"(16-bit moments, updates below half a 16-bit ulp lost). Make it before "
                    f"and pass it: model, opt = mp.prepare(model, opt, level=...) (or "
                    f"amp.setup(model, opt)); or wrap this one: "
                    f"opt = mp.MasterWeightOptimizer(opt)")
    _CLEARED[optimizer] = groups


setattr(_refuse_masterless_step, INTERNAL, True)
