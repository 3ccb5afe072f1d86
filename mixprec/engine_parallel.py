"""What the engine checks when a model runs in several processes (DDP, FSDP2).

:meth:`mixprec.MixedPrecision.setup` takes the model before DDP wraps it, and leaves FSDP2 to
:func:`mixprec.parallel.fsdp` (``mixed_precision=amp``) at the levels whose shards must be made
for the policy; :meth:`~mixprec.MixedPrecision.step` checks once per optimizer that it trains
the models the run set up (a ``fully_shard`` after ``setup`` replaces their parameters).
Everything else the engine does across ranks lives in the loss scaler: the overflow flag is
all-reduced (MAX), and the clip norm of sharded gradients is the global one.
"""

from __future__ import annotations

import torch
from torch import nn

from . import distenv as env
from .policy import Policy

__all__ = ["check_not_wrapped", "check_owned"]


def check_not_wrapped(model: nn.Module, policy: Policy) -> None:
    """Refuse a model that DDP already wraps, or that ``fully_shard`` sharded when the policy
    casts its storage or keeps masters (FSDP2 then holds the parameters and their dtype).

    Raises:
        TypeError: a ``DistributedDataParallel``.
        RuntimeError: a sharded model at O2/O3 (or any policy with masters or 16-bit storage).
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("setup() takes the model before it is wrapped in "
                        "DistributedDataParallel (DDP sizes its gradient buckets for the "
                        "parameters' dtype when it wraps): call model, opt = amp.setup(model, "
                        "opt) first, then model = mp.parallel.ddp(model) (or "
                        "DistributedDataParallel(model))")
    sharded = any(env.is_fsdp(m) for m in model.modules())
    if sharded and (policy.master_weights or policy.param_dtype != torch.float32):
        raise RuntimeError(f"this model is already sharded with fully_shard, and {policy} "
                           f"stores its weights in 16 bits (with fp32 masters at O2): the "
                           f"shards must be made for that. Pass the unsharded model to "
                           f"mp.parallel.fsdp(model, opt, mixed_precision=amp) instead of "
                           f"setup() (your own fully_shard works at O0 and O1)")


def check_owned(models: list[nn.Module], optimizer) -> None:
    """Refuse an optimizer none of whose parameters belong to ``models``.

    Raises:
        RuntimeError: naming the likely cause (``fully_shard`` after ``setup``).
    """
    model_param = getattr(optimizer, "model_param", None)
    held = [model_param(p) if callable(model_param) else p
            for g in optimizer.param_groups for p in g["params"]]
    mine = {id(p) for m in models for p in m.parameters()}
    if held and not any(id(p) in mine for p in held):
        raise RuntimeError(
            "none of this optimizer's parameters belong to the model(s) set up in this run, "
            "so it would step tensors the model does not use. Either it was copied apart from "
            "its model (copy.deepcopy(model) and copy.deepcopy(opt) make two unlinked copies): "
            "copy them together, model2, opt2 = copy.deepcopy((model, opt)), and "
            "amp.adopt(model2); or its model was set up in another run: amp.adopt(model); or "
            "the model was sharded (fully_shard) after setup(), which replaced its parameters: "
            "shard with mp.parallel.fsdp(model, opt, mixed_precision=amp) instead of setup()")
