"""Loss-scale arithmetic: the state (0-d tensors), the dynamic hyper-parameters, the pure update.

Kept apart from the scaler objects in :mod:`mixprec.scaling`, which are thin shells around it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .. import kernel_table

__all__ = ["ScaleState", "DynamicConfig", "adjust_scale", "positive_scale", "check_keys",
           "skip_limit"]

_FP32_MAX = torch.finfo(torch.float32).max
_FP32_TINY = torch.finfo(torch.float32).tiny  # 2^-126


@dataclasses.dataclass(frozen=True)
class ScaleState:
    """The loss-scale state, 0-d tensors on one device (never mutated; see :func:`adjust_scale`).

    Attributes:
        scale: the current loss scale (float32).
        growth_tracker: clean steps in a row since the last growth or overflow (int32).
        hysteresis_tracker: overflowing steps still tolerated before a backoff (int32).
        skips_at_min: overflowing steps in a row taken at ``min_scale`` (int32).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_tracker: torch.Tensor
    skips_at_min: torch.Tensor

    @classmethod
    def initial(cls, scale: float, hysteresis: int = 1, device=None) -> "ScaleState":
        values = {"scale": scale, "growth_tracker": 0, "hysteresis_tracker": hysteresis,
                  "skips_at_min": 0}
        return cls.from_numbers(values, device)

    @classmethod
    def from_numbers(cls, values: dict, device=None) -> "ScaleState":
        """Build a state from plain numbers (one per field).

        Raises:
            ValueError: a scale that is not a valid loss scale, or a count that is not an
                integer of its range (a loaded state is checked before it is used)."""
        positive_scale("the state's scale", values["scale"])
        for name, low in (("growth_tracker", 0), ("hysteresis_tracker", 1), ("skips_at_min", 0)):
            _int_at_least(f"the state's {name}", values[name], low)
        def tensor(field):
            dtype = torch.float32 if field.name == "scale" else torch.int32
            return torch.tensor(values[field.name], dtype=dtype, device=device)
        return cls(**{f.name: tensor(f) for f in dataclasses.fields(cls)})

    def to_numbers(self) -> dict:
        """The state as plain Python numbers (one host sync)."""
        return {f.name: getattr(self, f.name).item() for f in dataclasses.fields(self)}

    def to(self, device) -> "ScaleState":
        fields = dataclasses.fields(self)
        return ScaleState(**{f.name: getattr(self, f.name).to(device) for f in fields})

    @property
    def device(self) -> torch.device:
        return self.scale.device


@dataclasses.dataclass(frozen=True)
class DynamicConfig:
    """Hyper-parameters of dynamic loss scaling (validated; see :class:`DynamicLossScaler`)."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0 ** 24
    max_skips_at_min: int | None = 8
    enabled: bool = True

    def __post_init__(self):
        gf = _finite_number("growth_factor", self.growth_factor)
        if gf <= 1.0:
            raise ValueError(f"growth_factor must be > 1 (the scale must be able to grow); "
                             f"got {gf}")
        bf = _finite_number("backoff_factor", self.backoff_factor)
        if not 0.0 < bf < 1.0:
            raise ValueError(f"backoff_factor must be in the open interval (0, 1); got {bf}")
        _int_at_least("growth_interval", self.growth_interval, 1)
        _int_at_least("hysteresis", self.hysteresis, 1)
        lo = positive_scale("min_scale", self.min_scale)
        hi = positive_scale("max_scale", self.max_scale)
        if lo > hi:
            raise ValueError(f"min_scale must be <= max_scale; got min_scale={lo}, max_scale={hi}")
        skip_limit("max_skips_at_min", self.max_skips_at_min)
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled must be a bool; got {self.enabled!r}")


def adjust_scale(state: ScaleState, found_inf: torch.Tensor, config: DynamicConfig) -> ScaleState:
    """One dynamic-loss-scale update; a pure function of 0-d tensors (no host sync).

    Args:
        state: the state before the update.
        found_inf: a 0-d tensor, > 0 when any gradient of the step held inf/NaN.
        config: the hyper-parameters.

    Returns:
        The new state. An overflow resets the growth tracker and uses up one unit of hysteresis;
        when none is left the scale is multiplied by ``backoff_factor`` (never below
        ``min_scale``) and the hysteresis is refilled. A clean step refills the hysteresis (it
        counts overflows in a row) and, after ``growth_interval`` clean steps, multiplies the scale
        by ``growth_factor`` (never above ``max_scale``, so never to inf).
    """
    table = kernel_table.TABLE
    # torch's kernel keeps the scale when a growth overflows fp32 (the bound here: max_scale)
    finite = config.max_scale * config.growth_factor <= _FP32_MAX
    if finite and table.scale_update_path(state.device.type, config.hysteresis) == "amp":
        return _adjust_amp(state, found_inf, config, table.kernel("amp_update_scale"))
    found = found_inf.to(state.device) > 0
    hysteresis, zero, backoff, growth_factor, one = _constants(config, state.device)
    hyst = torch.where(found, state.hysteresis_tracker - 1, hysteresis)
    back_off = found & (hyst <= 0)
    growth = torch.where(found, zero, state.growth_tracker + 1)
    grow = growth >= config.growth_interval
    # the scale lies in [min_scale, max_scale], so one clamp bounds a backoff from below and a
    # growth from above
    factor = torch.where(back_off, backoff, torch.where(grow, growth_factor, one))
    scale = torch.clamp(state.scale * factor, config.min_scale, config.max_scale)
    at_min = found & (state.scale <= config.min_scale)
    return ScaleState(
        scale=scale,
        growth_tracker=torch.where(grow, zero, growth),
        hysteresis_tracker=torch.where(back_off, hysteresis, hyst),
        skips_at_min=torch.where(at_min, state.skips_at_min + 1, zero),
    )


def _adjust_amp(state: ScaleState, found_inf: torch.Tensor, config: DynamicConfig,
                kernel) -> ScaleState:
    """:func:`adjust_scale` without hysteresis, by torch's ``_amp_update_scale_`` (the update
    ``torch.amp.GradScaler`` runs: back off on an overflow, grow when the clean steps reach the
    interval) on copies of the state, then bounded to ``[min_scale, max_scale]``."""
    found = found_inf.to(state.device, torch.float32)
    scale = state.scale.clone()
    # torch grows when the count reaches the interval exactly: a count past it (the interval
    # was lowered) grows at once, as the element-wise update does
    growth = torch.clamp(state.growth_tracker, max=config.growth_interval - 1)
    kernel(scale, growth, found, config.growth_factor, config.backoff_factor,
           config.growth_interval)
    scale.clamp_(config.min_scale, config.max_scale)
    at_min = (found > 0) & (state.scale <= config.min_scale)
    zero = _constants(config, state.device)[1]
    return ScaleState(scale=scale, growth_tracker=growth,
                      hysteresis_tracker=state.hysteresis_tracker,
                      skips_at_min=torch.where(at_min, state.skips_at_min + 1, zero))


@functools.lru_cache(maxsize=16)
def _constants(config: DynamicConfig, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The update's constants as 0-d tensors on ``device``, made once per config (a Python
    number in ``torch.where`` is a kernel of its own each time): hysteresis and 0 (int32),
    backoff factor, growth factor and 1 (float32). Never written."""
    ints = torch.tensor([config.hysteresis, 0], dtype=torch.int32, device=device)
    floats = torch.tensor([config.backoff_factor, config.growth_factor, 1.0],
                          dtype=torch.float32, device=device)
    return (*ints.unbind(), *floats.unbind())


def _finite_number(name: str, value) -> float:
    try:  # (an int beyond float64's range: OverflowError from the conversion)
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and \
            math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    return float(value)


def positive_scale(name: str, value) -> float:
    """``value`` as a loss scale: a number a float32 holds as a normal number, whose reciprocal
    (what unscaling multiplies by) is finite: in [2^-126, float32 max]. (A smaller one was
    stored as 0, or unscaled by inf: the step wrote NaN or inf weights.)"""
    v = _finite_number(name, value)
    if not _FP32_TINY <= v <= _FP32_MAX:
        raise ValueError(f"{name} must be positive, a float32 normal number in [2^-126, "
                         f"{_FP32_MAX!r}] (float32's largest; its reciprocal finite); got "
                         f"{value!r}")
    return v


def _int_at_least(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    return value


def skip_limit(name: str, value) -> int | None:
    """``value`` when it is None or an integer >= 1 (a bound on overflowing steps in a row)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an integer >= 1 (steps skipped in a row before an "
                         f"error) or None (never raise); got {value!r}")
    return value


def check_keys(what: str, d, expected: tuple[str, ...]) -> None:
    """Raise ValueError unless ``d`` is a dict with exactly the ``expected`` keys."""
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a dict with keys {list(expected)}; "
                         f"got {type(d).__name__}")
    missing, unknown = set(expected) - set(d), set(d) - set(expected)
    if missing or unknown:
        raise ValueError(f"{what} must have keys {list(expected)}; missing {sorted(missing)}, "
                         f"unknown {sorted(unknown)}")
