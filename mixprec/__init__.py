"""mixprec: mixed-precision training for PyTorch.

Levels O0-O3, autocast with custom op lists, fp32 master weights, loss scaling, a training API
and numerics diagnostics. ``import mixprec as mp``.
"""

from . import debug, formats, lowbit, masters, monitor, parallel
from .advisor import Advice, advise
from .autocast import autocast
from .casting import to_float
from .emulation import emulate_fp16
from .engine import MixedPrecision
from .footprint import bytes_per_parameter
from .fp8 import fp8_modules
from .hardware import SlowDtypeWarning, device_capabilities
from .master import CompactMasterOptimizer, MasterWeightOptimizer
from .monitor import PrecisionMonitor
from .oplists import OpListWarning, op_lists
from .policy import NormLayer, Policy, is_norm_layer
from .precision import Precision
from .precision_map import PrecisionMap
from .prepare import policy_of, prepare
from .scaling import (
                      DynamicLossScaler,
                      NoLossScaler,
                      NonFiniteGradientsError,
                      StaticLossScaler,
                      make_loss_scaler,
)
from .statedict import fp32_state_dict
from .training import (
                       Accuracy,
                       Callback,
                       FP8Monitor,
                       History,
                       LossMonitor,
                       ModelCheckpoint,
                       Trainer,
)

__version__ = "0.5.0"

__all__ = [
    "__version__",
    # hardware, policy and levels
    "device_capabilities",
    "SlowDtypeWarning",
    "Policy",
    "PrecisionMap",
    "Precision",
    "NormLayer",
    "is_norm_layer",
    "prepare",
    "policy_of",
    "MixedPrecision",
    "to_float",
    "fp8_modules",
    "lowbit",
    "masters",
    # autocast with custom op lists
    "autocast",
    "op_lists",
    "OpListWarning",
    # master weights
    "MasterWeightOptimizer",
    "CompactMasterOptimizer",
    "fp32_state_dict",
    "bytes_per_parameter",
    # loss scaling
    "DynamicLossScaler",
    "StaticLossScaler",
    "NoLossScaler",
    "make_loss_scaler",
    "NonFiniteGradientsError",
    # training loop
    "Trainer",
    "History",
    "Callback",
    "LossMonitor",
    "FP8Monitor",
    "ModelCheckpoint",
    "Accuracy",
    # numerics
    "advise",
    "Advice",
    "formats",
    "debug",
    # seeing a run
    "PrecisionMonitor",
    "monitor",
    "emulate_fp16",
    # beyond one process
    "parallel",
    "convert_checkpoint",
]


def __getattr__(name: str):
    if name == "convert_checkpoint":  # deferred: torch.distributed.checkpoint's import cost
        from .training.portable import convert_checkpoint
        return convert_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
