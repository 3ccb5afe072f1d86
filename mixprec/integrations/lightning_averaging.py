"""Lightning's ``WeightAveraging`` callback (EMA, SWA) beside :class:`MixprecPrecision`.

The callback builds torch's ``torch.optim.swa_utils.AveragedModel`` in its ``setup``, before the
plugin prepares the module: an fp32 copy, which torch's update then pairs with the module's
16-bit parameters (an EMA's ``_foreach_lerp_`` raises a dtype error at the first update). A copy
made after the preparation would be worse: bf16 arithmetic, which freezes an EMA
(:mod:`mixprec.averaging`). So once the plugin has prepared the module, the callback's average
is rebuilt as :class:`mixprec.AveragedModel` of the prepared module, with the arguments of the
one it replaces, and its state when it holds one (a checkpoint the fit resumes from, loaded
before the plugin runs): stored in fp32, updated from the fp32 values the module trains. The
callback then works as on a plain model: it shows the module the average for validation
(rounded to the module's 16-bit weights), saves the average in checkpoints as the model's
``state_dict`` (fp32, exact), and copies it into the module when the fit ends (rounded to the
16-bit weights; its fp32 values, the masters, become the average exactly). Two of the
callback's steps are replaced to keep the fp32 values: its swap for validation keeps both
sides' values aside and puts them back as they were (Lightning's own swaps the tensors' values,
which rounds the fp32 average to the module's 16 bits on the way back), and its copy at the
end loads the average's ``state_dict`` into the module (Lightning's writes the 16-bit weights
through ``.data``).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.optim import swa_utils

from ..averaging import AveragedModel
from ..dtypes import is_low_precision

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
        if int(old.n_averaged):  # restored from the checkpoint a fit resumes from
            new.load_state_dict(old.state_dict())
        callback._average_model = new
        callback._swap_models = _ExactSwap(callback)
        callback._copy_average_to_current = _ExactCopy(callback)


class _ExactSwap:
    """A ``WeightAveraging`` callback's ``_swap_models`` (called when validation starts, then
    when it ends): the first call keeps the average's and the module's values aside and writes
    the average into the module; the second puts both back as they were."""

    def __init__(self, callback) -> None:
        self.callback = callback
        self.kept: list | None = None

    def __call__(self, pl_module: nn.Module) -> None:
        average = self.callback._average_model.module
        pairs = list(zip(itertools.chain(average.parameters(), average.buffers()),
                         itertools.chain(pl_module.parameters(), pl_module.buffers())))
        with torch.no_grad():
            if self.kept is None:
                self.kept = [(a.detach().clone(), c.detach().clone()) for a, c in pairs]
                for a, c in pairs:
                    c.data.copy_(a.data)
                return
            for (a, c), (kept_a, kept_c) in zip(pairs, self.kept):
                a.data.copy_(kept_a)
                c.data.copy_(kept_c)
            self.kept = None


class _ExactCopy:
    """A ``WeightAveraging`` callback's ``_copy_average_to_current`` (when the fit ends): the
    module loads the average's ``state_dict``, so its fp32 values (the masters) become the
    average exactly and its 16-bit weights their rounding (Lightning's own copy writes the
    16-bit weights alone, through ``.data``, and the masters then took their rounding)."""

    def __init__(self, callback) -> None:
        self.callback = callback

    def __call__(self, pl_module: nn.Module) -> None:
        pl_module.load_state_dict(self.callback._average_model.module.state_dict())
