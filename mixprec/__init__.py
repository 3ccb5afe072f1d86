"""mixprec: mixed-precision training for PyTorch.

Levels O0-O3, autocast with custom op lists, fp32 master weights, loss scaling, a training API
and numerics diagnostics. ``import mixprec as mp``.

``import mixprec`` loads the core (policies, ``prepare``, the engine, master weights, loss
scaling, autocast, the low-bit formats). The rest (the advisor, the monitor, the diagnostics,
the Trainer, the distributed helpers) is loaded on first use of its name (``mp.advise``,
``mp.Trainer``, ``mp.parallel``, ...): see ``_LAZY``.
"""

import importlib
from typing import TYPE_CHECKING

from . import formats, lowbit, masters
from .autocast import autocast
from .averaging import AveragedModel
from .casting import to_float
from .emulation import emulate_fp16
from .engine import MixedPrecision
from .footprint import bytes_per_parameter
from .fp8 import fp8_modules
from .fp32export import fp32_state_dict
from .hardware import SlowDtypeWarning, device_capabilities
from .oplists import OpListWarning, op_lists
from .optim import CompactMasterOptimizer, MasterWeightOptimizer
from .policy import NormLayer, Policy, is_norm_layer
from .precision import Precision
from .precision_map import PrecisionMap
from .prepare import policy_of, prepare
from .recompute import activation_checkpoint
from .scaling import (
    DynamicLossScaler,
    NoLossScaler,
    NonFiniteGradientsError,
    StaticLossScaler,
    make_loss_scaler,
)

#: name -> (module, attribute or None for the module itself): loaded on first use (PEP 562)
_LAZY = {
    "debug": ("debug", None),
    "monitor": ("monitor", None),
    "parallel": ("parallel", None),
    "advisor": ("advisor", None),
    "training": ("training", None),
    "advise": ("advisor", "advise"),
    "Advice": ("advisor", "Advice"),
    "PrecisionMonitor": ("monitor", "PrecisionMonitor"),
    "convert_checkpoint": ("training.portable", "convert_checkpoint"),
    **{name: ("training", name) for name in ("Trainer", "History", "Callback", "LossMonitor",
                                             "FP8Monitor", "ModelCheckpoint", "Accuracy")},
}

if TYPE_CHECKING:  # what _LAZY loads, for type checkers and editors
    from . import debug, monitor, parallel
    from .advisor import Advice, advise
    from .monitor import PrecisionMonitor
    from .training import (
                           Accuracy,
                           Callback,
                           FP8Monitor,
                           History,
                           LossMonitor,
                           ModelCheckpoint,
                           Trainer,
    )
    from .training.portable import convert_checkpoint

__version__ = "0.6.0"

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
    "activation_checkpoint",
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
    "AveragedModel",
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
    """The names of ``_LAZY``, imported on first use (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(f".{module}", __name__)  # lazy: import cost, see above
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """``__all__``: the submodules and helpers imported here are not part of the surface."""
    return sorted(__all__)
