"""What every mixprec loss scaler shares with ``torch.amp.GradScaler``: the hyper-parameter
getters and setters, and a ``state_dict`` that carries GradScaler's keys.

:class:`GradScalerInterface` is a base of :class:`~mixprec.scaling.base.LossScaler`; it reads
and writes the scaler's scale state, counters and stage book, and leaves the hyper-parameters of
each kind of scaler to the hooks the kinds override (``_config_dict``, ``_load_config``,
``_load_grad_scaler``).
"""

from __future__ import annotations

import dataclasses

from .records import Counters, StageBook
from .state import ScaleState, check_keys, positive_scale

__all__ = ["GradScalerInterface", "TORCH_KEYS"]

#: The keys of a ``torch.amp.GradScaler`` state_dict.
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class GradScalerInterface:
    """torch.amp.GradScaler's getters, setters and state_dict, for a scaler whose scale lives in
    ``_state`` (a :class:`ScaleState`), its counters in ``_counters`` and its stages in
    ``_stages``."""

    _kind = "none"
    _state: ScaleState
    _counters: Counters
    _stages: StageBook

    # -- getters and setters -----------------------------------------------------------------
    def get_growth_factor(self) -> float:
        """Multiplier of the scale after ``growth_interval`` clean steps (1.0: it never grows)."""
        return 1.0

    def get_backoff_factor(self) -> float:
        """Multiplier of the scale after an overflow (1.0: it never backs off)."""
        return 1.0

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows."""
        return 2000

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (dynamic scalers only)."""
        self._fixed("set_growth_factor")

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (dynamic scalers only)."""
        self._fixed("set_backoff_factor")

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (dynamic scalers only)."""
        self._fixed("set_growth_interval")

    # -- serialization -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume (syncs): kind, hyper-parameters, scale state, counters.

        It also carries torch.amp.GradScaler's keys (``scale``, ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``_growth_tracker``), so
        ``torch.amp.GradScaler().load_state_dict(scaler.state_dict())`` works too.
        """
        numbers = self._state.to_numbers()  # (a disabled scaler's kept scale, not 1.0)
        return {"scale": float(numbers["scale"]), "growth_factor": self.get_growth_factor(),
                "backoff_factor": self.get_backoff_factor(),
                "growth_interval": self.get_growth_interval(),
                "_growth_tracker": int(numbers["growth_tracker"]),
                "kind": self._kind, "config": self._config_dict(), "state": numbers,
                "counters": dataclasses.asdict(self._counters)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict` (or, for a dynamic scaler, a ``torch.amp.GradScaler``'s).

        Raises:
            ValueError: a state_dict of another scaler kind, or missing/unknown keys.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict() takes a dict; got {type(state_dict).__name__}")
        if "kind" not in state_dict:
            return self._load_grad_scaler(state_dict)
        check_keys("state_dict", {k: v for k, v in state_dict.items() if k not in TORCH_KEYS},
                   ("kind", "config", "state", "counters"))
        if state_dict["kind"] != self._kind:
            raise ValueError(f"this state_dict is from a {state_dict['kind']!r} loss scaler; "
                             f"{type(self).__name__} loads only {self._kind!r} ones")
        check_keys("state_dict['state']", state_dict["state"],
                   tuple(f.name for f in dataclasses.fields(ScaleState)))
        check_keys("state_dict['counters']", state_dict["counters"],
                   tuple(f.name for f in dataclasses.fields(Counters)))
        positive_scale("state_dict['state']['scale']", state_dict["state"]["scale"])
        for name, value in state_dict["counters"].items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"state_dict['counters'][{name!r}] must be an integer >= 0; got "
                                 f"{value!r}")
        old_config = self._config_dict()
        self._load_config(state_dict["config"])  # validates before anything is assigned
        try:
            state = ScaleState.from_numbers(state_dict["state"], self._state.device)
            self._check_loaded_scale(float(state_dict["state"]["scale"]))
        except ValueError:
            self._load_config(old_config)
            raise
        self._state = state
        self._counters = Counters(**state_dict["counters"])
        self._stages.clear()

    def _check_loaded_scale(self, scale: float) -> None:
        """Refuse a loaded scale the config rules out (a dynamic one: outside its bounds)."""

    # -- hooks for the kinds of scaler -------------------------------------------------------
    def _config_dict(self) -> dict:
        return {}

    def _load_config(self, config: dict) -> None:
        check_keys("state_dict['config']", config, ())

    def _load_grad_scaler(self, state_dict: dict) -> None:
        raise ValueError(f"{type(self).__name__} cannot load a torch.amp.GradScaler state_dict "
                         f"(keys {sorted(state_dict)}); use DynamicLossScaler")

    def _fixed(self, what: str) -> None:
        raise ValueError(f"{type(self).__name__} has a fixed scale; {what}() needs a "
                         f"DynamicLossScaler")
