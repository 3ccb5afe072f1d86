"""``MixprecPrecision``: a Lightning precision plugin that runs on :class:`mixprec.MixedPrecision`.

``L.Trainer(plugins=[MixprecPrecision(level="O2", dtype="fp16")])`` trains a LightningModule
with mixprec's policy, fp32 master weights and loss scaling, in mixprec's step order. Where each
of Lightning's precision hooks lands on the engine:

* ``connect(model, optimizers, schedulers)`` (after ``configure_optimizers``):
  ``engine.setup(model, *optimizers)`` prepares the model in place and, at a master-weight
  policy, wraps each optimizer in a :class:`mixprec.MasterWeightOptimizer` whose masters take the
  fp32 weights' own storage; Lightning then holds the wrapped optimizers. A scheduler built on the
  user's optimizer keeps working through the param groups both share; a scheduler stepped every
  ``"step"`` is wrapped so that it steps only after an applied update. The model is prepared
  here, not in ``convert_module``, because the masters need the optimizers.
* ``forward_context()`` (around ``training_step``, ``validation_step``, ...): the policy's
  precision context, so code that calls sub-modules directly computes as the model does; at O3
  (16-bit storage and compute) ``convert_input`` also casts the batch's floating tensors to the
  compute dtype and the forward context makes it torch's default dtype, as Lightning's
  ``bf16-true``/``16-true`` plugins do.
* ``backward``: the loss times the loss scale (``on_before_backward`` sees the true loss).
* ``optimizer_step``: run the closure (forward and backward); with a loss scale, unscale into the
  true gradients unless that was done (``engine.unscale_``: ``on_before_optimizer_step`` and
  clipping see true values); the ``on_before_optimizer_step`` hooks and
  ``configure_gradient_clipping``; then ``engine.step(optimizer)``: step, or skip when the
  gradients overflowed (the step still counts in ``global_step``, as with Lightning's own AMP),
  and update the scale.
* ``clip_gradients``: ``gradient_clip_val`` clips the true gradients the step uses: by norm
  through ``engine.clip_grad_norm_``, by value through ``engine.clip_grad_value_``; ``p.grad``
  read after clipping is the clipped, true gradient (at O2 the fp32 masters' gradients, and the
  16-bit model gradients rounded from them).
* ``optimizer.step(closure, **kwargs)``: the keywords go on to the optimizer's ``step`` (at O2
  through the fp32-master wrapper; a compact master method refuses them).
* ``monitor=``: a :class:`mixprec.PrecisionMonitor` records the run; its scalars also go to
  the trainer's loggers (``logger.log_metrics``), TensorBoard, CSV or W&B alike.
* ``state_dict``/``load_state_dict``: the engine's (policy and scaler) and every rank's RNG
  states (torch, CUDA, numpy, python; Lightning saves none) in the checkpoint, so that a model
  with dropout resumes exactly; the masters travel in the optimizer's state, and the model's
  ``state_dict`` is fp32. Lightning writes the checkpoint file itself (its checkpoint IO).

Strategies: one device, DDP (``"ddp"``, ``"ddp_spawn"``, ...) and ``ModelParallelStrategy``
(FSDP2); with DDP the model is prepared in ``convert_module``, before DDP wraps it, and the
optimizers wrapped in ``connect``; with FSDP2 the plugin shards the model (or
``configure_model`` calls :meth:`MixprecPrecision.shard`). See :mod:`.lightning_strategies`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn

from .. import vocabulary
from ..autocast import cast_floating
from ..engine import MixedPrecision, engine_for
from ..modulecasts import guard_casts
from ..monitor import CallbackWriter
from ..optim import is_master_optimizer
from ..optim.wrapper import is_wrapped
from ..policy import Policy
from ..prepare import policy_of, wrap_late
from ..regions import Entry
from ..statedict import companions_of, link_masters
from . import lightning_checkpoints as checkpoints
from . import lightning_strategies as strategies
from .lightning_averaging import average_in_fp32

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import _MockOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as exc:  # pragma: no cover - the error names the extra
    raise ImportError("mixprec.integrations.lightning needs the lightning package: "
                      "pip install 'mixprec[lightning]'") from exc

__all__ = ["MixprecPrecision", "SkipAwareScheduler"]

_FP32 = torch.float32
_RNG = "rng_states"  # the plugin's state_dict entry: every rank's RNG states


class SkipAwareScheduler:
    """An LR scheduler that steps only when its optimizer's last update was applied.

    Everything else (``state_dict``, ``get_last_lr``, ``optimizer``, ...) is the wrapped
    scheduler's, so checkpoints hold the scheduler's own state.

    Args:
        scheduler: the scheduler to wrap.
        applied: returns whether the last update of the scheduler's optimizer was applied.
    """

    def __init__(self, scheduler, applied: Callable[[], bool]):
        self.scheduler = scheduler
        self._applied = applied

    def step(self, *args, **kwargs) -> None:
        """``scheduler.step(...)``, unless the last update was skipped (inf/NaN gradients)."""
        if self._applied():
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict:
        """The wrapped scheduler's state."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the wrapped scheduler's state."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str):
        if name in ("scheduler", "_applied"):  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"SkipAwareScheduler({self.scheduler!r})"


@vocabulary.takes(*vocabulary.PRECISION, *vocabulary.LOOP, *vocabulary.EMULATION, notes={
    "monitor": "What it records is also logged through the trainer's loggers."})
class MixprecPrecision(Precision):
    """A Lightning precision plugin on a :class:`mixprec.MixedPrecision` engine.

    Args:
        {precision keywords}
        mixed_precision: a ready :class:`mixprec.MixedPrecision` instead of the keywords above
            (the shape ``MixprecTrainer`` takes too); with it, the others stay at their
            defaults.

    Attributes:
        engine: the :class:`mixprec.MixedPrecision`.
        policy: the engine's policy (None until ``dtype="auto"`` is resolved at set-up).
        scaler: the engine's loss scaler.
        applied: optimizer -> whether its last update was applied (read by the skip-aware
            schedulers).

    ``trainer.precision`` reports the parameters' storage: "32-true" at O0/O1, "bf16-true" or
    "16-true" at O2/O3. Passing Lightning's own ``precision=`` as well is refused by Lightning
    ("Received both `precision=...` and `plugins=...`"): two precision plugins would cast and
    scale twice.

    Raises:
        ValueError, TypeError: what :class:`mixprec.MixedPrecision` refuses.
        TypeError: ``mixed_precision`` that is not a :class:`mixprec.MixedPrecision`, or that
            comes with other keywords.

    Example:
        >>> import lightning.pytorch as L
        >>> plugin = MixprecPrecision(level="O2", dtype="bf16")
        >>> trainer = L.Trainer(plugins=[plugin], accelerator="cpu", logger=False,
        ...                     enable_progress_bar=False, enable_checkpointing=False)
    """

    def __init__(self, level: str = vocabulary.LEVEL, dtype: Any = vocabulary.DTYPE,
                 loss_scale: Any = "auto", policy: Policy | None = None, *,
                 monitor=None, keep_fp32=None,
                 low_precision_ops=(), fp32_ops=(), master=None, state_dtype=None, fp8=None,
                 fp8_modules=None, emulate_fp16="auto", max_consecutive_skips: int | None = 8,
                 mixed_precision: MixedPrecision | None = None):
        self.engine = engine_for(
            type(self), mixed_precision, level=level, dtype=dtype, loss_scale=loss_scale,
            policy=policy, keep_fp32=keep_fp32, low_precision_ops=low_precision_ops,
            fp32_ops=fp32_ops, master=master, state_dtype=state_dtype, fp8=fp8,
            fp8_modules=fp8_modules, emulate_fp16=emulate_fp16, monitor=monitor,
            max_consecutive_skips=max_consecutive_skips)
        self.applied: dict[int, bool] = {}
        self._context = None
        self._prepared: dict | None = None  # what convert_module left for connect

    def __repr__(self) -> str:
        return f"MixprecPrecision({self.engine!r})"

    @property
    def policy(self) -> Policy | None:
        return self.engine.policy

    @property
    def scaler(self):
        return self.engine.scaler

    @property
    def precision(self) -> str:  # what trainer.precision (and the model summary) reads
        policy = self.engine.policy
        if policy is None or policy.param_dtype == _FP32:
            return "32-true"
        return "bf16-true" if policy.param_dtype == torch.bfloat16 else "16-true"

    # -- set-up ----------------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Before a multi-process strategy wraps the model: prepare it (DDP) or shard it (FSDP2)
        for the policy (see :mod:`.lightning_strategies`); on one device, nothing yet."""
        if self._prepared is None:
            self._prepared = strategies.before_wrap(self.engine, module)
        return module

    def shard(self, module: nn.Module, *, units=None, reduce_dtype="fp32") -> None:
        """Under ``ModelParallelStrategy``, from ``LightningModule.configure_model``: prepare
        and shard the module with :func:`mixprec.parallel.fsdp` for this plugin's policy, over
        the strategy's data-parallel mesh (``units``: the sharding units, default every module
        held in an ``nn.ModuleList``; ``reduce_dtype``: of the gradient reduce-scatter). Without
        it, the plugin shards with the defaults before the strategy sets up."""
        strategy = module.trainer.strategy
        if strategies.kind_of(strategy) != "fsdp2":
            raise RuntimeError(f"shard() is for ModelParallelStrategy; this trainer runs "
                               f"{type(strategy).__name__}")
        module.to(strategy.root_device)  # FSDP2 shards where the parameters are
        self._prepared = strategies.shard(self.engine, module, units=units,
                                          reduce_dtype=reduce_dtype,
                                          mesh=strategies.data_parallel_mesh(strategy))

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list):
        """Prepare the model and its optimizers (see the module docstring)."""
        module = strategies.lightning_module_of(model)
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            optimizers = strategies.attach(self.engine, model, module, list(optimizers),
                                           prepared)
        else:
            optimizers = self._setup(module, list(optimizers))
        _check_finetuning(module, optimizers)
        average_in_fp32(module, getattr(pl.callbacks, "WeightAveraging", None))  # in fp32
        checkpoints.register(module, optimizers)
        self._context = _entry_context(module)
        _log_to_loggers(self.engine.monitor, module)
        configs = [self._skip_aware(config, optimizers) for config in lr_schedulers]
        return model, optimizers, configs

    def _setup(self, model: nn.Module, optimizers: list) -> list:
        if optimizers and all(isinstance(o, _MockOptimizer) for o in optimizers):
            self._setup(model, [])  # configure_optimizers returned None: Lightning's stand-in
            return optimizers  # has no parameters and is never stepped
        if policy_of(model) is None:
            if not optimizers and self.engine.policy.master_weights:
                self._setup_for_evaluation(model)
                return []
            prepared = self.engine.setup(model, *optimizers)
            return list(prepared[1:]) if optimizers else []
        if model not in self.engine.models:  # prepared by another run (adopt checks the policy)
            self.engine.adopt(model)
        fresh = [o for o in optimizers if not is_wrapped(o)]
        if not fresh or not policy_of(model).master_weights:
            return optimizers
        # an earlier run's (Lightning's Tuner.lr_find, a first fit): its fp32 values, held by
        # the model as companions, start the new optimizer's masters
        link = companions_of(model)
        values = link.settle() if link is not None else {}
        low = [p for o in fresh for g in o.param_groups for p in g["params"]
               if p.dtype in (torch.float16, torch.bfloat16)]
        if any(p not in values for p in low):
            raise RuntimeError(
                "this model was prepared by an earlier run and its weights are now stored in "
                "low precision: a new optimizer over it would start its fp32 masters from "
                "rounded weights. Fit a fresh model, or load its fp32 state_dict into one "
                "(fit(ckpt_path=...) does)")
        with torch.no_grad():
            start = {p: values[p].detach().clone() for p in low}
            kept = {p: v.detach().clone() for p, v in values.items() if p not in start}
        wrapped = iter(wrap_late(model, fresh, start, policy_of(model)))
        companions_of(model).keep(kept)  # the parameters this fit does not train keep theirs
        return [next(wrapped) if not is_wrapped(o) else o for o in optimizers]

    def _setup_for_evaluation(self, model: nn.Module) -> None:
        """``validate``/``test``/``predict`` before any ``fit`` at a master-weight level: the
        model is prepared (16-bit storage) and keeps its fp32 values as companions, as
        Lightning's own mixed precision keeps its fp32 weights: ``state_dict()`` still gives
        them, and a later ``fit`` starts its masters from them (a baseline first; without
        them the fit was refused, the weights rounded for good)."""
        with torch.no_grad():
            values = {p: p.detach().clone() for p in model.parameters()
                      if p.dtype == torch.float32}
        self.engine.setup(model)
        link_masters(model, [])
        companions_of(model).keep({p: v for p, v in values.items() if p.dtype != v.dtype})
        guard_casts(model, companions_of(model))  # (.float() takes them, as a fitted one's)

    def _skip_aware(self, config, optimizers: list):
        if config.interval != "step" or isinstance(config.scheduler, SkipAwareScheduler):
            return config
        target = getattr(config.scheduler, "optimizer", None)
        owner = next((o for o in optimizers
                      if o is target or getattr(o, "inner", None) is target), None)
        if owner is None:
            return config

        def applied() -> bool:
            return self.applied.get(id(owner), True)
        return dataclasses.replace(config, scheduler=SkipAwareScheduler(config.scheduler, applied))

    # -- the step --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """The policy's precision context (autocast with its op lists at O1/O2); at O3 also the
        compute dtype as torch's default dtype, as Lightning's ``bf16-true``/``16-true`` do
        (tensors made inside a step without a dtype are 16-bit)."""
        with contextlib.ExitStack() as stack:
            if self._context is not None:
                self._context.enter(stack)
            dtype = self._true_dtype()
            if dtype is not None:
                stack.enter_context(_default_dtype(dtype))
            yield

    def convert_input(self, data: Any) -> Any:
        """At O3 (16-bit storage and compute, no autocast) the batch's fp32/fp16/bf16 tensors
        in the compute dtype, as Lightning's ``bf16-true``/``16-true`` convert them: a step that
        feeds the batch to a sub-module (``self.layer(batch)``) computes as the model does.
        Other levels keep the batch as it is (autocast casts for each op)."""
        dtype = self._true_dtype()
        return data if dtype is None else cast_floating(data, dtype)

    def _true_dtype(self) -> torch.dtype | None:
        """The compute dtype of a policy that casts its inputs without autocast (O3), else None."""
        policy = self.engine.policy
        if policy is None or policy.autocast or not policy.cast_inputs:
            return None
        return policy.compute_dtype

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        """Backpropagate the loss times the loss scale (through ``model.backward``)."""
        model.backward(self.engine.scale(tensor), *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Closure, true gradients, Lightning's hooks and clipping, then the engine's step
        (``kwargs`` go on to ``optimizer.step``, as with Lightning's own plugins)."""
        inner = optimizer.inner if is_wrapped(optimizer) else optimizer
        if isinstance(inner, torch.optim.LBFGS):
            raise TypeError("LBFGS re-evaluates its closure inside step(), after the overflow "
                            "check; mixprec's loss scaling cannot drive it")
        result = closure()
        if result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward, nothing to step
        if self.engine.scaler.is_enabled() and not self.engine.is_unscaled(optimizer):
            self.engine.unscale_(optimizer)  # hooks and clipping see the true gradients
        self._after_closure(model, optimizer)
        self.applied[id(optimizer)] = self.engine.step(optimizer, **kwargs)
        return result

    def clip_gradients(self, optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        """Clip the true gradients: by norm (``engine.clip_grad_norm_``) or by value.

        Code reading ``p.grad`` after clipping (in ``configure_gradient_clipping``, after
        ``self.clip_gradients``) reads the clipped, true gradients the step uses (at O2 the fp32
        masters' in ``optimizer.param_groups``, the model's 16-bit ones rounded from them), as
        with Lightning's own plugins."""
        if clip_val <= 0:
            return
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.engine.clip_grad_value_(optimizer, clip_val)
        else:
            self.engine.clip_grad_norm_(optimizer, clip_val)

    def unscale_gradients(self, optimizer) -> None:
        """``engine.unscale_(optimizer)``: its gradients read as the true ones."""
        self.engine.unscale_(getattr(optimizer, "_optimizer", optimizer))

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The engine's state (policy and scaler) and every rank's RNG states (torch, CUDA,
        numpy, python: gathered, a collective under several processes, as Lightning's own
        checkpointing is); empty before set-up."""
        if self.engine.scaler is None:
            return {}
        return {**self.engine.state_dict(), _RNG: checkpoints.rank_rng_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the engine's state and this rank's RNG states (a checkpoint of fewer ranks:
        rank ``r`` takes those of rank ``r`` modulo their number); a checkpoint made under
        another policy is refused."""
        engine_state = {k: v for k, v in state_dict.items() if k != _RNG}
        self.engine.load_state_dict(engine_state)
        if _RNG in state_dict:
            checkpoints.restore_rank_rng(state_dict[_RNG])


def _check_finetuning(module: nn.Module, optimizers: list) -> None:
    """Refuse Lightning's fine-tuning callbacks beside fp32 masters: they name the optimizer's
    parameters by looking them up among the module's, and the optimizer holds fp32 masters in
    their place (a KeyError at the first epoch)."""
    trainer = getattr(module, "_trainer", None)
    callbacks = getattr(trainer, "callbacks", None) or []
    tuning = [type(cb).__name__ for cb in callbacks
              if isinstance(cb, pl.callbacks.BaseFinetuning)]
    if tuning and any(is_master_optimizer(o) for o in optimizers):
        raise RuntimeError(
            f"{tuning[0]} maps the optimizer's parameters to the LightningModule's by identity, "
            f"and with fp32 masters (O2's default) the optimizer holds fp32 copies in their "
            f"place. Use master='split' (the same fp32 masters' numbers in a 16-bit remainder, "
            f"the optimizer holding the module's parameters) or level='O1'")


def _log_to_loggers(monitor, model: pl.LightningModule) -> None:
    """Send what ``monitor`` records to the loggers of ``model``'s trainer too (once)."""
    if monitor is None or any(getattr(w, "lightning", False) for w in monitor.writers):
        return

    def log(step: int, scalars: dict) -> None:
        try:
            loggers = model.trainer.loggers
        except RuntimeError:  # the module left its trainer
            return
        for logger in loggers:
            logger.log_metrics(scalars, step)
    writer = CallbackWriter(log)
    writer.lightning = True
    monitor.writers.append(writer)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """``dtype`` as torch's default dtype inside the block; the previous one restored after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _entry_context(model: nn.Module):
    """The precision context the prepared model's entry runs its forward in, or None."""
    wrapper = model.__dict__.get("forward")
    while wrapper is not None:
        if isinstance(wrapper, Entry):
            return wrapper.context
        wrapper = getattr(wrapper, "inner", None)
    return None
