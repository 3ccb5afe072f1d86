"""apex's optimisation levels as data: the O0-O3 property table and apex's override rules.

``amp.initialize(opt_level=..., **overrides)`` starts from the level's properties and applies
every keyword that is not None, with the checks apex made (a property that contradicts the level
is a ``RuntimeError``, as in apex; a value of the wrong type is a ``TypeError``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..dtypes import LOW_PRECISION_DTYPES, TRAINING_DTYPES, dtype_name, to_dtype

__all__ = ["AmpProperties", "LEVELS", "level_properties", "resolve_properties", "check_dtype"]

LEVELS = ("O0", "O1", "O2", "O3")
_LOW = "low"  # placeholder in the table: the low-precision dtype (fp16 unless dtype= says bf16)

#: What each level sets (apex's table; ``_LOW`` stands for the ``dtype=`` extension's dtype).
_TABLE = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=_LOW, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=_LOW, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}

_BRIEF = {
    "O0": "pure fp32 training",
    "O1": "op lists: GEMMs and convolutions in {dtype}, precision-sensitive ops in fp32",
    "O2": "{dtype} model, fp32 batchnorm, fp32 master weights",
    "O3": "pure {dtype} training",
}


@dataclasses.dataclass(frozen=True)
class AmpProperties:
    """The properties apex's ``initialize`` works from (after the level and the overrides).

    Attributes:
        opt_level: "O0".."O3".
        low_dtype: the low-precision dtype of the ``dtype=`` extension (fp16 or bf16).
        cast_model_type: dtype the models (and their floating inputs) are cast to; None or
            False leaves them as they are.
        patch_torch_functions: run the models' forward under apex's O1 op lists.
        keep_batchnorm_fp32: keep affine BatchNorm layers in fp32 when the model is cast.
        master_weights: fp32 master copies of low-precision parameters in the optimizer.
        loss_scale: "dynamic" or a fixed float.
    """

    opt_level: str
    low_dtype: torch.dtype
    cast_model_type: Any
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | None
    loss_scale: str | float

    def table(self) -> str:
        """The properties as apex printed them, one ``name : value`` line each."""
        names = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions",
                 "keep_batchnorm_fp32", "master_weights", "loss_scale")
        values = {"enabled": True, **dataclasses.asdict(self)}
        return "\n".join(f"{name:22} : {values[name]}" for name in names)

    def brief(self) -> str:
        name = dtype_name(self.low_dtype)
        return f"{self.opt_level}: {_BRIEF[self.opt_level].format(dtype=name)}"


def check_dtype(dtype) -> torch.dtype:
    """The low-precision dtype of the ``dtype=`` extension: fp16 (apex's) or bf16."""
    resolved = to_dtype(dtype, what="dtype")
    if resolved not in LOW_PRECISION_DTYPES:
        raise ValueError(f"dtype must be 'fp16' (apex's) or 'bf16'; got {dtype!r}")
    return resolved


def level_properties(opt_level, low_dtype: torch.dtype) -> AmpProperties:
    """The properties a level sets before any override.

    Raises:
        TypeError: ``opt_level`` is not a string.
        RuntimeError: an unknown level (apex's error: the prefix is the letter O, upper case).
    """
    if not isinstance(opt_level, str):
        raise TypeError(f"opt_level must be a string, one of {', '.join(map(repr, LEVELS))}; "
                        f"got {type(opt_level).__name__} {opt_level!r}")
    if opt_level not in _TABLE:
        raise RuntimeError(f"unexpected optimization level {opt_level!r}; options are "
                           f"{', '.join(map(repr, LEVELS))} (the prefix is the capital letter O, "
                           f"not the number zero)")
    row = {k: (low_dtype if v == _LOW else v) for k, v in _TABLE[opt_level].items()}
    return AmpProperties(opt_level=opt_level, low_dtype=low_dtype, **row)


def resolve_properties(opt_level, low_dtype: torch.dtype, *, cast_model_type=None,
                       patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
                       loss_scale=None) -> AmpProperties:
    """The level's properties with apex's keyword overrides applied (None means "keep").

    Raises:
        TypeError: an override of the wrong type.
        ValueError: a bad value (a loss scale that is not positive, an unknown string).
        RuntimeError: an override that contradicts the level, as apex raised it: at O1,
            ``cast_model_type`` other than None/False/fp32, any ``keep_batchnorm_fp32`` or
            ``master_weights``; ``patch_torch_functions=True`` at any other level.
    """
    props = level_properties(opt_level, low_dtype)
    changes: dict[str, Any] = {}
    o1 = props.opt_level == "O1"
    if cast_model_type is not None:
        changes["cast_model_type"] = _cast_type(cast_model_type)
        if o1 and cast_model_type is not False and changes["cast_model_type"] != torch.float32:
            raise RuntimeError(f"O1 casts around torch functions, not the model's weights, which "
                               f"stay fp32; cast_model_type={cast_model_type} needs opt_level "
                               f"'O2' or 'O3'")
    if patch_torch_functions is not None:
        changes["patch_torch_functions"] = _bool("patch_torch_functions", patch_torch_functions)
        if patch_torch_functions and not o1:
            raise RuntimeError(f"patch_torch_functions=True is set by opt_level='O1' only; got "
                               f"opt_level={props.opt_level!r}")
    if keep_batchnorm_fp32 is not None:
        if o1:
            raise RuntimeError(f"at O1 batchnorm already runs with fp32 weights; "
                               f"keep_batchnorm_fp32 must be None, got {keep_batchnorm_fp32!r}")
        changes["keep_batchnorm_fp32"] = _keep_bn(keep_batchnorm_fp32)
    if master_weights is not None:
        if o1:
            raise RuntimeError("master_weights makes no sense at O1, whose model weights are "
                               f"fp32 already; got master_weights={master_weights!r}")
        changes["master_weights"] = _bool("master_weights", master_weights)
    if loss_scale is not None:
        changes["loss_scale"] = check_loss_scale(loss_scale)
    return dataclasses.replace(props, **changes)


def check_loss_scale(value) -> str | float:
    """``"dynamic"``, or a positive finite number (a numeric string such as "128.0" too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"loss_scale must be a number, a numeric string or 'dynamic'; "
                        f"got {type(value).__name__} {value!r}")
    if value == "dynamic":
        return value
    try:
        scale = float(value)
    except ValueError:
        raise ValueError(f"loss_scale must be a number, a numeric string such as '128.0', or "
                         f"'dynamic'; got {value!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"loss_scale must be positive and finite; got {value!r}")
    return scale


def _cast_type(value):
    if value is False:
        return False
    if not isinstance(value, torch.dtype):
        raise TypeError(f"cast_model_type must be a torch dtype (torch.float16, torch.bfloat16, "
                        f"torch.float32), False or None; got {type(value).__name__} {value!r}")
    if value not in TRAINING_DTYPES:
        raise ValueError(f"cast_model_type must be torch.float32, torch.float16 or "
                         f"torch.bfloat16; got {value}")
    return value


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None; got {type(value).__name__} {value!r}")
    return value


def _keep_bn(value) -> bool:
    if isinstance(value, str):
        if value not in ("True", "False"):
            raise ValueError(f"keep_batchnorm_fp32 as a string must be 'True' or 'False'; "
                             f"got {value!r}")
        return value == "True"
    if not isinstance(value, bool):
        raise TypeError(f"keep_batchnorm_fp32 must be a bool, the string 'True' or 'False', or "
                        f"None; got {type(value).__name__} {value!r}")
    return value
