"""How the Trainer reads a batch and a model output: tuples, dicts, Hugging Face ``ModelOutput``.

* A tuple or list ``(inputs..., target)`` calls ``model(*inputs)``; ``loss_fn(output, target)``.
* A dict (a Hugging Face batch: ``input_ids``, ``attention_mask``, ``labels``, ...) calls
  ``model(**batch)``; the target is ``batch["labels"]`` (None without one).
* With ``loss_fn=None`` the loss is the output's ``.loss`` (``output["loss"]`` for a dict): what
  a Hugging Face model computes when the batch holds ``labels``.
* Metrics and a given ``loss_fn`` see the output's ``logits`` when the output is a
  ``ModelOutput`` or a dict with one, else the output itself. A floating output and a floating
  target of different dtypes (a bf16 output at O3, an fp32 target) reach ``loss_fn`` in the
  wider dtype.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["Batch", "split_batch", "to_device", "logits_of", "compute_loss", "windows",
           "shifts_labels"]

LABEL_KEYS = ("labels", "label")


@dataclasses.dataclass
class Batch:
    """One batch, split into what the model takes and the target."""

    args: tuple
    kwargs: dict
    target: Any

    def run(self, model: Callable) -> Any:
        return model(*self.args, **self.kwargs)

    def size(self) -> int:
        """The batch size: the first dimension of the target, else of the first input tensor."""
        for t in (self.target, *self.args, *self.kwargs.values()):
            if isinstance(t, torch.Tensor) and t.dim():
                return t.shape[0]
        return 1


def to_device(x, device: torch.device):
    """``x`` with every tensor in it (nested in lists, tuples and dicts) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, (list, tuple)):
        moved = [to_device(v, device) for v in x]
        return type(x)(*moved) if hasattr(x, "_fields") else type(x)(moved)  # a namedtuple
    if isinstance(x, Mapping):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def split_batch(batch, needs_target: bool) -> Batch:
    """Split a batch (see the module docstring).

    Raises:
        TypeError: a batch that is neither a tuple/list nor a dict, or a tuple without a target
            when ``loss_fn`` needs one.
    """
    if isinstance(batch, Mapping):
        target = next((batch[k] for k in LABEL_KEYS if k in batch), None)
        return Batch((), dict(batch), target)
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return Batch(tuple(batch[:-1]), {}, batch[-1])
    if not needs_target:
        args = tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)
        return Batch(args, {}, None)
    what = type(batch).__name__
    if isinstance(batch, (list, tuple)):
        what += f" of length {len(batch)}"
    raise TypeError(f"each batch must be a tuple (inputs..., target) or a dict of model keyword "
                    f"arguments (with 'labels' for the target); got {what}")


def logits_of(output):
    """The ``logits`` of a ``ModelOutput`` or a dict holding one, else ``output`` itself."""
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    logits = getattr(output, "logits", None)
    return output if logits is None else logits


def shifts_labels(model) -> bool:
    """A Hugging Face causal language model: its logits at position t score the token at t + 1,
    and it shifts its ``labels`` for its own loss (``labels=input_ids``)."""
    if not type(model).__module__.startswith("transformers."):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - another transformers layout
        return False
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _promoted(output, target):
    """A floating output and target of different dtypes meet in the wider one (torch's type
    promotion, made explicit: some losses' CUDA backward kernels refuse mixed dtypes)."""
    if (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)
            and output.is_floating_point() and target.is_floating_point()
            and output.dtype != target.dtype):
        wide = torch.promote_types(output.dtype, target.dtype)
        return output.to(wide), target.to(wide)
    return output, target


def compute_loss(output, batch: Batch, loss_fn: Callable | None) -> torch.Tensor:
    """``loss_fn(logits or output, target)``, or the output's own ``loss`` when it is None.

    Raises:
        ValueError: ``loss_fn`` is None and the output carries no loss; the loss is not a
            floating scalar.
    """
    if loss_fn is None:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss",
                                                                               None)
        if loss is None:
            raise ValueError(
                f"loss_fn=None takes the loss from the model's output (.loss, as Hugging Face "
                f"models return when the batch holds 'labels'), but this "
                f"{type(output).__name__} has none: give the batch labels, or pass a loss_fn")
    else:
        loss = loss_fn(*_promoted(logits_of(output), batch.target))
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"the loss must be a floating scalar (0-d) tensor; got a "
                         f"{type(loss).__name__}: return the loss tensor itself from loss_fn")
    if loss.dim() != 0:
        raise ValueError(f"the loss must be a floating scalar (0-d) tensor; got shape "
                         f"{tuple(loss.shape)}: reduce it, e.g. with reduction='mean'")
    if not loss.is_floating_point():
        raise ValueError(f"the loss must be a floating scalar (0-d) tensor; got a {loss.dtype} "
                         f"one: compute it in floating point (a count or an argmax has no "
                         f"gradient)")
    return loss


def windows(batches, size: int):
    """``(batch, the size of its window)`` for each batch, the batches taken ``size`` at a time:
    a window's batches are read before its first is yielded, so the last window's size is known
    at its start when the data has no ``len()`` (an ``IterableDataset``, a generator)."""
    it = iter(batches)
    while window := list(itertools.islice(it, size)):
        for batch in window:
            yield batch, len(window)

