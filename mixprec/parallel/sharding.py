"""``mp.parallel.fsdp``: prepare a model for a level and shard it with FSDP2 (``fully_shard``).

How the levels map onto FSDP2's ``MixedPrecisionPolicy``:

* O0: no policy; fp32 shards, fp32 compute.
* O1: fp32 shards gathered in fp32; the forward runs under mixprec's autocast (as with
  :func:`mixprec.prepare` at O1).
* O2: fp32 shards gathered in the compute dtype (``param_dtype``): the fp32 shards *are* the
  master weights, so there is no :class:`mixprec.MasterWeightOptimizer` and no second fp32 copy.
  With a compact master method (``"split"``, ``"kahan"``, ``"stochastic"``: the method's
  ``compact``) the shards are 16-bit and the optimizer comes back wrapped in a
  :class:`mixprec.optim.CompactMasterOptimizer` that steps them (remainder or compensation
  buffers and moments sharded alike; each shard rounds stochastically with the random bits
  its elements get in one process); with ``state_dtype="bf16"`` and fp32 masters, in a
  ``MasterWeightOptimizer`` that only keeps the moments in bf16.
  Modules that :func:`mixprec.prepare` keeps in fp32 at O2 (norm layers, ``keep_fp32``) become
  sharding units of their own, gathered in fp32, so they still compute in fp32.
* O3: 16-bit shards, 16-bit compute.

FP8 layers (``fp8=``): with the tensorwise recipe, their weights are all-gathered in FP8
(torchao's float8 all-gather: each fp32 or 16-bit shard is cast to FP8 with one scale for the
whole weight, then gathered at one byte per value); rowwise recipes gather in the policy's
dtype and cast after.

Every rank starts from the first rank's initialisation: its parameters and buffers are broadcast
before the model is prepared and sharded (as ``DistributedDataParallel`` does), so ranks seeded
differently still train one model.

Gradients are reduce-scattered in ``reduce_dtype`` (fp32 by default at every level) and averaged
over the ranks. Sharding units: every module held in an ``nn.ModuleList`` (transformer blocks)
plus the root, or the ``units`` you name.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from .. import distenv as env
from .. import prepare_checks, vocabulary
from ..distenv import is_fsdp
from ..engine import MixedPrecision, engine_for
from ..fp8 import all_gather_in_fp8
from ..fp8.choice import split_spec
from ..optim import build, is_master_optimizer
from ..optim.wrapper import WrappedOptimizer
from ..policy import Policy
from ..prepare import module_device, policy_of, prepare_many, resolve_policy
from .ddp import reduce_dtype_of

__all__ = ["fsdp", "default_units", "wrap_sharded_optimizer", "broadcast_from_first_rank"]

_BUCKET = 1 << 26  # elements per broadcast (256 MB of fp32)


def default_units(model: nn.Module) -> list[str]:
    """Qualified names of the modules held in an ``nn.ModuleList`` (the default sharding units)."""
    return [f"{name}.{child}" if name else child
            for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList)
            for child, _ in mod.named_children()]


def _unit_names(model: nn.Module, units) -> list[str]:
    """Validate ``units`` (module classes and/or qualified names) and list the matching modules."""
    if units is None:
        return default_units(model)
    items = [units] if isinstance(units, (str, type)) else list(units)
    modules = dict(model.named_modules())
    types = []
    names: list[str] = []
    for item in items:
        if isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
        elif isinstance(item, str):
            if item not in modules or item == "":
                known = [n for n in modules if n][:8]
                raise ValueError(f"units names {item!r}, which is not a sub-module of the model; "
                                 f"sub-modules include {known}")
            names.append(item)
        else:
            raise TypeError(f"units entries must be nn.Module subclasses or qualified module "
                            f"names; got {item!r}")
    names += [n for n, m in modules.items() if n and types and isinstance(m, tuple(types))]
    return list(dict.fromkeys(names))


def _check_optimizer(model: nn.Module, optimizer) -> dict[int, str]:
    """Names (by id) of the optimizer's parameters; refuse what cannot be rebuilt after sharding."""
    if optimizer is None:
        return {}
    if is_master_optimizer(optimizer) or isinstance(optimizer, WrappedOptimizer):
        raise ValueError("fsdp takes the plain torch optimizer, not a MasterWeightOptimizer: "
                         "FSDP's fp32 shards are the master weights (a second fp32 copy would "
                         "waste memory); pass the optimizer built over model.parameters()")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None; "
                        f"got {type(optimizer).__name__}")
    if any(optimizer.state.values()):
        raise ValueError("the optimizer already holds state (it has stepped); build it fresh "
                         "over model.parameters() and pass it to fsdp before training")
    names = {id(p): n for n, p in model.named_parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if foreign:
        raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters "
                         f"of the model (shapes {[tuple(p.shape) for p in foreign[:3]]}); build "
                         f"it from model.parameters()")
    return names


def _rebind_optimizer(optimizer, names: dict[int, str], model: nn.Module) -> None:
    """Point every param group at the sharded parameters (same object, groups and options)."""
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"][:] = [sharded[names[id(p)]] for p in group["params"]]


def _fp32_modules(model: nn.Module, low: torch.dtype) -> list[str]:
    """Modules whose own parameters the prepared model keeps wider than ``low`` (norms at O2)."""
    return [name for name, mod in model.named_modules()
            if any(p.dtype != low for p in mod.parameters(recurse=False))]


def _policies(policy, reduce_dtype: torch.dtype):
    """(main policy, policy of fp32-kept units) for a prepared model's policy."""
    fp32 = policy.param_dtype == torch.float32
    reduce = None if reduce_dtype == torch.float32 and fp32 else reduce_dtype
    if policy.master_weights and not fp32:  # the fp32 shards are the masters
        main = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=reduce,
                                    cast_forward_inputs=False)
        kept = MixedPrecisionPolicy(reduce_dtype=reduce, cast_forward_inputs=False)
        return main, kept
    main = MixedPrecisionPolicy(reduce_dtype=reduce, cast_forward_inputs=False)
    return main, main


@vocabulary.takes(*vocabulary.PRECISION, *vocabulary.DISTRIBUTED, *vocabulary.EMULATION,
                  differs={"level": (
    "O2", "the level FSDP2 is for: its fp32 shards are the masters, so 16-bit compute costs no "
          "second fp32 copy")}, notes={
    "master": 'Under FSDP2 "fp32" means the fp32 shards are the masters; the others keep '
              "16-bit shards (see the module docstring).",
    "state_dtype": "O2 only."})
def fsdp(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         level: str = vocabulary.Default("O2"),
         dtype: Any = vocabulary.DTYPE, reduce_dtype: Any = "fp32", units: Iterable | None = None,
         mesh=None, keep_fp32=None, policy: Policy | None = None, low_precision_ops=(),
         fp32_ops=(), master=None, state_dtype=None, fp8=None, fp8_modules=None,
         emulate_fp16="auto", mixed_precision: MixedPrecision | None = None):
    """Prepare ``model`` for ``level`` and shard it with FSDP2, in one call, on every rank.

    Every rank starts from the first rank's parameters and buffers (broadcast before preparing,
    as DDP does): each rank shards the same model even when the ranks were seeded differently.
    The fp32 shards are the master weights at O2 (see the module docstring for each level), so
    the optimizer is never wrapped in a :class:`mixprec.MasterWeightOptimizer`. An optimizer
    built over the unsharded model is rebound in place to the sharded parameters (same object,
    class, defaults and per-group options, so LR schedulers built on it keep working); it must
    not have stepped yet. The process group is created from torchrun's environment when none
    exists. Move the model to this rank's device first.

    Loss scaling (fp16) agrees across the mesh: the scalers all-reduce their overflow flag.
    ``torch.nn.utils.clip_grad_norm_`` over the sharded parameters clips by the global norm.
    For gradient accumulation, gradients are reduce-scattered after every micro-batch (they stay
    sharded); ``model.set_requires_gradient_sync(False)`` defers that, at the cost of unsharded
    gradients.

    Args:
        model: the fp32 model (not yet prepared), on its device.
        optimizer: a torch optimizer over ``model.parameters()``, or None.
        {precision keywords}
        units: module classes and/or qualified module names to shard as units (default: every
            module held in an ``nn.ModuleList``); the root is always a unit.
        mesh: a 1-D ``DeviceMesh`` (default: all ranks, on the model's device type).
        mixed_precision: a :class:`mixprec.MixedPrecision` whose run this model joins, instead
            of the precision keywords (your own loop: ``amp.backward``, ``amp.step`` then
            drive the sharded model; the engine adopts it). With it, the precision keywords
            stay at their defaults.

    Returns:
        ``model`` (sharded in place), or ``(model, optimizer)`` when an optimizer is given.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or is a ``DistributedDataParallel``,
            bad ``units`` entries or optimizer;
            ``mixed_precision`` that is not a :class:`mixprec.MixedPrecision`, or comes with
            precision keywords.
        ValueError: an unknown level, dtype, reduce dtype, master or state dtype; a unit name
            that is not a sub-module; an optimizer that stepped, is a MasterWeightOptimizer or
            holds foreign tensors; no process group and no torchrun environment.
        RuntimeError: the model was already prepared or sharded.

    Example:
        >>> # torchrun --nproc-per-node 2 train.py
        >>> model, opt = mp.parallel.fsdp(net, opt, level="O2", dtype="bf16")  # doctest: +SKIP
        >>> amp = mp.MixedPrecision(level="O2", dtype="bf16")                  # doctest: +SKIP
        >>> model, opt = mp.parallel.fsdp(net, opt, mixed_precision=amp)      # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fsdp expects an nn.Module; got {type(model).__name__}")
    if env.in_ddp(model):
        raise TypeError("fsdp shards the plain model, not one wrapped in "
                        "DistributedDataParallel (FSDP2 reduces the gradients itself; the two do "
                        "not nest): pass model.module, or the model before you wrapped it")
    if is_fsdp(model) or policy_of(model) is not None:
        raise RuntimeError("fsdp prepares and shards the model itself: pass the fresh fp32 model "
                           "(not one already passed to mp.prepare or fully_shard)")
    vocabulary.check_policy_alone(policy, level, dtype, "fsdp")
    keep_fp32, low_precision_ops, fp32_ops = prepare_checks.check_keywords(
        keep_fp32, low_precision_ops, fp32_ops, emulate_fp16)
    if mixed_precision is not None:
        engine_for(fsdp, mixed_precision, level=level, dtype=dtype, keep_fp32=keep_fp32,
                   policy=policy, low_precision_ops=low_precision_ops, fp32_ops=fp32_ops,
                   master=master, state_dtype=state_dtype, fp8=fp8, fp8_modules=fp8_modules,
                   emulate_fp16=emulate_fp16)
        policy = mixed_precision.resolve_policy(module_device(model), model)
        ops = mixed_precision.op_lists
        low_precision_ops, fp32_ops = ops["low_precision_ops"], ops["fp32_ops"]
        emulate_fp16 = ops["emulate_fp16"]
    reduce = reduce_dtype_of(reduce_dtype)
    names = _check_optimizer(model, optimizer)
    unit_names = _unit_names(model, units)
    env.require_group("mp.parallel.fsdp")
    broadcast_from_first_rank(model, mesh)
    originals = {n: p.data for n, p in model.named_parameters()}
    fp8_names, chooser = split_spec(fp8 or getattr(policy, "fp8", None), fp8_modules)
    prepare_many(model, [], resolve_policy(level, dtype, keep_fp32, policy, module_device(model),
                                           master=master, state_dtype=state_dtype, fp8=fp8,
                                           fp8_modules=fp8_names), fp8_filter=chooser,
                 low_precision_ops=low_precision_ops, fp32_ops=fp32_ops, emulate_fp16=emulate_fp16)
    policy = policy_of(model)
    kept_units: list[str] = []
    if policy.master_weights:
        kept_units = _fp32_modules(model, policy.param_dtype)
        if not policy.master.compact:  # FSDP casts at gather time; the shards stay fp32
            for name, p in model.named_parameters():  # (compact masters keep 16-bit shards)
                p.data = originals[name]
    if not (policy.master_weights and policy.master.compact
            and policy.master.needs_initial_values):
        originals = {}  # only a compact method's buffer needs the fp32 values again
    all_gather_in_fp8(model)
    if mesh is None:
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        mesh = init_device_mesh(dev.type, (env.world_size(),))
    main, kept = _policies(policy, reduce)
    modules = dict(model.named_modules())
    chosen = set(unit_names) | set(kept_units)
    for name in reversed(list(modules)):  # children before parents
        if name in chosen and name and any(True for _ in modules[name].parameters()):
            fully_shard(modules[name], mesh=mesh, mp_policy=kept if name in kept_units else main)
    fully_shard(model, mesh=mesh, mp_policy=kept if "" in kept_units else main)
    if mixed_precision is not None:
        mixed_precision.adopt(model)
    if optimizer is None:
        return model
    _rebind_optimizer(optimizer, names, model)
    optimizer = _wrap_sharded(optimizer, policy, _sharded_originals(model, originals))
    if mixed_precision is not None and mixed_precision.scaler is not None:
        mixed_precision.watch_direct_steps(optimizer)
    return model, optimizer


def wrap_sharded_optimizer(model: nn.Module, optimizer, originals: dict):
    """An optimizer built over a model that :func:`fsdp` sharded without one (a host builds it
    afterwards over the sharded parameters), wrapped as the model's master method does.

    Args:
        model: the model :func:`fsdp` returned.
        optimizer: a torch optimizer over its (sharded) parameters.
        originals: qualified parameter name -> its fp32 value before :func:`fsdp` (the buffers
            of a compact master method start from them); may be empty otherwise.
    """
    policy = policy_of(model)
    if policy is None or not is_fsdp(model):
        raise ValueError(f"wrap_sharded_optimizer takes a model that mp.parallel.fsdp prepared "
                         f"and sharded; got a {type(model).__name__} that is "
                         f"{'not prepared' if policy is None else 'not sharded'}")
    return _wrap_sharded(optimizer, policy, _sharded_originals(model, originals))


def broadcast_from_first_rank(model: nn.Module, mesh=None) -> None:
    """Give every rank the first rank's parameters and buffers, in place (the first rank of
    ``mesh``'s group, else global rank 0): one broadcast per dtype and 2**26 elements."""
    group = mesh.get_group() if mesh is not None else None
    src = dist.get_global_rank(group, 0) if group is not None else 0
    kinds: dict = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and t.numel():
            kinds.setdefault((t.device.type, t.dtype), []).append(t.detach())
    with torch.no_grad():
        for tensors in kinds.values():
            bucket: list[torch.Tensor] = []
            held = 0
            for t in tensors:
                bucket.append(t)
                held += t.numel()
                if held >= _BUCKET:
                    _broadcast_bucket(bucket, src, group)
                    bucket, held = [], 0
            if bucket:
                _broadcast_bucket(bucket, src, group)


def _broadcast_bucket(tensors: list[torch.Tensor], src: int, group) -> None:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    wire = flat.to(torch.uint8) if flat.dtype == torch.bool else flat  # gloo sends no bool
    dist.broadcast(wire, src=src, group=group)
    offset = 0
    for t in tensors:
        t.copy_(wire[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()


def _sharded_originals(model: nn.Module, originals: dict) -> dict:
    """Sharded 16-bit parameter -> its fp32 value before the cast, sharded alike (each rank
    cuts its own shard: every rank holds the same full value, so no communication)."""
    out = {}
    for name, p in model.named_parameters():
        value = originals.get(name)
        if isinstance(p, DTensor) and value is not None and value.dtype != p.dtype:
            out[p] = distribute_tensor(value.to(p.device), p.device_mesh, p.placements,
                                       src_data_rank=None)
    return out


def _wrap_sharded(optimizer, policy: Policy, initial: dict):
    """The optimizer over the shards, wrapped as the policy's master method does (plain at fp32
    masters with fp32 moments: the fp32 shards are the masters)."""
    if not policy.master_weights:
        return optimizer
    return build.wrap_optimizer(policy.master, optimizer, state_dtype=policy.state_dtype,
                                initial_values=initial, sharded=True)
