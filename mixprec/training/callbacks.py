"""Callbacks of :class:`mixprec.Trainer`: a loss monitor, checkpointing, the progress bar, and
a monitor of FP8 layers' ranges.

A callback overrides any of the hooks of :class:`Callback`. ``logs`` of ``on_step_end`` is a dict
with ``epoch`` (1-based), ``step`` (optimizer steps so far, skipped ones included),
``epoch_step`` (1-based step within the epoch), ``loss``, ``loss_scale`` (the scale the step
used), ``skipped`` and ``lr``. ``logs`` of ``on_epoch_end`` holds the epoch's metrics. A callback
may set ``trainer.stop_training = True`` to stop after the current step (under ddp/fsdp every
rank stops when a callback on any rank asks to).

Under ddp/fsdp callbacks run on every rank; :class:`LossMonitor` and the progress bar print on
rank 0 only, and :class:`ModelCheckpoint` has every rank take part in the save (a collective)
while rank 0 alone writes the file and deletes old ones.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm.auto import tqdm

from ..debug.fp8stats import FP8RangeWarning, FP8Stats, fp8_stats
from ..parallel import is_main_process

__all__ = ["Callback", "LossMonitor", "ModelCheckpoint", "ProgressBar", "FP8Monitor"]


class Callback:
    """Base class: every hook is a no-op."""

    def on_fit_begin(self, trainer) -> None:
        pass

    def on_epoch_begin(self, trainer, epoch: int) -> None:
        pass

    def on_step_end(self, trainer, logs: dict) -> None:
        pass

    def on_epoch_end(self, trainer, epoch: int, logs: dict) -> None:
        pass

    def on_fit_end(self, trainer) -> None:
        pass


class LossMonitor(Callback):
    """Print the loss every ``per_print_times`` steps, as MindSpore's ``LossMonitor`` does.

    Output looks like ``epoch: 1 step: 32, loss is 2.3018966`` (the step counted within the
    epoch, the loss printed as a float32). Under ddp/fsdp only rank 0 prints, the loss averaged
    over the ranks.

    Args:
        per_print_times: print every this many optimizer steps (and never when 0).
        print_fn: where the line goes (default ``print``).
    """

    def __init__(self, per_print_times: int = 1, print_fn: Callable[[str], None] = print):
        if (isinstance(per_print_times, bool) or not isinstance(per_print_times, int)
                or per_print_times < 0):
            raise ValueError(f"per_print_times must be an integer >= 0; got {per_print_times!r}")
        if not callable(print_fn):
            raise TypeError(f"print_fn must be callable (print, a logger's info); got "
                            f"{type(print_fn).__name__} {print_fn!r}")
        self.per_print_times = per_print_times
        self.print_fn = print_fn

    def on_step_end(self, trainer, logs: dict) -> None:
        if not is_main_process():
            return
        if self.per_print_times and logs["epoch_step"] % self.per_print_times == 0:
            self.print_fn(f"epoch: {logs['epoch']} step: {logs['epoch_step']}, "
                          f"loss is {str(np.float32(logs['loss']))}")


class ModelCheckpoint(Callback):
    """Save the trainer (``Trainer.save``) every ``every_n_steps`` steps and/or every epoch.

    Files are ``{directory}/{prefix}-step{N}.pt`` (under fsdp, directories
    ``{prefix}-step{N}``); with ``keep_last`` only the newest that many are kept. ``last_path``
    is the newest checkpoint written. Under ddp/fsdp it runs on every rank (saving is
    collective); rank 0 alone deletes old checkpoints.

    Args:
        directory: where to write (created if missing).
        every_n_steps: save after every this many optimizer steps (None: never mid-epoch).
        every_epoch: save at the end of every epoch.
        keep_last: how many files to keep (None keeps all).
        prefix: file name prefix.
    """

    def __init__(self, directory, every_n_steps: int | None = None, every_epoch: bool = True,
                 keep_last: int | None = None, prefix: str = "ckpt"):
        for name, value in (("every_n_steps", every_n_steps), ("keep_last", keep_last)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1; got {value!r}")
        if not isinstance(every_epoch, bool):
            raise TypeError(f"every_epoch must be True or False; got {every_epoch!r}")
        if every_n_steps is None and not every_epoch:
            raise ValueError("this ModelCheckpoint would never save: give every_n_steps, or "
                             "keep every_epoch=True")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty string; got {prefix!r}")
        self.directory = Path(directory)
        self.every_n_steps = every_n_steps
        self.every_epoch = every_epoch
        self.keep_last = keep_last
        self.prefix = prefix
        self.saved: list[Path] = []

    @property
    def last_path(self) -> Path | None:
        return self.saved[-1] if self.saved else None

    def _save(self, trainer) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        suffix = getattr(getattr(trainer, "strategy", None), "checkpoint_suffix", ".pt")
        path = self.directory / f"{self.prefix}-step{trainer.global_step}{suffix}"
        if self.saved and self.saved[-1] == path:
            return
        trainer.save(path)
        self.saved.append(path)
        while self.keep_last is not None and len(self.saved) > self.keep_last:
            old = self.saved.pop(0)
            if not is_main_process():
                continue
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                os.remove(old)

    def on_step_end(self, trainer, logs: dict) -> None:
        if self.every_n_steps and logs["step"] % self.every_n_steps == 0:
            self._save(trainer)

    def on_epoch_end(self, trainer, epoch: int, logs: dict) -> None:
        if self.every_epoch:
            self._save(trainer)


class ProgressBar(Callback):
    """A ``tqdm`` bar per epoch showing the loss and the loss scale.

    Args:
        total: optimizer steps per epoch, or None when unknown.
        file: the stream (default ``sys.stdout``).
    """

    def __init__(self, total: int | None = None, file=None):
        self.total = total
        self.file = file
        self._bar = None

    def on_epoch_begin(self, trainer, epoch: int) -> None:
        self._bar = tqdm(total=self.total, desc=f"epoch {epoch}", file=self.file or sys.stdout,
                         leave=True, dynamic_ncols=True)

    def on_step_end(self, trainer, logs: dict) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{logs['loss']:.4g}", scale=f"{logs['loss_scale']:g}",
                                  refresh=False)

    def on_epoch_end(self, trainer, epoch: int, logs: dict) -> None:
        self._close()

    def on_fit_end(self, trainer) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class FP8Monitor(Callback):
    """Warn when an FP8 layer's tensors saturate or flush to zero beyond a limit.

    From the start of ``fit`` it records :func:`mixprec.debug.fp8_stats` on the trainer's model
    (on the device: no host sync per step). Every ``every_n_steps`` optimizer steps, and at the
    end of ``fit``, it reads them (one host sync per FP8 layer), issues one
    :class:`mixprec.debug.FP8RangeWarning` listing every layer and tensor (input, weight, output
    gradient) whose fraction of saturated or flushed-to-zero values, averaged over the steps
    since the last check, crossed its limit, and starts a new window. Under ddp/fsdp each rank
    checks its own layers.

    Args:
        every_n_steps: steps between checks.
        max_saturated: the largest fraction of saturated (or inf/NaN) values.
        max_underflow: the largest fraction of nonzero values flushed to zero.

    Attributes:
        stats: the :class:`mixprec.debug.FP8Stats` recording (None before ``fit``).
        alerts: every line warned so far, with the step it was found at.
    """

    def __init__(self, every_n_steps: int = 100, max_saturated: float = 1e-4,
                 max_underflow: float = 0.01):
        if (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be an integer >= 1; got {every_n_steps!r}")
        for name, value in (("max_saturated", max_saturated), ("max_underflow", max_underflow)):
            if not (isinstance(value, (int, float)) and 0 <= value <= 1):
                raise ValueError(f"{name} must be a fraction in [0, 1]; got {value!r}")
        self.every_n_steps = every_n_steps
        self.max_saturated, self.max_underflow = max_saturated, max_underflow
        self.stats: FP8Stats | None = None
        self.alerts: list[tuple[int, str]] = []

    def on_fit_begin(self, trainer) -> None:
        self.stats = fp8_stats(trainer.model)

    def on_step_end(self, trainer, logs: dict) -> None:
        if logs["step"] % self.every_n_steps == 0:
            self._check(trainer.global_step)

    def on_fit_end(self, trainer) -> None:
        if self.stats is not None:
            self._check(trainer.global_step)
            self.stats.close()

    def _check(self, step: int) -> None:
        lines = self.stats.alerts(self.max_saturated, self.max_underflow)
        self.stats.reset()
        if lines:
            self.alerts += [(step, line) for line in lines]
            warnings.warn(f"FP8 ranges at step {step}:\n  " + "\n  ".join(lines),
                          FP8RangeWarning, stacklevel=2)
