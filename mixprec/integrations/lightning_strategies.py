"""Where :class:`~mixprec.integrations.lightning.MixprecPrecision` meets Lightning's strategies.

Lightning calls the plugin's ``convert_module`` before the strategy wraps the model and
``connect`` after ``configure_optimizers``; what happens in between depends on the strategy:

* single device: nothing in ``convert_module``; ``connect`` prepares the model and wraps the
  optimizers in one go (:meth:`mixprec.MixedPrecision.setup`).
* DDP (``"ddp"``, ``"ddp_spawn"``, ``"ddp_fork"``, ...): DDP sizes its gradient buckets for the
  parameters' dtype when it wraps the model, so ``convert_module`` prepares the model first
  (after broadcasting rank 0's fp32 weights, so every rank's masters agree) and keeps the fp32
  values the cast replaced; ``connect`` then wraps the optimizers (built over the prepared
  parameters) with masters made from those values, exactly as :func:`mixprec.prepare` would
  have, and has DDP average 16-bit gradients in fp32 (``mp.parallel.ddp``'s default). The
  masters sit in each rank's optimizer; rank 0 checkpoints them.
* ``ModelParallelStrategy`` (FSDP2): ``convert_module`` shards the model with
  :func:`mixprec.parallel.fsdp` over the strategy's data-parallel mesh, unless the
  LightningModule's ``configure_model`` did it through :meth:`MixprecPrecision.shard`; the fp32
  shards are the masters (the checkpoints hold them), and ``connect`` wraps the optimizers as
  the master method needs (a compact method's buffers, sharded alike). A model sharded with
  torch's own ``fully_shard`` is taken at O0/O1 (fp32 storage) and refused at O2/O3.
* Checkpoints of the compact master methods under ``ModelParallelStrategy``: see
  :mod:`.lightning_checkpoints`.
* Anything else is refused by name: ``FSDPStrategy`` is FSDP1 (its flat parameters leave no
  per-parameter dtype to keep), DeepSpeed brings its own precision and master weights.

Overflow flags are all-reduced by the engine's loss scaler, and the clip norm is the global one
(DDP: the gradients are averaged before it is measured; FSDP2: it is reduced over the shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import distenv as env
from ..engine import MixedPrecision
from ..parallel.ddp import cast_reduce_hook
from ..parallel.sharding import fsdp, wrap_sharded_optimizer  # lightning imports FSDP2 already
from ..prepare import module_device, policy_of, prepare_many, wrap_late

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import (
        DDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )
except ImportError as exc:  # pragma: no cover - the error names the extra
    raise ImportError("mixprec.integrations.lightning needs the lightning package: "
                      "pip install 'mixprec[lightning]'") from exc

__all__ = ["SUPPORTED", "kind_of", "strategy_of", "before_wrap", "lightning_module_of",
           "attach", "shard", "data_parallel_mesh", "apply_timeout"]

SUPPORTED = ("SingleDeviceStrategy, DDPStrategy ('ddp', 'ddp_spawn', 'ddp_fork', "
             "'ddp_notebook') and ModelParallelStrategy (FSDP2)")


def kind_of(strategy) -> str:
    """"single", "ddp" or "fsdp2" for a Lightning strategy.

    Raises:
        RuntimeError: any other strategy, naming why and what to use.
    """
    if isinstance(strategy, DDPStrategy):
        return "ddp"
    if isinstance(strategy, ModelParallelStrategy):
        return "fsdp2"
    if isinstance(strategy, SingleDeviceStrategy) or strategy is None:
        return "single"
    name = type(strategy).__name__
    why = {"FSDPStrategy": "it is FSDP1, whose flat parameters leave no per-parameter dtype for "
                           "mixprec's policy and masters; for FSDP2 use "
                           "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)",
           "DeepSpeedStrategy": "DeepSpeed keeps its own fp32 master weights and loss scale; "
                                "use its precision, or DDP/ModelParallelStrategy with mixprec"}
    raise RuntimeError(f"MixprecPrecision runs under {SUPPORTED}; not under {name}: "
                       f"{why.get(name, 'a strategy mixprec does not know how to prepare for')}")


def strategy_of(module: nn.Module):
    """The strategy of ``module``'s trainer (None outside a trainer)."""
    trainer = getattr(module, "_trainer", None)
    return None if trainer is None else trainer.strategy


def before_wrap(engine: MixedPrecision, module: nn.Module) -> dict | None:
    """``convert_module``: prepare ``module`` before the strategy wraps it (DDP) or shard it
    (FSDP2). Returns what :func:`attach` needs (the fp32 values the cast replaced), or None
    when ``connect`` prepares the model (one device, or a model prepared by an earlier run)."""
    strategy = strategy_of(module)
    kind = kind_of(strategy)
    if kind != "single":
        apply_timeout()
    if kind == "single" or policy_of(module) is not None:
        return None
    device = strategy.root_device
    if kind == "fsdp2":
        if any(env.is_fsdp(m) for m in module.modules()):
            return _adopt_user_shards(engine, module, device)
        module.to(device)  # FSDP2 shards where the parameters are
        return shard(engine, module, mesh=data_parallel_mesh(strategy))
    with torch.no_grad():  # every rank's masters start from rank 0's fp32 weights
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)
    policy = engine.resolve_policy(device, module)
    before = {p: p.data for p in module.parameters() if p.is_floating_point()}
    prepare_many(module, [], policy, **engine.op_lists)
    return {"originals": {p: v for p, v in before.items() if p.dtype != v.dtype}}


def shard(engine: MixedPrecision, module: nn.Module, *, mesh=None, units=None,
          reduce_dtype="fp32") -> dict:
    """Prepare and shard ``module`` with :func:`mixprec.parallel.fsdp` for the engine's policy;
    returns the fp32 values a compact master method's buffers start from (by name)."""
    apply_timeout()  # before fsdp's first collective (configure_model calls this)
    originals = {n: p.data for n, p in module.named_parameters()}
    lists = {k: v for k, v in engine.op_lists.items() if k in ("low_precision_ops", "fp32_ops")}
    fsdp(module, policy=engine.resolve_policy(module_device(module), module), mesh=mesh,
         units=units, reduce_dtype=reduce_dtype, **lists)
    policy = policy_of(module)
    compact = policy.master_weights and policy.master.compact
    return {"sharded": originals if compact else {}}


def apply_timeout() -> None:
    """``$MIXPREC_DIST_TIMEOUT``, when set, on the process groups the strategy made (its
    ``timeout=`` otherwise stands; see :func:`mixprec.distenv.apply_timeout`)."""
    env.apply_timeout("Lightning", "the strategy's timeout=, e.g. "
                                   "DDPStrategy(timeout=timedelta(seconds=...))")


def data_parallel_mesh(strategy):
    mesh = strategy.device_mesh
    if mesh["tensor_parallel"].size() != 1:
        raise RuntimeError(f"MixprecPrecision under ModelParallelStrategy shards with FSDP2 only: "
                           f"set tensor_parallel_size=1 (got {mesh['tensor_parallel'].size()}) "
                           f"and data_parallel_size to the number of processes")
    return mesh["data_parallel"]


def _adopt_user_shards(engine: MixedPrecision, module: nn.Module, device) -> dict | None:
    """A model sharded by the user's own ``fully_shard``: fine while the weights stay fp32."""
    policy = engine.resolve_policy(device, module)
    if policy.master_weights or policy.param_dtype != torch.float32:
        raise RuntimeError(f"configure_model sharded the model with fully_shard, and {policy} "
                           f"stores its weights in 16 bits (with fp32 masters at O2): the "
                           f"shards must be made for that. Call "
                           f"self.trainer.precision_plugin.shard(self) in configure_model "
                           f"instead of fully_shard (your own fully_shard works at O0 and O1)")
    prepare_many(module, [], policy, **engine.op_lists)
    return {"sharded": {}}


def lightning_module_of(model: nn.Module) -> pl.LightningModule:
    """The LightningModule a strategy hands to ``connect`` (inside DDP's wrapper)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if not isinstance(inner, pl.LightningModule):
        raise RuntimeError(f"MixprecPrecision runs under {SUPPORTED}, which hand it the "
                           f"LightningModule or DDP around it; this strategy passed "
                           f"{type(model).__name__}")
    return inner


def attach(engine: MixedPrecision, model: nn.Module, module: pl.LightningModule,
           optimizers: list, prepared: dict) -> list:
    """``connect`` after :func:`before_wrap`: wrap the optimizers (built over the prepared
    parameters) as the policy's master method does, and adopt the model into the engine."""
    policy = policy_of(module)
    if "sharded" in prepared:
        optimizers = [wrap_sharded_optimizer(module, opt, prepared["sharded"])
                      for opt in optimizers]
    elif policy.master_weights and optimizers:
        originals = prepared["originals"]
        held = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
        lost = [n for n, p in module.named_parameters() if p in originals and id(p) not in held]
        if lost:
            raise ValueError(f"at {policy} every parameter that requires a gradient needs an "
                             f"optimizer to hold its fp32 master; no optimizer holds {lost[:4]}. "
                             f"Set requires_grad=False on those, or optimize them")
        moved = {p: v.to(p.device) for p, v in originals.items()}
        optimizers = wrap_late(module, optimizers, moved, policy)
    engine.adopt(module)
    if isinstance(model, DistributedDataParallel):
        _reduce_in_fp32(model, module)
    return optimizers


def _reduce_in_fp32(model: DistributedDataParallel, module: pl.LightningModule) -> None:
    """Average 16-bit gradient buckets in fp32 (one rounding), as ``mp.parallel.ddp`` does,
    unless the strategy registered a communication hook of its own."""
    low = any(p.is_floating_point() and p.element_size() < 4 for p in module.parameters())
    if low and getattr(strategy_of(module), "_ddp_comm_hook", None) is None:
        model.register_comm_hook(None, cast_reduce_hook(torch.float32))
