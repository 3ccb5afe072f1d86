"""``mp.prepare``, ``mp.to_float`` and ``mp.policy_of``: casting a model to a precision policy.

A prepared model stays the same ``nn.Module`` object: parameters are cast in place (their
identity is kept, so optimizers holding them keep working) and the forward of the root, of the
modules kept in fp32 and of ``to_float`` modules is wrapped by a small picklable object that
casts inputs, runs the forward under a :class:`mixprec.autocast.PrecisionContext` and casts
outputs. Nothing in torch is patched; the wrappers compile into one ``torch.compile`` graph.

Two kinds of wrapper:

* the entry of the prepared model (``_Entry``): casts the model's floating inputs to the compute
  dtype (``Policy.cast_inputs``), runs the forward under the policy's context (autocast with the
  op lists, or one fixed dtype), casts the outputs to ``Policy.output_dtype``;
* a precision island (``_Island``): a ``to_float`` module or a ``keep_fp32`` module. It casts its
  floating inputs to its dtype, runs with autocast off, and returns its floating outputs in the
  dtype its (first floating) input came in, so every module computes in its own dtype whatever
  its neighbours output, nested islands included.
"""

from __future__ import annotations

import difflib
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .autocast import PrecisionContext, autocast, cast_floating
from .dtypes import TRAINING_DTYPES, dtype_name, is_low_precision, to_dtype
from .master import MasterWeightOptimizer, is_master_optimizer
from .oplists import warn_unreachable
from .policy import Policy, keep_fp32_entries

__all__ = ["prepare", "to_float", "policy_of", "module_device", "ForwardWrapper"]

_POLICY_ATTR = "_mixprec_policy"
_FLOAT_ATTR = "_mixprec_float_dtype"      # set by to_float: this module computes in that dtype
_PREPARED_ATTR = "_mixprec_in_prepared"   # set on every submodule of a prepared model
_MASTERS_ATTR = "_mixprec_masters"        # a _MasterLink on the prepared root
_FP32 = torch.float32
_FP16_MIN_SUBNORMAL = 2.0 ** -24


# -- the forward wrappers --------------------------------------------------------------------------
class ForwardWrapper:
    """Replaces ``module.forward`` (as an instance attribute, picklable); ``call_inner`` runs the
    forward it replaced: an earlier wrapper, else the class's own ``forward``."""

    def __init__(self, module: nn.Module):
        self.module = module
        # a wrapper installed before this one, else None: the class's own forward
        self.inner = module.__dict__.get("forward")

    def call_inner(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


class _Entry(ForwardWrapper):
    """The prepared model's entry: inputs to the compute dtype, the policy's context, outputs."""

    def __init__(self, module, in_dtype, out_dtype, context: PrecisionContext | None):
        super().__init__(module)
        self.in_dtype, self.out_dtype, self.context = in_dtype, out_dtype, context

    def __call__(self, *args, **kwargs):
        if self.in_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), self.in_dtype)
        if self.context is None:
            out = self.call_inner(*args, **kwargs)
        else:
            out = self.context.run(self.call_inner, args, kwargs)
        return out if self.out_dtype is None else cast_floating(out, self.out_dtype)


class _Island(ForwardWrapper):
    """A module computing in one dtype: inputs cast in, outputs back to the incoming dtype."""

    def __init__(self, module, dtype: torch.dtype, cast_inputs: bool, context: PrecisionContext):
        super().__init__(module)
        self.dtype, self.cast_inputs, self.context = dtype, cast_inputs, context

    def __call__(self, *args, **kwargs):
        incoming = _first_floating_dtype((args, kwargs))
        if self.cast_inputs:
            args, kwargs = cast_floating((args, kwargs), self.dtype)
        out = self.context.run(self.call_inner, args, kwargs)
        if incoming is not None and incoming != self.dtype:
            out = cast_floating(out, incoming)
        return out


def _first_floating_dtype(tree) -> torch.dtype | None:
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and t.dtype in TRAINING_DTYPES:
            return t.dtype
    return None


# -- module dtypes -------------------------------------------------------------------------------
def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter (or buffer); the CPU for a module with none."""
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


def _cast_tensors(dtypes: dict[nn.Module, torch.dtype],
                  originals: dict[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Cast each module's own floating params and buffers in place; a tied tensor once.

    A tensor shared by modules that want different dtypes takes the widest of them. With
    ``originals``, each fp32 parameter cast narrower leaves its fp32 data there (the storage
    itself, no copy: the masters start from it).
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
                    if originals is not None and t.dtype == _FP32:
                        originals[t] = t.data
                    t.data = t.data.to(dt)
                else:
                    tensors[key] = t.to(dt)


def _width(dtype: torch.dtype) -> int:
    return 32 if dtype == _FP32 else 16


def _float_mark(mod: nn.Module, _name: str = ""):
    return getattr(mod, _FLOAT_ATTR, None)


def _check_materialised(model: nn.Module) -> None:
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(
            f"{len(meta)} parameter(s)/buffer(s) of the model are on the meta device (e.g. "
            f"{meta[0]!r}): they hold no values to cast. Materialise the model first, e.g. "
            "model.to_empty(device='cpu') and initialise (or load) its weights, then prepare it")


# -- to_float ------------------------------------------------------------------------------------
def to_float(module: nn.Module, dtype) -> nn.Module:
    """Make ``module`` compute in ``dtype`` (MindSpore's ``Cell.to_float``).

    Its floating parameters and buffers are cast, its floating inputs are cast at entry, and its
    forward runs with autocast off, so every op inside computes in ``dtype``. Its floating
    outputs are returned in the dtype its input came in, so the modules around it keep their
    own dtype. A sub-module with its own ``to_float`` keeps its setting:
    ``to_float(net, "fp16"); to_float(net.dense, "fp32")`` leaves ``net.dense`` in fp32
    whichever call comes first.

    Args:
        module: the sub-module.
        dtype: "fp32", "bf16", "fp16" or a floating torch dtype.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``dtype`` is not a training dtype; the module is on the meta device.
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
    if dt not in TRAINING_DTYPES:
        raise ValueError(f"to_float dtype must be 'fp32', 'fp16' or 'bf16'; got {dtype!r}")
    if getattr(module, _PREPARED_ATTR, False):
        raise RuntimeError("to_float must be called before mp.prepare() on the model that holds "
                           "this module (prepare already fixed its parameter dtypes and optimizer)")
    _check_materialised(module)
    setattr(module, _FLOAT_ATTR, dt)
    _cast_tensors(_module_dtypes(module, dt, lambda m, n: None if m is module else _float_mark(m)))
    context = PrecisionContext.fixed(dt, module_device(module).type)
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, _Island):  # re-marked: update the existing wrapper in place
        wrapper.dtype, wrapper.context = dt, context
    else:
        module.forward = _Island(module, dt, True, context)
    return module


# -- prepare -------------------------------------------------------------------------------------
def policy_of(model: nn.Module) -> Policy | None:
    """The :class:`Policy` a model was prepared with, or None."""
    return getattr(model, _POLICY_ATTR, None)


def _keep_matcher(keep: tuple):
    types = tuple(k for k in keep if isinstance(k, type))
    names = {k for k in keep if isinstance(k, str)}
    return lambda mod, name: bool(types) and isinstance(mod, types) or name in names


def _check_keep_names(model: nn.Module, keep: tuple) -> None:
    names = {name for name, _ in model.named_modules() if name}
    unknown = [k for k in keep if isinstance(k, str) and k not in names]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, names, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"keep_fp32 names no module of the model: {', '.join(hints)}; qualified "
                         f"names look like {sorted(names)[:4]}")


def _check_marks(model: nn.Module, policy: Policy) -> None:
    """A to_float dtype and the policy's compute dtype that are two different 16-bit formats."""
    if policy.compute_dtype == _FP32:
        return
    for name, mod in model.named_modules():
        mark = _float_mark(mod)
        if mark is not None and mark not in (_FP32, policy.compute_dtype):
            where = name or "the model itself"
            raise ValueError(
                f"module {where!r} was marked to_float({dtype_name(mark)}) but this policy "
                f"computes in {dtype_name(policy.compute_dtype)}: one model can't mix two "
                f"16-bit formats. Prepare with dtype={dtype_name(mark)!r}, or mark the module "
                f"to_float({dtype_name(policy.compute_dtype)!r}) or to_float('fp32')")


def _check_optimizer(model: nn.Module, optimizer) -> None:
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


def _check_eps(optimizer, policy: Policy) -> None:
    """Without masters, an fp16 model's Adam state is fp16 too, where a tiny eps is 0."""
    if optimizer is None or policy.master_weights or policy.param_dtype != torch.float16:
        return
    for i, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        if isinstance(eps, float) and 0 < eps < _FP16_MIN_SUBNORMAL / 2:
            warnings.warn(
                f"param_groups[{i}] has eps={eps:g}, which rounds to 0 in fp16 (smallest "
                f"subnormal 2^-24 = 5.96e-08): without master weights ({policy}) the optimizer "
                f"state is fp16 too, so where a gradient is 0 an Adam-style update divides 0 by "
                f"0. Use eps >= 1e-7, or level O2 (fp32 masters and state)", UserWarning,
                stacklevel=3)


def _resolve_policy(model, level, dtype, keep_fp32, policy) -> Policy:
    if policy is not None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a mixprec.Policy; got {type(policy).__name__}")
        if level != "O1" or not (isinstance(dtype, str) and dtype == "auto"):
            raise ValueError("pass either policy= or level=/dtype=, not both; got policy="
                             f"{policy} with level={level!r}, dtype={dtype!r}")
    else:
        policy = Policy.from_level(level, dtype, module_device(model))
    if keep_fp32 is not None:
        extra = keep_fp32_entries(keep_fp32)
        policy = Policy(**{**policy.__dict__, "keep_fp32": policy.keep_fp32 + extra})
    return policy


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, level: str = "O1",
            dtype: Any = "auto", keep_fp32=None, policy: Policy | None = None,
            low_precision_ops=(), fp32_ops=(), emulate_fp16="auto"):
    """Set a model (and its optimizer) up for a precision level or policy.

    * O0: nothing changes (fp32).
    * O1: parameters stay fp32; the forward runs under :class:`mixprec.autocast` (low precision
      for matmul/conv/linear; fp32 for softmax, layer/group/RMS norms and losses; BatchNorm
      takes low-precision activations with its fp32 statistics and parameters, accumulating in
      fp32, as torch.autocast does); ``keep_fp32`` modules run in fp32; outputs are cast to fp32.
    * O2: parameters and floating buffers are cast to the low-precision dtype, except norm layers
      and ``keep_fp32`` modules, which stay fp32 and compute in fp32; inputs are cast to the
      compute dtype at entry, outputs to fp32; the forward runs under :class:`mixprec.autocast`;
      the optimizer is wrapped in :class:`mixprec.MasterWeightOptimizer` with fp32 masters taken
      from the original weights.
    * O3: everything low precision, norms included; no autocast, no master weights.

    ``policy=mp.Policy(...)`` sets every one of these choices directly instead (see
    :class:`mixprec.Policy`). Integer buffers are never cast; a tied parameter is cast once;
    modules marked with :func:`to_float` keep their own dtype. The prepared model's
    ``state_dict()`` holds fp32 values: the exact masters of an optimizer prepared with it (O2),
    exact upcasts of other low-precision tensors; ``load_state_dict`` of such a dict sets the
    masters exactly and the low-precision parameters to their rounding.

    Args:
        model: the model (prepared in place; the same object is returned).
        optimizer: an optimizer over ``model``'s parameters, or None.
        level: "O0", "O1", "O2" or "O3".
        dtype: "bf16", "fp16", a torch dtype, or "auto" (the fast 16-bit type of the model's
            device).
        keep_fp32: extra module types or qualified module names kept in fp32.
        policy: a :class:`mixprec.Policy`, instead of ``level``/``dtype``.
        low_precision_ops, fp32_ops: custom op lists for the autocast of O1/O2.
        emulate_fp16: see :class:`mixprec.autocast`.

    Returns:
        ``model``, or ``(model, optimizer)`` when an optimizer is given.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or a bad ``policy``/``optimizer``/
            ``keep_fp32``.
        ValueError: an unknown level, dtype or op name; an optimizer holding foreign tensors;
            ``keep_fp32`` names that match no module; a ``to_float`` mark in another 16-bit
            format than the policy's; a model on the meta device; ``policy`` with ``level``.
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
        raise RuntimeError(f"this model was already prepared ({policy_of(model)}); prepare it "
                           f"once, from a fresh fp32 model")
    _check_materialised(model)
    policy = _resolve_policy(model, level, dtype, keep_fp32, policy)
    _check_keep_names(model, policy.keep_fp32)
    _check_marks(model, policy)
    _check_optimizer(model, optimizer)
    _check_eps(optimizer, policy)
    device_type = module_device(model).type
    context = _policy_context(policy, device_type, low_precision_ops, fp32_ops, emulate_fp16)
    warn_unreachable(model, low_precision_ops, fp32_ops, stacklevel=3)  # names op lists miss
    originals = _cast_model(model, policy, device_type)
    if policy.master_weights and optimizer is not None:
        optimizer = _wrap_optimizer(optimizer, originals)
        setattr(model, _MASTERS_ATTR, _MasterLink(optimizer))
    if policy.is_mixed or policy.autocast or policy.cast_inputs:
        in_dtype = policy.compute_dtype if policy.cast_inputs else None
        model.forward = _Entry(model, in_dtype, policy.output_dtype, context)
    _register_fp32_state_dict(model)
    setattr(model, _POLICY_ATTR, policy)
    for mod in model.modules():
        setattr(mod, _PREPARED_ATTR, True)
    return model if optimizer is None else (model, optimizer)


def _policy_context(policy: Policy, device_type: str, low_ops, fp32_ops,
                    emulate_fp16) -> PrecisionContext | None:
    if policy.autocast:
        return autocast(policy.compute_dtype, device_type=device_type, low_precision_ops=low_ops,
                        fp32_ops=fp32_ops, emulate_fp16=emulate_fp16).context
    if low_ops or fp32_ops:
        raise ValueError(f"custom op lists need autocast, which {policy} does not use; use "
                         f"level 'O1' or 'O2' (or a Policy with autocast=True)")
    if policy.compute_dtype == _FP32:
        return None
    return PrecisionContext.fixed(policy.compute_dtype, device_type, emulate_fp16)


def _cast_model(model: nn.Module, policy: Policy,
                device_type: str) -> dict[torch.Tensor, torch.Tensor]:
    """Cast tensors per the policy and wrap kept modules; return the fp32 data of cast params."""
    keep = _keep_matcher(policy.keep_fp32)

    def override(mod, name):
        return _float_mark(mod) or (_FP32 if keep(mod, name) else None)

    dtypes = _module_dtypes(model, policy.param_dtype, override)
    originals: dict[torch.Tensor, torch.Tensor] = {}
    _cast_tensors(dtypes, originals)
    if not policy.is_mixed:
        return originals
    context = PrecisionContext.fixed(_FP32, device_type)
    for name, mod in model.named_modules():
        if _float_mark(mod) is None and keep(mod, name):
            cast_inputs = not _takes_low_precision_input(mod, device_type)
            mod.forward = _Island(mod, _FP32, cast_inputs, context)
    return originals


def _takes_low_precision_input(mod: nn.Module, device_type: str) -> bool:
    """Norm kernels that read bf16/fp16 activations with fp32 parameters (and statistics) and
    accumulate in fp32: the numbers of casting the input up, to the rounding of the output and
    fp32 reassociation, without two casts around the layer (BatchNorm on CPU and CUDA;
    LayerNorm and GroupNorm on CPU, 4x faster than the cast path there)."""
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        return device_type in ("cpu", "cuda")
    return isinstance(mod, (nn.LayerNorm, nn.GroupNorm)) and device_type == "cpu"


def _wrap_optimizer(optimizer, originals: dict[torch.Tensor, torch.Tensor]):
    """Wrap in a MasterWeightOptimizer whose masters are the exact fp32 originals (their
    storage: the cast kept no second fp32 copy of the weights)."""
    if is_master_optimizer(optimizer):
        return optimizer
    return MasterWeightOptimizer(optimizer, initial_masters=originals)


# -- fp32 state dicts ------------------------------------------------------------------------------
class _MasterLink:
    """The prepared model's link to its masters: a weak reference, dropped when pickled."""

    def __init__(self, optimizer: MasterWeightOptimizer):
        self._ref = weakref.ref(optimizer)

    def masters(self) -> dict[torch.Tensor, torch.Tensor]:
        opt = self._ref() if self._ref is not None else None
        return {} if opt is None else opt.masters_by_param()

    def __getstate__(self) -> dict:
        return {"_ref": None}


def _register_fp32_state_dict(model: nn.Module) -> None:
    if not any(t.is_floating_point() and is_low_precision(t)
               for t in [*model.parameters(), *model.buffers()]):
        return
    post = getattr(model, "register_state_dict_post_hook", None)
    if post is not None:
        post(_fp32_state_dict_hook)
    else:  # torch < 2.5
        model._register_state_dict_hook(_fp32_state_dict_hook)
    pre = getattr(model, "register_load_state_dict_pre_hook", None)
    if pre is not None:
        pre(_load_masters_hook)
    else:  # torch < 2.5
        model._register_load_state_dict_pre_hook(_load_masters_hook, with_module=True)


def _named_tensors(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    head = prefix[:-1] if prefix.endswith(".") else prefix
    return {**dict(module.named_parameters(prefix=head, remove_duplicate=False)),
            **dict(module.named_buffers(prefix=head, remove_duplicate=False))}


def _fp32_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: low-precision floating values become fp32 (masters where known)."""
    link = getattr(module, _MASTERS_ATTR, None)
    masters = link.masters() if link is not None else {}
    tensors = _named_tensors(module, prefix)
    for key, value in list(state_dict.items()):
        own = tensors.get(key)
        if own is None or value is own or not torch.is_tensor(value) \
                or not is_low_precision(value):
            continue  # not ours, keep_vars=True (the tensor itself), or already fp32
        master = masters.get(own)
        state_dict[key] = master.detach() if master is not None else value.to(_FP32)


def _load_masters_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                       unexpected_keys, error_msgs) -> None:
    """load_state_dict pre-hook: the masters take the loaded values exactly (torch then rounds
    them into the low-precision parameters)."""
    link = getattr(module, _MASTERS_ATTR, None)
    masters = link.masters() if link is not None else {}
    if not masters:
        return
    tensors = _named_tensors(module, prefix)
    with torch.no_grad():
        for key, value in state_dict.items():
            master = masters.get(tensors.get(key))
            if master is not None and torch.is_tensor(value) and value.shape == master.shape:
                master.copy_(value)
