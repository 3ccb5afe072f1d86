"""The dtype registry: every floating dtype mixprec knows, its names and what each part of mixprec
may do with it.

One :class:`DtypeInfo` per format (fp64, fp32, fp16, bf16 and the two fp8 formats): its canonical
short name, every accepted spelling, its bit width, and three roles:

* ``trainable``: a model's parameters and compute can be in it (fp32, fp16, bf16);
* ``castable``: the forward wrappers and :class:`mixprec.autocast` cast tensors of it to the
  compute dtype (fp64 and fp8 tensors, and integers, pass through untouched);
* ``roundable``: the fp16 emulation rounds tensors of it to fp16 (:mod:`mixprec.emulation`).

The tuples below (:data:`TRAINING_DTYPES`, :data:`CASTABLE_DTYPES`, ...) are derived from the
registry, so a dtype's roles are written down once. The lowest layer of mixprec: it imports
nothing of ours.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["DtypeInfo", "REGISTRY", "CANONICAL", "ALIASES", "TRAINING_DTYPES",
           "LOW_PRECISION_DTYPES", "CASTABLE_DTYPES", "ROUNDABLE_DTYPES", "to_dtype",
           "dtype_name", "bits", "is_low_precision"]


@dataclasses.dataclass(frozen=True)
class DtypeInfo:
    """One floating dtype as mixprec sees it.

    Attributes:
        name: the canonical short name ("fp32", "bf16", "fp8_e4m3", ...).
        dtype: the torch dtype, or None where this torch build lacks it.
        bits: the total width in bits.
        aliases: every accepted spelling (lower case), the name included.
        trainable: parameters and compute may be in this dtype.
        castable: forward wrappers and autocast cast tensors of this dtype.
        roundable: the fp16 emulation rounds tensors of this dtype to fp16.
    """

    name: str
    dtype: torch.dtype | None
    bits: int
    aliases: tuple[str, ...]
    trainable: bool = False
    castable: bool = False
    roundable: bool = False


#: Canonical short name -> :class:`DtypeInfo`, widest first.
REGISTRY: dict[str, DtypeInfo] = {i.name: i for i in (
    DtypeInfo("fp64", torch.float64, 64, ("fp64", "float64", "double")),
    DtypeInfo("fp32", torch.float32, 32, ("fp32", "float32", "float", "single"),
              trainable=True, castable=True, roundable=True),
    DtypeInfo("fp16", torch.float16, 16, ("fp16", "float16", "half"),
              trainable=True, castable=True, roundable=True),
    DtypeInfo("bf16", torch.bfloat16, 16, ("bf16", "bfloat16"),
              trainable=True, castable=True, roundable=True),
    DtypeInfo("fp8_e4m3", getattr(torch, "float8_e4m3fn", None), 8,
              ("fp8_e4m3", "float8_e4m3", "float8_e4m3fn", "e4m3")),
    DtypeInfo("fp8_e5m2", getattr(torch, "float8_e5m2", None), 8,
              ("fp8_e5m2", "float8_e5m2", "e5m2")),
)}

#: Canonical short name -> torch dtype (None where this torch build lacks it).
CANONICAL: dict[str, torch.dtype | None] = {name: i.dtype for name, i in REGISTRY.items()}

#: Every accepted spelling -> canonical short name.
ALIASES: dict[str, str] = {alias: name for name, i in REGISTRY.items() for alias in i.aliases}


def _having(role: str) -> tuple[torch.dtype, ...]:
    return tuple(i.dtype for i in REGISTRY.values() if getattr(i, role) and i.dtype is not None)


#: The dtypes a model can train in: fp32, fp16, bf16.
TRAINING_DTYPES: tuple[torch.dtype, ...] = _having("trainable")
#: The 16-bit training dtypes (the low-precision dtype of a level): fp16, bf16.
LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = tuple(
    i.dtype for i in REGISTRY.values() if i.trainable and i.bits < 32)
#: The dtypes whose tensors autocast and the forward wrappers cast.
CASTABLE_DTYPES: tuple[torch.dtype, ...] = _having("castable")
#: The dtypes whose tensors the fp16 emulation rounds to fp16.
ROUNDABLE_DTYPES: tuple[torch.dtype, ...] = _having("roundable")

_BY_DTYPE = {i.dtype: i for i in REGISTRY.values() if i.dtype is not None}
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
    entry = _BY_DTYPE.get(dtype)
    return entry.name if entry is not None else str(dtype).replace("torch.", "")


def bits(dtype: torch.dtype) -> int:
    """The width of a dtype in bits (8 for fp8, 16 for fp16 and bf16, ...).

    Raises:
        TypeError: ``dtype`` is not a torch dtype.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"bits() takes a torch.dtype; got {type(dtype).__name__} {dtype!r}")
    entry = _BY_DTYPE.get(dtype)
    return entry.bits if entry is not None else dtype.itemsize * 8


def is_low_precision(tensor: torch.Tensor) -> bool:
    """True for a floating tensor narrower than fp32 (bf16, fp16, fp8)."""
    return tensor.is_floating_point() and tensor.element_size() < 4
