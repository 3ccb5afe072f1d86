"""Autocast op lists: torch's default cast policies and mixprec's additions, as data, and the
names custom op lists use.

* :mod:`.tables`: :data:`TORCH_DEFAULTS` (torch.autocast's cast policies per device type),
  :data:`MIXPREC_FP32_ADDITIONS`, :data:`MODULE_FUNCTIONS` and :data:`OPS_BENEATH`.
* :mod:`.names`: :func:`normalize_op_name`, :func:`resolve_op`, :func:`op_list_name` and
  :func:`validate_custom_lists`.
* :mod:`.effective`: :func:`op_lists`, the lists in force for a device and custom lists.
* :mod:`.reach`: :func:`unreachable_names` and :func:`warn_unreachable`: names a model's code
  never calls at the Python level (:class:`OpListWarning`).

Custom op lists (``mp.autocast(low_precision_ops=..., fp32_ops=...)``) name Python-level torch
functions ("linear", "softmax", "add"; "torch.add" and "F.gelu" are accepted too) and act where
those functions are called; an ATen op beneath such a function (``addmm`` beneath ``F.linear``)
is out of their reach, and :func:`unreachable_names` says what to name instead.
"""

from .effective import op_lists
from .names import normalize_op_name, op_list_name, resolve_op, validate_custom_lists
from .reach import OpListWarning, unreachable_names, warn_unreachable
from .tables import (
    MIXPREC_FP32_ADDITIONS,
    MODULE_FUNCTIONS,
    OPS_BENEATH,
    POLICIES,
    TORCH_DEFAULTS,
    check_device_type,
)

__all__ = ["op_lists", "TORCH_DEFAULTS", "MIXPREC_FP32_ADDITIONS", "resolve_op", "POLICIES",
           "normalize_op_name", "op_list_name", "validate_custom_lists", "MODULE_FUNCTIONS",
           "OPS_BENEATH", "unreachable_names", "warn_unreachable", "OpListWarning",
           "check_device_type"]
