"""``activation_checkpoint``: torch's ``checkpoint`` of a function, recomputed as it was computed.

``torch.utils.checkpoint.checkpoint`` runs its function again during backward and restores
the autocast state for it, not the op lists and fp16 emulation a mixprec block adds to
autocast (:mod:`mixprec.autocast`). A *module* checkpointed inside a prepared model re-enters
them itself (its region's forward wrapper, :mod:`mixprec.regions`); a plain function or a
method does not: its recomputation would run the listed ops in autocast's own dtypes (torch's
non-reentrant checkpoint then refuses the recomputed values' dtypes; the reentrant one
computes other gradients). :func:`activation_checkpoint` captures the mixprec block in force
when it is called and enters it again around the recomputation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint
from torch.overrides import _get_current_function_mode_stack

from .autocast import _OpListMode, context_active, is_mixprec_mode
from .emulation import Fp16EmulationMode
from .oplists import kernels
from .regions import active_casts, cast_again

__all__ = ["activation_checkpoint", "recompute_hint"]


class _Recompute:
    """``function``, run inside the captured mixprec block when none is in force, and with the
    parameters cast for the call again (a module's that a fixed-dtype region casts per call)
    when the module's call has returned (the recomputation)."""

    def __init__(self, function: Callable, block, modes: list, casts: list) -> None:
        self.function, self.block, self.modes, self.casts = function, block, modes, casts

    def __call__(self, *args, **kwargs):
        if self.casts and not active_casts():
            return cast_again(self.casts, self._run, args, kwargs)
        return self._run(args, kwargs)

    def _run(self, args, kwargs):
        if context_active() or (self.block is None and not self.modes):
            return self.function(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            if self.block is not None:
                stack.enter_context(kernels.active(self.block.device_type, self.block.targets,
                                                   self.block.mode_targets))
            for mode in self.modes:  # fresh modes, outermost first, as they were entered
                stack.enter_context(
                    _OpListMode(mode.device_type, mode.targets) if isinstance(mode, _OpListMode)
                    else Fp16EmulationMode(mode.device_type))
            return self.function(*args, **kwargs)


def activation_checkpoint(function: Callable, *args: Any, use_reentrant: bool | None = None,
                          **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=..., **kwargs)``,
    whose recomputation runs under the mixprec op lists and fp16 emulation in force now (see
    the module docstring), with the parameters a fixed-dtype region casts per call cast again:
    the gradients are bitwise those of the forward without checkpointing. Call it where you
    would call torch's, inside a prepared model's forward; outside any mixprec block it is
    torch's.

    Raises:
        TypeError: ``function`` is not callable.

    Example:
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> activation_checkpoint(torch.sin, x, use_reentrant=False).shape
        torch.Size([2, 3])
    """
    if not callable(function):
        raise TypeError(f"activation_checkpoint takes a callable to run (and recompute); got "
                        f"{type(function).__name__}")
    modes = [m for m in _get_current_function_mode_stack() if is_mixprec_mode(m)]
    return torch.utils.checkpoint.checkpoint(
        _Recompute(function, kernels.block_in_force(), modes, active_casts()), *args,
        use_reentrant=use_reentrant, **kwargs)


def recompute_hint(error: torch.utils.checkpoint.CheckpointError) -> Exception:
    """``error`` (torch's refusal of recomputed values), saying what to write instead where
    the values differ in dtype: the mistake this module's function corrects."""
    if "dtype" not in str(error):
        return error
    return type(error)(
        f"{error}\nInside a prepared model, a function that is not a module call (a method, a "
        "lambda) checkpointed with torch.utils.checkpoint is recomputed without mixprec's op "
        "lists, in other dtypes: use mp.activation_checkpoint(fn, *args, use_reentrant=...) in "
        "its place, or checkpoint a module")
