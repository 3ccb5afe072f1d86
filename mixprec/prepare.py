"""``mp.prepare`` and ``mp.policy_of``: setting a model and its optimizers up for a policy.

A prepared model stays the same ``nn.Module`` object: parameters are cast in place (their
identity is kept, so optimizers holding them keep working) and the forward of the root, of the
modules kept in fp32 and of ``to_float`` modules is wrapped by a small picklable object (see
:mod:`mixprec.regions`). Nothing in torch is patched; the wrappers compile into one
``torch.compile`` graph.

What is stored in which dtype: a parameter is stored in the policy's ``param_dtype``, except in
fp32 modules (``keep_fp32``, ``to_float("fp32")``) where it is fp32, and except a parameter that
no optimizer trains under a master-weight policy (``requires_grad=False``, or not in the
optimizer given to ``prepare``): it keeps the dtype it has, since no master would keep its fp32
value. ``to_float`` alone never changes a parameter's storage (MindSpore keeps the Parameter in
fp32 and casts at compute): its region casts parameters for the call. Floating buffers take the
dtype their module computes in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from . import lowbit, vocabulary
from . import prepare_checks as checks
from .autocast import PrecisionContext, autocast
from .casting import (
    PREPARED_ATTR,
    cast_tensors,
    check_materialised,
    float_mark,
    marks_map,
    module_device,
    module_dtypes,
    takes_low_precision_input,
    to_float,
)
from .distenv import in_ddp
from .dtypes import dtype_name, is_low_precision
from .fp8 import choice as fp8_choice
from .fp8.convert import convert as convert_fp8
from .hfsave import fp32_save_pretrained
from .modulecasts import guard_casts
from .oplists import warn_unreachable
from .optim import is_master_optimizer, wrap_optimizer
from .optim.refusals import check_listed_once
from .optim.wrapper import WrappedOptimizer
from .policy import Policy, no_masters_message
from .precision_map import keep_fp32_entries
from .regions import (
    Entry,
    ForwardWrapper,
    Island,
    Region,
    assign_regions,
    island_of,
    island_region,
    refresh_island,
    region_modules,
)
from .statedict import companions_of, link_masters, register_fp32_state_dict

__all__ = ["prepare", "prepare_many", "resolve_policy", "to_float", "policy_of", "module_device",
           "ForwardWrapper"]

_POLICY_ATTR = "_mixprec_policy"
_FP32 = torch.float32


def policy_of(model: nn.Module) -> Policy | None:
    """The :class:`Policy` a model was prepared with, or None. Its ``modules`` map holds what
    single modules compute in as prepared: the policy's entries, the model's ``to_float``
    marks, and the low-bit layers chosen, by qualified name (``str()`` shows them).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"policy_of takes an nn.Module (a model or sub-module); got "
                        f"{type(model).__name__}")
    return getattr(model, _POLICY_ATTR, None)


def _module_dtype(policy: Policy):
    """(module, qualified name) -> the dtype ``policy.modules`` gives it, or None."""
    return policy.module_dtype


def _check_marks(model: nn.Module, policy: Policy) -> None:
    """A module dtype and the policy's compute dtype that are two different 16-bit formats."""
    if policy.compute_dtype == _FP32:
        return
    dtype_of = _module_dtype(policy)
    for name, mod in model.named_modules():
        dt = dtype_of(mod, name)
        if dt is not None and dt not in (_FP32, policy.compute_dtype):
            where = name or "the model itself"
            how = ("marked to_float" if float_mark(mod) is not None else "given by the "
                   "policy's modules map as")
            raise ValueError(
                f"module {where!r} was {how}({dtype_name(dt)}) but this policy "
                f"computes in {dtype_name(policy.compute_dtype)}: one model can't mix two "
                f"16-bit formats. Prepare with dtype={dtype_name(dt)!r}, or mark the module "
                f"to_float({dtype_name(policy.compute_dtype)!r}) or to_float('fp32')")


def _recorded(model: nn.Module, policy: Policy) -> Policy:
    """The policy with the model's to_float marks as entries of its map by qualified name (a
    mark replaces an entry for the same name: the module computes as marked)."""
    marks = marks_map(model)
    if not len(marks):
        return policy
    lowbit_too = [n for n in marks if (policy.modules.get(n) or marks[n]).lowbit is not None]
    if lowbit_too:
        raise ValueError(f"modules {lowbit_too} are marked to_float and given a low-bit GEMM "
                         f"format by the policy: a low-bit layer computes in the dtype of the "
                         f"code around it; drop one of the two")
    return dataclasses.replace(policy, modules=policy.modules.updated(marks))


def resolve_policy(level, dtype, keep_fp32, policy, device, *, warn: bool = True, master=None,
                   state_dtype=None, fp8=None, fp8_modules=None) -> Policy:
    """The policy ``prepare`` uses: ``policy``, or the level's on ``device`` (resolving
    ``dtype="auto"`` there; ``warn``: about a dtype slow there), with ``keep_fp32`` added,
    ``master``/``state_dtype`` set when given (they need a master-weight policy), and ``fp8`` /
    ``fp8_modules`` (names) set."""
    if policy is not None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a mixprec.Policy; got {type(policy).__name__}")
    else:
        policy = Policy.from_level(level, dtype, device, warn=warn)
    if keep_fp32 is not None:
        policy = dataclasses.replace(policy, keep_fp32=keep_fp32_entries(keep_fp32))
    compact = {k: v for k, v in (("master", master), ("state_dtype", state_dtype))
               if v is not None}
    if compact:
        policy = dataclasses.replace(policy, **compact)
    if master is not None and not policy.master_weights and policy.param_dtype != torch.float32:
        # fp32 masters asked for where there are none (the compact methods are refused by Policy)
        raise ValueError(no_masters_message(f"master={str(policy.master)!r}", policy.level,
                                            policy.param_dtype))
    policy = _with_fp8(policy, fp8, fp8_modules)
    return policy


def _with_fp8(policy: Policy, fp8, fp8_modules) -> Policy:
    """``policy`` with the ``fp8=`` / ``fp8_modules=`` (names) arguments of ``prepare``."""
    if fp8 is not None:
        fp8 = lowbit.resolve(fp8)
        if policy.fp8 is not None and policy.fp8 != fp8:
            raise ValueError(f"fp8={str(fp8)!r} disagrees with the policy's "
                             f"fp8={str(policy.fp8)!r}")
        policy = dataclasses.replace(policy, fp8=fp8)
    if fp8_modules is not None:
        if policy.fp8 is None:
            raise ValueError(f"fp8_modules chooses the layers that run in FP8: it needs fp8= "
                             f"({fp8_choice.FORMATS})")
        policy = dataclasses.replace(policy, fp8_modules=fp8_modules)
    return policy


@vocabulary.takes(*vocabulary.PRECISION, *vocabulary.EMULATION)
def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
            level: str = vocabulary.LEVEL,
            dtype: Any = vocabulary.DTYPE, keep_fp32=None, policy: Policy | None = None,
            low_precision_ops=(), fp32_ops=(), emulate_fp16="auto", master: str | None = None,
            state_dtype=None, fp8: str | None = None, fp8_modules=None):
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
    * ``fp8=``, with any level: the GEMMs of chosen ``nn.Linear`` layers (and Hugging Face
      ``Conv1D`` layers) run in FP8 through torchao (``pip install mixprec[fp8]``): their
      inputs, weights and output gradients are cast to FP8 with dynamic scales, the output
      comes back in the layer's compute dtype; everything else follows the level. The default
      choice keeps the first and last Linear, and layers whose dimensions are not multiples of
      16, in 16 bits (see :mod:`mixprec.fp8.choice`); ``mp.fp8_modules(model)`` lists the
      converted layers, and ``mp.policy_of(model).fp8_modules`` records their names.

    Keeping something in fp32, one way at each level (the other spellings are aliases that
    write the same setting):

    * an op: ``fp32_ops=["softmax"]``, beyond the autocast's fp32 list (O1/O2);
    * a module, its parameters and its compute: ``keep_fp32=["head", nn.LayerNorm]``. Aliases:
      ``mp.to_float(model.head, "fp32")`` before ``prepare`` (MindSpore's spelling), and the
      ``Policy.modules`` entry ``{"head": "fp32"}``; ``policy_of(model)`` shows all three as
      ``modules=[head:fp32]``;
    * a module's parameters only, its compute staying 16-bit: the ``Policy.modules`` entry
      ``{"embed": mp.Precision("bf16", params="fp32")}``.

    ``policy=mp.Policy(...)`` sets every one of these choices directly instead (see
    :class:`mixprec.Policy`). Integer buffers are never cast; a tied parameter is cast once;
    modules marked with :func:`to_float` keep their own dtype. The prepared model's
    ``state_dict()`` holds fp32 values: the exact masters of an optimizer prepared with it (O2),
    exact upcasts of other low-precision tensors; ``load_state_dict`` of such a dict sets the
    masters exactly and the low-precision parameters to their rounding.

    Args:
        model: the model (prepared in place; the same object is returned).
        optimizer: an optimizer over ``model``'s parameters, or None.
        {precision keywords}

    Returns:
        ``model``, or ``(model, optimizer)`` when an optimizer is given.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or is already wrapped in
            ``DistributedDataParallel`` (prepare first, then wrap), or a bad ``policy``/
            ``optimizer``/``keep_fp32``.
        ValueError: an unknown level, dtype or op name; an optimizer holding foreign tensors;
            ``keep_fp32`` names that match no module; a ``to_float`` mark in another 16-bit
            format than the policy's; a model on the meta device; ``policy`` with ``level``;
            ``fp8_modules`` naming a layer that cannot take FP8 (the reason is given).
        RuntimeError: the model was already prepared; FP8 on a GPU older than sm89; NVFP4.
        ImportError: ``fp8`` without torchao installed (``pip install mixprec[fp8]``).

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> net, opt = prepare(net, opt, level="O2", dtype="bf16")
        >>> net[0].weight.dtype, net[1].weight.dtype, type(opt).__name__
        (torch.bfloat16, torch.float32, 'MasterWeightOptimizer')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare expects an nn.Module as model; got {type(model).__name__}")
    checks.check_one_of(policy, level, dtype)
    keep_fp32, low_precision_ops, fp32_ops = checks.check_keywords(
        keep_fp32, low_precision_ops, fp32_ops, emulate_fp16)
    names, chooser = fp8_choice.split_spec(fp8 or getattr(policy, "fp8", None), fp8_modules)
    model, optimizers = prepare_many(
        model, [] if optimizer is None else [optimizer],
        resolve_policy(level, dtype, keep_fp32, policy, module_device(model), master=master,
                       state_dtype=state_dtype, fp8=fp8, fp8_modules=names),
        low_precision_ops=low_precision_ops, fp32_ops=fp32_ops, emulate_fp16=emulate_fp16,
        fp8_filter=chooser)
    return model if optimizer is None else (model, optimizers[0])


def prepare_many(model: nn.Module, optimizers: list, policy: Policy, *, low_precision_ops=(),
                 fp32_ops=(), emulate_fp16="auto", fp8_filter=None) -> tuple[nn.Module, list]:
    """:func:`prepare` for a resolved ``policy`` and any number of optimizers over ``model``
    (disjoint parameter sets; each is wrapped at a master-weight policy). What
    :class:`mixprec.MixedPrecision` and the strategies call. ``fp8_filter``: the callable
    ``fp8_modules`` of :func:`prepare` (the policy holds names only)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare expects an nn.Module as model; got {type(model).__name__}")
    if in_ddp(model):  # (also inside torch.compile's wrapper)
        raise TypeError("prepare takes the model before it is wrapped in "
                        "DistributedDataParallel (DDP sizes its gradient buckets for the "
                        "parameters' dtype when it wraps, and would no longer average the "
                        "gradients of the cast ones): call model, opt = mp.prepare(model, opt, "
                        "...) first, then model = mp.parallel.ddp(model)")
    if policy_of(model) is not None:
        raise RuntimeError(f"this model was already prepared ({policy_of(model)}); prepare it "
                           f"once, from a fresh fp32 model")
    check_materialised(model)
    policy = _recorded(model, policy)  # to_float marks: entries of the map from here on
    checks.check_names(model, policy)
    checks.check_float64_model(model, policy)
    _check_marks(model, policy)
    for optimizer in optimizers:
        checks.check_optimizer(model, optimizer)
        checks.check_fp16_state(optimizer, policy)
        if policy.master_weights and policy.master.compact and optimizer is not None:
            check_listed_once([p for g in optimizer.param_groups for p in g["params"]],
                              policy.master)
    checks.check_prepared_parts(model, optimizers, policy.param_dtype != _FP32)
    policy = fp8_choice.with_modules(policy, model, fp8_filter)  # names, recorded below
    convert_fp8(model, policy)
    device_type = module_device(model).type
    context = _policy_context(policy, device_type, low_precision_ops, fp32_ops, emulate_fp16)
    warn_unreachable(model, low_precision_ops, fp32_ops, stacklevel=4)  # names op lists miss
    originals = _cast_model(model, policy, device_type, _trained(optimizers, policy))
    if policy.master_weights and optimizers:
        optimizers = wrap_late(model, optimizers, originals, policy)
    elif policy.param_dtype != _FP32:  # O3: state made before (Adagrad's sums, a step taken)
        for optimizer in optimizers:  # and gradients held, in the 16-bit parameters' dtype
            if optimizer is not None:
                _cast_state_and_grads(optimizer)
    if (policy.is_mixed or policy.autocast or policy.cast_inputs
            or policy.output_dtype not in (None, _FP32)):  # (an fp32 policy's outputs cast)
        in_dtype = policy.compute_dtype if policy.cast_inputs else None
        # without autocast (O3) the inputs follow the parameters' dtype: model.float() after
        # prepare gives an fp32 model whose inputs are fp32 (under autocast the GEMMs cast)
        probe = (None if policy.autocast or in_dtype is None else
                 next((p for p in model.parameters() if p.dtype == in_dtype), None))
        model.forward = Entry(model, in_dtype, policy.output_dtype, context, probe)
        root_island = island_of(model)  # to_float(model, ...): the root computes in that
        if root_island is not None:
            root_island.place(None)  # the entry casts the outputs
        region = (island_region(model, root_island) if root_island is not None
                  else _root_region(model, policy, context))
        model.forward.cast_params = None if root_island is not None else region.cast
        assign_regions(model, region)
    register_fp32_state_dict(model, policy.master_weights)
    if any(is_low_precision(p) for p in model.parameters()):
        fp32_save_pretrained(model)  # (its state_dict() holds fp32 values: at O3 upcast)
    if policy.master_weights:
        checks.watch_masterless_steps(p for p in model.parameters()
                                      if p.dtype in (torch.float16, torch.bfloat16))
    setattr(model, _POLICY_ATTR, policy)
    for mod in model.modules():
        setattr(mod, PREPARED_ATTR, True)
    return model, list(optimizers)


def wrap_late(model: nn.Module, optimizers: list, originals: dict, policy: Policy) -> list:
    """Wrap the optimizers over a model's cast parameters as the policy's master method does,
    masters from ``originals`` (cast parameter -> its fp32 value), and link them to the model.
    What :func:`prepare_many` does after the cast; also called on its own for a model prepared
    before its optimizers existed (a host that wraps the model in DDP between the two)."""
    optimizers = [_wrap_optimizer(opt, originals, policy) for opt in optimizers]
    names = {p: n for n, p in model.named_parameters()}
    for opt in optimizers:
        opt.name_params(names)
    link_masters(model, optimizers)
    guard_casts(model, companions_of(model))  # .float()/.half() keep or refuse the masters
    fp32_save_pretrained(model)  # Hugging Face: a config that loads the fp32 masters
    return optimizers


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


def _root_region(model: nn.Module, policy: Policy, context) -> Region:
    """The entry's region: a fixed-dtype policy with islands of another dtype casts each
    module's inputs to its compute dtype (an fp32 island's output is fp32), and so does one
    whose modules hold parameters stored in another dtype (untrained ones a master-weight
    policy keeps as they are, one tied to an fp32 island's), which are cast for the call."""
    dtype = policy.compute_dtype
    if policy.autocast and dtype != _FP32:  # (autocast casts each op's operands)
        return Region(context)
    stored = any(p.is_floating_point() and p.dtype not in (dtype, torch.float64)
                 for m in region_modules(model) for p in m._parameters.values() if p is not None)
    if context is None:  # fp32 compute (16-bit storage): a region only to cast the parameters
        return Region(None, dtype if stored else None)
    other = stored or any(island_of(m) is not None and island_of(m).dtype != dtype
                          for m in model.modules() if m is not model)
    return Region(context, dtype if other else None)


def _cast_state_and_grads(optimizer) -> None:
    """What ``model.to(dtype)`` and torch's ``load_state_dict`` do to what an optimizer made
    before the cast, in place (its groups, hooks and held objects untouched): each parameter with
    state, its floating state (but ``step``; lists, LBFGS's, too) and its gradient in the
    parameter's dtype."""
    def cast(value, dtype):
        if torch.is_tensor(value):
            return value.to(dtype) if value.is_floating_point() else value
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v, dtype) for v in value)
        return value
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if not p.is_floating_point() or not state:  # (an optimizer keeping its state
                    continue                                 # elsewhere, ZeRO's: as it was)
                if p.grad is not None and p.grad.dtype != p.dtype:
                    p.grad = p.grad.to(p.dtype)
                for key, value in state.items():
                    if key != "step":
                        state[key] = cast(value, p.dtype)


def _trained(optimizers: list, policy: Policy):
    """A predicate: is this parameter trained through fp32 masters? (Under a master-weight
    policy, a parameter that requires no gradient or that no given optimizer holds has no
    master, so it keeps its dtype: its fp32 value would otherwise be lost.)"""
    if not policy.master_weights:
        return lambda p: True
    if not optimizers:
        return lambda p: p.requires_grad
    held = {id(opt.model_param(p) if is_master_optimizer(opt) else p)
            for opt in optimizers for g in opt.param_groups for p in g["params"]}
    return lambda p: p.requires_grad and id(p) in held


def _cast_model(model: nn.Module, policy: Policy, device_type: str,
                trained) -> dict[torch.Tensor, torch.Tensor]:
    """Cast tensors per the policy and make islands of the modules with a dtype of their own;
    return the fp32 data of cast params."""
    dtype_of = _module_dtype(policy)

    def param_override(mod, name):  # fp32 for fp32 modules (and params="fp32" entries)
        entry = policy.modules.lookup(mod, name)
        if entry is None or entry.compute is None:
            return None
        return entry.param_dtype or policy.param_dtype

    params = module_dtypes(model, policy.param_dtype, param_override)
    buffers = module_dtypes(model, policy.param_dtype, dtype_of)
    originals: dict[torch.Tensor, torch.Tensor] = {}
    cast_tensors(params, "_parameters", originals, keep=lambda t: not trained(t))
    # under autocast (O2) a non-persistent buffer, a constant the model derives (rotary
    # frequencies: a Llama's inv_freq in bf16 is 1.5 rad off at position 8191), stays fp32;
    # autocast gives the ops that read it their dtypes. Pure 16-bit (O3) casts it too.
    derived = ({id(b) for mod in model.modules() for name, b in mod._buffers.items()
                if b is not None and name in mod._non_persistent_buffers_set}
               if policy.autocast else set())
    cast_tensors(buffers, "_buffers", keep=lambda t: id(t) in derived)
    if not policy.is_mixed:
        return originals
    for name, mod in model.named_modules():
        dt = dtype_of(mod, name)
        if dt is None or float_mark(mod) is not None:  # none, or to_float made its island
            continue
        cast_inputs = dt != _FP32 or not takes_low_precision_input(mod, device_type)
        mod.forward = Island(mod, dt, cast_inputs, PrecisionContext.fixed(dt, device_type))
        refresh_island(mod)
    return originals


def _wrap_optimizer(optimizer, originals: dict[torch.Tensor, torch.Tensor], policy: Policy):
    """Wrap as the policy's master method does: a MasterWeightOptimizer whose masters are the
    exact fp32 originals (their storage: the cast kept no second fp32 copy of the weights), or
    a CompactMasterOptimizer whose buffers start from them (a Kahan compensation holds what the
    cast lost, a split remainder the rest of the exact value)."""
    if isinstance(optimizer, WrappedOptimizer):
        return optimizer
    return wrap_optimizer(policy.master, optimizer, state_dtype=policy.state_dtype,
                          initial_values=originals)
