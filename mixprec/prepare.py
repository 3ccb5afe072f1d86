"""``mp.prepare``, ``mp.to_float`` and ``mp.policy_of``: casting a model to a precision level.

A prepared model stays the same ``nn.Module`` object: parameters are cast in place (their
identity is kept, so optimizers holding them keep working) and the forward of the root, of the
modules kept in fp32 and of ``to_float`` modules is wrapped by a small object that casts inputs,
enters the precision context and casts outputs. Nothing in torch is patched.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .autocast import autocast, cast_floating
from .dtypes import to_dtype
from .emulation import emulation_context
from .master import MasterWeightOptimizer, is_master_optimizer
from .oplists import warn_unreachable
from .policy import Policy

__all__ = ["prepare", "to_float", "policy_of"]

_POLICY_ATTR = "_mixprec_policy"
_FLOAT_ATTR = "_mixprec_float_dtype"      # set by to_float: this module computes in that dtype
_PREPARED_ATTR = "_mixprec_in_prepared"   # set on every submodule of a prepared model


class _PrecisionForward:
    """Replaces ``module.forward``: cast inputs, run under a context, cast outputs."""

    def __init__(self, forward, in_dtype, out_dtype, context_factory):
        self.forward = forward            # the module's own bound forward
        self.in_dtype = in_dtype
        self.out_dtype = out_dtype
        self.context_factory = context_factory

    def __call__(self, *args, **kwargs):
        if self.in_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), self.in_dtype)
        with self.context_factory():
            out = self.forward(*args, **kwargs)
        if self.out_dtype is not None:
            out = cast_floating(out, self.out_dtype)
        return out


def _wrap_forward(module: nn.Module, in_dtype, out_dtype, context_factory) -> None:
    current = module.forward
    module.forward = _PrecisionForward(current, in_dtype, out_dtype, context_factory)


def _fixed_precision_context(dtype: torch.dtype, device_type: str):
    """Autocast off (the module computes in exactly ``dtype``), with fp16 emulation if needed."""
    def factory():
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device_type, enabled=False))
        if dtype == torch.float16:
            stack.enter_context(emulation_context(device_type, dtype, "auto"))
        return stack
    return factory


def _device_of(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def _module_dtypes(root: nn.Module, root_dtype, override) -> dict[nn.Module, torch.dtype]:
    """The dtype each module's own tensors take: an override, else the parent's (top-down)."""
    result: dict[nn.Module, torch.dtype] = {}

    def visit(mod: nn.Module, name: str, inherited: torch.dtype) -> None:
        dt = override(mod, name) or inherited
        result.setdefault(mod, dt)
        for child_name, child in mod.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, dt)

    visit(root, "", root_dtype)
    return result


def _cast_tensors(dtypes: dict[nn.Module, torch.dtype]) -> None:
    """Cast each module's own floating params and buffers in place; a tied tensor once.

    A tensor shared by modules that want different dtypes takes the widest of them.
    """
    wanted: dict[int, torch.dtype] = {}
    for mod, dt in dtypes.items():
        for t in list(mod._parameters.values()) + list(mod._buffers.values()):
            if t is not None and t.is_floating_point() and t.dtype != torch.float64:
                prev = wanted.get(id(t))
                wanted[id(t)] = dt if prev is None or _width(dt) > _width(prev) else prev
    for mod in dtypes:
        for tensors in (mod._parameters, mod._buffers):
            for key, t in tensors.items():
                dt = None if t is None else wanted.get(id(t))
                if dt is None or t.dtype == dt:
                    continue
                if isinstance(t, nn.Parameter):
                    t.data = t.data.to(dt)
                else:
                    tensors[key] = t.to(dt)


def _width(dtype: torch.dtype) -> int:
    return 32 if dtype == torch.float32 else 16


def _float_mark(mod: nn.Module, _name: str = ""):
    return getattr(mod, _FLOAT_ATTR, None)


def to_float(module: nn.Module, dtype) -> nn.Module:
    """Make ``module`` compute in ``dtype`` (MindSpore's ``Cell.to_float``).

    Its floating parameters and buffers are cast, its floating inputs are cast at entry, and its
    forward runs with autocast off, so every op inside computes in ``dtype``. A sub-module with its
    own ``to_float`` keeps its setting: ``to_float(net, "fp16"); to_float(net.dense, "fp32")``
    leaves ``net.dense`` in fp32 whichever call comes first.

    Args:
        module: the sub-module.
        dtype: "fp32", "bf16", "fp16" or a floating torch dtype.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``dtype`` is not a floating dtype.
        RuntimeError: ``module`` belongs to a model already passed to :func:`prepare`.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> _ = to_float(net, "bf16"); _ = to_float(net[2], "fp32")
        >>> net[0].weight.dtype, net[2].weight.dtype
        (torch.bfloat16, torch.float32)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"to_float expects an nn.Module; got {type(module).__name__}")
    dt = to_dtype(dtype)
    if dt not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"to_float dtype must be 'fp32', 'fp16' or 'bf16'; got {dtype!r}")
    if getattr(module, _PREPARED_ATTR, False):
        raise RuntimeError("to_float must be called before mp.prepare() on the model that holds "
                           "this module (prepare already fixed its parameter dtypes and optimizer)")
    first = getattr(module, _FLOAT_ATTR, None) is None
    setattr(module, _FLOAT_ATTR, dt)
    _cast_tensors(_module_dtypes(module, dt, lambda m, n: None if m is module else _float_mark(m)))
    device_type = _device_of(module).type
    if first:
        _wrap_forward(module, dt, None, _fixed_precision_context(dt, device_type))
    else:  # re-marked: update the existing wrapper in place
        module.forward.in_dtype = dt
        module.forward.context_factory = _fixed_precision_context(dt, device_type)
    return module


def policy_of(model: nn.Module) -> Policy | None:
    """The :class:`Policy` a model was prepared with, or None."""
    return getattr(model, _POLICY_ATTR, None)


def _keep_matcher(keep: tuple):
    types = tuple(k for k in keep if isinstance(k, type))
    names = {k for k in keep if isinstance(k, str)}
    return lambda mod, name: bool(types) and isinstance(mod, types) or name in names


def _check_optimizer(model: nn.Module, optimizer) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None; got {type(optimizer).__name__}")
    owned = {id(p) for p in model.parameters()}
    params = ([optimizer.model_param(p) for g in optimizer.param_groups for p in g["params"]]
              if is_master_optimizer(optimizer) else
              [p for g in optimizer.param_groups for p in g["params"]])
    foreign = [p for p in params if id(p) not in owned]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
        raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the "
                         f"model (shapes {shapes}{', ...' if len(foreign) > 3 else ''}); build it from "
                         f"model.parameters() of the model you prepare")


def _resolve_policy(model, level, dtype, keep_fp32) -> Policy:
    policy = Policy.from_level(level, dtype, _device_of(model))
    if keep_fp32 is not None:
        extra = (keep_fp32,) if isinstance(keep_fp32, (type, str)) else tuple(keep_fp32)
        policy = Policy(**{**policy.__dict__, "keep_fp32": policy.keep_fp32 + extra})
    return policy


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, level: str = "O1",
            dtype: Any = "auto", keep_fp32=None, low_precision_ops=(), fp32_ops=(),
            emulate_fp16="auto"):
    """Set a model (and its optimizer) up for a precision level.

    * O0: nothing changes (fp32).
    * O1: parameters stay fp32; the forward runs under :class:`mixprec.autocast` (low precision
      for matmul/conv/linear; fp32 for softmax, layer/group/RMS norms and losses; BatchNorm
      takes low-precision activations with its fp32 statistics and parameters, accumulating in
      fp32, as torch.autocast does); ``keep_fp32`` modules run in fp32; outputs are cast to fp32.
    * O2: parameters and floating buffers are cast to the low-precision dtype, except norm layers
      and ``keep_fp32`` modules, which stay fp32 (inputs cast up, outputs cast back down); inputs
      are cast to the compute dtype at entry, outputs to fp32; the forward runs under
      :class:`mixprec.autocast`; the optimizer is wrapped in
      :class:`mixprec.MasterWeightOptimizer` with fp32 masters taken from the original weights.
    * O3: everything low precision, norms included; no autocast, no master weights.

    Integer buffers are never cast; a tied parameter is cast once; modules marked with
    :func:`to_float` keep their own dtype.

    Args:
        model: the model (prepared in place; the same object is returned).
        optimizer: an optimizer over ``model``'s parameters, or None.
        level: "O0", "O1", "O2" or "O3".
        dtype: "bf16", "fp16", a torch dtype, or "auto" (the fast 16-bit type of the model's device).
        keep_fp32: extra module types or qualified module names kept in fp32.
        low_precision_ops, fp32_ops: custom op lists for the autocast of O1/O2.
        emulate_fp16: see :class:`mixprec.autocast`.

    Returns:
        ``model``, or ``(model, optimizer)`` when an optimizer is given.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: an unknown level, dtype or op name, or an optimizer holding foreign tensors.
        RuntimeError: the model was already prepared.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> net, opt = prepare(net, opt, level="O2", dtype="bf16")
        >>> net[0].weight.dtype, net[1].weight.dtype, type(opt).__name__
        (torch.bfloat16, torch.float32, 'MasterWeightOptimizer')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare expects an nn.Module as model; got {type(model).__name__}")
    if policy_of(model) is not None:
        raise RuntimeError(f"this model was already prepared ({policy_of(model)}); prepare it once, "
                           f"from a fresh fp32 model")
    policy = _resolve_policy(model, level, dtype, keep_fp32)
    _check_optimizer(model, optimizer)
    context = _level_context(policy, _device_of(model).type, low_precision_ops, fp32_ops, emulate_fp16)
    warn_unreachable(model, low_precision_ops, fp32_ops, stacklevel=3)  # names op lists miss
    originals = _cast_model(model, policy)
    if policy.master_weights and optimizer is not None:
        optimizer = _wrap_optimizer(optimizer, originals)
    if policy.level != "O0":
        in_dtype = policy.compute_dtype if policy.level in ("O2", "O3") else None
        _wrap_forward(model, in_dtype, policy.output_dtype, context)
    setattr(model, _POLICY_ATTR, policy)
    for mod in model.modules():
        setattr(mod, _PREPARED_ATTR, True)
    return model if optimizer is None else (model, optimizer)


def _level_context(policy: Policy, device_type: str, low_ops, fp32_ops, emulate_fp16):
    if policy.autocast:
        ac = autocast(policy.compute_dtype, device_type=device_type, low_precision_ops=low_ops,
                      fp32_ops=fp32_ops, emulate_fp16=emulate_fp16)
        return ac._recreate_cm
    if low_ops or fp32_ops:
        raise ValueError(f"custom op lists need autocast, which level {policy.level} does not use; "
                         f"use level 'O1' or 'O2'")
    if policy.level == "O0":
        return contextlib.nullcontext
    return _fixed_precision_context(policy.compute_dtype, device_type)


def _cast_model(model: nn.Module, policy: Policy) -> dict[int, torch.Tensor]:
    """Cast tensors per the policy and wrap kept modules; return fp32 originals of cast params."""
    keep = _keep_matcher(policy.keep_fp32)
    fp32 = torch.float32

    def override(mod, name):
        return _float_mark(mod) or (fp32 if keep(mod, name) else None)

    dtypes = _module_dtypes(model, policy.param_dtype, override)
    originals = {id(p): p.detach().clone() for mod, dt in dtypes.items() if dt != fp32
                 for p in mod._parameters.values() if p is not None and p.dtype == fp32}
    _cast_tensors(dtypes)
    device_type = _device_of(model).type
    out = policy.compute_dtype if policy.level in ("O2", "O3") else None
    for name, mod in model.named_modules():
        if _float_mark(mod) is None and keep(mod, name) and policy.level != "O0":
            in_dtype = None if _takes_low_precision_input(mod, device_type) else fp32
            _wrap_forward(mod, in_dtype, out, _fixed_precision_context(fp32, device_type))
    return originals


def _takes_low_precision_input(mod: nn.Module, device_type: str) -> bool:
    """Norm kernels that read bf16/fp16 activations with fp32 parameters (and statistics) and
    accumulate in fp32: the numbers of casting the input up, to the rounding of the output and
    fp32 reassociation, without two casts around the layer (BatchNorm on CPU and CUDA;
    LayerNorm and GroupNorm on CPU, 4x faster than the cast path there)."""
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        return device_type in ("cpu", "cuda")
    return isinstance(mod, (nn.LayerNorm, nn.GroupNorm)) and device_type == "cpu"


def _wrap_optimizer(optimizer, originals: dict[int, torch.Tensor]):
    """Wrap in a MasterWeightOptimizer whose masters hold the exact fp32 originals."""
    if is_master_optimizer(optimizer):
        return optimizer
    wrapped = MasterWeightOptimizer(optimizer)
    with torch.no_grad():
        for group in wrapped.param_groups:
            for master in group["params"]:
                original = originals.get(id(wrapped.model_param(master)))
                if original is not None and master is not wrapped.model_param(master):
                    master.copy_(original)
    return wrapped
