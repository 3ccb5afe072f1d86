"""mixprec: mixed-precision training for PyTorch.

Levels O0-O3, autocast with custom op lists, fp32 master weights, loss scaling, a training API
and numerics diagnostics. ``import mixprec as mp``.
"""

from .hardware import SlowDtypeWarning, device_capabilities
from .policy import Policy
from .master import MasterWeightOptimizer, fp32_state_dict
from . import formats
from . import debug
from .emulation import emulate_fp16
from .scaling import (DynamicLossScaler, NoLossScaler, NonFiniteGradientsError, StaticLossScaler,
                      make_loss_scaler)

__version__ = "0.1.0"

from .trainer import History, Trainer
from .callbacks import Callback, LossMonitor, ModelCheckpoint
from .metrics import Accuracy

from .autocast import autocast
from .oplists import op_lists
from .prepare import policy_of, prepare, to_float

__all__ = [
    # training loop
    "Trainer",
    "History",
    "Callback",
    "LossMonitor",
    "ModelCheckpoint",
    "Accuracy",
    "autocast",
    "op_lists",
    "prepare",
    "policy_of",
    "to_float",
    "__version__",
    # hardware / policy
    "device_capabilities",
    "SlowDtypeWarning",
    "Policy",
    # master weights
    "MasterWeightOptimizer",
    "fp32_state_dict",
    # numerics
    "formats",
    "debug",
    "emulate_fp16",
    # loss scaling
    "DynamicLossScaler",
    "StaticLossScaler",
    "NoLossScaler",
    "make_loss_scaler",
    "NonFiniteGradientsError",
]
