"""The advisor's reference pass: one fp32 forward and backward of the user's batch, recording
each layer's inputs, output and output gradient; and passes that leave no trace on the model.

A *layer* is a module with parameters of its own and no sub-module with parameters (Linear,
Conv, Embedding, norm layers, Hugging Face's Conv1D, ...): the unit a policy can set a format
for. Every pass runs with the same random state (dropout draws the same masks in each), and the
model's gradients and buffers (BatchNorm's running statistics) are restored after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..training.batches import Batch, compute_loss, split_batch

__all__ = ["LayerCall", "find_layers", "isolated", "reference_pass", "loss_of"]


@dataclasses.dataclass
class LayerCall:
    """One layer's first call in the reference pass (fp32, detached).

    Attributes:
        name, module: the layer.
        args, kwargs: its inputs.
        output: its output (a tensor).
        grad: the loss's gradient with respect to ``output`` (None when none flowed).
        calls: how many times the layer ran in the pass (only the first is measured).
    """

    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    calls: int = 0


def find_layers(model: nn.Module, names=None) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the model's layers (see the module docstring), in
    ``named_modules()`` order; with ``names``, those only.

    Raises:
        ValueError: a name that is not a layer of the model.
    """
    found = [(n, m) for n, m in model.named_modules()
             if any(True for _ in m.parameters(recurse=False))
             and not any(any(True for _ in c.parameters()) for c in m.children())]
    if names is None:
        return found
    known = dict(found)
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"layers names {missing}, which are not layers of the model (modules "
                         f"with parameters of their own and none below); layers are "
                         f"{list(known)[:6]}{' ...' if len(known) > 6 else ''}")
    return [(n, known[n]) for n in names]


def _detach(tree):
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def cuda_indices(tensors) -> list[int]:
    """The indices of the CUDA devices ``tensors`` live on (whose random states a pass forks)."""
    return sorted({t.device.index for t in tensors if t.device.type == "cuda"})


@contextlib.contextmanager
def isolated(model: nn.Module, seed: int):
    """Run a pass that leaves the model as it was: the same random state on entry each time,
    gradients and buffers restored on exit."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    with torch.random.fork_rng(devices=cuda_indices([*model.parameters(), *model.buffers()])):
        torch.manual_seed(seed)
        try:
            for p in grads:
                p.grad = None
            yield
        finally:
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])
            for p, g in grads.items():
                p.grad = g


def loss_of(model: nn.Module, batch: Batch, loss_fn: Callable | None) -> torch.Tensor:
    """The model's loss on ``batch``, as the Trainer computes it."""
    return compute_loss(batch.run(model), batch, loss_fn)


def reference_pass(model: nn.Module, batch: Any, loss_fn: Callable | None,
                   layers: list[tuple[str, nn.Module]], seed: int
                   ) -> tuple[float, dict[str, LayerCall]]:
    """One fp32 forward and backward recording every layer's first call.

    Returns:
        The loss (a float; one host sync) and ``{name: LayerCall}``.
    """
    calls = {name: LayerCall(name, mod, (), {}) for name, mod in layers}
    handles = []

    def pre(name):
        def hook(module, args, kwargs):
            call = calls[name]
            call.calls += 1
            if call.calls == 1:
                call.args, call.kwargs = _detach((args, kwargs))
        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            call = calls[name]
            if call.calls != 1 or not isinstance(output, torch.Tensor):
                return None
            call.output = output.detach()
            replaced = None
            if not output.requires_grad and output.is_floating_point():
                # a frozen layer (a backbone, an embedding): its output made a leaf that asks
                # for its gradient, so the backward measures it too (it read as no effect)
                output = replaced = output.detach().requires_grad_(True)
            if output.requires_grad:
                output.register_hook(lambda g: setattr(call, "grad", g.detach()))
            return replaced
        return hook

    for name, mod in layers:
        handles.append(mod.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(mod.register_forward_hook(post(name), with_kwargs=True))
    try:
        with isolated(model, seed):
            loss = loss_of(model, batch, loss_fn)
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    return float(loss.detach()), calls


def as_batch(batch: Any, loss_fn: Callable | None) -> Batch:
    """The user's batch, split as the Trainer splits it."""
    return split_batch(batch, needs_target=loss_fn is not None)
