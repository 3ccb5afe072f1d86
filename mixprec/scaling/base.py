"""The loss-scaler shell shared by every scaler: per-optimizer stages, unscale/step/update,
counters, parameter names and serialization. The public scalers live in :mod:`mixprec.scaling`.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref

import torch
from torch import nn

from . import unscale as _grads
from .state import ScaleState, check_keys, positive_scale

__all__ = ["LossScaler"]

_SEQUENCE = ("the order per iteration is scale(loss).backward() -> [unscale_(opt)] -> step(opt) "
             "-> update()")


class _Stage(enum.Enum):
    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclasses.dataclass
class _OptimizerRecord:
    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None
    bad_params: list[str] | None = None  # set when this step reached the min-scale limit


@dataclasses.dataclass
class _Counters:
    skipped_steps: int = 0
    applied_steps: int = 0


class LossScaler:
    """Shared shell: per-optimizer stages, unscale/step/update, counters, names, serialization."""

    _kind = "none"
    _scales = False   # multiply the loss and unscale gradients
    _checks = False   # read the overflow flag in step() and skip on overflow

    def __init__(self):
        self._state = ScaleState.initial(1.0)
        self._counters = _Counters()
        self._records: dict[int, _OptimizerRecord] = {}
        self._modules: list[weakref.ref] = []
        self.process_group = None

    # -- public API ------------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """step() calls that skipped the optimizer because of inf/NaN gradients."""
        return self._counters.skipped_steps

    @property
    def applied_steps(self) -> int:
        """step() calls that ran the optimizer."""
        return self._counters.applied_steps

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a 0-d float32 tensor (no host sync)."""
        return self._state.scale

    def get_scale(self) -> float:
        """The current loss scale as a float (a host sync; 1.0 when not scaling)."""
        return float(self._state.scale.item()) if self._scales else 1.0

    def attach(self, *modules: nn.Module) -> "LossScaler":
        """Name parameters after these modules' ``named_parameters()`` in error messages.

        Parameters of a :class:`mixprec.MasterWeightOptimizer` are found through its
        ``model_param()`` mapping. Without an attached module, a parameter is named by its
        position, e.g. ``"param_groups[0][2] shape (16, 8)"``. Returns the scaler.
        """
        for m in modules:
            if not isinstance(m, nn.Module):
                raise TypeError(f"attach() takes nn.Module objects; got {type(m).__name__}")
            self._modules.append(weakref.ref(m))
        return self

    def scale(self, loss):
        """Multiply a loss (or a list/tuple of losses) by the current scale; no host sync.

        The scale state moves to the loss's device on first use.
        """
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(x) for x in loss)
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise TypeError(f"scale() takes a floating-point tensor (the loss) or a list/tuple of "
                            f"them; got {_describe(loss)}")
        if not self._scales:
            return loss
        if self._state.device != loss.device and not self._records:
            self._state = self._state.to(loss.device)
        return loss * self._state.scale.to(loss.device, non_blocking=True)

    def unscale_(self, optimizer) -> None:
        """Divide this optimizer's gradients by the scale in place and record inf/NaN; no host sync.

        Call it before clipping or inspecting gradients (at most once per optimizer per
        iteration); step() calls it when you did not. For a :class:`mixprec.MasterWeightOptimizer`
        it first calls ``optimizer.sync_grads()`` and then unscales the fp32 master gradients.
        Sparse gradients are coalesced first. ``None`` gradients are skipped. Gradients are
        unscaled in their own dtype: fp16 gradients of a plain optimizer may underflow again,
        which is why fp16 training wants a MasterWeightOptimizer (level O2).

        Raises:
            RuntimeError: unscale_() was already called on this optimizer, or step() was,
                since the last update().
        """
        _check_optimizer(optimizer)
        record = self._records.setdefault(id(optimizer), _OptimizerRecord())
        if record.stage is not _Stage.READY:
            what = "unscale_()" if record.stage is _Stage.UNSCALED else "step()"
            raise RuntimeError(f"unscale_() called on an optimizer after {what} since the last "
                               f"update(); {_SEQUENCE}")
        if _grads.is_master_optimizer(optimizer):
            optimizer.sync_grads()
        if self._scales:
            inv_scale = self._state.scale.double().reciprocal().float()
            record.found_inf = _grads.unscale_and_check_(optimizer.param_groups, inv_scale,
                                                         self._state.device)
        record.stage = _Stage.UNSCALED

    def step(self, optimizer, *args, **kwargs) -> bool:
        """Unscale (if not done yet) and step the optimizer unless its gradients hold inf/NaN.

        Under ``torch.distributed`` the overflow flag is first all-reduced (max) over
        ``process_group``, so every rank skips together. A skipped step leaves the parameters and
        all optimizer state untouched. A scaler that neither scales nor checks (``NoLossScaler``)
        does not unscale implicitly: a :class:`mixprec.MasterWeightOptimizer` then syncs (or,
        fused, reads) the model gradients in its own step. One host sync (reading the flag);
        one more on a step that overflowed. Extra arguments go to ``optimizer.step``.

        Returns:
            True when the optimizer stepped, False when the step was skipped.

        Raises:
            TypeError: a closure was passed (it would recompute gradients after the check).
            RuntimeError: step() was already called on this optimizer since the last update().
        """
        if kwargs.get("closure") is not None or any(callable(a) for a in args):
            raise TypeError("step() does not take a closure: it would recompute scaled gradients "
                            "after the inf/NaN check. Compute the loss, call "
                            "scaler.scale(loss).backward(), then scaler.step(optimizer); call "
                            "optimizer.step(closure) directly when not scaling")
        _check_optimizer(optimizer)
        record = self._records.get(id(optimizer))
        if record is not None and record.stage is _Stage.STEPPED:
            raise RuntimeError(f"step() has already been called on this optimizer since the last "
                               f"update(); {_SEQUENCE}")
        if record is None or record.stage is _Stage.READY:
            if self._scales or self._checks:
                self.unscale_(optimizer)
            else:  # nothing to unscale or check: the optimizer's step reads the gradients itself
                self._records[id(optimizer)] = _OptimizerRecord()
            record = self._records[id(optimizer)]
        record.stage = _Stage.STEPPED
        if self._checks and self._overflowed(record):
            self._counters.skipped_steps += 1
            if self._next_overflow_raises():
                record.bad_params = _grads.nonfinite_param_names(optimizer, self._param_names())
            return False
        optimizer.step(*args, **kwargs)
        self._counters.applied_steps += 1
        return True

    def update(self) -> None:
        """Adjust the scale from the steps since the last update() and start a new iteration.

        No host sync. Call it once per iteration, after step() on every optimizer; when any of
        them overflowed the scale backs off once.

        Raises:
            RuntimeError: no step() since the last update().
            NonFiniteGradientsError: gradients stayed non-finite at ``min_scale`` for
                ``max_skips_at_min`` steps in a row (dynamic scaling).
        """
        stepped = [r for r in self._records.values() if r.stage is _Stage.STEPPED]
        if not stepped:
            raise RuntimeError(f"update() called before any step() since the last update(); "
                               f"{_SEQUENCE}")
        self._records = {}
        flags = [r.found_inf for r in stepped if r.found_inf is not None]
        if self._checks and flags:
            self._state = self._adjust(torch.stack([f.to(self._state.device) for f in flags]).sum())
        bad = [r.bad_params for r in stepped if r.bad_params is not None]
        if bad:
            names = list(dict.fromkeys(n for names in bad for n in names))
            raise self._persistent_overflow_error(names)

    def state_dict(self) -> dict:
        """Everything needed to resume: kind, hyper-parameters, scale state and counters (syncs)."""
        return {"kind": self._kind, "config": self._config_dict(),
                "state": self._state.to_numbers(), "counters": dataclasses.asdict(self._counters)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict` (or, for a dynamic scaler, a ``torch.amp.GradScaler``'s).

        Raises:
            ValueError: a state_dict of another scaler kind, or missing/unknown keys.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict() takes a dict; got {type(state_dict).__name__}")
        if "_growth_tracker" in state_dict or not state_dict:
            return self._load_grad_scaler(state_dict)
        check_keys("state_dict", state_dict, ("kind", "config", "state", "counters"))
        if state_dict["kind"] != self._kind:
            raise ValueError(f"this state_dict is from a {state_dict['kind']!r} loss scaler; "
                             f"{type(self).__name__} loads only {self._kind!r} ones")
        check_keys("state_dict['state']", state_dict["state"],
                   tuple(f.name for f in dataclasses.fields(ScaleState)))
        check_keys("state_dict['counters']", state_dict["counters"],
                   tuple(f.name for f in dataclasses.fields(_Counters)))
        positive_scale("state_dict['state']['scale']", state_dict["state"]["scale"])
        self._load_config(state_dict["config"])  # validates before anything is assigned
        self._state = ScaleState.from_numbers(state_dict["state"], self._state.device)
        self._counters = _Counters(**state_dict["counters"])
        self._records = {}

    # -- hooks for subclasses ----------------------------------------------------------------
    def _adjust(self, found_inf: torch.Tensor) -> ScaleState:
        return self._state

    def _next_overflow_raises(self) -> bool:
        return False

    def _persistent_overflow_error(self, names: list[str]) -> RuntimeError:
        raise NotImplementedError

    def _config_dict(self) -> dict:
        return {}

    def _load_config(self, config: dict) -> None:
        check_keys("state_dict['config']", config, ())

    def _load_grad_scaler(self, state_dict: dict) -> None:
        raise ValueError(f"{type(self).__name__} cannot load a torch.amp.GradScaler state_dict "
                         f"(keys {sorted(state_dict)}); use DynamicLossScaler")

    # -- internals ---------------------------------------------------------------------------
    def _overflowed(self, record: _OptimizerRecord) -> bool:
        found = record.found_inf
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX,
                                         group=self.process_group)
        return bool(found.item())

    def _param_names(self) -> dict[int, str]:
        names = {}
        for ref in self._modules:
            module = ref()
            if module is not None:
                names.update({id(p): n for n, p in module.named_parameters()})
        return names

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config_dict().items())
        return f"{type(self).__name__}({args})"


def _check_optimizer(optimizer) -> None:
    if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
        raise TypeError(f"expected a torch.optim.Optimizer (or MasterWeightOptimizer); "
                        f"got {_describe(optimizer)}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of {x.dtype}"
    return f"{type(x).__name__} {x!r}"
