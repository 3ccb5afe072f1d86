"""``EngineGradScaler``: a :class:`mixprec.MixedPrecision` in the place of the
``torch.amp.GradScaler`` that Hugging Face Accelerate (and so the ``transformers.Trainer``)
calls when it backpropagates (``scale(loss).backward()``), steps (``step(optimizer)`` then
``update()``), unscales and checkpoints (``state_dict``). Neither library is imported here.
"""

from __future__ import annotations

import torch

from ..engine import MixedPrecision

__all__ = ["EngineGradScaler"]


class EngineGradScaler:
    """A :class:`mixprec.MixedPrecision` seen through the calls accelerate makes on its
    gradient scaler (``torch.amp.GradScaler``'s): ``scale``, ``step``, ``update``, ``unscale_``,
    ``state_dict``, ``load_state_dict``.

    Args:
        engine: the engine.
    """

    def __init__(self, engine: MixedPrecision):
        self.engine = engine

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale."""
        return self.engine.scale(loss)

    def unscale_(self, optimizer) -> None:
        """``engine.unscale_(optimizer)`` (once per step: a second call does nothing)."""
        if not self.engine.is_unscaled(optimizer):
            self.engine.unscale_(optimizer)

    def step(self, optimizer, closure=None) -> bool:
        """``engine.step(optimizer)``: step or skip, and update the scale; True when applied.

        Raises:
            TypeError: a closure (it would recompute scaled gradients after the check).
        """
        if closure is not None:
            raise TypeError("a closure would recompute scaled gradients after the overflow "
                            "check; mixprec's engine steps without one")
        # accelerate tells a skipped step by the optimizer's step() not being called: the flag
        # is read before the update, which then runs only when applied (a master optimizer, or
        # a torch one built with fused=True, would otherwise skip on the device)
        optimizer.skip_on_device = False
        return self.engine.step(optimizer)

    def update(self, new_scale=None) -> None:
        """Nothing left to do: :meth:`step` updated the scale.

        Raises:
            ValueError: a ``new_scale`` (set it on ``engine.scaler`` instead).
        """
        if new_scale is not None:
            raise ValueError("the engine updates its scale in step(); set a scale with "
                             "engine.scaler.update(new_scale)")

    def is_enabled(self) -> bool:
        """True when the engine scales the loss."""
        return self.engine.scaler.is_enabled()

    def get_scale(self) -> float:
        """The current loss scale (a host sync)."""
        return self.engine.scaler.get_scale()

    def state_dict(self) -> dict:
        """The engine's state: the policy and the scaler."""
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`; a state made under another policy is refused."""
        self.engine.load_state_dict(state_dict)

    @property
    def _device(self) -> torch.device:
        """Where the scale lives (accelerate's FSDP2 ``load_state`` reads it)."""
        return self.engine.scaler.scale_tensor.device

    def _lazy_init_scale_growth_tracker(self, device) -> None:
        """Nothing to do: accelerate's FSDP2 ``load_state`` calls it after
        :meth:`load_state_dict`; the engine's scaler is ready once loaded."""
