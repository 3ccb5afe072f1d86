"""Weight averaging (EMA, SWA) of a model trained in 16 bits: :class:`AveragedModel`.

torch's ``torch.optim.swa_utils.AveragedModel`` deep-copies the model and averages its
parameters in their own dtype. Over a model ``mp.prepare`` cast to 16 bits (O2, O3) that is
bf16 or fp16 arithmetic: an EMA with decay 0.999 moves each weight by a thousandth of its
distance to the trained one, below half a bf16 ulp unless the weight is near zero, so the
average freezes where it started, silently (``bench/ema_freeze.py``: over a 200-step run of a
small MLP 85% of the EMA's weights never moved after its first update, and it ended up to
3.6e-2 from the fp32 EMA, which moved up to 4.1e-2).

:class:`AveragedModel` is torch's class with two changes, both before torch's code runs:

* its copy of the model stores every 16-bit floating parameter and buffer in fp32, holding the
  exact fp32 values the model trains (a prepared model's masters, Kahan or split values, or
  shadows; a plain 16-bit model's weights, upcast). The copy keeps the model's policy: a
  prepared O2 model's copy still computes in 16 bits (``.float()`` on a prepared model changes
  storage, not compute);
* :meth:`AveragedModel.update_parameters` hands torch's update the model's fp32 values in place
  of its 16-bit parameters: the masters themselves with ``master="fp32"``; split, Kahan and
  stochastic values computed for the call (4 bytes per parameter, freed after it).

torch's own update then runs on them: ``avg_fn``, ``multi_avg_fn`` (``get_ema_multi_avg_fn``,
``get_swa_multi_avg_fn``), the default running mean, ``use_buffers``, ``n_averaged``, its
``state_dict``. So the average is what torch's ``AveragedModel`` gives over an fp32 model holding
the masters, bit for bit, and ``torch.optim.swa_utils.update_bn`` takes it as torch's.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.optim import swa_utils

from .distenv import unwrap
from .dtypes import is_low_precision
from .statedict import links_of

__all__ = ["AveragedModel", "fp32_parameters"]


def _widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 when it is a 16-bit float (the cast a prepared model's guard turns into its
    exact fp32 values), else as it is (fp32, fp64 and integer tensors)."""
    return t.float() if is_low_precision(t) else t


def fp32_parameters(model: nn.Module) -> list[torch.Tensor]:
    """``model.parameters()`` in order, each 16-bit one replaced by the fp32 value it trains:
    the fp32 master (the tensor itself) of a prepared model's optimizer, the value a split or
    Kahan pair holds (computed now), a copy's shadow; a 16-bit parameter without one (no
    master kept: O3, a plain 16-bit model) upcast, an fp32 one as it is.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    pairs: dict[torch.Tensor, torch.Tensor] = {}
    for link in links_of(unwrap(model)):
        for opt in link.optimizers():  # a weight written since the step: its master takes it
            opt.follow_writes(settle=False)
        pairs.update(link.pairs())
    return [pairs[p] if p in pairs else _widened(p.detach()) for p in model.parameters()]


class _Values:
    """What torch's ``update_parameters`` reads of a model: its parameters (here the fp32
    values) and its buffers."""

    def __init__(self, params: list[torch.Tensor], model: nn.Module) -> None:
        self._params, self._model = params, model

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self._params)

    def buffers(self) -> Iterator[torch.Tensor]:
        return (_widened(b.detach()) for b in self._model.buffers())  # (as the copy's: fp32)


class AveragedModel(swa_utils.AveragedModel):
    """torch's ``AveragedModel``, averaging in fp32 the fp32 values a 16-bit model trains (see
    the module docstring). Same arguments as torch's.

    Args:
        model: the model to average (prepared by ``mp.prepare`` at any level, DDP-wrapped, or
            plain); deep-copied, its 16-bit floating tensors stored in fp32.
        device: where the average lives (None: the model's device).
        avg_fn, multi_avg_fn, use_buffers: as torch's (``get_ema_multi_avg_fn(decay)`` for an
            EMA).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> from torch.optim.swa_utils import get_ema_multi_avg_fn
        >>> ema = mp.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
        >>> ...; amp.step(opt); ema.update_parameters(model)
    """

    def __init__(self, model: nn.Module, device=None, avg_fn=None, multi_avg_fn=None,
                 use_buffers: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        super().__init__(model, device, avg_fn, multi_avg_fn, use_buffers)
        with torch.no_grad():
            self.module._apply(_widened)  # (a prepared copy: its exact fp32 values)

    def update_parameters(self, model: nn.Module) -> None:
        """torch's update, from ``model``'s fp32 values (:func:`fp32_parameters`).

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ValueError: ``model`` has another number of parameters (or, with ``use_buffers``,
                of buffers) than the average (torch pairs them up to the shorter list).
        """
        values = fp32_parameters(model)
        mine = list(self.module.parameters())
        counts = [(len(mine), len(values), "parameters")]
        if self.use_buffers:
            counts.append((sum(1 for _ in self.module.buffers()),
                           sum(1 for _ in model.buffers()), "buffers"))
        for have, given, what in counts:
            if have != given:
                raise ValueError(f"update_parameters: the average holds {have} {what}, the "
                                 f"model given {given}; pass the model this average was made "
                                 "from")
        with torch.no_grad():
            super().update_parameters(_Values(values, model))
