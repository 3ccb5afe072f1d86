"""``mp.bytes_per_parameter``: what a training run holds per model parameter, measured.

Every figure is counted from the tensors the model and its optimizer hold right now, not from a
table: the model's weights as stored, fp32 masters (:class:`mixprec.MasterWeightOptimizer`),
the 16-bit buffers of compact masters (:class:`mixprec.optim.CompactMasterOptimizer`: Kahan
compensations, split remainders), the optimizer's
state (moments in their dtype; quantized states of torchao's and bitsandbytes' low-bit
optimizers by their codes, scales and maps; step counters), and the gradients currently held
(the model's, plus fp32 gradient copies a master optimizer holds at that moment). A DTensor
(FSDP2) counts its local shard, so the figures are per rank over that rank's parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from .distenv import ddp_of
from .optim import CompactMasterOptimizer, MasterWeightOptimizer
from .optim.params import held_grad
from .optim.states import BUFFER_KEYS, GENERATOR_KEY
from .shards import is_dtensor

__all__ = ["bytes_per_parameter", "tensor_bytes"]


def tensor_bytes(t) -> int:
    """Bytes of a tensor's elements: a DTensor's local shard; a wrapper subclass (torchao's
    quantized optimizer states) as the sum of the tensors it is made of."""
    if not torch.is_tensor(t):
        return 0
    if is_dtensor(t):
        return tensor_bytes(t.to_local())
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        names, _ = flatten()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if is_dtensor(p) else p.numel()


def _ddp_buckets(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets (held for the run: one element per parameter it
    reduces, in the parameter's dtype), less the gradients that are views of them
    (``gradient_as_bucket_view``), counted as gradients; 0 for a model DDP does not wrap."""
    model = ddp_of(model)  # (inside torch.compile's wrapper too)
    if model is None:
        return 0
    ignored = getattr(model, "parameters_to_ignore", set())
    synced = [p for n, p in model.module.named_parameters() if p.requires_grad
              and n not in ignored]
    views = sum(tensor_bytes(p.grad) for p in synced) if model.gradient_as_bucket_view else 0
    return sum(tensor_bytes(p.detach()) for p in synced) - views


def bytes_per_parameter(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                        ) -> dict[str, float]:
    """Bytes per model parameter, measured from the tensors held.

    Args:
        model: the model (prepared or not; DDP-wrapped or FSDP-sharded: per rank).
        optimizer: its optimizer (wrapped by ``prepare`` or a plain torch one), or None.

    Returns:
        A dict with ``weights`` (the model's parameters as stored), ``masters`` (fp32 master
        copies), ``compensation`` (the buffers of compact masters: Kahan compensations, split
        remainders), ``optimizer_state`` (everything else in
        ``optimizer.state`` for the model's parameters, except the rounding generator's state:
        5 KB, not per parameter; the optimizer's parameters outside the model are not
        counted), ``gradients`` (those currently held: 0 after
        ``zero_grad(set_to_none=True)``; under DDP its gradient buckets too, held for the run)
        and ``total``, each in bytes per parameter.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
        ValueError: the model has no parameters.

    Example:
        >>> bytes_per_parameter(nn.Linear(4, 4))["weights"]
        4.0
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None; got "
                        f"{type(optimizer).__name__}")
    params = list({id(p): p for p in model.parameters()}.values())
    count = sum(_local_numel(p) for p in params)
    if count == 0:
        raise ValueError("the model has no parameters to count bytes per parameter for")
    out = {"weights": sum(tensor_bytes(p.detach()) for p in params),
           "masters": 0, "compensation": 0, "optimizer_state": 0,
           "gradients": sum(tensor_bytes(p.grad) for p in params) + _ddp_buckets(model)}
    ours = {id(p) for p in params}
    if isinstance(optimizer, MasterWeightOptimizer):
        masters = [m for p, m in optimizer.masters_by_param().items() if id(p) in ours]
        out["masters"] = sum(tensor_bytes(m.detach()) for m in masters)
        out["gradients"] += sum(tensor_bytes(held_grad(m)) for m in masters)
    if isinstance(optimizer, CompactMasterOptimizer):
        held = optimizer.held_tensors()
        out["gradients"] += sum(tensor_bytes(g) for g in held["gradients"])
        out["compensation"] += sum(tensor_bytes(c) for c in held["compensation"])
    if optimizer is not None:
        side = getattr(optimizer, "model_param", None)  # a master's model parameter
        for tensor, state in optimizer.state.items():
            if id(side(tensor) if isinstance(optimizer, MasterWeightOptimizer) else tensor) \
                    not in ours:  # a parameter outside the model (added to the optimizer)
                continue
            for key, value in state.items():
                if key == GENERATOR_KEY:  # a fixed 5 KB whatever the model's size
                    continue
                where = "compensation" if key in BUFFER_KEYS else "optimizer_state"
                out[where] += tensor_bytes(value)
    out["total"] = sum(out.values())
    return {k: v / count for k, v in out.items()}
