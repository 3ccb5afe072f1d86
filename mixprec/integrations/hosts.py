"""What the Accelerate and Hugging Face Trainer integrations share to set up a model under a
host: the distributed modes refused, rank 0's weights everywhere, preparing (or preparing and
sharding) through the engine, the FSDP2 units a plugin picks, an optimizer state laid out before
a sharded load, and DDP's fp32 gradient reduction."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel

from .. import distenv as env
from ..engine import MixedPrecision
from ..lowbit.backend import quiet_import
from ..parallel.ddp import cast_reduce_hook
from ..parallel.sharding import fsdp
from ..prepare import module_device

try:
    with quiet_import():
        from accelerate.utils import DistributedType
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
except ImportError as exc:  # pragma: no cover - the error names the extra
    raise ImportError("mixprec.integrations needs accelerate for its hosts: "
                      "pip install 'mixprec[accelerate]'") from exc

__all__ = ["refused_host", "fsdp_units", "setup_for_host", "lay_out_state", "reduce_in_fp32",
           "refuse_host"]


_REFUSED = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.MEGATRON_LM: "Megatron-LM",
            DistributedType.XLA: "XLA"}


def refused_host(distributed_type, fsdp_version: int | None) -> str | None:
    """The name of a distributed mode the engine cannot run under, else None."""
    if distributed_type in _REFUSED:
        return _REFUSED[distributed_type]
    if distributed_type == DistributedType.FSDP and fsdp_version != 2:
        return "FSDP1 (FullyShardedDataParallel; FSDP2, fsdp_version=2, is supported)"
    return None


def refuse_host(name: str) -> None:
    raise ValueError(f"mixprec's engine cannot run under {name}: its own optimizer step or "
                     f"sharding would take the step (loss scale, masters, skip on overflow) out of "
                     f"the engine's hands; use DDP or FSDP2 (fsdp_version=2)")


def _broadcast_weights(model: nn.Module) -> None:
    """Rank 0's fp32 weights and buffers on every rank, before the masters are copied; the
    gloo workers are let finish at interpreter exit (:func:`mixprec.distenv.settle`)."""
    if env.world_size() > 1:
        env.require_group("MixprecAccelerator and MixprecTrainer")
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)


def fsdp_units(plugin, model: nn.Module) -> list[str] | None:
    """The sharding units an FSDP2 plugin's wrap policy picks in ``model`` (its
    ``transformer_layer_cls_to_wrap``, or the model's ``_no_split_modules``); None: no policy,
    mixprec's default units. The plugin's policy is resolved on the unsharded model here, so
    Accelerate's later look at the sharded one (whose classes FSDP2 renamed) finds it done.

    Raises:
        ValueError: the plugin's own activation checkpointing (it would wrap the already
            sharded layers; use the model's ``gradient_checkpointing_enable()``).
    """
    if getattr(plugin, "activation_checkpointing", False):
        raise ValueError("FSDP's activation_checkpointing wraps layers before sharding, and "
                         "mixprec shards the prepared model itself; turn it off and use the "
                         "model's gradient_checkpointing_enable() instead")
    plugin.set_auto_wrap_policy(model)
    choose = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if choose is None:
        return None
    return [name for name, module in model.named_modules() if name and choose(module)]


def setup_for_host(engine: MixedPrecision, model: nn.Module, optimizers: list, *,
                   shard: bool, units=None) -> tuple[nn.Module, list]:
    """Prepare ``model`` (and its optimizers) through ``engine`` before a host wraps it.

    Several ranks first take rank 0's fp32 weights. ``shard``: prepare and shard with
    :func:`mixprec.parallel.fsdp` (FSDP2; the fp32 shards are the masters; ``units``: its
    sharding units), for one optimizer at most; else ``engine.setup``. Returns the model and
    the optimizers to hand to the host.

    Raises:
        ValueError: ``shard`` with several optimizers.
    """
    _broadcast_weights(model)
    if not shard:
        out = engine.setup(model, *optimizers)
        return (out, []) if not optimizers else (out[0], list(out[1:]))
    if len(optimizers) > 1:
        raise ValueError(f"under FSDP2 one optimizer per model is supported; got "
                         f"{len(optimizers)}")
    policy = engine.resolve_policy(module_device(model), model)
    lists = {k: v for k, v in engine.op_lists.items() if k in ("low_precision_ops", "fp32_ops")}
    out = fsdp(model, optimizers[0] if optimizers else None, policy=policy, units=units,
               **lists)
    model, opts = (out, []) if not optimizers else (out[0], [out[1]])
    engine.adopt(model)
    return model, opts


def lay_out_state(model: nn.Module, optimizer) -> None:
    """Give an FSDP2 optimizer that has not stepped its state's layout before a host loads a
    sharded checkpoint into it.

    torch's distributed checkpointing lays out a fresh optimizer's state by stepping it once
    at lr 0 with zero gradients; a host that loads the model first and the optimizer after
    (Accelerate's ``load_state``, the Trainer's resume) would take that step on the loaded
    weights, and a compact master's step rewrites them (Kahan recombines and rounds weight and
    compensation again), or, through the host's optimizer wrapper, runs the engine's step on
    the loaded scaler. Stepped here, on the engine's optimizer itself, before anything is
    loaded: everything it touches is overwritten by the load.
    """
    if not any(optimizer.state.values()):
        get_optimizer_state_dict(model, optimizer)


def reduce_in_fp32(model: nn.Module) -> None:
    """Average a ``DistributedDataParallel`` model's 16-bit gradients in fp32 (mixprec's reduce
    hook: each bucket copied to fp32, averaged, rounded back once), as ``mp.parallel.ddp``
    does. Nothing for other models, fp32 models, or a model that already has the hook."""
    if not isinstance(model, DistributedDataParallel) or getattr(model, "_mixprec_hook", False):
        return
    if any(p.is_floating_point() and p.element_size() < 4 for p in model.module.parameters()):
        model.register_comm_hook(None, cast_reduce_hook(torch.float32))
        model._mixprec_hook = True
