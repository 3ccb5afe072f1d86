"""Lightning's ``WeightAveraging`` callback (EMA, SWA) beside :class:`MixprecPrecision`.

The callback builds torch's ``torch.optim.swa_utils.AveragedModel`` in its ``setup``, before the
plugin prepares the module: an fp32 copy, which torch's update then pairs with the module's
16-bit parameters (an EMA's ``_foreach_lerp_`` raises a dtype error at the first update). A copy
made after the preparation would be worse: bf16 arithmetic, which freezes an EMA
(:mod:`mixprec.averaging`). So once the plugin has prepared the module, the callback's average
is rebuilt as :class:`mixprec.AveragedModel` of the prepared module, with the arguments of the
one it replaces, and its state (a checkpoint the fit resumes from was loaded into it before
the plugin runs; otherwise it holds the module's fp32 values, as the new one does): stored in
fp32, updated from the fp32 values the module trains. The
callback then works as on a plain model: it shows the module the average for validation
(rounded to the module's 16-bit weights), saves the average in checkpoints as the model's
``state_dict`` (fp32, exact), and copies it into the module when the fit ends (rounded to the
16-bit weights; its fp32 values, the masters, become the average: exactly with fp32 and
split masters). Two of the
callback's steps are replaced to keep the fp32 values (unless a subclass overrides them):
its swap for validation writes the average into the module and puts the module's own values
back after it, its fp32 values too, leaving the average as it was (Lightning's own swaps the
tensors' values, which rounds the fp32 average to the module's 16 bits on the way back), and
its copy at the end also sets the fp32 values to the average's (Lightning's writes the
16-bit weights through ``.data``). Neither goes through the module's own ``state_dict`` or
``load_state_dict`` (a module may override them, leave keys out, or keep extra state).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.optim import swa_utils

from ..averaging import AveragedModel, fp32_parameters
from ..dtypes import is_low_precision
from ..optim import CompactMasterOptimizer
from ..statedict import links_of

__all__ = ["average_in_fp32"]


def average_in_fp32(module: nn.Module, kind: type | None) -> None:
    """Rebuild, as :class:`mixprec.AveragedModel` of the prepared ``module``, the average of each
    of its trainer's callbacks of type ``kind`` (Lightning's ``WeightAveraging``; None: this
    Lightning has none) that holds torch's own class, where the module holds 16-bit parameters
    (see the module docstring)."""
    if kind is None or not any(is_low_precision(p) for p in module.parameters()):
        return  # fp32 parameters: torch's class averages them as they are
    for callback in getattr(getattr(module, "_trainer", None), "callbacks", None) or []:
        old = getattr(callback, "_average_model", None) if isinstance(callback, kind) else None
        if type(old) is not swa_utils.AveragedModel:  # none yet, ours, or the user's own class
            continue
        new = AveragedModel(module, device=old.n_averaged.device, avg_fn=old.avg_fn,
                            multi_avg_fn=old.multi_avg_fn, use_buffers=old.use_buffers)
        # what the old one holds: a checkpoint's average (a resumed fit, even one saved before
        # the first update), else the module's fp32 values when the callback copied it (read
        # tensor by tensor: a module's own state_dict() may leave keys out)
        with torch.no_grad():
            for mine, theirs in zip(new.module.parameters(), fp32_parameters(old.module)):
                mine.copy_(theirs)
            for mine, theirs in zip(new.module.buffers(), old.module.buffers()):
                mine.copy_(theirs)
            new.n_averaged.copy_(old.n_averaged)
        callback._average_model = new
        for name, step in (("_swap_models", _ExactSwap), ("_copy_average_to_current", _ExactCopy)):
            if getattr(type(callback), name, None) is getattr(kind, name, None):  # not the
                setattr(callback, name, step(callback))  # user's own (a subclass's override)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return list(itertools.chain(module.parameters(), module.buffers()))


def _held(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tensors that hold ``module``'s fp32 values besides its own (per 16-bit parameter its
    fp32 master, its Kahan compensation or split remainder, or the shadow a copy or a later fit
    keeps), each with a copy in host memory."""
    held: dict[int, torch.Tensor] = {}
    for link in links_of(module):
        stepped: set[int] = set()
        for opt in link.optimizers():
            values = opt.masters_by_param()  # (compact: values computed now; buffers hold)
            stepped.update(id(p) for p in values)
            compact = isinstance(opt, CompactMasterOptimizer)
            for p, value in values.items():
                t = opt.compensation(p) if compact else value
                if t is not None:
                    held[id(t)] = t
        for p, t in link.pairs().items():
            if id(p) not in stepped:
                held[id(t)] = t
    return [(t, t.detach().to("cpu", copy=True)) for t in held.values()]


class _ExactSwap:
    """A ``WeightAveraging`` callback's ``_swap_models`` (called when validation starts, then
    when it ends). The first call keeps the module's tensors and what holds its fp32 values
    (masters, compensations, remainders) aside in host memory and writes the average into the
    module; the second puts them all back, so the fp32 values are as they were even where
    something read the module's ``state_dict()`` during validation (which gives the masters
    the weights' values: the average's rounding). The average is never written; nothing is
    loaded through the module's own ``state_dict`` machinery."""

    def __init__(self, callback) -> None:
        self.callback = callback
        self.kept: tuple | None = None

    def __call__(self, pl_module: nn.Module) -> None:
        current = _tensors(pl_module)
        with torch.no_grad():
            if self.kept is None:
                self.kept = ([c.detach().to("cpu", copy=True) for c in current],
                             _held(pl_module))
                for a, c in zip(_tensors(self.callback._average_model.module), current):
                    c.data.copy_(a.data)
                return
            own, held = self.kept
            for c, kept in zip(current, own):
                c.data.copy_(kept)
            for t, kept in held:
                t.copy_(kept)
        self.kept = None


class _ExactCopy:
    """A ``WeightAveraging`` callback's ``_copy_average_to_current`` (when the fit ends):
    Lightning's copy (every parameter and buffer, non-persistent ones too, through ``.data``),
    then each 16-bit parameter's fp32 value set to the average's through its companion, as a
    load of an fp32 ``state_dict`` sets it, so the masters become the average (after
    Lightning's copy alone they took its rounding)."""

    def __init__(self, callback) -> None:
        self.callback = callback

    def __call__(self, pl_module: nn.Module) -> None:
        average = self.callback._average_model.module
        owner = {id(p): (link, comp) for link in links_of(pl_module)
                 for p, comp in link.pairs().items()}
        with torch.no_grad():
            for a, c in zip(_tensors(average), _tensors(pl_module)):
                c.data.copy_(a.data)
            for a, c in zip(average.parameters(), pl_module.parameters()):
                if id(c) in owner:
                    link, comp = owner[id(c)]
                    c.copy_(link.load(c, comp, a.detach()))
