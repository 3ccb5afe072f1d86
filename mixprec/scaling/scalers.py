"""Loss scaling: multiply the loss by S before backward, divide the gradients by S before the step.

Three scalers share one shape (``scale`` -> ``unscale_`` -> ``step`` -> ``update``):

* :class:`DynamicLossScaler` skips steps whose gradients hold inf/NaN and adapts S (back off after
  ``hysteresis`` overflowing steps in a row, grow after ``growth_interval`` clean steps, always
  within ``[min_scale, max_scale]``); overflow that persists at ``min_scale`` raises
  :class:`NonFiniteGradientsError`.
* :class:`StaticLossScaler` keeps S fixed (MindSpore's ``FixedLossScaleManager``;
  ``skip_on_overflow`` is its ``drop_overflow_update``).
* :class:`NoLossScaler` is a no-op with the same methods, so a training loop keeps one shape.

The scale arithmetic is the pure function :func:`adjust_scale` over a :class:`ScaleState` of 0-d
tensors living on the loss's device (:mod:`mixprec.scaling.state`); the scaler objects are thin
mutable shells around it (the shared shell, :class:`LossScaler`, is in
:mod:`mixprec.scaling.base`; the fused gradient pass in :mod:`mixprec.scaling.unscale`).

Host-device syncs (they matter on CUDA): ``step()`` reads the overflow flag once (and once more on
a step that overflowed, to check the ``min_scale`` limit): after the optimizer's step is queued
when the optimizer skips on the device (torch's fused kernels take the flag), else before it;
``get_scale()`` and ``state_dict()`` read the scale. ``scale()``, ``unscale_()`` and ``update()``
never sync.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..dtypes import to_dtype
from .base import LossScaler
from .gradscaler import TORCH_KEYS
from .state import (
    DynamicConfig,
    ScaleState,
    adjust_scale,
    check_keys,
    positive_scale,
    skip_limit,
)

__all__ = [
    "DynamicLossScaler", "StaticLossScaler", "NoLossScaler", "make_loss_scaler",
    "NonFiniteGradientsError", "LossScaler", "ScaleState", "DynamicConfig", "adjust_scale",
]


class NonFiniteGradientsError(RuntimeError):
    """Gradients stayed non-finite at the minimum loss scale for too many steps in a row.

    Attributes:
        parameters: names of the parameters whose gradients held inf/NaN at the last skipped step
            (on this rank; empty when only another rank overflowed).
    """

    def __init__(self, message: str, parameters: list[str]):
        super().__init__(message)
        self.parameters = parameters


class NoLossScaler(LossScaler):
    """A loss scaler that does not scale the loss, with the methods of the others (one loop shape).

    ``scale()`` returns the loss, ``unscale_()`` only makes a MasterWeightOptimizer's fp32
    gradients. By default it checks nothing: ``step()`` always steps and returns True, with no
    host sync. With ``skip_nonfinite=True`` (what a 16-bit run without a loss scale gets, bf16:
    ``make_loss_scaler("auto", "bf16")``) it checks each step's gradients for inf/NaN as a scaler
    of scale 1 would: such a step is skipped (weights, optimizer state and step count untouched;
    ``step()`` returns False), the first skip warns, and ``max_consecutive_skips`` skips in a row
    raise :class:`NonFiniteGradientsError` naming the parameters (nothing about the run changes
    between two steps that could make the next one finite). The call order is checked as for
    the others.

    Args:
        skip_nonfinite: check for inf/NaN and skip such steps (one host read per optimizer
            and step, after its step is queued where the optimizer skips on the device).
        max_consecutive_skips: with ``skip_nonfinite``, skipped steps in a row before
            :class:`NonFiniteGradientsError` (an integer >= 1, or None: never).

    Raises:
        TypeError, ValueError: a bad ``skip_nonfinite`` or ``max_consecutive_skips``.

    Example:
        >>> scaler = NoLossScaler()
        >>> scaler.get_scale()
        1.0
    """

    def __init__(self, skip_nonfinite: bool = False, max_consecutive_skips: int | None = 8):
        super().__init__()
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be a bool; got {skip_nonfinite!r}")
        self.skip_nonfinite = skip_nonfinite
        self.max_consecutive_skips = skip_limit("max_consecutive_skips", max_consecutive_skips)

    @property
    def _checks(self) -> bool:
        return self.skip_nonfinite

    @property
    def _warns_on_first_skip(self) -> bool:
        return self.skip_nonfinite

    def _skip_limit(self):
        return self.max_consecutive_skips

    def _first_skip_message(self, names):
        return (f"skipped a step: gradients hold inf/NaN ({_listed(names)}). There is no loss "
                f"scale to back off, so the cause is in the loss, the inputs or the forward "
                f"(mixprec.debug.trace_nonfinite(model) names the first op that makes inf/NaN); "
                f"{self.max_consecutive_skips} skipped steps in a row raise "
                f"NonFiniteGradientsError (max_consecutive_skips=)")

    def _persistent_overflow_error(self, names):
        limit = self.max_consecutive_skips
        return _bound_error(f"{limit} steps in a row (max_consecutive_skips={limit}), with no "
                            f"loss scale that could cause or fix it", names)

    def _config_dict(self):
        if not self.skip_nonfinite:
            return {}
        return {"skip_nonfinite": True, "max_consecutive_skips": self.max_consecutive_skips}

    def _load_grad_scaler(self, state_dict):
        """A disabled ``torch.amp.GradScaler``'s (empty) state_dict: nothing to load. An enabled
        one's scaled the loss, which this scaler cannot continue."""
        if state_dict:
            raise ValueError(f"this torch.amp.GradScaler state_dict holds a loss scale "
                             f"({state_dict.get('scale')!r}); NoLossScaler scales nothing: load "
                             f"it into a DynamicLossScaler (or a StaticLossScaler, which takes "
                             f"its scale as its fixed one)")

    def _load_config(self, config):
        if config == {}:  # a no-op scaler's (or an earlier version's): settings stay as made
            return
        check_keys("state_dict['config']", config, ("skip_nonfinite", "max_consecutive_skips"))
        if not isinstance(config["skip_nonfinite"], bool):
            raise ValueError(f"state_dict['config']['skip_nonfinite'] must be a bool; "
                             f"got {config['skip_nonfinite']!r}")
        limit = skip_limit("state_dict['config']['max_consecutive_skips']",
                           config["max_consecutive_skips"])
        self.skip_nonfinite, self.max_consecutive_skips = config["skip_nonfinite"], limit


def _listed(names: list[str]) -> str:
    return "; ".join(names) if names else "none on this rank (another rank overflowed)"


def _bound_error(how_long: str, names: list[str], hint: str = "") -> NonFiniteGradientsError:
    """The error of a run of skipped steps past its bound: how long and at what scale, the
    first parameter with a non-finite gradient, where to look, and every such parameter."""
    first = names[0].split(" shape ")[0] if names else "none on this rank"
    return NonFiniteGradientsError(
        f"gradients held inf/NaN for {how_long}; the first parameter with a non-finite "
        f"gradient: {first}. {hint}Look for inf/NaN in the loss, the inputs or the forward "
        f"pass (e.g. with mixprec.debug.trace_nonfinite(model)). Parameters with non-finite "
        f"gradients: {_listed(names)}", names)


class DynamicLossScaler(LossScaler):
    """Loss scaling that skips overflowing steps and adapts the scale (as torch, Paddle, apex do).

    Args:
        init_scale: the first scale; must lie in ``[min_scale, max_scale]``.
        growth_factor: multiplier (> 1) applied after ``growth_interval`` clean steps in a row.
        backoff_factor: multiplier in (0, 1) applied after ``hysteresis`` overflows in a row.
        growth_interval: clean steps in a row before the scale grows.
        hysteresis: overflowing steps in a row before the scale backs off (Paddle's
            ``decr_every_n_nan_or_inf``, DeepSpeed's ``hysteresis``); 1 backs off at once.
        min_scale, max_scale: bounds of the scale (positive, finite, within float32).
        max_skips_at_min: overflowing steps in a row at ``min_scale`` before
            :class:`NonFiniteGradientsError` is raised (None: never).
        process_group: the group over which the overflow flag is all-reduced (max) when
            ``torch.distributed`` is initialised (None: the default group).
        enabled: False makes it behave as :class:`NoLossScaler` (state kept for checkpoints).

    Raises:
        ValueError: a hyper-parameter out of its range (the message says which and why).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = DynamicLossScaler(init_scale=128.0)
        >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        >>> scaler.step(opt), scaler.update(), scaler.get_scale()
        (True, None, 128.0)
    """

    _kind = "dynamic"

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 1,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 24,
                 max_skips_at_min: int | None = 8, process_group=None, enabled: bool = True):
        super().__init__()
        self.config = DynamicConfig(growth_factor, backoff_factor, growth_interval, hysteresis,
                                    min_scale, max_scale, max_skips_at_min, enabled)
        self._state = ScaleState.initial(self._checked_init(init_scale), hysteresis)
        self.process_group = process_group

    @property
    def _scales(self) -> bool:
        return self.config.enabled

    @property
    def _checks(self) -> bool:
        return self.config.enabled

    def _checked_init(self, init_scale) -> float:
        init = positive_scale("init_scale", init_scale)
        lo, hi = self.config.min_scale, self.config.max_scale
        if not lo <= init <= hi:
            raise ValueError(f"init_scale must lie in [min_scale, max_scale] = [{lo}, {hi}]; "
                             f"got {init}")
        return init

    def _adjust(self, found_inf):
        return adjust_scale(self._state, found_inf, self.config)

    def _skip_limit(self):
        return self.config.max_skips_at_min

    def _at_min(self):
        return self._state.scale <= self.config.min_scale

    def _persistent_overflow_error(self, names):
        limit = self.config.max_skips_at_min
        return _bound_error(f"{limit} steps in a row at the minimum loss scale "
                            f"{self.config.min_scale} (max_skips_at_min={limit}; the precision "
                            f"keyword max_consecutive_skips= sets it): the overflow is not "
                            f"caused by the scale", names)

    def get_growth_factor(self) -> float:
        return self.config.growth_factor

    def get_backoff_factor(self) -> float:
        return self.config.backoff_factor

    def get_growth_interval(self) -> int:
        return self.config.growth_interval

    def set_growth_factor(self, new_factor: float) -> None:
        self.config = dataclasses.replace(self.config, growth_factor=new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        self.config = dataclasses.replace(self.config, backoff_factor=new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        self.config = dataclasses.replace(self.config, growth_interval=new_interval)

    def _set_scale(self, new_scale: float) -> None:
        lo, hi = self.config.min_scale, self.config.max_scale
        if not lo <= new_scale <= hi:
            raise ValueError(f"new_scale must lie in [min_scale, max_scale] = [{lo}, {hi}]; "
                             f"got {new_scale}")
        self._state = dataclasses.replace(self._state, scale=torch.full_like(
            self._state.scale, new_scale))

    def _config_dict(self):
        return dataclasses.asdict(self.config)

    def _repr_fields(self):
        return {"scale": float(self._state.scale.item()), **self._config_dict()}

    def _load_config(self, config):
        """The saved settings, ``enabled`` aside: it stays as this scaler was made (as
        ``torch.amp.GradScaler``'s). An enabled scaler refuses a disabled one's state (it
        would stop scaling, silently), as ``GradScaler`` refuses a disabled one's."""
        names = tuple(f.name for f in dataclasses.fields(DynamicConfig))
        check_keys("state_dict['config']", config, names)
        if self.config.enabled and config["enabled"] is False:
            raise ValueError("this state_dict was saved by a disabled DynamicLossScaler "
                             "(enabled=False: it scaled nothing); an enabled one does not load "
                             "it. Make this scaler with enabled=False, or load a state_dict "
                             "saved while scaling")
        self.config = DynamicConfig(**{**config, "enabled": self.config.enabled})

    def _load_grad_scaler(self, state_dict):
        if not state_dict:
            raise ValueError("this state_dict is empty (a disabled torch.amp.GradScaler saves "
                             "nothing); nothing to load")
        check_keys("a torch.amp.GradScaler state_dict", state_dict, TORCH_KEYS)
        config = dataclasses.replace(
            self.config, growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"])
        scale = positive_scale("the GradScaler's scale", state_dict["scale"])
        self._check_loaded_scale(scale, config)
        state = ScaleState.from_numbers(
            {"scale": scale, "growth_tracker": state_dict["_growth_tracker"],
             "hysteresis_tracker": config.hysteresis, "skips_at_min": 0}, self._state.device)
        self.config, self._state = config, state
        self._stages.clear()

    def _check_loaded_scale(self, scale: float, config=None) -> None:
        config = self.config if config is None else config
        if not config.min_scale <= scale <= config.max_scale:
            raise ValueError(f"the loaded scale {scale} lies outside [min_scale, max_scale] = "
                             f"[{config.min_scale}, {config.max_scale}]")


class StaticLossScaler(LossScaler):
    """A fixed loss scale (MindSpore's ``FixedLossScaleManager``).

    Args:
        scale: the loss scale, positive and finite.
        skip_on_overflow: skip steps whose gradients hold inf/NaN (MindSpore's
            ``drop_overflow_update``). False applies every step without reading the flag (no
            host sync at all).
        max_consecutive_skips: with ``skip_on_overflow``, skipped steps in a row before
            :class:`NonFiniteGradientsError` naming the parameters (an integer >= 1; a fixed
            scale cannot fix any of them), or None (default: never, as MindSpore's manager;
            watch ``skipped_steps``). A policy's numeric ``loss_scale`` gets the precision
            keyword of the same name (8 unless set).

    Example:
        >>> StaticLossScaler(1024.0).get_scale()
        1024.0
    """

    _kind = "static"
    _scales = True

    def __init__(self, scale: float = 128.0, skip_on_overflow: bool = True,
                 max_consecutive_skips: int | None = None):
        super().__init__()
        if not isinstance(skip_on_overflow, bool):
            raise TypeError(f"skip_on_overflow must be a bool; got {skip_on_overflow!r}")
        self._state = ScaleState.initial(positive_scale("scale", scale))
        self._unit = float(scale) == 1.0  # (no scale to divide by: a plain backward is fine)
        self.skip_on_overflow = skip_on_overflow
        self.max_consecutive_skips = skip_limit("max_consecutive_skips", max_consecutive_skips)
        if not skip_on_overflow and max_consecutive_skips is not None:
            raise ValueError(f"max_consecutive_skips={max_consecutive_skips!r} bounds skipped "
                             f"steps, and skip_on_overflow=False skips none: drop one of them")

    @property
    def _checks(self) -> bool:
        return self.skip_on_overflow

    def _skip_limit(self):
        return self.max_consecutive_skips

    def _persistent_overflow_error(self, names):
        limit = self.max_consecutive_skips
        scale = self.get_scale()
        return _bound_error(f"{limit} steps in a row (max_consecutive_skips={limit}) at the "
                            f"fixed loss scale {scale}", names,
                            "A smaller scale (or a DynamicLossScaler) fixes an overflow the "
                            "scale causes. " if scale > 1 else "")

    def _config_dict(self):
        if self.max_consecutive_skips is None:  # (the layout of earlier versions)
            return {"skip_on_overflow": self.skip_on_overflow}
        return {"skip_on_overflow": self.skip_on_overflow,
                "max_consecutive_skips": self.max_consecutive_skips}

    def _repr_fields(self):
        return {"scale": self.get_scale(), **self._config_dict()}

    def _set_scale(self, new_scale: float) -> None:
        self._state = dataclasses.replace(self._state, scale=torch.full_like(
            self._state.scale, new_scale))
        self._unit = float(new_scale) == 1.0

    def _load_config(self, config):
        keys = ("skip_on_overflow",) + (("max_consecutive_skips",)
                                        if isinstance(config, dict)
                                        and "max_consecutive_skips" in config else ())
        check_keys("state_dict['config']", config, keys)
        if not isinstance(config["skip_on_overflow"], bool):
            raise ValueError(f"state_dict['config']['skip_on_overflow'] must be a bool; got "
                             f"{config['skip_on_overflow']!r}")
        limit = (skip_limit("state_dict['config']['max_consecutive_skips']",
                            config["max_consecutive_skips"])
                 if "max_consecutive_skips" in config  # an earlier version's: keep this one's
                 else self.max_consecutive_skips)
        self.skip_on_overflow, self.max_consecutive_skips = config["skip_on_overflow"], limit

    def _load_grad_scaler(self, state_dict):
        """A ``torch.amp.GradScaler``'s scale becomes this fixed one (its growth settings have
        nothing to apply to here)."""
        if not state_dict:
            raise ValueError("this state_dict is empty (a disabled torch.amp.GradScaler saves "
                             "nothing); nothing to load")
        check_keys("a torch.amp.GradScaler state_dict", state_dict, TORCH_KEYS)
        scale = positive_scale("the GradScaler's scale", state_dict["scale"])
        self._state = ScaleState.initial(scale, device=self._state.device)
        self._unit = float(scale) == 1.0
        self._stages.clear()


def make_loss_scaler(spec: Any = "auto", dtype: Any = None, *,
                     max_consecutive_skips: int | None = 8) -> LossScaler:
    """Build a loss scaler from a short spec.

    Args:
        spec: ``"auto"`` (dynamic for fp16, none for bf16 and fp32, per the level table),
            ``"dynamic"``, ``"none"`` or None, a positive number (a static scale), or a scaler
            (returned as it is).
        dtype: the low-precision training dtype ("fp16", torch.bfloat16, ...), or a
            :class:`mixprec.Policy` whose ``loss_scale`` decides. Needed for ``"auto"``. Without
            a loss scale, a 16-bit dtype (bf16; a policy that computes or stores in 16 bits) gets
            a :class:`NoLossScaler` that skips steps with inf/NaN gradients.
        max_consecutive_skips: steps skipped in a row that the scale cannot fix (without a loss
            scale: every skip; dynamic: those at ``min_scale``, its ``max_skips_at_min``) before
            :class:`NonFiniteGradientsError`; None: never. Only for a scaler built here.

    Raises:
        ValueError: an unknown spec, a bad number, ``"auto"`` without a dtype, or
            ``max_consecutive_skips`` set beside a scaler object (set it on the scaler).
        TypeError: a spec of another type.

    Example:
        >>> type(make_loss_scaler("auto", "fp16")).__name__
        'DynamicLossScaler'
        >>> scaler = make_loss_scaler("auto", "bf16")
        >>> type(scaler).__name__, scaler.skip_nonfinite
        ('NoLossScaler', True)
    """
    limit = skip_limit("max_consecutive_skips", max_consecutive_skips)
    if isinstance(spec, LossScaler):
        if limit != 8:
            raise ValueError(f"max_consecutive_skips={limit!r} beside a scaler object: set it "
                             f"on the scaler (NoLossScaler(max_consecutive_skips=...), "
                             f"StaticLossScaler(max_consecutive_skips=...), "
                             f"DynamicLossScaler(max_skips_at_min=...))")
        return spec
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return StaticLossScaler(spec, max_consecutive_skips=limit)
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"loss scaler spec must be 'auto', 'dynamic', 'none', None, a number or a "
                        f"loss scaler; got {type(spec).__name__} {spec!r}")
    key = "none" if spec is None else spec.strip().lower()
    if key == "auto":
        key = _auto_spec(dtype) or "none"
        if not isinstance(key, str):  # a Policy's fixed loss_scale: a number
            return StaticLossScaler(key, max_consecutive_skips=limit)
    if key == "dynamic":
        return DynamicLossScaler(max_skips_at_min=limit)
    if key == "none":
        return NoLossScaler(skip_nonfinite=_is_16_bit(dtype), max_consecutive_skips=limit)
    raise ValueError(f"loss scaler spec must be 'auto', 'dynamic', 'none', None, a number or a "
                     f"loss scaler; got {spec!r}")


def _auto_spec(dtype):
    if hasattr(dtype, "loss_scale"):  # a Policy (scaling sits below the policy that names it)
        return dtype.loss_scale
    if dtype is None:
        raise ValueError("make_loss_scaler('auto') needs the training dtype (e.g. dtype='fp16') "
                         "or a Policy; got dtype=None")
    return "dynamic" if to_dtype(dtype) == torch.float16 else None


def _is_16_bit(dtype) -> bool:
    """Whether a run in ``dtype`` (a dtype, its name, or a Policy) computes or stores in 16 bits."""
    if dtype is None:
        return False
    dtypes = ((dtype.param_dtype, dtype.compute_dtype) if hasattr(dtype, "compute_dtype")
              else (to_dtype(dtype),))
    return any(d in (torch.float16, torch.bfloat16) for d in dtypes)
