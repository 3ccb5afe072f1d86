"""``mp.MixedPrecision``: one object that owns a precision run, for any training loop.

It holds the :class:`~mixprec.Policy`, prepares models and optimizers for it, owns the loss
scaler, and runs the step in the one order mixprec uses everywhere (its ``Trainer``, the apex
compatibility layer, the Lightning and Hugging Face integrations):

1. ``backward(loss)``: scale the loss (fp16's dynamic scale; 1 for bf16) and backpropagate;
2. ``step(*optimizers)``: for each optimizer, check the gradients the step will read for
   inf/NaN (unscaling them into the fp32 masters, or folding the scale into the step), clip the
   true gradients to ``max_grad_norm``, then step it, or skip it when its gradients overflowed
   (weights and optimizer state untouched); then update the scale once, and return whether
   every optimizer stepped (a scheduler steps only then).

``state_dict()`` carries the policy and the scaler, so a checkpoint restores the run exactly and
a checkpoint made under another policy is refused. Inside a function compiled with
``torch.compile``, the steps, unscales and clips run eagerly (``torch._disable_dynamo``, as
torch's own ``Optimizer.zero_grad`` and ``state_dict``): the same bits as the function run eagerly.

Example:
    >>> import torch, mixprec as mp
    >>> model = torch.nn.Linear(4, 2)
    >>> amp = mp.MixedPrecision(level="O2", dtype="bf16")
    >>> model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> amp.backward(model(torch.randn(8, 4)).float().pow(2).mean())
    >>> amp.step(opt, max_grad_norm=1.0)
    True
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from . import hardware, lowbit, prepare_checks, vocabulary
from .engine_checks import (
    StepOrder,
    check_masters,
    check_max_norm,
    check_monitor,
    check_policy,
    positive_finite,
    same_apart_from_marks,
)
from .engine_parallel import check_not_wrapped, check_owned
from .fp8.choice import split_spec, with_modules
from .optim.compact_state import show_held
from .optim.params import show_master_grads
from .policy import Policy
from .prepare import module_device, policy_of, prepare_many, resolve_policy
from .recompute import recompute_hint
from .scaling import LossScaler, make_loss_scaler, owns_gradients
from .scaling.args import check_clip_args, check_optimizer
from .scaling.direct import watch as refuse_direct_steps
from .scaling.gradscaler import TORCH_KEYS
from .scaling.state import skip_limit
from .scaling.unscale import clip_value_, total_norm
from .shards import replicated

__all__ = ["MixedPrecision", "check_max_norm", "engine_for"]


@vocabulary.takes(*vocabulary.PRECISION, *vocabulary.LOOP, *vocabulary.EMULATION, notes={
    "dtype": 'Here "auto" is resolved on the first model :meth:`setup` is given.'})
class MixedPrecision:
    """A precision run: the policy, model preparation, the loss scaler and the step order.

    Args:
        {precision keywords}

    Attributes:
        policy: the resolved :class:`mixprec.Policy` (None until ``dtype="auto"`` is resolved
            by the first :meth:`setup`); ``mp.policy_of(model)`` adds a prepared model's
            ``to_float`` marks as overrides.
        scaler: the loss scaler.
        models: the models :meth:`setup` (or :meth:`adopt`) prepared, in order.

    Raises:
        ValueError, TypeError: a bad level, dtype, loss-scale spec or policy.

    Example:
        A loop of your own: ``setup`` prepares the model and wraps the optimizer (fp32 masters
        at O2), ``backward`` scales the loss, ``step`` checks, clips and steps or skips.

        >>> import torch, mixprec as mp
        >>> amp = mp.MixedPrecision(level="O2", dtype="bf16")
        >>> net = torch.nn.Linear(4, 2)
        >>> net, opt = amp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        >>> for _ in range(3):
        ...     amp.backward(net(torch.randn(8, 4)).float().pow(2).mean())
        ...     applied = amp.step(opt, max_grad_norm=1.0)   # False: skipped (inf/NaN)
        ...     opt.zero_grad()
        >>> amp.policy.level, amp.models == [net], applied
        ('O2', True, True)
    """

    def __init__(self, level: str = vocabulary.LEVEL, dtype: Any = vocabulary.DTYPE,
                 loss_scale: Any = "auto", policy: Policy | None = None, *,
                 keep_fp32=None, low_precision_ops=(),
                 fp32_ops=(), emulate_fp16="auto", master: str | None = None, state_dtype=None,
                 fp8: str | None = None, fp8_modules=None, monitor=None,
                 max_consecutive_skips: int | None = 8):
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be a mixprec.Policy; got {type(policy).__name__}")
        vocabulary.check_policy_alone(policy, level, dtype, "MixedPrecision")
        keep_fp32, low_precision_ops, fp32_ops = prepare_checks.check_keywords(
            keep_fp32, low_precision_ops, fp32_ops, emulate_fp16)
        if policy is None:
            Policy.from_level(level, dtype, warn=False)  # validate now, resolve on a device later
        self._fp8 = lowbit.resolve(fp8)  # the low-bit format, validated now
        self._fp8_names, self._fp8_filter = split_spec(fp8 or getattr(policy, "fp8", None),
                                                       fp8_modules)
        self._level, self._dtype, self._keep = level, dtype, keep_fp32
        self._compact = {"master": master, "state_dtype": state_dtype}
        self._ops = dict(low_precision_ops=low_precision_ops, fp32_ops=fp32_ops,
                         emulate_fp16=emulate_fp16)
        self._loss_scale = loss_scale
        self._skips = skip_limit("max_consecutive_skips", max_consecutive_skips)
        self.policy: Policy | None = None
        self.scaler: LossScaler | None = None
        self._given = policy
        if policy is not None or not (isinstance(dtype, str) and dtype.lower() == "auto"):
            self._resolve(None)
        else:
            self._check_for_some_dtype()
        self.models: list[nn.Module] = []
        self.monitor = check_monitor(monitor)
        self._owned: weakref.WeakSet = weakref.WeakSet()  # optimizers checked by _check_owned
        self._order = StepOrder()  # amp.backward calls, and what each optimizer last stepped

    def __repr__(self) -> str:
        return f"MixedPrecision({self.policy or self._level}, scaler={self.scaler!r})"

    def __getstate__(self) -> dict:  # pickled to spawned ranks (Lightning's "ddp_spawn"):
        return {**self.__dict__, "_owned": None}  # a WeakSet does not pickle

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._owned = weakref.WeakSet()

    def _check_for_some_dtype(self) -> None:
        """With ``dtype="auto"`` (resolved on the model's device at ``setup``): refuse now the
        options no dtype could take (an unknown master or loss scale), with the error the
        first dtype tried gives."""
        errors = []
        for probe in ("bf16", "fp16", "fp32"):
            try:
                policy = resolve_policy(self._level, probe, self._keep, None, None, warn=False,
                                        fp8=self._fp8, fp8_modules=self._fp8_names,
                                        **self._compact)
                make_loss_scaler(self._loss_scale, dtype=policy, max_consecutive_skips=self._skips)
                return
            except (TypeError, ValueError) as error:
                errors.append(error)
        raise errors[0]

    def _resolve(self, device) -> Policy:
        if self.policy is None:
            policy = resolve_policy(self._level, self._dtype, self._keep, self._given, device,
                                    warn=device is not None, fp8=self._fp8,
                                    fp8_modules=self._fp8_names, **self._compact)
            self.scaler = make_loss_scaler(self._loss_scale, dtype=policy,
                                           max_consecutive_skips=self._skips)
            self.policy = policy
        elif device is not None:
            hardware.warn_if_slow(self.policy.compute_dtype, device)
        return self.policy

    # -- set-up --------------------------------------------------------------------------------
    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer):
        """Prepare ``model`` and its optimizers for the policy (see :func:`mixprec.prepare`).

        Call it once per model (a GAN: once for each network, sharing this engine's scaler).
        Several optimizers over one model must hold disjoint parameters; at a master-weight
        policy each comes back wrapped in a :class:`mixprec.MasterWeightOptimizer`.

        Returns:
            ``model`` alone, ``(model, optimizer)``, or ``(model, opt1, opt2, ...)``.

        Raises:
            TypeError: not an ``nn.Module``, a bad optimizer, or a model already in
                ``DistributedDataParallel``.
            RuntimeError: the model was already prepared, or sharded with ``fully_shard`` at a
                level that stores the weights in 16 bits or keeps fp32 masters (O2, O3).
            ValueError: what :func:`mixprec.prepare` refuses.

        Several processes: wrap the model it returns in ``mp.parallel.ddp`` (or torch's DDP);
        FSDP2: ``mp.parallel.fsdp(model, opt, mixed_precision=amp)`` instead of ``setup``.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"setup expects an nn.Module as model; got {type(model).__name__}")
        policy = self._resolve(module_device(model))
        check_not_wrapped(model, policy)
        model, opts = prepare_many(model, list(optimizers), policy, fp8_filter=self._fp8_filter,
                                   **self._ops)
        self.adopt(model)
        for opt in opts:
            self.watch_direct_steps(opt)
        return model if not opts else (model, *opts)

    def watch_direct_steps(self, optimizer) -> None:
        """Refuse ``optimizer.step()`` called directly (not through :meth:`step`) on gradients
        that carry the loss scale, or on the very gradients this engine's last step of it read
        (an update applied twice); :meth:`setup` does this for the optimizers it returns."""
        refuse_direct_steps(optimizer, self.scaler, self._order)

    def adopt(self, model: nn.Module) -> None:
        """Take a model prepared elsewhere (a strategy's ``prepare``) into this run: its
        parameters are named in the scaler's error messages and its policy is recorded."""
        prepared = policy_of(model)
        if prepared is None:
            raise ValueError("adopt() takes a model prepared for this run's policy; this one was "
                             "not prepared (use setup())")
        if self.policy is not None and not same_apart_from_marks(prepared, self.policy):
            raise ValueError(f"this model was prepared with {prepared}, not with this run's "
                             f"{self.policy}")
        if self.policy is None:
            self.policy = prepared
        if self.scaler is None:
            self.scaler = make_loss_scaler(self._loss_scale, dtype=prepared,
                                           max_consecutive_skips=self._skips)
        self.scaler.attach(model)
        self.models.append(model)
        if self.monitor is not None:
            self.monitor.watch(model, self)

    @property
    def op_lists(self) -> dict:
        """The autocast options models are prepared with: ``low_precision_ops``, ``fp32_ops``
        and ``emulate_fp16`` (what a strategy passes to its ``prepare``)."""
        return dict(self._ops)

    def policy_on(self, device) -> Policy:
        """The run's policy, or, before ``dtype="auto"`` is resolved, the one it resolves to on
        ``device``, without resolving it (:meth:`setup` still resolves on the model's device)
        and without a warning."""
        if self.policy is not None:
            return self.policy
        return resolve_policy(self._level, self._dtype, self._keep, self._given, device,
                              warn=False, fp8=self._fp8, fp8_modules=self._fp8_names,
                              **self._compact)

    def resolve_policy(self, device, model: nn.Module | None = None) -> Policy:
        """The run's policy, resolving ``dtype="auto"`` on ``device`` (what a strategy
        prepares the model with); with ``model``, its FP8 layers chosen by name for it."""
        policy = self._resolve(device)
        return policy if model is None else with_modules(policy, model, self._fp8_filter)

    # -- the step --------------------------------------------------------------------------------
    @torch._disable_dynamo  # eager inside a compiled function, as GradScaler.scale (it counts)
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale (no host sync)."""
        if self.monitor is not None:
            self.monitor.observe_loss(loss)
        scaled = self._ready().scale(loss)
        self._order.backwards += 1
        return scaled

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``scale(loss).backward(**kwargs)``.

        Raises:
            TypeError: ``loss`` is not a tensor (several losses: their sum, or one call each)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"amp.backward takes one loss tensor; got {type(loss).__name__}: "
                            f"for several losses call amp.backward(l1 + l2), or once per loss "
                            f"(retain_graph=True where they share a graph)")
        try:
            self.scale(loss).backward(**kwargs)
        except torch.utils.checkpoint.CheckpointError as error:
            hinted = recompute_hint(error)  # a function checkpointed with torch's: what instead
            if hinted is error:
                raise
            raise hinted from error

    @torch._disable_dynamo
    def unscale_(self, optimizer) -> None:
        """Make ``optimizer``'s gradients read as the true (unscaled) ones, and check them for
        inf/NaN (at most once per optimizer per step; see :meth:`LossScaler.unscale_`)."""
        self._measure_as_left(optimizer)
        self._ready().unscale_(optimizer)

    def _measure_as_left(self, optimizer) -> None:
        """A recorded step's underflow counts, taken before an unscale or a clip changes the
        gradients the backward stored."""
        if (self.monitor is not None and self.monitor.recording
                and self._ready().stage_of(optimizer) == "ready"):
            self.monitor.measure_underflow(optimizer)

    def is_unscaled(self, optimizer) -> bool:
        """True when :meth:`unscale_`, :meth:`clip_grad_norm_` or :meth:`clip_grad_value_` ran on
        ``optimizer`` since its last :meth:`step` (its gradients are then the true ones, or a
        clip is folded into the step: :meth:`unscale_` must not run again)."""
        return self._ready().stage_of(optimizer) in ("unscaled", "folded")

    @torch._disable_dynamo
    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0):
        """Clip the true gradients ``optimizer`` will step with; returns their total norm.

        Before :meth:`unscale_`, a :class:`mixprec.MasterWeightOptimizer` gets the norm measured
        on the model's 16-bit gradients and the clip applied with the step's own arithmetic (see
        :meth:`LossScaler.clip_grad_norm_` and :meth:`LossScaler.settle_`); after it, the fp32
        master gradients are clipped in place. Either way what torch code reads afterwards, in
        ``optimizer.param_groups`` (fp32) and ``model.parameters()`` (rounded to their dtype),
        is the clipped, true gradient the step uses; that takes fp32 gradients until the step
        (``step(optimizer, max_grad_norm=...)`` clips inside the step with no fp32 copy).
        """
        self._measure_as_left(optimizer)
        total = self._ready().clip_grad_norm_(optimizer, max_norm, norm_type)
        self._show_clipped(optimizer)
        if self.monitor is not None and norm_type == 2.0:  # the step's record: the norm before
            self.monitor.clipped(optimizer, total)           # the clip, not the clipped one
        return total

    @torch._disable_dynamo
    def clip_grad_value_(self, optimizer, clip_value: float) -> None:
        """Clamp each true gradient ``optimizer`` will step with to ``[-clip_value, clip_value]``.

        Unscales first unless :meth:`unscale_` was called this step (for a
        :class:`mixprec.MasterWeightOptimizer` that makes the fp32 master gradients, which the
        step then uses; the model's gradients then read as them, rounded). No host sync.

        Raises:
            ValueError: ``clip_value`` is not a positive finite number.
            RuntimeError: :meth:`clip_grad_norm_` already folded a clip into this step.
        """
        if not positive_finite(clip_value):
            raise ValueError(f"clip_value must be a positive finite number; got {clip_value!r}")
        stage = self._ready().stage_of(optimizer)
        if stage == "folded":
            raise RuntimeError("clip_grad_value_() after clip_grad_norm_() in one step: the norm "
                               "clip was folded into the step; clip by value or by norm")
        if stage == "ready":
            self.unscale_(optimizer)
        else:
            self._ready().recheck_(optimizer, "clip_grad_value_()")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        ids = {id(p) for p in params}
        step = optimizer.grads_for_step() if owns_gradients(optimizer) else []
        if any(id(p) in ids and g is not p.grad for p, g in step):  # a compact one's fp32 copies
            clip_value_([g for _, g in step], clip_value)
        elif params:
            torch.nn.utils.clip_grad_value_(params, clip_value)
        self._show_clipped(optimizer)

    def _show_clipped(self, optimizer) -> None:
        """After a clip, the gradients torch code reads (the optimizer's and the model's) are
        the clipped, true ones the step uses: a folded clip is applied to fp32 gradients made
        with the step's own arithmetic (``LossScaler.settle_``); after a clip of the fp32 master
        gradients in place the model's read as them (rounded to their dtype)."""
        if not owns_gradients(optimizer):
            return
        scaler = self._ready()
        if scaler.stage_of(optimizer) == "folded":
            scaler.settle_(optimizer)
        elif scaler.stage_of(optimizer) == "unscaled":
            show_master_grads(optimizer.param_groups)
            show_held(optimizer)

    @torch._disable_dynamo
    def grad_norm(self, optimizer, norm_type: float = 2.0) -> torch.Tensor:
        """The total norm of the true gradients ``optimizer`` will step with, as they stand (what
        ``torch.nn.utils.clip_grad_norm_(..., max_norm=inf)`` reports on fp32 gradients); no
        host sync.

        Raises:
            ValueError: a ``norm_type`` that is not positive (or ``float("inf")``).
            RuntimeError: :meth:`clip_grad_norm_` already ran this step (it returned the norm).
        """
        check_clip_args(1.0, norm_type)  # (the norm types clip_grad_norm_ takes)
        scaler = self._ready()
        stage = scaler.stage_of(optimizer)
        if stage == "folded":
            raise RuntimeError("grad_norm() after clip_grad_norm_(): use the norm it returned")
        grads = list(_grads(optimizer))
        total = replicated(total_norm(grads, norm_type, scaler.scale_tensor.device))  # FSDP2
        carried = scaler.carried_factor(optimizer) if stage == "ready" else None
        if carried is not None:  # they still carry the scale of the loss they came from
            total = total / carried.to(total.device)
        return total

    @torch._disable_dynamo
    def step(self, *optimizers, max_grad_norm: float | None = None, **kwargs) -> bool:
        """Step every optimizer unless its gradients overflowed; update the scale once.

        Args:
            optimizers: the optimizers :meth:`setup` returned (at least one).
            max_grad_norm: clip each optimizer's true gradients to this total 2-norm first.
            kwargs: passed on to each optimizer's ``step`` (as ``torch.amp.GradScaler.step``
                does); a closure is refused.

        Returns:
            True when every optimizer stepped; False when any was skipped (inf/NaN gradients:
            its weights and state are untouched, and the scale backed off). bf16 has no loss
            scale and skips such a step all the same; its first skip warns.

        Host syncs: one per optimizer (the overflow flag, for the return value). Where the
        optimizer skips on the device (a master optimizer on torch's fused kernels), its step
        and the scale update are queued first and the flag is read after them, so the read
        stalls no part of the step; otherwise it is read before the optimizer's step.

        Raises:
            ValueError: no optimizer, or a bad ``max_grad_norm``.
            TypeError: something other than an optimizer (a model, say).
            RuntimeError: a step that would train on wrong numbers, with what to write instead:
                under a loss scale, no :meth:`backward` since the optimizer's last step
                (``loss.backward()`` instead); a second step on the same gradients; at a
                master-weight level, an optimizer over the models' 16-bit parameters that is not
                a master optimizer (made after :meth:`setup`); an optimizer over none of the
                models' parameters (copied apart from its model, say).
            NonFiniteGradientsError: ``max_consecutive_skips`` skips in a row the scale cannot
                fix.
        """
        if not optimizers:
            raise ValueError("step() needs the optimizer(s) to step, e.g. amp.step(optimizer)")
        for opt in optimizers:
            check_optimizer(opt)
        check_max_norm(max_grad_norm)
        scaler = self._ready()
        watch = self.monitor is not None and self.monitor.recording
        queued = []
        for opt in optimizers:
            self._check_owned(opt)
            self._order.check(opt, functools.partial(_grads, opt), scaler)
        for opt in optimizers:
            if max_grad_norm is not None:
                self._measure_as_left(opt)  # (before the clip: a settled one changes them)
            norm = None if max_grad_norm is None else scaler.clip_grad_norm_(opt, max_grad_norm)
            if watch:
                self.monitor.before_step(opt, norm)
            queued.append(scaler.queue_step(opt, **kwargs))
        scaler.update()
        for opt in optimizers:
            self._order.stepped(opt, functools.partial(_grads, opt))
        applied = True
        for opt, step in zip(optimizers, queued):
            stepped = scaler.read_step(step)  # the one host read, after the step is queued
            if watch:
                self.monitor.after_step(opt, stepped)
            applied = stepped and applied
        if self.monitor is not None:
            self.monitor.end_step(applied)
        return applied

    def _check_owned(self, optimizer) -> None:
        if not self.models:
            raise RuntimeError("amp.step(optimizer) on a MixedPrecision that set up no model: "
                               "write model, opt = amp.setup(model, opt) first (amp.adopt(model) "
                               "for a model prepared elsewhere), then amp.backward(loss) and "
                               "amp.step(opt)")
        if optimizer not in self._owned:  # once per optimizer
            check_owned(self.models, optimizer)
            check_masters(self.policy, self.models, optimizer)
            self._owned.add(optimizer)

    def _ready(self) -> LossScaler:
        if self.scaler is None:
            raise RuntimeError("this MixedPrecision resolves dtype='auto' on the model's device: "
                               "call setup(model, optimizer) first")
        return self.scaler

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The policy (as plain data) and the scaler's state, and with a monitor its step count
        (a resumed run records at the steps the uninterrupted one would); a host sync."""
        state = {"policy": None if self.policy is None else self.policy.state_dict(),
                 "scaler": self._ready().state_dict()}
        if self.monitor is not None:
            state["monitor"] = self.monitor.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`, or a ``torch.amp.GradScaler``'s ``state_dict()`` (a
        checkpoint of an autocast + GradScaler loop moving to mixprec): its scale and growth
        settings go to the loss scaler; a disabled GradScaler's (empty) one loads into a run
        that does not scale the loss as nothing.

        Raises:
            ValueError: the checkpoint's policy differs from this run's (both are shown), a
                GradScaler's scale into a run without a loss scale, or a malformed dict.
        """
        if isinstance(state, dict) and "policy" not in state and \
                (set(state) == set(TORCH_KEYS) or not state):
            scaler = self._ready()
            if state or scaler.is_enabled():
                scaler.load_state_dict(state)
            return
        if not isinstance(state, dict) or not ({"policy", "scaler"} <= set(state)
                                               <= {"policy", "scaler", "monitor"}):
            got = sorted(state) if isinstance(state, dict) else repr(state)
            raise ValueError(f"a MixedPrecision state_dict has the keys ['policy', 'scaler'] "
                             f"(and 'monitor' with a monitor; or a torch.amp.GradScaler's: "
                             f"{list(TORCH_KEYS)}); got {got}")
        self._ready()
        check_policy(state["policy"], self.policy)
        self.scaler.load_state_dict(state["scaler"])
        if self.monitor is not None and state.get("monitor") is not None:
            self.monitor.load_state_dict(state["monitor"])


def _grads(optimizer) -> Iterator[torch.Tensor]:
    """The gradients ``optimizer``'s step reads (a master optimizer's: the model's)."""
    if owns_gradients(optimizer):
        return (g for _, g in optimizer.grads_for_step())
    return (p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)


def engine_for(entry_point, mixed_precision: MixedPrecision | None, **options) -> MixedPrecision:
    """The engine an integration runs on: ``mixed_precision`` itself (then every other option of
    ``entry_point`` must be left at its default), or one built from ``options`` (the precision
    keywords, ``loss_scale``, ``emulate_fp16``, ``monitor``).

    Raises:
        TypeError: ``mixed_precision`` is not a :class:`MixedPrecision`, or comes with options.
    """
    if mixed_precision is None:
        return MixedPrecision(**options)
    if not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"mixed_precision must be a mixprec.MixedPrecision, e.g. "
                        f"mp.MixedPrecision(level='O2', dtype='bf16'), or None (then the "
                        f"precision keywords build one); got {type(mixed_precision).__name__}")
    vocabulary.check_engine_alone(mixed_precision, options, entry_point)
    return mixed_precision
