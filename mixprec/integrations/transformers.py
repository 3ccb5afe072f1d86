"""``MixprecTrainer``: a Hugging Face ``transformers.Trainer`` that runs on
:class:`mixprec.MixedPrecision`.

``MixprecTrainer(model, args, train_dataset=..., level="O2", dtype="bf16")`` (the precision
keywords of :func:`mixprec.prepare`, or ``mixed_precision=mp.MixedPrecision(...)`` instead)
trains with mixprec's policy, fp32 master weights and loss scaling, in mixprec's step order.
How the Trainer's loop lands on the engine, in the order it runs:

* ``create_optimizer``: the optimizer the Trainer builds from its ``TrainingArguments`` (or the
  one passed as ``optimizers=(opt, sched)``) and the model go through ``engine.setup``: the model
  is prepared in place and, at a master-weight policy, the optimizer becomes a
  :class:`mixprec.MasterWeightOptimizer` whose masters take the fp32 weights' own storage. A
  scheduler built on the user's optimizer keeps working through the param groups both share.
* the loss scale: the Trainer's accelerator gets an :class:`EngineGradScaler` as its gradient
  scaler, the object accelerate calls when it backpropagates (``scale(loss).backward()``), steps
  (``step(optimizer)`` then ``update()``) and checkpoints (``state_dict``). It is the engine seen
  through ``torch.amp.GradScaler``'s calls: ``step`` is ``engine.step(optimizer)`` (check, step or
  skip, update the scale once), ``update`` has nothing left to do. Every backward of the loop,
  a ``training_step`` override's included, goes through ``accelerator.backward``.
* clipping: under a loss scale the gradients are first unscaled (``engine.unscale_``: the
  ``on_pre_optimizer_step`` callbacks see true values, as with the Trainer's own fp16 AMP);
  ``args.max_grad_norm`` clips the true gradients the step uses (``engine.clip_grad_norm_``),
  so callbacks read the clipped ones, and the logged ``grad_norm`` is the true one before
  clipping (``engine.grad_norm``).
  This overrides the Trainer's ``_clip_grad_norm``/``_get_grad_norm``, the two methods its loop
  calls for exactly that; their presence is checked when the trainer is built, so a
  transformers version without them fails loudly instead of clipping scaled gradients.
* skipped steps: accelerate reports a step the scaler did not take as
  ``optimizer_step_was_skipped``, and the Trainer then leaves the LR scheduler alone: the
  scheduler steps on applied updates only.
* checkpoints: the masters travel in the optimizer's state (``optimizer.pt``), the engine's state
  (policy and scaler) in ``scaler.pt``, both written with every checkpoint and read back by
  ``train(resume_from_checkpoint=...)`` (a checkpoint made under another policy is refused).
  A checkpoint is written all or nothing: into ``.checkpoint-N.saving/`` by every rank, then,
  when every rank is done, given the checksums of its files (``mixprec-checksums.json``) and
  renamed to ``checkpoint-N``; ``train`` checks them before resuming (``verify=False`` skips
  that). ``save_model`` writes the fp32 weights (the masters) and a config that says float32.

An engine built with ``monitor=mp.PrecisionMonitor(...)`` records the run; its scalars also go
through ``Trainer.log``, so every ``report_to`` integration (TensorBoard, W&B, ...) receives them.

Several processes (``torchrun``, ``accelerate launch``): the model is prepared in
``create_optimizer``, before accelerate wraps it, through
:func:`mixprec.integrations.hosts.setup_for_host` (rank 0's fp32 weights first; under FSDP2,
``fsdp_config={"version": 2}``, :func:`mixprec.parallel.fsdp` shards the prepared model with the
plugin's sharding units, the fp32 shards being the masters); under DDP the 16-bit gradients are
averaged in fp32 (``_prepare_for_training``). DeepSpeed, FSDP1, XLA and ``DataParallel`` are
refused, named in the error. Under FSDP2 a checkpoint carries every master method (a split
remainder or Kahan compensation in the FSDP optimizer file) and resumes at another number of
FSDP2 processes, one included (the Trainer reads an FSDP checkpoint only under FSDP).

The model is prepared when training starts: ``evaluate()`` before the first ``train()`` runs the
fp32 model. ``TrainingArguments(fp16=True)``/``bf16=True`` are refused (accelerate's autocast and
GradScaler on top of the engine would cast and scale twice).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .. import distenv as env
from .. import vocabulary
from ..engine import MixedPrecision, engine_for
from ..integrity import save_directory, verify_on_ranks
from ..lowbit.backend import quiet_import
from ..monitor import CallbackWriter
from ..policy import Policy
from .gradscaler import EngineGradScaler
from .hosts import (
    fsdp_units,
    lay_out_state,
    reduce_in_fp32,
    refused_host,
    setup_for_host,
)

try:
    with quiet_import():  # transformers.trainer imports torchao when it is installed
        import transformers
        import transformers.trainer
        from transformers.trainer_utils import (
            PREFIX_CHECKPOINT_DIR,
            get_last_checkpoint,
            rotate_checkpoints,
        )
except ImportError as exc:  # pragma: no cover - the error names the extra
    raise ImportError("mixprec.integrations.transformers needs transformers and accelerate: "
                      "pip install 'mixprec[transformers]'") from exc

__all__ = ["MixprecTrainer", "EngineGradScaler"]

_LOOP_HOOKS = ("_clip_grad_norm", "_get_grad_norm", "create_optimizer",
               "create_accelerator_and_postprocess", "save_model", "_prepare_for_training",
               "_load_from_checkpoint", "_save_checkpoint", "_get_output_dir",
               "_push_from_checkpoint")


@vocabulary.takes(*vocabulary.PRECISION, *vocabulary.LOOP, *vocabulary.EMULATION, notes={
    "monitor": "Its scalars also go through ``Trainer.log``."})
class MixprecTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose precision is a :class:`mixprec.MixedPrecision`.

    Takes every argument of ``transformers.Trainer`` (``TrainingArguments``,
    ``optimizers=(optimizer, scheduler)``, ``optimizer_cls_and_kwargs``, callbacks, ...), plus
    the precision keywords (keyword only), or a ready engine:

    Args:
        mixed_precision: a :class:`mixprec.MixedPrecision`, e.g.
            ``mp.MixedPrecision(level="O2", dtype="bf16")``, instead of the keywords below
            (with it, they stay at their defaults); None: one built from them.
        {precision keywords}

    Attributes:
        mixed_precision: the engine; ``.policy`` and ``.scaler`` are its.

    Raises:
        TypeError: ``mixed_precision`` is not a :class:`mixprec.MixedPrecision`, or comes with
            precision keywords.
        ValueError: ``TrainingArguments(fp16=True)``, ``bf16=True``, ``fp16_full_eval`` or
            ``bf16_full_eval``, an accelerator configured for mixed precision, or DeepSpeed,
            FSDP1, XLA or ``DataParallel`` (DDP and FSDP2 run).
        RuntimeError: this transformers version's loop lacks a method the trainer overrides.

    Example:
        >>> import mixprec as mp, transformers
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8))
        >>> args = transformers.TrainingArguments("out", use_cpu=True, report_to=[])
        >>> trainer = MixprecTrainer(model, args,
        ...                          mixed_precision=mp.MixedPrecision("O2", "bf16"))
    """

    def __init__(self, *args: Any, mixed_precision: MixedPrecision | None = None,
                 level: str = vocabulary.LEVEL, dtype: Any = vocabulary.DTYPE,
                 loss_scale: Any = "auto",
                 policy: Policy | None = None, keep_fp32=None, low_precision_ops=(), fp32_ops=(),
                 master=None, state_dtype=None, fp8=None, fp8_modules=None, emulate_fp16="auto",
                 monitor=None, max_consecutive_skips: int | None = 8, **kwargs: Any):
        mixed_precision = engine_for(
            type(self), mixed_precision, level=level, dtype=dtype, loss_scale=loss_scale,
            policy=policy, keep_fp32=keep_fp32, low_precision_ops=low_precision_ops,
            fp32_ops=fp32_ops, master=master, state_dtype=state_dtype, fp8=fp8,
            fp8_modules=fp8_modules, emulate_fp16=emulate_fp16, monitor=monitor,
            max_consecutive_skips=max_consecutive_skips)
        missing = [name for name in _LOOP_HOOKS if not hasattr(transformers.Trainer, name)]
        if missing:
            raise RuntimeError(f"transformers {transformers.__version__}'s Trainer has no "
                               f"{', '.join(missing)}, which MixprecTrainer overrides to clip and "
                               f"save through mixprec; use the version in mixprec's "
                               f"'transformers' extra")
        self.mixed_precision = mixed_precision
        self._engine_optimizer = None
        self._staging: Path | None = None  # where _save_checkpoint writes, while it does
        self._push_pending = False
        super().__init__(*args, **kwargs)
        self._monitored: dict = {}  # recorded during an optimizer step, logged after it
        if mixed_precision.monitor is not None:
            mixed_precision.monitor.writers.append(CallbackWriter(self._log_monitored))
            self.add_callback(_MonitorFlush(self))

    def _log_monitored(self, step: int, scalars: dict) -> None:
        """What the engine's monitor records, through ``self.log`` (and so ``report_to``), at
        the step the Trainer logs that optimizer step at: held until its ``global_step`` moved
        on (a step's record is made inside the optimizer's step, before it does), else (a
        closing record, after training) logged now."""
        if self.optimizer is not None and self.state.global_step < self.state.max_steps:
            self._monitored.update(scalars)
        else:
            self.log(dict(scalars))

    def _flush_monitored(self) -> None:
        if self._monitored:
            scalars, self._monitored = self._monitored, {}
            self.log(scalars)

    # -- set-up ----------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, with the engine as its gradient scaler."""
        _refuse_amp_arguments(self.args)
        super().create_accelerator_and_postprocess()
        env.apply_timeout("the Hugging Face Trainer", "TrainingArguments(ddp_timeout=seconds)")
        accelerator = self.accelerator
        if accelerator.mixed_precision != "no" or accelerator.scaler is not None:
            raise ValueError(f"the accelerator was configured for mixed precision "
                             f"({accelerator.mixed_precision!r}, e.g. by "
                             f"ACCELERATE_MIXED_PRECISION or an accelerate config): unset it; the "
                             f"MixedPrecision engine decides the precision")
        _refuse_host(self)
        accelerator.scaler = EngineGradScaler(self.mixed_precision)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (from its arguments, or the one given), set up with the model
        through the engine (at O2: a MasterWeightOptimizer with fp32 masters)."""
        if self._engine_optimizer is not None and self.optimizer is not None:
            return self.optimizer  # a later train(): the model is prepared already
        optimizer = super().create_optimizer(model)
        shard = _is_fsdp2(self)
        units = fsdp_units(self.accelerator.state.fsdp_plugin, self.model) if shard else None
        self.model, (optimizer,) = setup_for_host(self.mixed_precision, self.model, [optimizer],
                                                  shard=shard, units=units)
        self.model_wrapped = self.model
        self.optimizer = self._engine_optimizer = optimizer
        return optimizer

    def _prepare_for_training(self, *args, **kwargs):
        """The Trainer's own (accelerate wraps the prepared model); under DDP, 16-bit gradients
        are then averaged in fp32 (mixprec's reduce hook)."""
        model, train_dataloader = super()._prepare_for_training(*args, **kwargs)
        reduce_in_fp32(model)
        return model, train_dataloader

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """The Trainer's own; under FSDP2 the optimizer's state is first laid out
        (:func:`mixprec.integrations.hosts.lay_out_state`), so that loading the model and
        then the optimizer restores both exactly."""
        if _is_fsdp2(self) and self._engine_optimizer is not None:
            lay_out_state(self.model, self._engine_optimizer)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    # -- the step --------------------------------------------------------------------------------
    def _clip_grad_norm(self, model):
        """Clip the true gradients to ``args.max_grad_norm``; returns their norm before.

        ``on_pre_optimizer_step`` callbacks then read the clipped, true gradients the step uses
        (at O2 the fp32 masters', and the model's rounded from them), as with the Trainer's own
        clipping."""
        self._unscale()
        return self.mixed_precision.clip_grad_norm_(self._engine_optimizer,
                                                    self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The norm the Trainer logs: the true gradients' (no clipping)."""
        if grad_norm is None:
            self._unscale()
            grad_norm = self.mixed_precision.grad_norm(self._engine_optimizer)
        return grad_norm

    def _unscale(self) -> None:
        """Under a loss scale, make the gradients the true ones before the loop's
        ``on_pre_optimizer_step`` callbacks read them (as the Trainer's own fp16 AMP does)."""
        engine, optimizer = self.mixed_precision, self._engine_optimizer
        if engine.scaler.is_enabled() and not engine.is_unscaled(optimizer):
            engine.unscale_(optimizer)

    # -- checkpoints -----------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, verify: bool = True, **kwargs):
        """``transformers.Trainer.train``; the checkpoint to resume from is first checked
        against the checksums its save wrote.

        Args:
            resume_from_checkpoint: as the Trainer's (a path, or True: the latest
                ``checkpoint-N`` in ``args.output_dir``).
            verify: False skips the checksums (a checkpoint edited on purpose); a checkpoint
                without ``mixprec-checksums.json`` (the stock Trainer's) loads unchecked.

        Raises:
            ValueError: a file of the checkpoint is missing or does not match its checksum
                (the error names it).
        """
        if resume_from_checkpoint is True:  # resolved as the Trainer does, to check that one
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        if isinstance(resume_from_checkpoint, (str, os.PathLike)) and os.path.isdir(
                resume_from_checkpoint):
            verify_on_ranks(resume_from_checkpoint, verify=verify)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's own, all or nothing: every rank writes the checkpoint in
        ``.checkpoint-N.saving/`` beside its place, and when every rank is done the saving rank
        adds the checksums and renames it ``checkpoint-N``
        (:func:`mixprec.integrity.save_directory`); then old checkpoints are rotated out and the
        Hub push (``push_to_hub``) runs, on the renamed checkpoint."""
        run_dir = Path(self._get_output_dir(trial))
        path = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"

        def write(tmp: Path) -> Path:
            self._staging = tmp  # the Trainer's run directory while it saves
            try:
                transformers.Trainer._save_checkpoint(self, model, trial)
            finally:
                self._staging = None
            written = tmp / path.name
            if self.state.best_model_checkpoint == str(written):  # this one is the best
                self.state.best_model_checkpoint = str(path)
                if self.args.should_save:
                    self.state.save_to_json(str(written / transformers.trainer.TRAINER_STATE_NAME))
            return written
        save_directory(path, write, main=self.args.should_save)
        if self.args.should_save:
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint,
                               use_mtime=True)
        if self._push_pending:
            self._push_pending = False
            self._push_from_checkpoint(str(path))

    def _get_output_dir(self, trial) -> str:
        """The Trainer's run directory; while a checkpoint is written, its temporary one."""
        return str(self._staging) if self._staging is not None else super()._get_output_dir(trial)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """The Trainer's Hub push, of a checkpoint once it has its name."""
        if self._staging is not None:
            self._push_pending = True
            return
        super()._push_from_checkpoint(checkpoint_folder)

    # -- saving ----------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``transformers.Trainer.save_model``: fp32 weights (the masters), a float32 config."""
        super().save_model(output_dir, _internal_call)
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        if self.args.should_save and config is not None and self._engine_optimizer is not None:
            config.dtype = torch.float32  # save_pretrained wrote the low-precision storage
            config.save_pretrained(output_dir if output_dir is not None else self.args.output_dir)


def _is_fsdp2(trainer) -> bool:
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return bool(trainer.is_fsdp_enabled) and getattr(plugin, "fsdp_version", 1) == 2


def _refuse_host(trainer) -> None:
    """What the engine cannot run under: DeepSpeed, FSDP1, XLA, DataParallel (several GPUs in
    one process)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    refused = refused_host(trainer.accelerator.distributed_type,
                           getattr(plugin, "fsdp_version", None))
    if trainer.is_deepspeed_enabled:
        refused = "DeepSpeed"
    if refused is None and trainer.args.n_gpu > 1:
        refused = (f"torch.nn.DataParallel ({trainer.args.n_gpu} GPUs in one process; launch one "
                   f"process per GPU with torchrun or accelerate launch for DDP)")
    if refused:
        raise ValueError(f"MixprecTrainer cannot run under {refused}: it takes the step (loss "
                         f"scale, masters, skip on overflow) out of the engine's hands; use DDP "
                         f"or FSDP2 (fsdp_config={{'version': 2}})")


def _refuse_amp_arguments(args) -> None:
    flags = [name for name in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval")
             if getattr(args, name, False)]
    if flags:
        shown = ", ".join(f"{name}=True" for name in flags)
        raise ValueError(
            f"TrainingArguments({shown}) turns on accelerate's own mixed precision (torch "
            f"autocast and GradScaler, or a half-precision model for evaluation) on top of the "
            f"MixedPrecision engine, which would cast and scale twice; leave fp16/bf16 False: "
            f"mixed_precision=mp.MixedPrecision(level=..., dtype=...) decides the precision")


class _MonitorFlush(transformers.TrainerCallback):
    """Logs the monitor's record of an optimizer step once the Trainer counted that step (its
    own loss and grad norm for the step are logged at the same ``global_step``)."""

    def __init__(self, trainer: MixprecTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        should_log = control.should_log  # (Trainer.log clears it: its own log of this step)
        self.trainer._flush_monitored()
        self.trainer.control.should_log = control.should_log = should_log

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._flush_monitored()
