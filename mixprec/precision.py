"""One module's precision: :class:`Precision`, the value of a :class:`mixprec.PrecisionMap`
entry (compute dtype, low-bit GEMM format, fp32 parameters), and the key checks and type paths
maps and policies share."""


from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch
from torch import nn

from . import lowbit
from .dtypes import TRAINING_DTYPES, dtype_name, to_dtype

__all__ = ["Precision", "OFF", "type_path", "type_from_path", "check_key", "described",
           "key_name"]

OFF = "off"  # Precision(gemm=OFF): the module's GEMMs run in its compute dtype, no low-bit format
_FP32 = torch.float32
_DTYPES = "'fp32', 'bf16', 'fp16' or a torch dtype"


def type_path(t: type) -> str:
    """``"module:QualName"`` of a class (how a policy serialises module types)."""
    return f"{t.__module__}:{t.__qualname__}"


def type_from_path(path: str) -> type:
    """The class :func:`type_path` named (imported)."""
    module, _, qualname = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"a policy names the module type {path!r}, which can't be imported "
                         f"here ({exc}); define it in an importable module") from exc
    return obj


def described(value: Any) -> str:
    """``value`` for an error message: its type and repr, with a hint for module instances."""
    text = f"{type(value).__name__} {value!r}"
    if isinstance(value, nn.Module):
        text = (f"the module instance {type(value).__name__}(...) (pass its type, "
                f"{type(value).__name__}, or its qualified name)")
    return text if len(text) <= 120 else text[:117] + "..."


def check_key(key: Any, what: str = "a precision map key"):
    """``key`` when it is a qualified module name or an ``nn.Module`` subclass.

    Raises:
        TypeError: anything else, named.
    """
    if isinstance(key, str) or (isinstance(key, type) and issubclass(key, nn.Module)):
        return key
    raise TypeError(f"{what} must be an nn.Module subclass or a qualified module name "
                    f"(string); got {described(key)}")


def key_name(key) -> str:
    return key if isinstance(key, str) else key.__name__


@dataclasses.dataclass(frozen=True)
class Precision:
    """What one module computes in: the value of a :class:`PrecisionMap` entry.

    Args:
        compute: the dtype the module computes in ("fp32", "bf16", "fp16", a torch dtype), or
            None to inherit its region's. A module with a dtype of its own is an island: its
            floating inputs (and parameters stored in another dtype) are cast to it for the
            call, autocast is off inside, its output is returned as computed. Its parameters
            are stored in fp32 when it computes in fp32 (``keep_fp32``'s meaning), else as the
            policy stores parameters.
        gemm: the low-bit GEMM format of the module (an ``nn.Linear`` or Hugging Face
            ``Conv1D``): a :mod:`mixprec.lowbit` format or its shorthand ("tensorwise",
            "mxfp8", ...); ``"off"``: no low-bit format; None: the map does not say.
        params: "fp32" to store the module's parameters in fp32 while it computes in another
            ``compute`` dtype (cast for each call, MindSpore's ``to_float``); None: the rule
            above.

    Raises:
        ValueError: an unknown dtype or format; a low-bit ``gemm`` with a ``compute`` dtype
            (a low-bit layer computes in its region's dtype); ``params`` other than fp32, or
            without ``compute``.
        TypeError: a value of the wrong kind.

    Example:
        >>> Precision("fp32"), Precision(gemm="mxfp8")
        (Precision('fp32'), Precision(gemm='mxfp8'))
    """

    compute: torch.dtype | None = None
    gemm: Any = None
    params: torch.dtype | None = None

    def __post_init__(self):
        if self.compute is not None:
            dt = to_dtype(self.compute, what="Precision compute")
            if dt not in TRAINING_DTYPES:
                raise ValueError(f"Precision compute must be {_DTYPES} or None; "
                                 f"got {self.compute!r}")
            object.__setattr__(self, "compute", dt)
        object.__setattr__(self, "gemm", _gemm(self.gemm))
        if isinstance(self.gemm, lowbit.LowBitFormat) and self.compute is not None:
            raise ValueError(f"Precision(compute={dtype_name(self.compute)!r}, gemm="
                             f"{str(self.gemm)!r}): a low-bit layer computes in the dtype of "
                             f"the code around it; give it a compute dtype or a gemm format, "
                             f"not both")
        if self.params is not None:
            dt = to_dtype(self.params, what="Precision params")
            if dt != _FP32:
                raise ValueError(f"Precision params can keep a module's parameters in 'fp32' "
                                 f"(or None: as it computes); got {self.params!r}")
            if self.compute is None:
                raise ValueError("Precision(params='fp32') stores a module's parameters in "
                                 "fp32 while it computes in another dtype: give compute= too")
            object.__setattr__(self, "params", None if self.compute == _FP32 else dt)

    @property
    def param_dtype(self) -> torch.dtype | None:
        """fp32 when the module's parameters are stored in fp32 by this entry, else None."""
        return _FP32 if _FP32 in (self.params, self.compute) else None

    @property
    def lowbit(self) -> lowbit.LowBitFormat | None:
        """The low-bit format (None for ``"off"`` or unset)."""
        return self.gemm if isinstance(self.gemm, lowbit.LowBitFormat) else None

    def __repr__(self) -> str:
        parts = [] if self.compute is None else [repr(dtype_name(self.compute))]
        if self.gemm is not None:
            parts.append(f"gemm={str(self.gemm)!r}")
        if self.params is not None:
            parts.append(f"params={dtype_name(self.params)!r}")
        return f"Precision({', '.join(parts)})"

    def __str__(self) -> str:
        parts = [] if self.compute is None else [dtype_name(self.compute)]
        if self.gemm is not None:
            parts.append(f"gemm={self.gemm}")
        if self.params is not None:
            parts.append(f"params={dtype_name(self.params)}")
        return "+".join(parts) or "inherit"

    def to_data(self) -> dict:
        """Plain data (dtype names; a format's ``to_data``)."""
        gemm = self.gemm.to_data() if isinstance(self.gemm, lowbit.LowBitFormat) else self.gemm
        return {"compute": None if self.compute is None else dtype_name(self.compute),
                "gemm": gemm,
                "params": None if self.params is None else dtype_name(self.params)}

    @classmethod
    def of(cls, value: Any) -> "Precision":
        """A :class:`Precision` from a value a map accepts: a Precision, a dtype (compute), a
        low-bit format or its shorthand (gemm), ``"off"``, or :meth:`to_data`'s dict."""
        if isinstance(value, Precision):
            return value
        if isinstance(value, torch.dtype):
            return cls(compute=value)
        if isinstance(value, lowbit.LowBitFormat) or value == OFF:
            return cls(gemm=value)
        if isinstance(value, str):
            if value in lowbit.shorthands():
                return cls(gemm=value)
            try:
                return cls(compute=value)
            except ValueError:
                raise ValueError(f"a precision map value must be a dtype ({_DTYPES}), a low-bit "
                                 f"format shorthand ({', '.join(map(repr, lowbit.shorthands()))}"
                                 f"), 'off' or a mixprec.Precision; got {value!r}") from None
        if isinstance(value, dict) and set(value) == {"compute", "gemm", "params"}:
            return cls(**value)
        raise TypeError(f"a precision map value must be a mixprec.Precision, a dtype or a "
                        f"low-bit format; got {described(value)}")


def _gemm(value: Any):
    if value is None or value == OFF:
        return value
    try:
        return lowbit.resolve(value)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"Precision gemm must be None, 'off', a mixprec.lowbit format or one "
                        f"of {', '.join(map(repr, lowbit.shorthands()))}; got "
                        f"{described(value)}") from None
