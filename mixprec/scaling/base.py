"""The loss-scaler shell every scaler shares: scale, unscale/clip/step/update over the
per-optimizer stages (:mod:`mixprec.scaling.records`), and parameter names in error messages;
torch.amp's getters, setters and state_dict come from :mod:`mixprec.scaling.gradscaler`. The
public scalers live in :mod:`mixprec.scaling.scalers`.

Two kinds of optimizer are driven:

* a plain torch optimizer: its gradients are in ``param_groups``; the scaler unscales them in
  place (one fused pass that also checks for inf/NaN) and calls ``step()``;
* an optimizer that owns the gradients its step reads (:class:`mixprec.MasterWeightOptimizer`;
  the protocol in :mod:`mixprec.scaling.protocol`): the scaler checks the gradients it reads
  and passes the factor they still carry as ``step(grad_scale=...)`` (and, where it skips on
  the device, the overflow flag as ``found_inf``); ``unscale_`` asks for fp32 gradients.

``unscale_``, ``clip_grad_norm_``, ``step`` and ``update`` run eagerly inside a function compiled
with ``torch.compile`` (``torch._disable_dynamo``): the same bits as the function run eagerly.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch
from torch import nn

from ..callsite import user_stacklevel
from ..dtypes import is_low_precision
from ..shards import local as _local
from ..shards import replicated as _replicated
from . import args as checks
from . import unscale as passes
from .gradscaler import GradScalerInterface
from .protocol import owns_gradients
from .records import (
    SEQUENCE,
    Counters,
    OptimizerRecord,
    QueuedStep,
    Stage,
    StageBook,
    check_not_stepped,
)
from .state import ScaleState
from .windows import Windows, unchanged, versions

__all__ = ["LossScaler", "owns_gradients"]


class LossScaler(GradScalerInterface):
    """Shared shell: per-optimizer stages, unscale/clip/step/update, counters, serialization."""

    _kind = "none"
    _scales = False   # multiply the loss and unscale gradients
    _checks = False   # read the overflow flag in step() and skip on overflow

    def __init__(self):
        self._state = ScaleState.initial(1.0)
        self._carried: torch.Tensor | None = None  # the scale the last scaled loss carried
        self._scaled = 0  # losses scaled so far (a backward between unscale_ and step: refused)
        self._handled: dict[int, int] = {}  # id(optimizer) -> losses scaled when this scaler
        # last unscaled or stepped its gradients: see .direct
        self._windows = Windows()  # open accumulation windows, records kept across updates
        self._stepping = None  # the optimizer this scaler is stepping
        self._resumed = False  # a state loaded: gradients of its run may carry its scale
        self._counters = Counters()
        self._stages = StageBook()
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

    def stage_of(self, optimizer) -> str:
        """Where ``optimizer`` is in this iteration: ``"ready"``, ``"unscaled"`` (its gradients
        read as the true ones), ``"folded"`` (a clip is folded into its step's unscaling) or
        ``"stepped"``."""
        record = self._record(optimizer)
        if record is None:
            return Stage.READY.value
        if record.stage is Stage.UNSCALED and record.grad_scale is not None:
            return "folded"
        return record.stage.value

    def carried_factor(self, optimizer) -> torch.Tensor | None:
        """The factor ``optimizer``'s gradients still carry before its step, as a 0-d tensor (no
        host sync): the loss scale while ``"ready"`` (when scaling), the scale over the clip
        coefficient once a clip is ``"folded"``; None when they read as the true ones."""
        record = self._record(optimizer)
        if record is None or record.stage is Stage.READY:
            return self._grads_scale(optimizer) if self._scales else None
        return record.grad_scale if record.stage is Stage.UNSCALED else None

    def carried_scale(self, optimizer) -> torch.Tensor | None:
        """The loss scale ``optimizer``'s gradients hold as the backward left them (no host
        sync): the scale while ``"ready"`` or ``"folded"`` (a folded clip changes no gradient),
        None once they were unscaled."""
        if self.stage_of(optimizer) in ("ready", "folded") and self._scales:
            return self._grads_scale(optimizer)
        return None

    def settle_(self, optimizer) -> None:
        """Apply a clip folded into an owner's step now, with the step's arithmetic: its fp32
        gradients (and the model's, rounded) read as the clipped true ones the step uses."""
        record = self._record(optimizer)
        if record is not None and record.stage is Stage.UNSCALED and record.grad_scale is not None:
            settle = getattr(optimizer, "settle_grads_", None)  # as its step would divide
            if callable(settle):
                settle(record.grad_scale)
            else:
                optimizer.unscale_grads_(record.grad_scale.reciprocal())
            record.grad_scale = None
            self._handled_now(optimizer)

    def is_enabled(self) -> bool:
        """True when this scaler multiplies the loss (torch.amp's ``GradScaler.is_enabled``)."""
        return self._scales

    def attach(self, *modules: nn.Module) -> LossScaler:
        """Name parameters after these modules' ``named_parameters()`` in error messages.

        Without an attached module, a parameter is named by its position, e.g.
        ``"param_groups[0][2] shape (16, 8)"``. Returns the scaler.
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
                            f"them; got {checks.describe(loss)}")
        self._windows.settle_kept(self._stages)
        if not self._scales:  # (counted still: a backward after unscale_ or a clip)
            self._scaled += 1
            return loss
        if self._state.device != loss.device and not self._stages:
            self._state = self._state.to(loss.device)
        self._windows.rescale_open(self._state.scale)  # (before its backward adds to them)
        self._carried = self._state.scale  # (a scale update makes a new tensor)
        self._scaled += 1
        return loss * self._state.scale.to(loss.device, non_blocking=True)

    @torch._disable_dynamo
    def unscale_(self, optimizer) -> None:
        """Divide this optimizer's gradients by the scale and record inf/NaN; no host sync.

        Call it before clipping or inspecting gradients by hand (at most once per optimizer
        per iteration); ``step()`` does the work itself when you did not. For a plain optimizer
        the gradients in ``param_groups`` are unscaled in place, in their own dtype (fp16
        gradients of a plain optimizer may underflow again, which is why fp16 training wants
        master weights, level O2). For a :class:`mixprec.MasterWeightOptimizer` it makes
        unscaled fp32 gradients for the masters (``unscale_grads_``): clip the optimizer's
        parameters then, not ``model.parameters()`` -- or use :meth:`clip_grad_norm_`, which
        needs no fp32 gradients at all. ``None`` gradients are skipped; sparse gradients are
        coalesced first.

        Raises:
            RuntimeError: unscale_() or clip_grad_norm_() was already called on this
                optimizer, or step() was, since the last update().
        """
        self._check_scaled("unscale_()")  # (step() and clip_grad_norm_() check on entry)
        record = self._ready_record(optimizer, "unscale_()")
        inv_scale = self._inv_scale(optimizer) if self._scales else None
        if owns_gradients(optimizer):
            found = optimizer.unscale_grads_(inv_scale)
            record.found_inf = _local(found).to(self._state.device) if self._checks else None
        elif self._scales or self._checks:  # unscaled in place, or (no scale) checked
            record.found_inf = _local(passes.unscale_and_check_(optimizer.param_groups,
                                                                inv_scale, self._state.device))
        record.stage, record.scaled = Stage.UNSCALED, self._scaled
        self._handled_now(optimizer)

    @torch._disable_dynamo
    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the true (unscaled) gradients the step will use to ``max_norm``; return their norm.

        Unscales first if ``unscale_`` was not called. For an optimizer that owns its gradients
        (mixprec's) with none unscaled yet, the norm is measured on the model's gradients and the
        clip folded into the step's unscaling (one read, no fp32 copy). Otherwise the gradients
        the step reads are clipped in place as ``torch.nn.utils.clip_grad_norm_`` does (a compact
        optimizer's fp32 copies of fp16 gradients included). An inf/NaN gradient makes the norm
        non-finite (the step is then skipped when this scaler checks). No host sync.

        Args:
            optimizer: the optimizer whose gradients to clip.
            max_norm: the largest total norm allowed (positive, finite).
            norm_type: the p of the p-norm (``float("inf")`` for the max norm).

        Returns:
            The total norm of the unscaled gradients before clipping (a 0-d float32 tensor).

        Raises:
            ValueError: a bad ``max_norm`` or ``norm_type``.
            RuntimeError: called twice, or after step(), in one iteration.
        """
        checks.check_clip_args(max_norm, norm_type)
        self._check_scaled("clip_grad_norm_()")
        record, owner = self._record(optimizer), owns_gradients(optimizer)
        if record is not None and record.stage is not Stage.READY:
            check_not_stepped(record, "clip_grad_norm_()")
            self._check_no_backward_since(record, "clip_grad_norm_()", optimizer)
        elif owner and not _has_pre_hooks(optimizer):  # (a pre-hook reads true gradients)
            return self._fold_clip(optimizer, max_norm, norm_type)
        else:
            self.unscale_(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return torch.zeros((), dtype=torch.float32, device=self._state.device)
        ids, step = {id(p) for p in params}, optimizer.grads_for_step() if owner else []
        if any(id(p) in ids and g is not p.grad for p, g in step):  # a compact one's fp32 copies
            return passes.clip_norm_([g for _, g in step], max_norm, norm_type)
        if any(is_low_precision(p.grad) for p in params):  # (the norm accumulated in fp32)
            return passes.clip_norm_([p.grad for p in params], max_norm, norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    @torch._disable_dynamo
    def step(self, optimizer, *args, **kwargs) -> bool:
        """Step the optimizer with the unscaled gradients, unless they hold inf/NaN.

        Under ``torch.distributed`` the overflow flag is first all-reduced (max) over
        ``process_group``, so every rank skips together. A skipped step leaves the parameters
        and all optimizer state untouched. Extra arguments go to ``optimizer.step``.

        Host syncs: none when this scaler does not check. An optimizer that skips on the device
        (``skips_on_device()``: a master optimizer on torch's fused kernels; a torch optimizer
        built with ``fused=True``, its state made, no step hooks:
        :func:`~mixprec.scaling.args.torch_skips_on_device`) gets the flag with its step, as
        ``torch.amp.GradScaler`` hands it to a fused optimizer, and the flag is read once, after
        the step is queued; any other optimizer reads it before its step. One more read on a
        step that overflowed.

        Returns:
            True when the optimizer stepped, False when the step was skipped.

        Raises:
            TypeError: a closure was passed to a scaler that scales or checks (it would
                recompute gradients after the check; one that does neither, ``NoLossScaler()``
                or ``enabled=False``, steps with it, as a disabled ``torch.amp.GradScaler``).
            RuntimeError: step() was already called on this optimizer since the last update().
        """
        return self.read_step(self.queue_step(optimizer, *args, **kwargs), updated=False)

    def queue_step(self, optimizer, *args, **kwargs) -> QueuedStep:
        """:meth:`step` up to the read of the flag; :meth:`read_step` reads it (after
        :meth:`update`, the scale update is queued before the read too: ``MixedPrecision.step``)."""
        if (self._scales or self._checks) and (kwargs.get("closure") is not None
                                               or any(callable(a) for a in args)):
            raise TypeError("step() does not take a closure: it would recompute scaled gradients "
                            "after the inf/NaN check. Compute the loss, call "
                            "scaler.scale(loss).backward(), then scaler.step(optimizer); call "
                            "optimizer.step(closure) directly when not scaling")
        checks.check_optimizer(optimizer)
        self._check_scaled("step()")
        record = self._record(optimizer)
        if record is not None and record.stage is Stage.STEPPED:
            raise RuntimeError(f"step() has already been called on this optimizer since the last "
                               f"update(); {SEQUENCE}")
        owner = owns_gradients(optimizer)
        if record is None or record.stage is Stage.READY:
            record = self._prepare_step(optimizer, owner)
        else:
            self._check_no_backward_since(record, "step()", optimizer)
        record.stage = Stage.STEPPED
        self._handled_now(optimizer)
        queued = QueuedStep(optimizer, record, owner)
        flag = record.found_inf if self._checks else None
        if flag is not None:
            flag = record.found_inf = self._reduced(flag)
            if owner and checks.skips_on_device(optimizer):  # no read: the kernels skip
                self._step(optimizer, args, dict(kwargs, grad_scale=record.grad_scale,
                                                 found_inf=flag))
                queued.flag = flag
                return queued
            if not owner and checks.torch_skips_on_device(optimizer):  # (GradScaler's way)
                optimizer.found_inf = flag  # (the gradients are unscaled: no grad_scale)
                try:
                    self._step(optimizer, args, kwargs)
                finally:
                    del optimizer.found_inf
                queued.flag = flag
                return queued
            if bool(flag.item()):
                self._count_skip(queued, updated=False)
                queued.stepped = False
                return queued
        self._step(optimizer, args,
                   dict(kwargs, grad_scale=record.grad_scale) if owner else kwargs)
        self._counters.applied_steps += 1
        queued.stepped = True
        return queued

    def _step(self, optimizer, args: tuple, kwargs: dict) -> None:
        self._stepping = optimizer  # (not a direct step: .direct)
        try:
            optimizer.step(*args, **kwargs)
        finally:
            self._stepping = None

    def direct_step_problem(self, optimizer) -> bool:
        """Whether ``optimizer.step()`` called now, not through this scaler, would read
        gradients that carry the loss scale (no host sync): a loss was scaled since this scaler
        last unscaled or stepped them (a clip folded into the step unscales nothing). Only
        under a loss scale (bf16 has none)."""
        if not self._scales or optimizer is self._stepping:
            return False
        return self._scaled > self._handled.get(id(optimizer), 0)

    @property
    def losses_scaled(self) -> int:
        """How many losses :meth:`scale` has scaled (a backward each, as a rule)."""
        return self._scaled

    def read_step(self, queued: QueuedStep, updated: bool = True) -> bool:
        """Whether the step ``queued`` (from :meth:`queue_step`) was applied; reads the flag when
        the optimizer skips on the device (a host sync). ``updated``: :meth:`update` ran.

        Raises:
            NonFiniteGradientsError: with ``updated``, gradients stayed non-finite at
                ``min_scale`` for ``max_skips_at_min`` steps in a row (without it,
                :meth:`update` raises).
        """
        if queued.stepped is not None:
            return queued.stepped
        queued.stepped = not bool(queued.flag.item())
        if queued.stepped:
            self._counters.applied_steps += 1
        else:
            self._count_skip(queued, updated)
        return queued.stepped

    def _count_skip(self, queued: QueuedStep, updated: bool) -> None:
        self._counters.skipped_steps += 1
        opt = queued.optimizer
        raises = self._next_overflow_raises(updated)
        first = self._counters.skipped_steps == 1 and self._warns_on_first_skip
        if raises or first:
            names = passes.nonfinite_param_names(checks.grad_pairs(opt, queued.owner),
                                                 checks.param_names(opt, self._modules))
            if raises and updated:
                raise self._persistent_overflow_error(names)
            if raises:
                queued.record.bad_params = names
            elif first:
                warnings.warn(self._first_skip_message(names), RuntimeWarning,
                              stacklevel=user_stacklevel())
        if queued.owner:
            opt.drop_master_grads()

    @torch._disable_dynamo
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Adjust the scale from the steps since the last update() and start a new iteration.

        No host sync. Call it once per iteration, after step() on every optimizer; when any of
        them overflowed the scale backs off once.

        Args:
            new_scale: set the scale to this value instead (torch.amp's ``update(new_scale)``;
                a positive number or a 1-element tensor; within ``[min_scale, max_scale]`` for
                a dynamic scaler).

        Raises:
            RuntimeError: no step() since the last update() (unless ``new_scale`` is given).
            ValueError: a bad ``new_scale``.
            NonFiniteGradientsError: gradients stayed non-finite at ``min_scale`` for
                ``max_skips_at_min`` steps in a row (dynamic scaling).
        """
        if new_scale is not None:  # as torch.amp: an explicit scale needs no step first
            value = checks.as_number(new_scale, "new_scale")
            self._windows.record_open(self._handled, self._scaled, self._grads_scale)
            self._set_scale(value)
            self._end_iteration()
            return
        stepped = self._stages.stepped()
        if not stepped:
            raise RuntimeError(f"update() called before any step() since the last update(); "
                               f"{SEQUENCE}")
        self._end_iteration()
        flags = [r.found_inf for r in stepped if r.found_inf is not None]
        if self._checks and flags:
            found = (flags[0] if len(flags) == 1
                     else torch.stack([f.to(self._state.device) for f in flags]).amax())
            self._windows.record_open(self._handled, self._scaled, self._grads_scale)
            self._state = self._adjust(found)
        bad = [r.bad_params for r in stepped if r.bad_params is not None]
        if bad:
            names = list(dict.fromkeys(n for names in bad for n in names))
            raise self._persistent_overflow_error(names)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._repr_fields().items())
        return f"{type(self).__name__}({args})"

    # -- hooks for subclasses ----------------------------------------------------------------
    def _adjust(self, found_inf: torch.Tensor) -> ScaleState:
        """The state after a step's overflow flag: a fixed scale (or none) counts skips in a
        row, which no change of scale can fix (a dynamic scaler adjusts its scale instead)."""
        found = found_inf.to(self._state.device) > 0
        return dataclasses.replace(self._state, skips_at_min=(self._state.skips_at_min + 1) * found)

    def _next_overflow_raises(self, updated: bool = False) -> bool:
        """Whether this overflow reaches the limit of skips in a row that the scale cannot fix
        (``updated``: the scale update counted it; one host read)."""
        limit = self._skip_limit()
        if limit is None or not self._checks:
            return False
        if updated:  # the update counted this overflow: at min_scale it added a skip
            return int(self._state.skips_at_min.item()) >= limit
        at_min, skips = torch.stack([self._at_min().int(), self._state.skips_at_min]).tolist()
        return bool(at_min) and skips + 1 >= limit

    def _skip_limit(self) -> int | None:
        """Overflowing steps in a row at the lowest scale before an error (None: never)."""
        return None

    def _at_min(self) -> torch.Tensor:
        """A 0-d bool tensor: the scale cannot back off any further."""
        return torch.ones((), dtype=torch.bool, device=self._state.device)

    _warns_on_first_skip = False
    _unit = False  # a fixed scale of 1: gradients of a plain backward divide by it harmlessly

    def _first_skip_message(self, names: list[str]) -> str:
        raise NotImplementedError

    def _persistent_overflow_error(self, names: list[str]) -> RuntimeError:
        raise NotImplementedError

    def _repr_fields(self) -> dict:
        return self._config_dict()

    def _set_scale(self, new_scale: float) -> None:
        if new_scale != 1.0:
            raise ValueError(f"{type(self).__name__} does not scale the loss; update(new_scale) "
                             f"takes only 1.0 here, got {new_scale!r}")

    # -- internals ---------------------------------------------------------------------------
    def _grads_scale(self, optimizer=None) -> torch.Tensor:
        """The scale ``optimizer``'s gradients carry: the one an update() inside its window
        recorded (:mod:`.windows`), else the one the last scaled loss was multiplied by (two
        ``amp.step`` calls after one backward: the first call's update must not change what
        the second unscales by), else the current one."""
        carried = self._windows.carried(optimizer)
        carried = self._carried if carried is None else carried
        return self._state.scale if carried is None else carried.to(self._state.device)

    def _inv_scale(self, optimizer=None) -> torch.Tensor:
        return self._grads_scale(optimizer).double().reciprocal().float()

    def _handled_now(self, optimizer) -> None:
        """``optimizer``'s gradients were unscaled, stepped or settled: they carry no scale of
        this scaler's any more (its accumulation window is closed)."""
        self._handled[id(optimizer)] = self._scaled
        self._windows.handled(optimizer)

    def _end_iteration(self) -> None:
        """The records go, but an optimizer unscaled or clipped and not yet stepped keeps its
        own until its step (:meth:`.windows.Windows.end_iteration`)."""
        self._windows.end_iteration(self._stages, self._scaled)

    def _record(self, optimizer):
        """``optimizer``'s record in this iteration, or None (one kept across an update ends
        where its gradients changed: :meth:`.windows.Windows.record`)."""
        return self._windows.record(self._stages, optimizer, self._scaled)

    def _ready_record(self, optimizer, what: str) -> OptimizerRecord:
        checks.check_optimizer(optimizer)
        self._record(optimizer)  # (a kept record whose gradients changed ends here)
        return self._stages.ready(optimizer, what)

    def _check_scaled(self, what: str) -> None:
        """Refuse ``what`` from a scaler that never scaled a loss nor loaded a state (as
        ``torch.amp.GradScaler`` refuses it): the gradients carry no scale to divide by."""
        if self._scales and not self._scaled and not self._resumed and not self._unit:
            raise RuntimeError(
                f"{what} before any scaler.scale(loss): the gradients carry no loss scale, and "
                f"unscaling them would divide them by {self.get_scale():g}. Write "
                f"scaler.scale(loss).backward() instead of loss.backward(), then "
                f"scaler.step(optimizer) and scaler.update()")

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._resumed = True

    def _prepare_step(self, optimizer, owner: bool) -> OptimizerRecord:
        """A READY optimizer about to step: unscale (plain, or an owner whose step pre-hooks
        read gradients, as with torch's GradScaler) or check (owner) its gradients."""
        if not owner or _has_pre_hooks(optimizer):
            if self._scales or self._checks:
                self.unscale_(optimizer)
            return self._stages.ensure(optimizer)
        record = self._ready_record(optimizer, "step()")
        if self._checks:
            grads = [g for _, g in optimizer.grads_for_step()]
            record.found_inf = _local(passes.found_nonfinite(grads, self._state.device))
        if self._scales:
            record.grad_scale = self._grads_scale(optimizer)
        return record

    def _fold_clip(self, optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip an owner's gradients by folding the clip factor into the step's grad_scale."""
        record = self._ready_record(optimizer, "clip_grad_norm_()")
        grads = [g for _, g in optimizer.grads_for_step()]
        total = _replicated(passes.total_norm(grads, norm_type, self._state.device))
        carried = self._grads_scale(optimizer) if self._scales else torch.ones_like(total)
        total = total / carried
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        record.grad_scale = carried / coef
        if self._checks:
            record.found_inf = (~torch.isfinite(total)).float()
        record.stage, record.scaled = Stage.UNSCALED, self._scaled
        record.folded_on = None if self._scales else versions(grads)
        self._windows.known.add(optimizer)  # (an update before its step keeps the clip)
        return total

    def _check_no_backward_since(self, record: OptimizerRecord, what: str, optimizer) -> None:
        """A loss scaled (a backward) after this optimizer's gradients were unscaled or a clip
        applied: with a loss scale the sum is neither scaled nor true, and a clip folded into
        the step would clip it with the earlier gradients' factor: refused. Without (bf16), the
        sum is the true gradients: checked for inf/NaN again, an owner's fp32 gradients made of
        it (else the step took the sum unchecked, and a compact optimizer clipped it in bf16)."""
        if record.stage is not Stage.UNSCALED or record.scaled == self._scaled:
            return
        owner = owns_gradients(optimizer)
        if (not self._scales and record.grad_scale is not None and record.folded_on is not None
                and unchanged(record.folded_on, [g for _, g in optimizer.grads_for_step()])):
            return  # (a loss scaled with no backward: a logged value)
        if self._scales or record.grad_scale is not None:
            why = ("the new gradients carry the loss scale, the earlier ones do not, and their "
                   "sum is neither" if self._scales else "the clip was folded into the step, "
                   "with the factor of the gradients before that backward")
            raise RuntimeError(
                f"{what} after a backward that followed unscale_() or clip_grad_norm_() on this "
                f"optimizer: {why}. Unscale or clip once per iteration, after the last "
                "backward (with gradient accumulation: after the last micro-batch, e.g. when "
                f"accelerator.sync_gradients is True); {SEQUENCE}")
        refresh = getattr(optimizer, "refresh_grads_", None) if owner else None
        if callable(refresh):  # (a compact optimizer's fp32 copies of the changed gradients)
            refresh()
        if self._checks and record.found_inf is not None:
            grads = ([g for _, g in optimizer.grads_for_step()] if owner else
                     [p.grad for g in optimizer.param_groups for p in g["params"]
                      if p.grad is not None])
            found = _local(passes.found_nonfinite(grads, self._state.device))
            record.found_inf = torch.maximum(record.found_inf, found.to(record.found_inf.device))
        record.scaled = self._scaled

    def recheck_(self, optimizer, what: str) -> None:
        """:meth:`_check_no_backward_since` for ``optimizer`` (the engine's value clip)."""
        record = self._record(optimizer)
        if record is not None:
            self._check_no_backward_since(record, what, optimizer)

    def _reduced(self, found: torch.Tensor) -> torch.Tensor:
        """The overflow flag of every rank (max over ``process_group``; no host read)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX,
                                         group=self.process_group)
        return found


def _has_pre_hooks(optimizer) -> bool:
    """Whether step pre-hooks will run in ``optimizer``'s step (they read true gradients)."""
    hooked = getattr(optimizer, "has_step_pre_hooks", None)
    return hooked is not None and hooked()
