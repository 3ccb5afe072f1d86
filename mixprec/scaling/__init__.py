"""Loss scaling: pure scale state and its update, the scalers, and the unscale pass.

* :mod:`.state`: :class:`ScaleState` (0-d tensors), :class:`DynamicConfig`, :func:`adjust_scale`.
* :mod:`.base`: :class:`LossScaler`, the shell every scaler shares (unscale/clip/step/update).
* :mod:`.records`: what a scaler records per iteration (each optimizer's stage, the counters).
* :mod:`.gradscaler`: torch.amp.GradScaler's getters, setters and state_dict keys.
* :mod:`.scalers`: :class:`DynamicLossScaler`, :class:`StaticLossScaler`, :class:`NoLossScaler`,
  :func:`make_loss_scaler`.
* :mod:`.unscale`: the fused unscale + inf/NaN pass over plain optimizers' gradients.
* :mod:`.protocol`: :class:`OwnsGradients`, the protocol between a scaler and an optimizer that
  owns the gradients its step reads (fp32 masters).
"""

from .base import LossScaler
from .protocol import OwnsGradients, owns_gradients
from .scalers import (
                      DynamicLossScaler,
                      NoLossScaler,
                      NonFiniteGradientsError,
                      StaticLossScaler,
                      make_loss_scaler,
)
from .state import DynamicConfig, ScaleState, adjust_scale

__all__ = ["DynamicLossScaler", "StaticLossScaler", "NoLossScaler", "make_loss_scaler",
           "NonFiniteGradientsError", "LossScaler", "ScaleState", "DynamicConfig", "adjust_scale",
           "OwnsGradients", "owns_gradients"]
