"""Precision policy: the frozen ``Policy``, the O0-O3 level table, ``dtype="auto"`` resolution."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import torch
from torch import nn

from . import hardware, lowbit, masters
from .callsite import user_stacklevel
from .dtypes import TRAINING_DTYPES, dtype_name, to_dtype
from .norms import NORM_LAYERS, NormLayer, is_norm_layer
from .precision import Precision, type_from_path, type_path
from .precision_map import PrecisionMap, one_format, with_legacy, with_names
from .scaling.state import positive_scale

__all__ = ["Policy", "LEVELS", "NORM_LAYERS", "NormLayer", "is_norm_layer", "resolve_dtype",
           "MASTERS", "STATE_DTYPES", "FP8_RECIPES", "type_path", "type_from_path"]

LEVELS = ("O0", "O1", "O2", "O3")
_LOG = logging.getLogger("mixprec")
_told: set[str] = set()  # the devices whose dtype="auto" choice was logged


def resolve_dtype(dtype: Any = "auto", device=None, *, warn: bool = True) -> torch.dtype:
    """Resolve a low-precision dtype spec; ``"auto"`` picks the fast 16-bit type of ``device``.

    ``"auto"`` gives bf16 where it is fast (on a CPU: where a bf16 GEMM measured at least fp32's
    rate, see :func:`mixprec.hardware.cpu_gemm_probe`; on CUDA: cc >= 8.0), fp16 on CUDA 7.x,
    else fp32 with a warning that says why (the measured rates on a CPU). The choice and its
    reason are logged once per device on the ``"mixprec"`` logger (level INFO), and read back as
    ``device_capabilities(device)["auto_reason"]``. An explicit dtype that is slow on the device
    gives one :class:`mixprec.hardware.SlowDtypeWarning`.
    """
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        caps = hardware.device_capabilities(device)
        resolved = to_dtype(caps["auto_dtype"])
        if caps["device"] not in _told:
            _told.add(caps["device"])
            _LOG.info("dtype='auto' -> %s on %s: %s", caps["auto_dtype"], caps["device"],
                      caps["auto_reason"])
        if resolved == torch.float32 and warn:
            warnings.warn(f"dtype='auto' resolved to fp32 on {caps['device']}: "
                          f"{caps['auto_reason']}",
                          hardware.SlowDtypeWarning, stacklevel=user_stacklevel())
        return resolved
    try:
        resolved = to_dtype(dtype)
    except ValueError:  # an unknown name (the registry's message lists dtypes refused here)
        resolved = None
    if resolved not in TRAINING_DTYPES:
        raise ValueError(f"a training dtype must be 'auto', 'fp32', 'fp16' or 'bf16' (or their "
                         f"torch dtypes); got {dtype!r}")
    if warn:
        hardware.warn_if_slow(resolved, device)
    return resolved


MASTERS = masters.shorthands()  # the strings master= accepts
STATE_DTYPES = ("fp32", "bf16")
FP8_RECIPES = lowbit.shorthands()  # the strings fp8= accepts
_FP32 = torch.float32


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class Policy:
    """How a model stores parameters, computes, and returns outputs: the whole description.

    Every cast :func:`mixprec.prepare` makes follows from these fields (no level string is
    consulted): parameters and floating buffers take ``param_dtype``; ``modules``, a
    :class:`mixprec.PrecisionMap`, says what single modules compute in (by qualified name or
    type: a module with a dtype of its own computes in it, keeping fp32 parameters when that is
    fp32; a low-bit GEMM format for chosen Linear layers); with ``cast_inputs`` the model's
    floating inputs are cast to ``compute_dtype`` at entry; the forward runs under
    :class:`mixprec.autocast` in ``compute_dtype`` when ``autocast`` is set, else with autocast
    off (every op in the dtype of its inputs); outputs are cast to ``output_dtype``;
    ``master_weights`` wraps the optimizer so that 16-bit parameters keep fp32-quality updates
    (``master``: fp32 masters, a Kahan compensation buffer, or stochastic rounding;
    ``state_dtype``: the optimizer moments' dtype); ``fp8`` is the low-bit GEMM format.

    ``keep_fp32=``, ``overrides=`` and ``fp8_modules=`` are entries of ``modules`` (and read
    back as views of it); ``prepare`` records :func:`mixprec.to_float` marks there too.
    Policies compare (``==``, ``hash``) by value: every field but ``level``, a label (the level
    a policy came from) that changes no cast, so a level with ``master="kahan"`` equals the same
    policy built field by field. They print canonically; :meth:`state_dict` /
    :meth:`from_state_dict` round-trip them through checkpoints.

    Args:
        param_dtype: dtype of the model's parameters and floating buffers.
        compute_dtype: dtype compute-heavy ops run in (matmul, conv, linear).
        output_dtype: dtype the model's floating outputs are cast to (fp32 keeps the loss in
            fp32), or None to leave them as they come.
        modules: per-module precision: a :class:`mixprec.PrecisionMap`, or what its
            constructor takes (a dict of qualified name / module type -> precision).
        keep_fp32: module types (or qualified module names) kept in fp32 with fp32 compute:
            one, or an iterable of them; each becomes the entry ``key: Precision("fp32")``.
        master_weights: wrap the optimizer so that low-precision parameters train through
            masters (see ``master``).
        loss_scale: ``"dynamic"``, a fixed float, or None.
        autocast: run the forward under :func:`mixprec.autocast` with ``compute_dtype``.
        cast_inputs: cast the model's floating inputs to ``compute_dtype`` at entry.
        level: the level this policy came from ("O0".."O3"), or None for a custom one: a label,
            left out of comparisons.
        overrides: module type or qualified name -> dtype ("fp32", "bf16", "fp16"): those
            modules compute in that dtype (a dict, or pairs): entries ``key: Precision(dtype)``
            (they replace a ``keep_fp32`` entry of the same key).
        master: a :mod:`mixprec.masters` method, or its shorthand: "fp32" (fp32 master
            copies), "split" (an exact fp32 master as the bf16 weight plus an int16
            remainder), "kahan" (a 16-bit compensation buffer) or "stochastic" (stochastic
            rounding into the bf16 weight); resolved to the method here.
        state_dtype: dtype of the optimizer's moment buffers under masters: "fp32" or "bf16".
        fp8: None, or the low-bit GEMM format: a :mod:`mixprec.lowbit` format, or its shorthand
            ("tensorwise", "rowwise", "rowwise_gw_hp", "mxfp8", "nvfp4"), resolved to the
            format here. Without entries giving layers a format, ``prepare`` chooses the layers
            (see :func:`mixprec.prepare`); when ``modules`` gives some a format and ``fp8`` is
            None, ``fp8`` is that format.
        fp8_modules: the qualified names of the layers that run in ``fp8``: entries
            ``name: Precision(gemm=fp8)`` replacing the map's low-bit choice (an empty list: no
            layer). None: the map's choice, else prepare's.

    Raises:
        TypeError, ValueError: a field of the wrong kind or value (named in the message); a
            map giving two low-bit formats, or one other than ``fp8``.

    Example:
        >>> str(Policy.from_level("O2", "bf16"))
        'O2(params=bf16,compute=bf16,output=fp32,master=fp32)'
        >>> Policy(keep_fp32=nn.LayerNorm) == Policy(modules={nn.LayerNorm: "fp32"})
        True
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype | None = torch.float32
    modules: PrecisionMap = dataclasses.field(default_factory=PrecisionMap)
    master_weights: bool = False
    loss_scale: str | float | None = None
    autocast: bool = False
    cast_inputs: bool = False
    level: str | None = None
    master: masters.MasterMethod = masters.FP32()
    state_dtype: torch.dtype = torch.float32
    fp8: lowbit.LowBitFormat | None = None

    def __init__(self, param_dtype=torch.float32, compute_dtype=torch.float32,
                 output_dtype=torch.float32, *, modules=None, keep_fp32=(),
                 master_weights=False, loss_scale=None, autocast=False, cast_inputs=False,
                 level=None, overrides=(), master="fp32", state_dtype=torch.float32, fp8=None,
                 fp8_modules=None):
        values = dict(param_dtype=param_dtype, compute_dtype=compute_dtype,
                      output_dtype=output_dtype, master_weights=master_weights,
                      loss_scale=loss_scale, autocast=autocast, cast_inputs=cast_inputs,
                      level=level, master=master, state_dtype=state_dtype)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        fmt = lowbit.resolve(fp8)
        pmap = modules if isinstance(modules, PrecisionMap) else PrecisionMap(modules)
        pmap = with_legacy(pmap, keep_fp32, overrides)
        if fp8_modules is not None:
            pmap = with_names(pmap, fp8_modules, one_format(pmap, fmt))
        object.__setattr__(self, "modules", pmap)
        object.__setattr__(self, "fp8", one_format(pmap, fmt))
        self.__post_init__()

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype"):
            dtype = to_dtype(getattr(self, field), what=field)
            if dtype.itemsize < 2:  # an fp8 dtype: a GEMM format, not what a model trains in
                raise ValueError(f"{field} must be a dtype a model trains in (fp32, bf16, fp16); "
                                 f"got {dtype_name(dtype)}: FP8 GEMMs are fp8= (a "
                                 f"mixprec.lowbit format, e.g. fp8='tensorwise')")
            if dtype not in TRAINING_DTYPES:  # fp64: its forward met fp32 inputs and failed
                raise ValueError(f"{field} must be a dtype a model trains in (fp32, bf16, fp16); "
                                 f"got {dtype_name(dtype)}")
            object.__setattr__(self, field, dtype)
        object.__setattr__(self, "state_dtype", _state_dtype(self.state_dtype))
        if self.output_dtype is not None:
            object.__setattr__(self, "output_dtype", to_dtype(self.output_dtype,
                                                              what="output_dtype"))
        for flag in ("master_weights", "autocast", "cast_inputs"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False; got {getattr(self, flag)!r}")
        ls = self.loss_scale
        if not (ls is None or ls == "dynamic"):
            try:  # the scalers' own check of a scale (mixprec.scaling)
                positive_scale("loss_scale", ls)
            except ValueError as error:
                raise ValueError(f"loss_scale must be 'dynamic', None, or a number a loss "
                                 f"scaler takes ({error}); got {ls!r}") from None
        if self.level is not None and self.level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(map(repr, LEVELS))} or None; "
                             f"got {self.level!r}")
        self._check_masters()
        if self.fp8 is not None and self.compute_dtype != _FP32:
            self.fp8.check_compute_dtype(dtype_name(self.compute_dtype))

    def _check_masters(self) -> None:
        object.__setattr__(self, "master", masters.resolve(self.master))
        asked = ([f"master={str(self.master)!r}"] if self.master.compact else []) + (
            [f"state_dtype={dtype_name(self.state_dtype)!r}"] if self.state_dtype != _FP32 else [])
        if asked and not self.master_weights:  # (first: a method's dtype advice would send
            raise ValueError(no_masters_message(" and ".join(asked), self.level,  # the user
                                                self.param_dtype))  # to another refusal)
        if self.param_dtype != _FP32:
            self.master.check_dtype(self.param_dtype)

    # -- per-module precision (views of ``modules``) -------------------------------------------
    def module_dtype(self, module: nn.Module, name: str) -> torch.dtype | None:
        """The dtype ``modules`` gives ``module`` (qualified ``name``), or None (it inherits)."""
        entry = self.modules.lookup(module, name)
        return None if entry is None else entry.compute

    @property
    def keep_fp32(self) -> tuple:
        """The keys of ``modules`` whose modules compute in fp32 (with fp32 parameters)."""
        return tuple(k for k, v in self.modules.items() if v.compute == _FP32)

    @property
    def overrides(self) -> tuple:
        """``(key, dtype)`` for each entry of ``modules`` that gives a compute dtype."""
        return tuple((k, v.compute) for k, v in self.modules.items() if v.compute is not None)

    @property
    def fp8_modules(self) -> tuple | None:
        """The qualified names ``modules`` gives a low-bit format, or None when no entry gives
        one (nor ``"off"``): then ``prepare`` chooses the layers."""
        return self.modules.gemm_names() if self.modules.sets_gemm else None

    # -- serialisation -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The policy as plain data (names for dtypes, ``"module:QualName"`` for module types),
        derived from the dataclass fields."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.dtype):
                value = dtype_name(value)
            elif isinstance(value, (lowbit.LowBitFormat, masters.MasterMethod)):
                value = value.to_data()
            elif isinstance(value, PrecisionMap):
                value = value.state_dict()
            out[f.name] = value
        return out

    @classmethod
    def from_state_dict(cls, state: dict) -> "Policy":
        """Rebuild a policy from :meth:`state_dict` (also from the older form that held
        ``keep_fp32``, ``overrides`` and ``fp8_modules`` instead of ``modules``).

        Raises:
            ValueError: unknown or missing fields, or a module type that can't be imported.
        """
        if not isinstance(state, dict):
            raise TypeError(f"a policy state_dict must be a dict; got {type(state).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        older = names - {"modules"} | {"keep_fp32", "overrides", "fp8_modules"}
        if set(state) not in (names, older):
            raise ValueError(f"a policy state_dict has the keys {sorted(names)}; got "
                             f"{sorted(state)}")

        def key(k):
            return type_from_path(k["type"]) if isinstance(k, dict) else k

        values = dict(state)
        if "modules" in state:
            values["modules"] = PrecisionMap.from_state_dict(state["modules"])
        else:
            values["keep_fp32"] = tuple(key(k) for k in state["keep_fp32"])
            values["overrides"] = tuple((key(k), dt) for k, dt in state["overrides"])
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
                resolve_dtype(dtype, device, warn=False)  # still validate: a training dtype
            return cls(level="O0")
        low = resolve_dtype(dtype, device, warn=warn)
        fp32 = torch.float32
        scale = "dynamic" if low == torch.float16 else None
        if level == "O1":  # params are fp32 already; the op lists decide each norm's compute
            return cls(fp32, low, fp32, loss_scale=scale, autocast=True, level="O1")
        if level == "O2":
            return cls(low, low, fp32, modules=_O2_MODULES, master_weights=low != fp32,
                       loss_scale=scale, autocast=True, cast_inputs=True, level="O2")
        # outputs as computed: low precision, except what an fp32 module returns
        return cls(low, low, None, cast_inputs=True, level="O3")

    def replace(self, **changes) -> "Policy":
        """A copy with some fields changed.

        The level label stays when only what :func:`mixprec.prepare`'s keywords set on a level
        changes (``keep_fp32``, ``master``, ``state_dtype``, ``fp8``, ``fp8_modules``: as
        ``prepare(level="O2", master="kahan")`` labels its policy O2); any other change makes it
        None (a custom policy) unless ``level=`` is given. ``modules=`` replaces the map;
        ``keep_fp32=`` and ``overrides=`` add entries to it (``modules=`` given too: to that
        one); ``fp8_modules=`` replaces its low-bit choice.
        """
        if not set(changes) <= _LEVEL_KEEPING:
            changes.setdefault("level", None)
        return dataclasses.replace(self, **changes)

    def _value(self) -> tuple:
        """Every field but the ``level`` label: what ``==`` and ``hash`` compare."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "level")

    def __eq__(self, other) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return self._value() == other._value()

    def __hash__(self) -> int:
        return hash(self._value())

    @property
    def is_mixed(self) -> bool:
        """True unless the policy is plain fp32 everywhere, its per-module entries included
        (then prepare changes nothing)."""
        return (self.compute_dtype != torch.float32 or self.param_dtype != torch.float32
                or any(entry.compute not in (None, torch.float32)
                       or entry.param_dtype not in (None, torch.float32)
                       for entry in self.modules.values()))

    def __str__(self) -> str:
        master = (self.master if self.master_weights else "none")
        output = "as-is" if self.output_dtype is None else dtype_name(self.output_dtype)
        body = (f"params={dtype_name(self.param_dtype)},compute={dtype_name(self.compute_dtype)},"
                f"output={output},master={master}")
        scale, autocast, cast_inputs = _level_switches(self.level, self.compute_dtype)
        if self.level is None:
            extras = [name for name, on in (("autocast", self.autocast),
                                             ("cast_inputs", self.cast_inputs)) if on]
        else:  # a level's own switches go without saying; a change to them does not
            extras = [f"{name}={on}" for name, on, level_value in (
                ("autocast", self.autocast, autocast),
                ("cast_inputs", self.cast_inputs, cast_inputs)) if on != level_value]
        if extras:
            body += "," + ",".join(extras)
        if self.loss_scale != scale:  # (unequal policies print unequal)
            body += f",loss_scale={self.loss_scale}"
        if self.state_dtype != _FP32:
            body += f",state={dtype_name(self.state_dtype)}"
        shown = self.modules
        if self.level == "O2" and shown.items()[:1] == _O2_MODULES.items():
            shown = PrecisionMap(shown.items()[1:])
        listed = shown.without(lambda k, v: isinstance(k, str) and v.lowbit is not None)
        if len(listed):
            body += f",modules={listed}"
        if self.fp8 is not None:
            body += f",fp8={self.fp8}"
            if self.fp8_modules is not None:
                body += f",fp8_modules={len(self.fp8_modules)}"
        return f"{self.level or 'custom'}({body})"


_O2_MODULES = PrecisionMap({NormLayer: Precision(_FP32)})  # O2 keeps norm layers in fp32
def _level_switches(level: str | None, compute: torch.dtype) -> tuple:
    """``(loss_scale, autocast, cast_inputs)`` a level sets (a custom policy: the defaults)."""
    low = compute != torch.float32
    scale = "dynamic" if compute == torch.float16 and level in ("O1", "O2") else None
    return (scale, level in ("O1", "O2") and low, level in ("O2", "O3") and low)


#: the fields Policy.replace may change keeping the level label (what prepare's keywords set)
_LEVEL_KEEPING = {"keep_fp32", "master", "state_dtype", "fp8", "fp8_modules"}
_NO_MASTERS = {"O0": "fp32 training", "O1": "its parameters stay fp32",
               "O3": "pure 16-bit: the optimizer updates the 16-bit parameters themselves"}


def no_masters_message(asked: str, level: str | None, param_dtype: torch.dtype) -> str:
    """Why ``asked`` (``"master='kahan'"``, ...) needs master weights a policy does not have,
    and what to use instead."""
    if level in _NO_MASTERS:
        return (f"{asked}: master weights exist at level O2 only (or in a Policy with "
                f"master_weights=True); level {level} has none ({_NO_MASTERS[level]}): use "
                f"level='O2'")
    if level == "O2":
        return (f"{asked}: level O2 has master weights only with a 16-bit dtype; here the "
                f"parameters are {dtype_name(param_dtype)}: use dtype='bf16' (or 'fp16')")
    return (f"{asked}: how an optimizer updates 16-bit parameters through master weights, "
            f"which need master_weights=True")


def _state_dtype(spec) -> torch.dtype:
    """``state_dtype`` as a torch dtype, or an error listing the valid ones only."""
    valid = f"one of {', '.join(map(repr, STATE_DTYPES))} (or torch.float32, torch.bfloat16)"
    if not isinstance(spec, (str, torch.dtype)):
        raise TypeError(f"state_dtype must be {valid}; got {type(spec).__name__} {spec!r}")
    try:
        dt = to_dtype(spec, what="state_dtype")
    except ValueError:
        dt = None
    if dt is None or dtype_name(dt) not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be {valid}; got {spec!r}")
    return dt
