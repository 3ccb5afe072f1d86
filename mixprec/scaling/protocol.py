"""The protocol between a loss scaler and an optimizer that owns the gradients its step reads.

torch's own version is ``_step_supports_amp_scaling``: ``GradScaler.step`` passes ``grad_scale``
and ``found_inf`` to an optimizer whose fused kernels consume them, and assumes it can see and
check the gradients in ``param_groups`` first. An optimizer that steps fp32 masters of 16-bit
parameters (:class:`mixprec.MasterWeightOptimizer`) reads the model's 16-bit gradients instead,
so mixprec's scalers (and :class:`mixprec.MixedPrecision`, the apex compatibility layer and the
integrations) drive it through these four calls, and through nothing else:

* ``grads_for_step()``: the ``(parameter, gradient)`` pairs the next ``step()`` reads, in their
  own dtypes: what a scaler checks for inf/NaN and measures for clipping. They are the tensors
  the step reads, so an in-place change is what the step uses (the apex layer adds gradients
  set aside from an earlier loss into them).
* ``unscale_grads_(inv_scale)``: make the fp32 gradients the step will use, times ``inv_scale``
  (a 0-d tensor, or None for 1), check them for inf/NaN in the same pass, and return a 0-d flag
  (> 0: overflow). Afterwards the gradients read as unscaled wherever torch code looks.
* ``step(grad_scale=s)``: the gradients still carry the factor ``s`` (a 0-d tensor): divide by
  it while reading them. A scaler that clips folds the clip factor into ``s``.
* ``drop_master_grads()``: the step is skipped: drop what ``unscale_grads_`` made. A step
  skipped on the host never calls ``step()``, so weights and optimizer state stay untouched.

Two optional calls (:class:`mixprec.MasterWeightOptimizer` has them):

* ``skips_on_device()`` and ``step(grad_scale=s, found_inf=f)``: where the first is True, the
  scaler does not read the 0/1 overflow flag ``f`` before the step but hands it over, as
  ``torch.amp.GradScaler`` hands it to torch's fused optimizers: their kernels skip on the
  device (weights, moments and step counts untouched), and the flag is read after the step is
  queued.
* ``settle_grads_(s)``: ``unscale_grads_`` with the step's own arithmetic for the factor ``s``
  (torch's fused kernels divide by it), so a clip applied before the step steps bitwise as one
  folded into it. Without it the scaler calls ``unscale_grads_(1 / s)``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["OwnsGradients", "owns_gradients", "INTERNAL"]

#: Set on mixprec's own global step pre-hook (a refusal that passes every master optimizer by):
#: it does not count as a user's hook (:func:`mixprec.optim.hooks.has_step_pre_hooks`,
#: :func:`mixprec.scaling.args.torch_skips_on_device`).
INTERNAL = "_mixprec_internal"


@runtime_checkable
class OwnsGradients(Protocol):
    """An optimizer whose step reads gradients that are not in its ``param_groups``."""

    param_groups: list[dict]

    def grads_for_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (parameter, gradient) pairs the next step reads."""

    def unscale_grads_(self, inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Make the fp32 gradients times ``inv_scale``; return the 0-d inf/NaN flag."""

    def drop_master_grads(self) -> None:
        """Drop what :meth:`unscale_grads_` made (the step is skipped)."""

    def step(self, closure: Any = None, *, grad_scale: torch.Tensor | None = None) -> Any:
        """Step; the gradients still carry ``grad_scale`` when it is given."""


def owns_gradients(optimizer: Any) -> bool:
    """True for an optimizer that implements :class:`OwnsGradients`."""
    return isinstance(optimizer, OwnsGradients)
