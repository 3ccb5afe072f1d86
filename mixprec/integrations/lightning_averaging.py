"""Lightning's ``WeightAveraging`` callback (EMA, SWA) beside :class:`MixprecPrecision`.

The callback builds torch's ``torch.optim.swa_utils.AveragedModel`` in its ``setup``, before the
plugin prepares the module: an fp32 copy, which torch's update then pairs with the module's
16-bit parameters (an EMA's ``_foreach_lerp_`` raises a dtype error at the first update). A copy
made after the preparation would be worse: bf16 arithmetic, which freezes an EMA
(:mod:`mixprec.averaging`). So once the plugin has prepared the module, the callback's average
is rebuilt as :class:`mixprec.AveragedModel` of the prepared module, with the arguments of the
one it replaces: stored in fp32, updated from the fp32 values the module trains. The callback
works as it does on a plain model: it swaps the average in for validation (rounded to the
module's 16-bit weights, and swapped back exactly), saves it in checkpoints as the model's
``state_dict`` (fp32, exact), and copies it into the module when the fit ends (rounded to the
16-bit weights, which the module's fp32 values then take).
"""

from __future__ import annotations

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
        callback._average_model = AveragedModel(
            module, device=old.n_averaged.device, avg_fn=old.avg_fn,
            multi_avg_fn=old.multi_avg_fn, use_buffers=old.use_buffers)
