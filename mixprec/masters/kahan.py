"""``Kahan``: a 16-bit compensation buffer per 16-bit weight (Kahan summation, as in
"Revisiting BFloat16 Training" and the optimi library): weight + compensation is the value the
optimizer steps, about 16 significant bits with bf16 (22 with fp16), 2 bytes per parameter.

**Store.** The weight takes the fp32 result rounded to nearest and the compensation what that
lost (exact in fp32), rounded stochastically: rounded to nearest, the compensation of a weight
receiving many small updates of one sign drifts (an update of 1/700 of an ulp a step moved bf16
weights 11% too far in 2000 steps); stochastic rounding is unbiased, so weight + compensation
follows the fp32 sum in expectation (:mod:`mixprec.masters.rounding`).

**A pair split the saved way** (:meth:`Kahan.register_load_hooks`). A model ``state_dict``
holds each Kahan weight's value (weight + compensation) in fp32; loading it splits the value
again, the weight rounded to nearest. Where the value lies exactly half an ulp between two
16-bit weights (a 16-bit compensation can round to that tie), the new weight may be the other
neighbour, and the compensation the optimizer's ``state_dict`` brings next belongs to the saved
one: the pair would be an ulp off. So loading the optimizer keeps the values the pairs held just
before: a weight whose value minus the loaded compensation is exactly a 16-bit number becomes
that number (:func:`keep_pair`; an FSDP Trainer loading a one-process file applies it to its
shards with the file's values). Loading the model after the optimizer does the same with the
compensation the optimizer brought (:meth:`Kahan.assign`), so either order restores the pairs.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import ClassVar

import torch

from ..shards import is_dtensor, local
from .base import MasterMethod, register
from .rounding import noise_lists, round_fp16_with, round_into_lists, rounds_to

__all__ = ["Kahan", "COMPENSATION_KEY", "keep_pair"]

_unflatten = torch._C._nn.unflatten_dense_tensors

#: The optimizer ``state`` key of a parameter's compensation (in the weight's dtype).
COMPENSATION_KEY = "compensation"


def _widened(tensors: list[torch.Tensor], spare: torch.Tensor | None) -> list[torch.Tensor]:
    """``tensors`` as the fp32 operands of an op with fp32 ones: widened into ``spare`` (one
    ``_foreach_copy_``) when given, else themselves (on the CPU the op then makes a temporary
    fp32 copy of each, allocated and freed tensor by tensor; the same values)."""
    if spare is None:
        return tensors
    wide = list(_unflatten(spare[:sum(t.numel() for t in tensors)], tensors))
    torch._foreach_copy_(wide, tensors)
    return wide


@dataclasses.dataclass(frozen=True, eq=False)
class Kahan(MasterMethod):
    """Kahan-compensated 16-bit weights (bf16 or fp16; a buffer of the weight's dtype).

    Example:
        >>> Kahan() == "kahan", Kahan().master_bytes(2)
        (True, 2)
    """

    name: ClassVar[str] = "kahan"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16)
    buffer_key: ClassVar[str | None] = COMPENSATION_KEY
    uses_spare: ClassVar[bool] = True

    def master_bytes(self, param_bytes: int) -> int:
        return param_bytes

    def buffer_dtype(self, param_dtype: torch.dtype) -> torch.dtype | None:
        return param_dtype

    def make_buffer(self, param, initial):
        comp = torch.zeros_like(param, memory_format=torch.preserve_format)
        if initial is not None:  # what the cast lost
            comp.copy_(initial.to(param.device) - param.float())
        return comp

    def register_load_hooks(self, optimizer) -> None:
        """Split each loaded pair the saved way (see the module docstring); registered after
        the optimizer's other load hooks."""
        optimizer.register_load_state_dict_pre_hook(_take_values)
        optimizer.register_load_state_dict_post_hook(_keep_values)

    # -- load and store: weight + compensation (see the module docstring) --------------------
    @staticmethod
    def load(weight, comp):
        return weight.float() + comp.float()

    @staticmethod
    def load_lists(out, weights, comps, spare=None):
        values = _unflatten(out, weights)
        torch._foreach_copy_(values, weights)
        torch._foreach_add_(values, _widened(comps, spare))  # as load's w.float() + c.float()

    @staticmethod
    def store_lists(values, weights, comps, keys, spare=None):
        runs = _unflatten(values, weights)
        torch._foreach_copy_(weights, runs)  # rounded to nearest
        torch._foreach_sub_(runs, _widened(weights, spare))  # what that lost (exact)
        if comps[0].dtype == torch.bfloat16:  # a NaN's compensation: the weight is NaN too
            round_into_lists(values, comps, keys)
        else:
            noise = noise_lists(keys, [c.numel() for c in comps], values.device)
            torch._foreach_copy_(comps, _unflatten(round_fp16_with(values, noise), comps))

    def assign(self, weight, comp, value):
        """Where ``value`` minus the compensation held is exactly a 16-bit number, the weight
        becomes it and the compensation stays (:func:`keep_pair`: an optimizer ``state_dict``
        loaded before the model's brings the saved pair's compensation, and the pair comes back
        as saved, even at a tie); elsewhere rounded to nearest, the compensation taking what
        that lost (to nearest: no rounding bits are drawn)."""
        value = value.to(device=weight.device, dtype=torch.float32)
        if comp is None:
            weight.copy_(value)
            return
        weight, comp, value = (local(t) for t in (weight.detach(), comp, value))  # FSDP2 shards
        target = value - comp.float()
        exact = target.to(weight.dtype)
        # kept where the weight it gives is a nearest rounding of the value: a pair whose
        # weight is not (a stale compensation of a loaded 16-bit value) is a direct write to
        # the step's check (optim.writes), which dropped the compensation: up to 100% off
        kept = (exact.float() == target) & rounds_to(value, exact)
        rounded = value.to(weight.dtype)
        weight.copy_(torch.where(kept, exact, rounded))
        comp.copy_(torch.where(kept, comp, (value - rounded.float()).to(comp.dtype)))


register(Kahan, {"kahan": {}})


# the values the Kahan pairs held when a load_state_dict call began, until its post-hook
_VALUES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _take_values(optimizer, state_dict) -> None:
    _VALUES[optimizer] = {p: v for p, v in optimizer.fp32_values().items()
                          if not is_dtensor(p)}


def _keep_values(optimizer) -> None:
    values = _VALUES.pop(optimizer, None) or {}
    for param, value in values.items():
        comp = optimizer.compensation(param)
        if comp is not None and comp.shape == param.shape:
            keep_pair(param, comp, value)


@torch.no_grad()
def keep_pair(weight: torch.Tensor, comp: torch.Tensor, value: torch.Tensor) -> None:
    """Make the Kahan pair (``weight``, loaded ``comp``) stand for the fp32 ``value`` the
    saved pair held: where ``value - comp`` is exactly a 16-bit number, ``weight`` becomes it
    (elsewhere it keeps its value, ``value`` rounded to nearest). Plain tensors (this rank's
    shards under FSDP)."""
    target = value.to(torch.float32) - comp.float()
    exact = target.to(weight.dtype)
    weight.copy_(torch.where(exact.float() == target, exact, weight))
