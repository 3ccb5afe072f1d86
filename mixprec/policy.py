"""Precision policy: the frozen ``Policy``, the O0-O3 level table, ``dtype="auto"`` resolution."""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from . import hardware, lowbit, masters
from .dtypes import TRAINING_DTYPES, dtype_name, to_dtype
from .norms import NORM_LAYERS, NormLayer, is_norm_layer

__all__ = ["Policy", "LEVELS", "NORM_LAYERS", "NormLayer", "is_norm_layer", "resolve_dtype",
           "MASTERS", "STATE_DTYPES", "FP8_RECIPES", "type_path", "type_from_path"]

LEVELS = ("O0", "O1", "O2", "O3")

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


MASTERS = masters.shorthands()  # the strings master= accepts
STATE_DTYPES = ("fp32", "bf16")
FP8_RECIPES = lowbit.shorthands()  # the strings fp8= accepts
_FP32 = torch.float32


def _check_key(k, what: str):
    if isinstance(k, str) or (isinstance(k, type) and issubclass(k, nn.Module)):
        return k
    raise TypeError(f"{what} entries must be nn.Module subclasses or qualified module names "
                    f"(strings); got {type(k).__name__} {k!r}")


def _keys(value, what: str) -> tuple:
    if isinstance(value, (type, str)):
        value = (value,)
    if not isinstance(value, (tuple, list, set, frozenset)):
        raise TypeError(f"{what} must be a module type, a qualified module name, or a tuple/list "
                        f"of them; got {type(value).__name__} {value!r}")
    return tuple(_check_key(k, what) for k in value)


def _overrides(value) -> tuple[tuple[Any, torch.dtype], ...]:
    items = value.items() if isinstance(value, dict) else value
    if not isinstance(items, (tuple, list, type({}.items()))):
        raise TypeError(f"overrides must be a dict (or pairs) of module type / qualified module "
                        f"name -> dtype; got {type(value).__name__} {value!r}")
    out = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"overrides entries must be (module type or name, dtype) pairs; "
                            f"got {item!r}")
        key, dt = _check_key(item[0], "overrides"), to_dtype(item[1], what="an override dtype")
        if dt not in TRAINING_DTYPES:
            raise ValueError(f"an override dtype must be 'fp32', 'fp16' or 'bf16'; got "
                             f"{item[1]!r} for {key!r}")
        out.append((key, dt))
    return tuple(out)


def type_path(t: type) -> str:
    """``"module:QualName"`` of a class (how a Policy serialises module types)."""
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
    """How a model stores parameters, computes, and returns outputs: the whole description.

    Every cast :func:`mixprec.prepare` makes follows from these fields (no level string is
    consulted): parameters and floating buffers take ``param_dtype``; a module named in
    ``overrides`` (by qualified name, or by type) computes in its dtype (MindSpore's
    ``to_float``; :func:`mixprec.to_float` marks are recorded here by ``prepare``), and
    ``keep_fp32`` modules keep fp32 parameters and compute in fp32 (an fp32 module's output is
    fp32); with ``cast_inputs`` the model's floating inputs are cast to ``compute_dtype`` at
    entry; the forward runs under :class:`mixprec.autocast` in ``compute_dtype`` when
    ``autocast`` is set, else with autocast off (every op in the dtype of its inputs); outputs
    are cast to ``output_dtype``; ``master_weights`` wraps the optimizer so that 16-bit
    parameters keep fp32-quality updates (``master``: fp32 masters, a Kahan compensation
    buffer, or stochastic rounding; ``state_dtype``: the optimizer moments' dtype); ``fp8``
    runs the GEMMs of chosen ``nn.Linear`` layers in FP8.

    Policies compare by value (``==``) and print canonically; :meth:`state_dict` /
    :meth:`from_state_dict` round-trip them through checkpoints.

    Args:
        param_dtype: dtype of the model's parameters and floating buffers.
        compute_dtype: dtype compute-heavy ops run in (matmul, conv, linear).
        output_dtype: dtype the model's floating outputs are cast to (fp32 keeps the loss in
            fp32), or None to leave them as they come.
        keep_fp32: module types (or qualified module names) kept in fp32 with fp32 compute:
            one, or an iterable of them.
        master_weights: wrap the optimizer so that low-precision parameters train through
            masters (see ``master``).
        loss_scale: ``"dynamic"``, a fixed float, or None.
        autocast: run the forward under :func:`mixprec.autocast` with ``compute_dtype``.
        cast_inputs: cast the model's floating inputs to ``compute_dtype`` at entry.
        level: the level this policy came from ("O0".."O3"), or None for a custom one.
        overrides: module type or qualified name -> dtype ("fp32", "bf16", "fp16"): those
            modules compute in that dtype (a dict, or pairs; names win over types).
        master: a :mod:`mixprec.masters` method, or its shorthand: "fp32" (fp32 master
            copies), "split" (an exact fp32 master as the bf16 weight plus an int16
            remainder), "kahan" (a 16-bit compensation buffer) or "stochastic" (stochastic
            rounding into the bf16 weight); resolved to the method here.
        state_dtype: dtype of the optimizer's moment buffers under masters: "fp32" or "bf16".
        fp8: None, or the low-bit GEMM format of the chosen Linear layers: a
            :mod:`mixprec.lowbit` format, or its shorthand ("tensorwise", "rowwise",
            "rowwise_gw_hp", "mxfp8", "nvfp4"), resolved to the format here.
        fp8_modules: the qualified names of the layers that run in FP8 (None: the default
            choice, see :func:`mixprec.prepare`).

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
    overrides: tuple = ()
    master: masters.MasterMethod = masters.FP32()
    state_dtype: torch.dtype = torch.float32
    fp8: lowbit.LowBitFormat | None = None
    fp8_modules: tuple | None = None

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "state_dtype"):
            object.__setattr__(self, field, to_dtype(getattr(self, field), what=field))
        if self.output_dtype is not None:
            object.__setattr__(self, "output_dtype", to_dtype(self.output_dtype,
                                                              what="output_dtype"))
        object.__setattr__(self, "keep_fp32", keep_fp32_entries(self.keep_fp32))
        object.__setattr__(self, "overrides", _overrides(self.overrides))
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
        self._check_masters()
        object.__setattr__(self, "fp8", lowbit.resolve(self.fp8))
        if self.fp8_modules is not None:
            names = _keys(self.fp8_modules, "fp8_modules")
            if not all(isinstance(n, str) for n in names):
                raise TypeError(f"fp8_modules in a Policy must be qualified module names; got "
                                f"{self.fp8_modules!r}")
            object.__setattr__(self, "fp8_modules", names)

    def _check_masters(self) -> None:
        object.__setattr__(self, "master", masters.resolve(self.master))
        if dtype_name(self.state_dtype) not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {', '.join(map(repr, STATE_DTYPES))}; "
                             f"got {dtype_name(self.state_dtype)!r}")
        if self.param_dtype != _FP32:
            self.master.check_dtype(self.param_dtype)
        compact = self.master.compact or self.state_dtype != _FP32
        if compact and not self.master_weights:
            raise ValueError(f"master={str(self.master)!r} and state_dtype="
                             f"{dtype_name(self.state_dtype)!r} describe how an optimizer "
                             f"updates 16-bit parameters: they need master_weights=True")

    def module_dtype(self, module: nn.Module, name: str) -> torch.dtype | None:
        """The dtype the policy sets for ``module`` (qualified ``name``), or None: an override
        by name, else by type, else fp32 for a ``keep_fp32`` module."""
        for key, dt in self.overrides:
            if isinstance(key, str) and key == name:
                return dt
        for key, dt in self.overrides:
            if isinstance(key, type) and isinstance(module, key):
                return dt
        for key in self.keep_fp32:
            if (key == name) if isinstance(key, str) else isinstance(module, key):
                return _FP32
        return None

    def named_keys(self) -> list[str]:
        """The qualified module names the policy refers to (they must exist in the model)."""
        return [k for k in (*self.keep_fp32, *(k for k, _ in self.overrides))
                if isinstance(k, str)]

    # -- serialisation -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The policy as plain data (names for dtypes, ``"module:QualName"`` for module types),
        derived from the dataclass fields."""
        def key(k):
            return k if isinstance(k, str) else {"type": type_path(k)}

        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.dtype):
                value = dtype_name(value)
            elif f.name == "keep_fp32":
                value = [key(k) for k in value]
            elif f.name == "overrides":
                value = [[key(k), dtype_name(dt)] for k, dt in value]
            elif isinstance(value, (lowbit.LowBitFormat, masters.MasterMethod)):
                value = value.to_data()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_state_dict(cls, state: dict) -> "Policy":
        """Rebuild a policy from :meth:`state_dict`.

        Raises:
            ValueError: unknown or missing fields, or a module type that can't be imported.
        """
        if not isinstance(state, dict):
            raise TypeError(f"a policy state_dict must be a dict; got {type(state).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(state) != names:
            raise ValueError(f"a policy state_dict has the keys {sorted(names)}; got "
                             f"{sorted(state)}")

        def key(k):
            return type_from_path(k["type"]) if isinstance(k, dict) else k

        values = dict(state)
        values["keep_fp32"] = tuple(key(k) for k in state["keep_fp32"])
        values["overrides"] = tuple((key(k), dt) for k, dt in state["overrides"])
        if state["fp8_modules"] is not None:
            values["fp8_modules"] = tuple(state["fp8_modules"])
        return cls(**values)

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
            return cls(low, low, fp32, (NormLayer,), low != fp32, scale, True, True, "O2")
        # outputs as computed: low precision, except what an fp32 module returns
        return cls(low, low, None, (), False, None, False, True, "O3")

    def replace(self, **changes) -> "Policy":
        """A copy with some fields changed (the level becomes None unless given)."""
        changes.setdefault("level", None)
        return dataclasses.replace(self, **changes)

    @property
    def is_mixed(self) -> bool:
        """True unless the policy is plain fp32 everywhere (then prepare changes nothing)."""
        return self.compute_dtype != torch.float32 or self.param_dtype != torch.float32

    def __str__(self) -> str:
        master = (self.master if self.master_weights else "none")
        output = "as-is" if self.output_dtype is None else dtype_name(self.output_dtype)
        body = (f"params={dtype_name(self.param_dtype)},compute={dtype_name(self.compute_dtype)},"
                f"output={output},master={master}")
        extras = [name for name, on in (("autocast", self.autocast),
                                         ("cast_inputs", self.cast_inputs)) if on]
        if self.level is None and extras:
            body += "," + ",".join(extras)
        if self.state_dtype != _FP32:
            body += f",state={dtype_name(self.state_dtype)}"
        default_keep = (NormLayer,) if self.level == "O2" else ()
        if self.keep_fp32 != default_keep:
            body += f",keep_fp32=[{','.join(_key_name(k) for k in self.keep_fp32)}]"
        if self.overrides:
            body += ",overrides=[" + ",".join(f"{_key_name(k)}:{dtype_name(dt)}"
                                              for k, dt in self.overrides) + "]"
        if self.fp8 is not None:
            body += f",fp8={self.fp8}"
            if self.fp8_modules is not None:
                body += f",fp8_modules={len(self.fp8_modules)}"
        return f"{self.level or 'custom'}({body})"


def _key_name(key) -> str:
    return key if isinstance(key, str) else ("NormLayer" if key is NormLayer else key.__name__)
