"""What the precision monitor measures, as 0-d tensors on the device (no host sync).

* **Gradient underflow** of a layer: of its nonzero gradient values, the fraction whose
  magnitude at the current loss scale is below the training format's smallest normal number.
  Those values are subnormal in the format (they keep fewer significant bits the smaller they
  are) or, below half the smallest subnormal, flush to zero. The gradients are measured as
  the step will read them: the factor they still carry (the loss scale, a folded clip) is
  divided out and the current scale multiplied back in.
* **Activation amax** of a layer: the largest magnitude among its output values over the
  forward passes of a recorded step; the headroom is ``log2(format max / amax)``, in binades.
* **Update lost** of a layer: the fraction of the step's intended update that the stored
  weights did not take. The intended update is the one an fp32 copy of the same optimizer
  makes from the same values, gradients and state (a *probe* stepped beside the real step);
  what was taken is the change in the value the run keeps (the fp32 master where there is
  one, weight plus compensation for Kahan masters, else the 16-bit weight itself). Over the
  layer's parameters, ``lost = 1 - <taken, intended> / <intended, intended>``: 0 when the
  update landed exactly, 1 when it rounded away, a little off 0 (either sign) for stochastic
  rounding, which is exact only on average.

Sharded parameters (FSDP) are measured on this rank's shards; the monitor adds the ranks' parts
up at a recorded step (:mod:`mixprec.monitor.ranks`), so what it records is the whole model's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import kernel_table
from ..optim.states import COMPENSATION_KEY
from ..optim.wrapper import is_wrapped
from ..scaling.protocol import owns_gradients
from ..shards import local
from .ranks import lost_fraction

__all__ = ["gradient_pairs", "underflow_counts", "output_amax", "UpdateProbe"]


def gradient_pairs(optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """Model parameter -> the gradient the next step reads, in its own dtype (this rank's shard
    of a sharded one)."""
    if owns_gradients(optimizer):
        pairs = optimizer.grads_for_step()
    else:
        pairs = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
    return {p: local(g) for p, g in pairs}


@torch.no_grad()
def underflow_counts(grads: Iterable[torch.Tensor], carried: torch.Tensor | None,
                     scale: torch.Tensor, smallest_normal: float) -> torch.Tensor:
    """``[values below smallest_normal at the current scale, nonzero values]`` (float32).

    Args:
        grads: the layer's gradients as held (dense).
        carried: the factor they still carry (None: they read as the true ones).
        scale: the current loss scale.
        smallest_normal: the training format's smallest normal number.
    """
    counts = torch.zeros(2, dtype=torch.float32, device=scale.device)
    # held * scale / carried < smallest_normal  <=>  held < smallest_normal * carried / scale
    limit = smallest_normal / scale.double()
    if carried is not None:
        limit = limit * carried.to(scale.device).double()
    for grad in grads:
        magnitude = grad.detach().to(torch.float32, copy=True).abs_()  # one exact fp32 copy
        nonzero = torch.count_nonzero(magnitude)
        zeros = magnitude.numel() - nonzero
        below = torch.count_nonzero(magnitude < limit.float().to(grad.device)) - zeros
        counts += torch.stack([below, nonzero]).float().to(counts.device)
    return counts


@torch.no_grad()
def output_amax(output) -> torch.Tensor | None:
    """The largest magnitude among a module output's floating-point values (float32), or None."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point() and output.numel():
            low, high = torch.aminmax(output.detach())  # one pass, no copy of the output
            return torch.maximum(-low, high).float()
        return None
    if isinstance(output, (tuple, list)):
        found = [a for a in (output_amax(o) for o in output) if a is not None]
        return torch.stack([a.to(found[0].device) for a in found]).amax() if found else None
    return None


def _stepped(optimizer) -> torch.optim.Optimizer:
    return optimizer.inner if is_wrapped(optimizer) else optimizer


def kept_values(optimizer, params: Iterable[torch.Tensor],
                copy: bool = True) -> dict[torch.Tensor, torch.Tensor]:
    """Model parameter -> the value the run keeps for it (its master, weight plus compensation,
    or the weight) in float32: a copy, or with ``copy=False`` the master itself where it is one."""
    held = optimizer.masters_by_param() if callable(getattr(optimizer, "masters_by_param",
                                                            None)) else {}
    with torch.no_grad():
        return {p: local(held.get(p, p).detach()).to(torch.float32, copy=copy) for p in params}


class UpdateProbe:
    """An fp32 copy of one optimizer's step over some of its parameters: the intended update.

    Built just before the real step, from the kept values, the true gradients (the factor they
    carry divided out) and a float32 copy of the optimizer state; :meth:`lost` compares it with
    what the real step changed.

    Args:
        optimizer: the optimizer about to step (plain or a mixprec master optimizer).
        layers: layer name -> its parameters to measure.
        carried: the factor the gradients still carry (None: none).
    """

    def __init__(self, optimizer, layers: dict[str, list[torch.Tensor]],
                 carried: torch.Tensor | None):
        self.optimizer = optimizer
        grads = gradient_pairs(optimizer)
        wanted = {p for params in layers.values() for p in params
                  if p in grads and not grads[p].is_sparse}
        self.layers = {name: [p for p in params if p in wanted] for name, params in layers.items()}
        self.start = kept_values(optimizer, wanted)
        self.copies: dict[torch.Tensor, torch.Tensor] = {}
        self._step(_stepped(optimizer), grads, carried)

    @torch.no_grad()
    def _step(self, inner, grads, carried) -> None:
        model_of = getattr(self.optimizer, "model_param", None)
        groups, state = [], {}
        for group in inner.param_groups:
            params = []
            for t in group["params"]:
                p = model_of(t) if callable(model_of) else t
                if p not in self.start:
                    continue
                copy = self.start[p].clone()
                grad = grads[p].float()
                copy.grad = grad / carried.to(grad.device) if carried is not None else grad
                state[copy] = {k: _fp32_copy(v) for k, v in inner.state.get(t, {}).items()
                               if k != COMPENSATION_KEY}
                self.copies[p] = copy
                params.append(copy)
            if params:
                groups.append({**{k: v for k, v in group.items() if k != "params"},
                               **_fused_options(inner, group), "params": params})
        if not groups:
            return
        probe = type(inner)(groups)
        for copy, values in state.items():
            if values:
                probe.state[copy] = values
        probe.step()

    @torch.no_grad()
    def sums(self) -> dict[str, torch.Tensor]:
        """Layer name -> ``[<taken, intended>, <intended, intended>]`` (float64) over its
        parameters (this rank's shards of sharded ones: the ranks' sums add up)."""
        now = kept_values(self.optimizer, self.copies, copy=False)
        sums = {}  # per parameter, once (a tied weight belongs to two layers)
        for p, copy in self.copies.items():
            intended = copy.sub_(self.start[p]).flatten()  # the probe is done with its copy
            taken = now[p].sub(self.start[p]).flatten()
            sums[p] = torch.stack([torch.dot(taken, intended), torch.dot(intended, intended)])
        out = {}
        for name, params in self.layers.items():
            params = [p for p in params if p in sums]
            if params:
                out[name] = torch.stack([sums[p].double().to(sums[params[0]].device)
                                         for p in params]).sum(0)
        return out

    def lost(self) -> dict[str, torch.Tensor]:
        """Layer name -> the fraction of its intended update the real step did not keep."""
        return {name: lost_fraction(total) for name, total in self.sums().items()}


_FUSED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_NOT_FUSED = ("differentiable", "capturable")


def _fused_options(inner, group: dict) -> dict:
    """torch's fused fp32 kernel for the probe where it exists (one pass per tensor, as the master
    step of a MasterWeightOptimizer runs it), else the group's own options."""
    if type(inner) not in _FUSED or any(group.get(k) for k in _NOT_FUSED):
        return {}
    if not all(kernel_table.TABLE.fused_optimizer(p.device.type, torch.float32)
               for p in group["params"]):
        return {}
    return {"fused": True, "foreach": False}


def _fp32_copy(value):
    if not isinstance(value, torch.Tensor):
        return value
    value = local(value.detach())
    return value.float() if value.is_floating_point() and value.dtype != torch.float32 \
        else value.clone()
