"""One apex loss scaler: a fixed scale, or apex's dynamic rules over mixprec's scale state.

apex's dynamic rules are :func:`mixprec.scaling.adjust_scale` with no hysteresis: the first scale
is ``min(2**16, max_loss_scale)``; every clean ``scale_loss`` exit counts one "unskipped" step
and after 2000 in a row the scale doubles (never above ``max_loss_scale``); an exit that found
inf/NaN halves it (never below ``min_loss_scale``) and resets the count. A fixed scale never
changes and never skips; its exits only count. A first scale below ``min_loss_scale`` (a floor
above 2**16) stays as it is until an overflow or a growth, as in apex (the bounds apply to the
scale a change makes: :func:`_apex_rule`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..scaling.state import DynamicConfig, ScaleState, positive_scale

__all__ = ["ApexLossScaler", "INIT_SCALE", "GROWTH_INTERVAL"]

INIT_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000
# apex's scale was a Python float with no floor; ours is an fp32 tensor: floor at its tiniest
# normal number unless min_loss_scale says otherwise.
_NO_FLOOR = float(torch.finfo(torch.float32).tiny)


class ApexLossScaler:
    """The scale of one ``loss_id``; its state is a :class:`ScaleState` of 0-d tensors.

    Args:
        loss_scale: "dynamic" or a positive float.
        min_loss_scale: floor of the dynamic scale (None: none).
        max_loss_scale: ceiling of the dynamic scale, and cap of its first value.
    """

    def __init__(self, loss_scale, min_loss_scale=None, max_loss_scale=2.0 ** 24):
        self.dynamic = loss_scale == "dynamic"
        hi = positive_scale("max_loss_scale", max_loss_scale)
        lo = _NO_FLOOR if min_loss_scale is None else positive_scale("min_loss_scale",
                                                                      min_loss_scale)
        if lo > hi:
            raise ValueError(f"min_loss_scale must be <= max_loss_scale; got min_loss_scale="
                             f"{min_loss_scale}, max_loss_scale={max_loss_scale}")
        self.config = DynamicConfig(growth_factor=2.0, backoff_factor=0.5,
                                    growth_interval=GROWTH_INTERVAL, hysteresis=1, min_scale=lo,
                                    max_scale=hi, max_skips_at_min=None)
        first = min(INIT_SCALE, hi) if self.dynamic else positive_scale("loss_scale", loss_scale)
        self.state = ScaleState.initial(first)
        self.fixed = None if self.dynamic else first  # the fixed scale, known without a sync

    def scale(self, device) -> torch.Tensor:
        """The current scale as a 0-d fp32 tensor on ``device`` (no host sync)."""
        if self.state.device != torch.device(device):
            self.state = self.state.to(device)
        return self.state.scale

    def inv_scale(self) -> torch.Tensor:
        return self.state.scale.double().reciprocal().float()

    def update(self, found_inf: torch.Tensor) -> None:
        """Count one ``scale_loss`` exit; a dynamic scale adapts to ``found_inf`` (no sync)."""
        if self.dynamic:
            self.state = _apex_rule(self.state, found_inf, self.config)
        else:
            self.state = dataclasses.replace(self.state,
                                             growth_tracker=self.state.growth_tracker + 1)

    def loss_scale(self) -> float:
        """The current scale (a host sync)."""
        return float(self.state.scale.item())

    def unskipped(self) -> int:
        """Clean exits since the last growth or overflow (a host sync)."""
        return int(self.state.growth_tracker.item())

    def load(self, loss_scale, unskipped) -> None:
        """Set the scale and the count, as apex's ``load_state_dict`` did."""
        scale = positive_scale("loss_scale", loss_scale)
        if isinstance(unskipped, bool) or not isinstance(unskipped, int) or unskipped < 0:
            raise ValueError(f"'unskipped' must be an integer >= 0; got {unskipped!r}")
        self.state = ScaleState.from_numbers(
            {"scale": float(loss_scale), "growth_tracker": unskipped,
             "hysteresis_tracker": self.config.hysteresis, "skips_at_min": 0},
            self.state.device)
        if not self.dynamic:
            self.fixed = scale


def _apex_rule(state: ScaleState, found_inf: torch.Tensor, config: DynamicConfig) -> ScaleState:
    """apex's update (no host sync): an overflow sets ``max(min, scale / 2)`` and resets the
    count; a clean exit counts, and the count reaching the interval sets ``min(max, scale * 2)``
    and resets it. A scale outside the bounds (below a floor above 2**16) is left as it is
    otherwise."""
    found = found_inf.to(state.device) > 0
    count = torch.where(found, torch.zeros_like(state.growth_tracker), state.growth_tracker + 1)
    grow = count >= config.growth_interval
    scale = torch.where(found, torch.clamp(state.scale * config.backoff_factor,
                                           min=config.min_scale),
                        torch.where(grow, torch.clamp(state.scale * config.growth_factor,
                                                      max=config.max_scale), state.scale))
    return dataclasses.replace(state, scale=scale,
                               growth_tracker=torch.where(grow, torch.zeros_like(count), count))
