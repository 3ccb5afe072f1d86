"""Validation of a :class:`mixprec.Trainer`'s arguments and data (clear errors up front)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..engine_checks import check_max_norm
from .metrics import Accuracy

__all__ = ["check_options", "check_device", "check_reiterable", "length", "check_next_token"]


def check_options(grad_accum_steps, max_grad_norm, loss_fn, scheduler=None, optimizer=None,
                  **flags) -> None:
    if (isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int)
            or grad_accum_steps < 1):
        raise ValueError(f"grad_accum_steps must be an integer >= 1; got {grad_accum_steps!r}")
    check_max_norm(max_grad_norm)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (output, target) -> scalar, or None to use the "
                        f"model output's .loss; got {loss_fn!r}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"Trainer's optimizer must be a torch.optim.Optimizer over the model's "
                        f"parameters, e.g. torch.optim.AdamW(model.parameters()); got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):  # (torch's own TypeError at the first step)
        raise TypeError("Trainer steps without a closure, and LBFGS re-evaluates the loss "
                        "through one (torch.amp.GradScaler refuses closures too): step it "
                        "yourself, model, opt = mp.prepare(model, opt, level=...) then "
                        "opt.step(closure), at a level without a loss scale")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False; got {value!r}")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"scheduler must be an LR scheduler over the optimizer (with a step() "
                        f"method), or None; got {scheduler!r}")
    if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("scheduler was made for another optimizer than the Trainer's: make it "
                         "over the optimizer you pass, e.g. StepLR(opt, ...) with "
                         "Trainer(model, loss_fn, opt, scheduler=...)")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "scheduler=ReduceLROnPlateau steps on a metric, and the Trainer steps its scheduler "
            "after every applied update with no argument. Pass scheduler=None and step it from "
            "a callback: class Plateau(mp.training.Callback): def on_epoch_end(self, trainer, "
            "epoch, logs): sched.step(logs['val_loss'])  (with eval_data; or logs['loss'])")


def check_next_token(metrics, model_name: str) -> None:
    """A Hugging Face causal language model (``model_name``) with ``loss_fn=None``: refuse an
    accuracy that does not say how its scores align with the labels (most such models score the
    next token at each position and shift the labels for their loss; some do not)."""
    if any(isinstance(m, Accuracy) and m.next_token is None for m in metrics):
        raise ValueError(
            f"metrics has an accuracy, and {model_name} is a causal language model: its scores "
            f"at a position are most often those of the next token (GPT-2, Llama: the model "
            f"shifts its labels for its loss), and accuracy against the labels at the same "
            f"position reads near 0. Say which: metrics=[mp.Accuracy(next_token=True)] (or "
            f"next_token=False where the model's loss does not shift)")


def check_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device or a device string such as 'cpu' or "
                         f"'cuda:0'; got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was asked for, but CUDA is not available here "
                           f"(torch {torch.__version__}); train on 'cpu' or install a CUDA build")
    return dev


def check_reiterable(name: str, data, epochs_left: int) -> None:
    if epochs_left > 1 and isinstance(data, Iterator):  # iter() would draw a loader's RNG
        raise TypeError(f"{name} is a one-shot iterator ({type(data).__name__}): it would be "
                        f"exhausted after the first of {epochs_left} epochs. Pass something "
                        f"that can be iterated again, e.g. a list of batches or a DataLoader")


def length(data) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None
