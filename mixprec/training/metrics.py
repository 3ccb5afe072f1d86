"""Metrics the :class:`mixprec.Trainer` accumulates over batches: a small reset/update/compute
protocol."""

from __future__ import annotations

import torch

__all__ = ["Metric", "Accuracy", "MeanAbsoluteError", "make_metrics"]


class Metric:
    """A quantity accumulated over batches.

    Subclasses set ``name`` and implement ``reset()``, ``update(output, target)`` and
    ``compute() -> float``. ``update`` receives the model's output (detached) and the batch
    target; it must not keep references to them.

    Under ddp/fsdp, ``sum_state`` names the attributes that add up across ranks (numbers or
    0-d tensors): they are summed over the ranks before ``compute()``, so the result is that of
    one process seeing every batch. A metric without ``sum_state`` is averaged over the ranks.
    """

    name = "metric"
    sum_state: tuple[str, ...] = ()

    def reset(self) -> None:
        raise NotImplementedError

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        raise NotImplementedError

    def compute(self) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Accuracy(Metric):
    """Top-1 accuracy of class scores ``(N, C, ...)`` against class indices ``(N, ...)``.

    Targets given as probabilities or one-hot rows (same shape as the output) are compared by
    their argmax. ``compute()`` returns a fraction in [0, 1] (NaN before any update).
    """

    name = "accuracy"
    sum_state = ("correct", "total")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.correct = 0  # an int, or a device tensor while updates accumulate (no host sync)
        self.total = 0

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        if target.shape == output.shape and target.is_floating_point():
            target = target.argmax(dim=1)
        if output.dim() != target.dim() + 1:
            raise ValueError(f"Accuracy needs class scores of shape (N, C, ...) and targets "
                             f"(N, ...); got output {tuple(output.shape)} and target "
                             f"{tuple(target.shape)}")
        pred = output.argmax(dim=1)
        self.correct = (pred == target).sum() + self.correct
        self.total += target.numel()

    def compute(self) -> float:
        return int(self.correct) / self.total if self.total else float("nan")


class MeanAbsoluteError(Metric):
    """Mean absolute difference between output and target (computed in fp32)."""

    name = "mae"
    sum_state = ("sum", "count")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sum = 0.0
        self.count = 0

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        self.sum = (output.float() - target.float()).abs().sum(dtype=torch.float64) + self.sum
        self.count += output.numel()

    def compute(self) -> float:
        return float(self.sum) / self.count if self.count else float("nan")


_BY_NAME = {"accuracy": Accuracy, "acc": Accuracy, "mae": MeanAbsoluteError}


def make_metrics(spec) -> list[Metric]:
    """Metrics from None, a name (``"accuracy"``, ``"mae"``), a :class:`Metric`, or a list of those.

    Raises:
        ValueError: an unknown metric name, or two metrics with the same name.
        TypeError: anything else.
    """
    if spec is None:
        return []
    items = [spec] if isinstance(spec, (str, Metric)) else spec
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"metrics must be None, a name, a Metric or a list of them; "
                        f"got {type(spec).__name__}")
    metrics = []
    for item in items:
        if isinstance(item, str):
            if item.lower() not in _BY_NAME:
                raise ValueError(f"unknown metric {item!r}; known: {', '.join(sorted(_BY_NAME))}")
            item = _BY_NAME[item.lower()]()
        elif not isinstance(item, Metric):
            raise TypeError(f"metrics entries must be names or Metric instances; got {item!r}")
        metrics.append(item)
    names = [m.name for m in metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"metric names must be distinct; got {names}")
    return metrics
