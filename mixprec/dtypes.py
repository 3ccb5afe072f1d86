"""Dtype names: every accepted spelling, the canonical short names, and ``to_dtype``.

The lowest layer of mixprec: it imports nothing of ours.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CANONICAL", "ALIASES", "TRAINING_DTYPES", "to_dtype", "dtype_name", "is_low_precision"]

#: Canonical short name -> torch dtype (None where this torch build lacks it).
CANONICAL: dict[str, torch.dtype | None] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": getattr(torch, "float8_e4m3fn", None),
    "fp8_e5m2": getattr(torch, "float8_e5m2", None),
}

#: Every accepted spelling -> canonical short name.
ALIASES: dict[str, str] = {
    "fp64": "fp64", "float64": "fp64", "double": "fp64",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "single": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp8_e4m3": "fp8_e4m3", "float8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2",
}

#: The dtypes a model can train in.
TRAINING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_DTYPE_TO_NAME = {dt: name for name, dt in CANONICAL.items() if dt is not None}
_VALID_HINT = ("one of 'fp32', 'fp16'/'half', 'bf16', 'fp64', 'fp8_e4m3', 'fp8_e5m2' or a "
               "torch dtype")


def to_dtype(spec: Any, *, what: str = "dtype") -> torch.dtype:
    """Turn a dtype name (``"bf16"``, ``"half"``, ...) or a floating ``torch.dtype`` into a dtype.

    Args:
        spec: a name from :data:`ALIASES` (any case) or a floating ``torch.dtype``.
        what: how error messages name the argument.

    Raises:
        ValueError: an unknown name, a non-floating dtype, or a dtype this torch build lacks.
        TypeError: neither a string nor a torch dtype.

    Example:
        >>> to_dtype("half")
        torch.float16
    """
    if isinstance(spec, torch.dtype):
        if not spec.is_floating_point:
            raise ValueError(f"{what} must be a floating-point dtype ({_VALID_HINT}); got {spec}")
        return spec
    if isinstance(spec, str):
        name = ALIASES.get(spec.strip().lower())
        if name is None:
            raise ValueError(f"{what} must be {_VALID_HINT}; got {spec!r}")
        dt = CANONICAL[name]
        if dt is None:
            raise ValueError(f"{what} {spec!r} is not available in torch {torch.__version__}")
        return dt
    raise TypeError(f"{what} must be a string or a torch.dtype ({_VALID_HINT}); "
                    f"got {type(spec).__name__} {spec!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """Short canonical name of a dtype: ``torch.bfloat16`` -> ``"bf16"``."""
    return _DTYPE_TO_NAME.get(dtype, str(dtype).replace("torch.", ""))


def is_low_precision(tensor: torch.Tensor) -> bool:
    """True for a floating tensor narrower than fp32 (bf16, fp16, fp8)."""
    return tensor.is_floating_point() and tensor.element_size() < 4
