"""A training loop with mixed precision as one argument:
``Trainer(model, loss_fn, opt, level="O2")``.

The Trainer drives a :class:`mixprec.MixedPrecision` (the policy, the prepared model, the loss
scaler and the step order): backward of the scaled loss on every micro-batch, then one
``engine.step`` (check, clip the true gradients, step or skip, update the scale), then the LR
scheduler only when the update was applied. It adds what a loop needs around that: epochs,
accumulation, metrics, callbacks, strategies across processes, and exact resume.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .. import kernel_table, vocabulary
from ..engine import engine_for
from ..optim import compile_master_step
from ..policy import Policy
from ..prepare import policy_of
from . import state as ts
from .batches import compute_loss, logits_of, shifts_labels, split_batch, to_device, windows
from .callbacks import Callback, ProgressBar
from .checks import check_device, check_next_token, check_options, check_reiterable, length
from .choose import make_strategy
from .diagnose import diagnose_overflow
from .evaluate import evaluate
from .history import History
from .metrics import make_metrics

__all__ = ["Trainer", "History"]


@vocabulary.takes(*vocabulary.PRECISION, *vocabulary.LOOP, *vocabulary.EMULATION,
                  *vocabulary.DISTRIBUTED, *vocabulary.COMPILE, notes={
    "fp8_modules": "The names chosen are in ``trainer.policy.fp8_modules``.",
    "compile": "At O2 on a CPU, with an optimizer the compiled master step supports, also "
               'that step (``MasterWeightOptimizer(fused="compile")``; on CUDA torch\'s fused '
               "kernels stay)."})
class Trainer:
    """Train a model at an optimisation level with loss scaling, accumulation, clipping and resume.

    Args:
        model: the fp32 model (prepared in place; see :func:`mixprec.prepare`).
        loss_fn: ``(output, target) -> scalar tensor``; use a mean-reduced loss so that
            gradient accumulation averages like a large batch. Outputs reach it in the policy's
            ``output_dtype`` (fp32 at O1/O2); a Hugging Face ``ModelOutput`` (or a dict with
            ``logits``) reaches it as its ``logits``. None: the loss is the output's ``.loss``
            (Hugging Face models compute it when the batch holds ``labels``).
        optimizer: an optimizer over ``model``'s parameters (wrapped in a
            :class:`mixprec.MasterWeightOptimizer` at O2).
        {precision keywords}
        loss_scaler: deprecated alias of ``loss_scale`` (a ``DeprecationWarning``).
        metrics: None, "accuracy", a :class:`mixprec.training.Metric`, or a list of them.
        scheduler: an LR scheduler over ``optimizer``; stepped after every applied update.
        grad_accum_steps: micro-batches per optimizer step (each loss is divided by the number of
            micro-batches in its window, so the update equals the large-batch one).
        max_grad_norm: clip the unscaled gradients to this total 2-norm (None: no clipping).
        device: where to train (default: the device of the model's parameters).
        callbacks: :class:`mixprec.Callback` objects.
        diagnose_overflow: when a step overflows, re-run its last micro-batch once under
            :func:`mixprec.debug.trace_nonfinite` and log which op produced inf/NaN first
            (see :mod:`mixprec.training.diagnose`).
        progress: show a tqdm bar (only when stdout is a terminal).
        strategy: "auto" ("ddp" under torchrun with ``WORLD_SIZE`` > 1 or in a default process
            group of more than one rank, else "single"), "single", "ddp" or "fsdp" (FSDP2; the
            fp32 shards are the masters). Under ddp/fsdp a ``DataLoader`` is rebuilt over a
            ``DistributedSampler`` (``batch_size`` per rank), the logged loss, metrics and
            :meth:`evaluate` are averaged over the ranks, and rank 0 alone prints. See
            :mod:`mixprec.training.strategy`.
        ddp_kwargs: options for ``DistributedDataParallel`` under ``strategy="ddp"`` (e.g.
            ``{"find_unused_parameters": True}`` for a model with parameters its forward does
            not use on every step), passed to :func:`mixprec.parallel.ddp`.
        mixed_precision: a ready :class:`mixprec.MixedPrecision` instead of the precision
            keywords, ``loss_scale``, ``monitor`` and ``emulate_fp16``.

    Batches are tuples ``(inputs..., target)`` (``model(*inputs)``) or dicts of model keyword
    arguments (``model(**batch)``, the target in ``batch["labels"]``): see
    :mod:`mixprec.training.batches`.

    Attributes: ``model``, ``optimizer`` (as prepared), ``engine`` (the MixedPrecision),
    ``scaler``, ``policy``, ``scheduler``, ``history``, ``state`` (a :class:`TrainState`).

    Raises:
        ValueError: ``grad_accum_steps < 1``, a bad ``max_grad_norm``, an unknown level, dtype,
            strategy or reduce dtype; ``strategy="ddp"``/``"fsdp"`` with neither a process group
            nor torchrun's environment.
        TypeError: a non-callable ``loss_fn``, a bad callback, ``mixed_precision`` with keywords.
        RuntimeError: ``device`` is a CUDA device but CUDA is not available.

    Example:
        >>> import torch, mixprec as mp
        >>> model = torch.nn.Linear(4, 3)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> trainer = mp.Trainer(model, torch.nn.functional.cross_entropy, opt, level="O2",
        ...                      dtype="bf16", metrics="accuracy", progress=False)
        >>> data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))] * 4
        >>> trainer.fit(data, epochs=2).steps
        8
    """

    def __init__(self, model: nn.Module, loss_fn: Callable | None,
                 optimizer: torch.optim.Optimizer, *,
                 level: str = vocabulary.LEVEL, dtype: Any = vocabulary.DTYPE,
                 loss_scale: Any = "auto", metrics=None,
                 scheduler=None, grad_accum_steps: int = 1, max_grad_norm: float | None = None,
                 device=None, callbacks: Iterable[Callback] = (), compile: bool = False,
                 diagnose_overflow: bool = False, progress: bool = True, strategy: str = "auto",
                 reduce_dtype: Any = "fp32", policy: Policy | None = None, keep_fp32=None,
                 low_precision_ops=(), fp32_ops=(), master=None, state_dtype=None, fp8=None,
                 fp8_modules=None, monitor=None, emulate_fp16="auto", mixed_precision=None,
                 max_consecutive_skips: int | None = 8, loss_scaler: Any = vocabulary.UNSET,
                 ddp_kwargs: dict | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer's model must be an nn.Module; got {type(model).__name__}")
        if isinstance(callbacks, (str, bytes)) or not hasattr(callbacks, "__iter__"):
            raise TypeError(f"callbacks must be a list of mixprec.Callback instances; got "
                            f"{type(callbacks).__name__} {callbacks!r}")
        check_options(grad_accum_steps, max_grad_norm, loss_fn, scheduler, optimizer,
                      compile=compile, diagnose_overflow=diagnose_overflow, progress=progress)
        self.engine = engine_for(
            type(self), mixed_precision, level=level, dtype=dtype, policy=policy,
            loss_scale=vocabulary.alias(loss_scale, loss_scaler=loss_scaler), keep_fp32=keep_fp32,
            low_precision_ops=low_precision_ops, fp32_ops=fp32_ops, master=master,
            state_dtype=state_dtype, fp8=fp8, fp8_modules=fp8_modules, monitor=monitor,
            emulate_fp16=emulate_fp16, max_consecutive_skips=max_consecutive_skips)
        self.strategy = make_strategy(strategy, reduce_dtype, ddp_kwargs)
        self.callbacks = list(callbacks)
        if not all(isinstance(cb, Callback) for cb in self.callbacks):
            raise TypeError(f"callbacks must be mixprec.Callback instances; got {self.callbacks!r}")
        self.metrics = make_metrics(metrics)
        if loss_fn is None and shifts_labels(model):
            check_next_token(self.metrics, type(model).__name__)
        self.device = check_device(device) if device is not None else self.strategy.device(model)
        model.to(self.device)
        self.model, self.optimizer = self.strategy.setup(
            model, optimizer, self.engine.resolve_policy(self.device, model),
            ops=self.engine.op_lists)
        self.engine.adopt(self.strategy.unwrap(self.model))
        self.policy = policy_of(self.strategy.unwrap(self.model))
        self.scaler = self.engine.scaler
        self.loss_fn, self.scheduler = loss_fn, scheduler
        self.grad_accum_steps, self.max_grad_norm = grad_accum_steps, max_grad_norm
        self.diagnose_overflow, self.progress = diagnose_overflow, progress
        self._forward_loss_fn = torch.compile(self.forward_loss) if compile else self.forward_loss
        if compile and kernel_table.TABLE.master_step(self.device.type) == "compile":
            compile_master_step(self.optimizer)  # CUDA: torch's fused kernels, faster
        self.history = History()
        self.state = ts.TrainState()
        self.stop_training = False
        self.timings: dict | None = None  # set to {} to accumulate per-phase seconds
        self.last_batch = None

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (skipped ones included)."""
        return self.state.global_step

    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return self.state.epoch

    # ----------------------------------------------------------------- the step
    def forward_loss(self, batch):
        """The model's output and the loss on one batch (outputs as the policy returns them)."""
        output = batch.run(self.model)
        return compute_loss(output, batch, self.loss_fn), output

    def prepare_batch(self, batch):
        """A batch moved to the device and split into inputs and target."""
        return split_batch(to_device(batch, self.device), needs_target=self.loss_fn is not None)

    def update_metrics(self, metrics, output, batch) -> None:
        """Give each metric the batch's logits and target (ValueError: the batch has none)."""
        if not metrics:
            return
        if batch.target is None:
            raise ValueError("metrics need the batch's labels: a tuple (inputs..., target) or a "
                             "dict with 'labels'")
        logits = logits_of(output)
        for m in metrics:
            m.update(logits.detach(), batch.target)

    def _tick(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[phase] = self.timings.get(phase, 0.0) + now - start
        return now

    def _micro_step(self, batch, divisor: int, last: bool = True) -> torch.Tensor:
        """Forward, loss and scaled backward of one micro-batch; returns the detached loss.

        ``last``: the last micro-batch of its step (the gradients are reduced across ranks then).
        """
        with self.strategy.micro_batch(self.model, last):
            return self._forward_backward(batch, divisor)

    def _forward_backward(self, batch, divisor: int) -> torch.Tensor:
        t = time.perf_counter()
        batch = self.prepare_batch(batch)
        loss, output = self._forward_loss_fn(batch)
        self.update_metrics(self.metrics, output, batch)
        t = self._tick("forward", t)
        self._in_backward = True  # (an exception in it leaves partial gradients: _reopened)
        self.engine.backward(loss / divisor if divisor > 1 else loss)
        self._in_backward = False
        self._tick("backward", t)
        self.last_batch = batch
        return loss.detach()

    def _apply_update(self) -> tuple[bool, float]:
        """The engine's step (check, clip, step or skip, update the scale), then the
        scheduler when the update was applied."""
        t = time.perf_counter()  # (the scale this step used, read after it: no sync before)
        scale = self.scaler.scale_tensor.clone() if self.scaler.is_enabled() else None
        applied = self.engine.step(self.optimizer, max_grad_norm=self.max_grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        if applied and self.scheduler is not None:
            self.scheduler.step()
        self._tick("update", t)
        return applied, 1.0 if scale is None else float(scale)

    def train_step(self, micro_batches: list) -> dict:
        """One optimizer step over ``micro_batches`` (a list of batches); returns the step's logs.

        ``fit`` runs the same code; this entry point serves benchmarks and custom loops.
        """
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch; got an empty list")
        self.model.train()
        n = len(micro_batches)
        try:
            loss = sum(self._micro_step(b, n, i == n - 1)
                       for i, b in enumerate(micro_batches)) / n
        finally:  # (a custom loop handles what an exception left: fit's window does not apply)
            self.__dict__.pop("_in_backward", None)
        return self._finish_step(loss, epoch_step=None)

    def _finish_step(self, window_loss: torch.Tensor, epoch_step: int | None) -> dict:
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses
        applied, scale = self._apply_update()
        self.state.global_step += 1
        loss = self.strategy.mean(window_loss)  # averaged over the ranks
        for name, value in (("loss", loss), ("loss_scale", scale), ("skipped", not applied),
                            ("lr", lr)):
            getattr(self.history, name).append(value)
        if math.isfinite(loss):
            self.state.add_loss(loss)
        if not applied and self.diagnose_overflow:
            diagnose_overflow(self)
        return {"epoch": self.epoch + 1, "step": self.global_step, "epoch_step": epoch_step,
                "loss": loss, "loss_scale": scale, "skipped": not applied, "lr": lr}

    # ----------------------------------------------------------------- epochs
    def fit(self, train_data: Iterable, epochs: int = 1, eval_data: Iterable | None = None,
            progress: bool | None = None) -> History:
        """Train until ``epochs`` epochs are complete.

        ``epochs`` counts from the start of the run, including epochs restored by :meth:`load`,
        so ``trainer.load(ckpt); trainer.fit(data, epochs=10)`` finishes the interrupted run. A
        run restored in the middle of an epoch continues at the next batch of that epoch: the
        epoch's data order is replayed from the RNG states recorded at its start, and the
        batches already trained on are fetched and dropped.

        Args:
            train_data: re-iterable batches (tuples or dicts, see the class docstring), e.g. a
                DataLoader. For exact resume, shuffle with a seeded ``generator``.
            epochs: the total number of epochs to reach.
            eval_data: batches to :meth:`evaluate` after every epoch (metrics get a ``val_``
                prefix).
            progress: override the constructor's ``progress``.

        Returns:
            The :class:`History` (also ``trainer.history``).

        Raises:
            ValueError: empty data, ``epochs < 1``, a non-scalar loss, no ``.loss`` (loss_fn=None).
            TypeError: a one-shot iterator (e.g. a generator) for more than one epoch.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be an integer >= 1; got {epochs!r}")
        for name, data in (("train_data", train_data), ("eval_data", eval_data)):
            if data is not None and length(data) == 0:
                raise ValueError(f"{name} is empty (0 batches); nothing to train or evaluate on")
            if data is not None:
                check_reiterable(name, data, epochs - self.epoch)
        callbacks = list(self.callbacks)
        train_data = self.strategy.loader(train_data)
        show = self.progress if progress is None else progress
        if show and sys.stdout.isatty() and self.strategy.is_main:
            n = length(train_data)
            steps = None if n is None else math.ceil(n / self.grad_accum_steps)
            callbacks.append(ProgressBar(steps))
        self.state.data, self.stop_training = train_data, False
        for cb in callbacks:
            cb.on_fit_begin(self)
        try:
            while self.epoch < epochs and not self.stop_training:
                if not self._run_epoch(train_data, callbacks):
                    break
                logs = self._epoch_logs(eval_data)
                self.history.epochs.append(logs)
                self.state.epoch += 1
                self.state.new_epoch()
                for cb in callbacks:
                    cb.on_epoch_end(self, self.epoch, logs)
                self.stop_training = self.strategy.any(self.stop_training, self.device)
        except Exception as exc:
            self.strategy.failed(exc)
            raise
        finally:
            try:
                for cb in callbacks:
                    cb.on_fit_end(self)
            finally:
                self.strategy.finish()  # e.g. let gloo's threads finish before the script ends
        return self.history

    def _run_epoch(self, data, callbacks) -> bool:
        """Train one (rest of an) epoch; False when a callback stopped training mid-epoch."""
        n, accum = length(data), self.grad_accum_steps
        window, window_loss, divisor = self._reopened(n) or (0, None, accum)
        self.strategy.begin_epoch(data, self.epoch)
        it = ts.epoch_iterator(self.state, data)
        for cb in callbacks:
            cb.on_epoch_begin(self, self.epoch + 1)
        self.model.train()
        if self.state.batch_in_epoch == 0:  # (mid-epoch, resumed: what the saved part counted)
            for m in self.metrics:
                m.reset()
        # without len(): each window read ahead, so a short last one divides by its own size
        for batch, size in (windows(it, accum) if n is None else ((b, None) for b in it)):
            if window == 0:
                start = self.state.batch_in_epoch
                divisor = size if n is None else min(accum, n - start)
                self._window_start = (self.epoch, start, [m.state_dict() for m in self.metrics])
            last = n is None or window + 1 == divisor  # without len(): reduce every micro-batch
            loss = self._micro_step(batch, divisor, last)
            window_loss = loss if window_loss is None else window_loss + loss
            self.state.batch_in_epoch += 1
            window += 1
            self._open_window = ((self.epoch, self.state.batch_in_epoch),
                                 (window, window_loss, divisor))
            if window == divisor:
                self._open_window = None
                self._end_window(window_loss / divisor, callbacks)
                window, window_loss = 0, None
                if self.stop_training:
                    return False
        if window:  # a trailing partial window of data without len()
            self._end_window(window_loss / window, callbacks)
        if self.state.batch_in_epoch == 0:
            raise ValueError("train_data yielded no batches")
        return True

    def _reopened(self, n: int | None) -> tuple | None:
        """The window an exception left open (a fit stopped inside an accumulation window):
        ``(window, loss, divisor)`` to go on with where it came between micro-batches of data
        with ``len()`` (the window's gradients are held). Where it came inside a backward (the
        gradients partial), or the data has no ``len()`` (its windows are read ahead from where
        an epoch resumes), the window starts again: gradients dropped, the position and the
        metrics as at its start (its dropout masks and BatchNorm statistics drawn and updated
        again). None: nothing to go on with."""
        held = self.__dict__.pop("_open_window", None)
        start = self.__dict__.pop("_window_start", None)
        broken = self.__dict__.pop("_in_backward", False)
        if held is None and not broken:
            return None
        if not broken and n is not None and held[0] == (self.epoch, self.state.batch_in_epoch):
            return held[1]
        self.optimizer.zero_grad(set_to_none=True)
        if start is not None and start[0] == self.epoch:
            self.state.batch_in_epoch = start[1]
            for m, state in zip(self.metrics, start[2]):
                m.load_state_dict(state)
        return None

    def _end_window(self, loss: torch.Tensor, callbacks) -> None:
        logs = self._finish_step(loss, math.ceil(self.state.batch_in_epoch /
                                                 self.grad_accum_steps))
        for cb in callbacks:
            cb.on_step_end(self, logs)
        self.stop_training = self.strategy.any(self.stop_training, self.device)

    def _epoch_logs(self, eval_data) -> dict:
        total, count = self.state.epoch_loss
        logs = {"epoch": self.epoch + 1, "loss": total / count if count else float("nan")}
        logs.update(self.strategy.metric_values(self.metrics, self.device))
        if eval_data is not None:
            logs.update({f"val_{k}": v for k, v in self.evaluate(eval_data).items()})
        return logs

    def evaluate(self, data: Iterable) -> dict:
        """Mean loss (weighted by batch size) and metrics over ``data``, without gradients.

        Under ddp/fsdp a ``DataLoader`` is split over the ranks and the sums are reduced, so
        every rank returns the same numbers (see :func:`mixprec.training.evaluate.evaluate`).

        Returns:
            ``{"loss": float, <metric name>: float, ...}``.

        Raises:
            ValueError: empty data.
        """
        return evaluate(self, data)

    # ----------------------------------------------------------------- checkpoints
    def save(self, path) -> None:
        """Write everything a resumed run needs to continue bitwise identically.

        Model, optimizer (with fp32 masters), loss scaler, scheduler, step/epoch counters, the
        position in the epoch, the history, the metrics' state, and the RNG states (torch,
        CUDA, numpy, python, the data loader's generators, and those from the start of the
        current epoch). The file is written to a temporary name and renamed, so a failure
        leaves any old file intact, and it carries the SHA-256 of its content, which
        :meth:`load` checks.

        Under ddp/fsdp call it on every rank: under ddp, rank 0 writes the one file (holding
        every rank's RNG states); under fsdp, ``path`` is a directory written by all ranks
        through ``torch.distributed.checkpoint`` (aside, renamed when every rank is done; the
        checksums of its files in ``mixprec-checksums.json``).

        Raises:
            ValueError: ``path`` is a directory (a file under fsdp).
            RuntimeError: a fit was interrupted inside an accumulation window (its gradients
                are not saved): call fit() again to finish it, or save between steps.
        """
        held = self.__dict__.get("_open_window")
        if self.__dict__.get("_in_backward") or (
                held is not None and held[0] == (self.epoch, self.state.batch_in_epoch)):
            raise RuntimeError(
                "save() inside an accumulation window: the interrupted fit holds gradients of "
                "the next step's micro-batches, which a checkpoint does not hold, so a resumed "
                "run could not continue it. Call fit() again on this trainer (it finishes the "
                "window, or starts it again where a backward was cut short), or save between "
                "steps (mp.training.ModelCheckpoint, a callback's on_step_end)")
        self.strategy.save(self, path)

    def load(self, path, *, verify: bool = True) -> None:
        """Restore a :meth:`save` file; the next :meth:`fit` continues where it was saved.

        Under ddp/fsdp call it on every rank; a resumed run is bitwise equal to the
        uninterrupted one at the same world size (at another world size, only checkpoints saved
        at the end of an epoch load). Either form loads under every strategy: a one-process or
        DDP file, or an FSDP directory (read whole by each process;
        :func:`mixprec.convert_checkpoint` writes one as a file).

        Args:
            path: the file or directory :meth:`save` wrote.
            verify: check the checksums :meth:`save` wrote (False: load a checkpoint edited on
                purpose; one written before mixprec carried checksums loads unchecked).

        Raises:
            FileNotFoundError: no such file or checkpoint directory.
            ValueError: not a Trainer checkpoint, a damaged one (its content no longer matches
                its checksum; the error names the file), or one from another model, policy or
                set-up (scheduler or not, another optimizer class); the trainer is left
                unchanged.
        """
        self.strategy.load(self, path, verify=verify)
        for name in ("_open_window", "_window_start", "_in_backward"):  # (an interrupted
            self.__dict__.pop(name, None)  # window's: the loaded run steps from a step's end
        self.optimizer.zero_grad(set_to_none=True)
