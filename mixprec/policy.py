"""Precision policy: the frozen ``Policy``, the O0-O3 level table, ``dtype="auto"`` resolution."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from . import hardware
from .dtypes import TRAINING_DTYPES, dtype_name, to_dtype

__all__ = ["Policy", "LEVELS", "NORM_LAYERS", "resolve_dtype"]

LEVELS = ("O0", "O1", "O2", "O3")

# Layers whose statistics and affine parameters stay fp32 at O1/O2 (the MindSpore and PaddlePaddle
# guides: BatchNorm and the loss are precision sensitive).
NORM_LAYERS: tuple[type[nn.Module], ...] = tuple(
    t for t in (
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
        nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
        nn.LocalResponseNorm, getattr(nn, "RMSNorm", None),
    ) if t is not None
)

def resolve_dtype(dtype: Any = "auto", device=None, *, warn: bool = True) -> torch.dtype:
    """Resolve a low-precision dtype spec; ``"auto"`` picks the fast 16-bit type of ``device``.

    ``"auto"`` gives bf16 where it is fast (CPU with AVX512-BF16/AMX, CUDA cc >= 8.0), fp16 on
    CUDA 7.x, else fp32 with a warning that says why. An explicit dtype that is slow on the
    device gives one :class:`mixprec.hardware.SlowDtypeWarning`.
    """
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        caps = hardware.device_capabilities(device)
        resolved = to_dtype(caps["auto_dtype"])
        if resolved == torch.float32 and warn:
            warnings.warn(f"dtype='auto' resolved to fp32 on {caps['device']}: "
                          f"{caps['auto_reason']}",
                          hardware.SlowDtypeWarning, stacklevel=3)
        return resolved
    resolved = to_dtype(dtype)
    if resolved not in TRAINING_DTYPES:
        raise ValueError(f"a training dtype must be 'fp32', 'fp16' or 'bf16'; got {dtype!r}")
    if warn:
        hardware.warn_if_slow(resolved, device)
    return resolved


_KEEP_FP32_VALID = ("an nn.Module subclass (e.g. nn.LayerNorm), a qualified module name "
                    "(e.g. 'encoder.norm'), or an iterable of them")


def keep_fp32_entries(keep: Any) -> tuple:
    """``keep_fp32`` as a tuple of module types and qualified module names.

    Args:
        keep: an ``nn.Module`` subclass, a qualified module name, or an iterable of them.

    Raises:
        TypeError: anything else (a number, a mapping, a module instance...), naming it.
    """
    if isinstance(keep, (type, str)):
        keep = (keep,)
    elif isinstance(keep, (bytes, Mapping, nn.Module)) or not isinstance(keep, Iterable):
        raise TypeError(f"keep_fp32 must be {_KEEP_FP32_VALID}; got {_described(keep)}")
    keep = tuple(keep)
    for k in keep:
        if not (isinstance(k, str) or (isinstance(k, type) and issubclass(k, nn.Module))):
            raise TypeError(f"keep_fp32 entries must be nn.Module subclasses or qualified module "
                            f"names; got {_described(k)}")
    return keep


def _described(value: Any) -> str:
    """``value`` for an error message: its type and repr, with a hint for module instances."""
    text = f"{type(value).__name__} {value!r}"
    if isinstance(value, nn.Module):
        text = (f"the module instance {type(value).__name__}(...) (pass its type, "
                f"{type(value).__name__}, or its qualified name)")
    return text if len(text) <= 120 else text[:117] + "..."


@dataclasses.dataclass(frozen=True)
class Policy:
    """How a model stores parameters, computes, and returns outputs.

    Every cast :func:`mixprec.prepare` makes follows from these fields (no level string is
    consulted): parameters and floating buffers take ``param_dtype``; ``keep_fp32`` modules
    keep fp32 parameters and compute in fp32, returning their outputs in the dtype their input
    came in; with ``cast_inputs`` the model's floating inputs are cast to ``compute_dtype`` at
    entry; the forward runs under :class:`mixprec.autocast` in ``compute_dtype`` when
    ``autocast`` is set, else with autocast off (every op in the dtype of its inputs); outputs
    are cast to ``output_dtype``; ``master_weights`` wraps the optimizer in
    :class:`mixprec.MasterWeightOptimizer`.

    Args:
        param_dtype: dtype of the model's parameters and floating buffers.
        compute_dtype: dtype compute-heavy ops run in (matmul, conv, linear).
        output_dtype: dtype the model's floating outputs are cast to (fp32 keeps the loss in
            fp32), or None to leave them as they come.
        keep_fp32: module types (or qualified module names) kept in fp32 with fp32 compute:
            one, or an iterable of them.
        master_weights: keep fp32 master copies of low-precision parameters in the optimizer.
        loss_scale: ``"dynamic"``, a fixed float, or None.
        autocast: run the forward under :func:`mixprec.autocast` with ``compute_dtype``.
        cast_inputs: cast the model's floating inputs to ``compute_dtype`` at entry.
        level: the level this policy came from ("O0".."O3"), or None for a custom one.

    Example:
        >>> str(Policy.from_level("O2", "bf16"))
        'O2(params=bf16,compute=bf16,output=fp32,master=fp32)'
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype | None = torch.float32
    keep_fp32: tuple = ()
    master_weights: bool = False
    loss_scale: str | float | None = None
    autocast: bool = False
    cast_inputs: bool = False
    level: str | None = None

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype"):
            object.__setattr__(self, field, to_dtype(getattr(self, field), what=field))
        if self.output_dtype is not None:
            object.__setattr__(self, "output_dtype", to_dtype(self.output_dtype,
                                                              what="output_dtype"))
        object.__setattr__(self, "keep_fp32", keep_fp32_entries(self.keep_fp32))
        for flag in ("master_weights", "autocast", "cast_inputs"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False; got {getattr(self, flag)!r}")
        ls = self.loss_scale
        if not (ls is None or ls == "dynamic" or (
                isinstance(ls, (int, float)) and not isinstance(ls, bool)
                and 0 < float(ls) < float("inf"))):
            raise ValueError(f"loss_scale must be 'dynamic', a positive finite number or None; "
                             f"got {ls!r}")
        if self.level is not None and self.level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(map(repr, LEVELS))} or None; "
                             f"got {self.level!r}")

    @classmethod
    def from_level(cls, level: str, dtype: Any = "auto", device=None, *,
                   warn: bool = True) -> "Policy":
        """The policy of an optimisation level (apex/MindSpore/Paddle ``O0``..``O3``).

        Args:
            level: "O0" (fp32), "O1" (autocast op lists), "O2" (low-precision model with fp32
                master weights, norms fp32), "O3" (pure low precision).
            dtype: the low-precision dtype or "auto".
            device: the device used to resolve "auto" and to warn about slow dtypes.
            warn: warn when the dtype is slow on the device (False for plans on paper).

        Raises:
            ValueError: an unknown level or dtype.
        """
        if not isinstance(level, str) or level.upper() not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(map(repr, LEVELS))}; got {level!r}")
        level = level.upper()
        if level == "O0":
            if not (isinstance(dtype, str) and dtype.lower() == "auto"):
                to_dtype(dtype)  # still validate
            return cls(level="O0")
        low = resolve_dtype(dtype, device, warn=warn)
        fp32 = torch.float32
        scale = "dynamic" if low == torch.float16 else None
        if level == "O1":  # params are fp32 already; the op lists decide each norm's compute
            return cls(fp32, low, fp32, (), False, scale, True, False, "O1")
        if level == "O2":
            return cls(low, low, fp32, NORM_LAYERS, low != fp32, scale, True, True, "O2")
        return cls(low, low, low, (), False, None, False, True, "O3")

    def replace(self, **changes) -> "Policy":
        """A copy with some fields changed (the level becomes None unless given)."""
        changes.setdefault("level", None)
        return dataclasses.replace(self, **changes)

    @property
    def is_mixed(self) -> bool:
        """True unless the policy is plain fp32 everywhere (then prepare changes nothing)."""
        return self.compute_dtype != torch.float32 or self.param_dtype != torch.float32

    def __str__(self) -> str:
        master = "fp32" if self.master_weights else "none"
        output = "as-is" if self.output_dtype is None else dtype_name(self.output_dtype)
        body = (f"params={dtype_name(self.param_dtype)},compute={dtype_name(self.compute_dtype)},"
                f"output={output},master={master}")
        extras = [name for name, on in (("autocast", self.autocast),
                                         ("cast_inputs", self.cast_inputs)) if on]
        if self.level is None and extras:
            body += "," + ",".join(extras)
        return f"{self.level or 'custom'}({body})"
