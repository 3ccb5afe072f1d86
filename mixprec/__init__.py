"""mixprec: mixed-precision training for PyTorch.

Levels O0-O3, autocast with custom op lists, fp32 master weights, loss scaling, a training API
and numerics diagnostics. ``import mixprec as mp``.
"""

from .hardware import SlowDtypeWarning, device_capabilities
from .policy import Policy
from . import formats
from .scaling import (DynamicLossScaler, NoLossScaler, NonFiniteGradientsError, StaticLossScaler,
                      make_loss_scaler)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # hardware / policy
    "device_capabilities",
    "SlowDtypeWarning",
    "Policy",
    # numerics
    "formats",
    # loss scaling
    "DynamicLossScaler",
    "StaticLossScaler",
    "NoLossScaler",
    "make_loss_scaler",
    "NonFiniteGradientsError",
]
