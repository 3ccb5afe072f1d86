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

    def state_dict(self) -> dict:
        """What has accumulated since :meth:`reset` (:meth:`mixprec.Trainer.save` writes it, so
        an epoch resumed mid-way counts every batch once): the attributes that are numbers,
        strings or tensors (copies). Override both methods for state of other types."""
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in vars(self).items() if isinstance(v, _PLAIN)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`."""
        for k, v in state.items():
            setattr(self, k, v.clone() if isinstance(v, torch.Tensor) else v)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_PLAIN = (bool, int, float, str, type(None), torch.Tensor)


class Accuracy(Metric):
    """Top-1 accuracy of class scores against class indices: scores ``(N, C, ...)`` (torch's
    layout, as ``F.cross_entropy`` takes them) against targets ``(N, ...)``, or scores
    ``(N, ..., C)`` (Hugging Face's token logits ``(N, T, C)``) against ``(N, ...)``: the class
    dimension is the one the target's shape leaves out.

    Targets given as probabilities or one-hot rows (same shape as the output) are compared by
    their argmax. ``compute()`` returns a fraction in [0, 1] (NaN before any update).

    Args:
        class_dim: the scores' class dimension (1 or -1); None: read from the shapes (where
            both fit, ``(N, C, C)`` scores against ``(N, C)`` targets, an update refuses to
            guess).
        ignore_index: a target value that is not counted (as ``F.cross_entropy`` ignores it:
            -100, Hugging Face's label for padding and for the tokens after the first of a
            word), or None to count every target.
        next_token: the scores at position t are of the token at t + 1 (a causal language
            model given ``labels=input_ids``, which shifts them for its own loss: GPT-2, Llama):
            each position's scores are compared with the next target. False: with the target
            at the same position; None (default): False, and a :class:`mixprec.Trainer` with
            ``loss_fn=None`` on a Hugging Face causal language model asks for one of the two.
    """

    name = "accuracy"
    sum_state = ("correct", "total")

    def __init__(self, class_dim: int | None = None, ignore_index: int | None = -100,
                 next_token: bool | None = None):
        if class_dim not in (None, 1, -1):
            raise ValueError(f"class_dim must be None, 1 or -1; got {class_dim!r}")
        if next_token not in (None, True, False):
            raise ValueError(f"next_token must be None, True or False; got {next_token!r}")
        self.next_token = next_token
        if ignore_index is not None and (isinstance(ignore_index, bool)
                                         or not isinstance(ignore_index, int)):
            raise ValueError(f"ignore_index must be an integer or None; got {ignore_index!r}")
        self.class_dim, self.ignore_index = class_dim, ignore_index
        self.reset()

    def reset(self) -> None:
        self.correct = 0  # an int, or a device tensor while updates accumulate (no host sync)
        self.total = 0

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        if self.next_token:
            if output.dim() != 3 or target.dim() != 2:
                raise ValueError(f"Accuracy(next_token=True) takes token scores (N, T, C) and "
                                 f"targets (N, T); got output {tuple(output.shape)} and target "
                                 f"{tuple(target.shape)}")
            output, target = output[:, :-1], target[:, 1:]
        if target.shape == output.shape and target.is_floating_point():
            target = target.argmax(dim=1 if self.class_dim is None else self.class_dim)
        fits = [d for d in (1, -1) if self.class_dim in (None, d) and output.dim() >= 2
                and tuple(target.shape) == _without(output.shape, d)]
        if not fits:
            raise ValueError(f"Accuracy needs class scores (N, C, ...) or (N, ..., C) and targets "
                             f"(N, ...), the scores' shape without its class dimension; got "
                             f"output {tuple(output.shape)} and target {tuple(target.shape)}")
        if len(fits) == 2 and output.dim() > 2:
            raise ValueError(f"Accuracy can't tell the class dimension of scores "
                             f"{tuple(output.shape)} against targets {tuple(target.shape)}: both "
                             f"(N, C, T) and (N, T, C) fit. Pass metrics=[mp.Accuracy(class_dim=1)]"
                             f" (torch's layout) or mp.Accuracy(class_dim=-1) (token logits)")
        pred = output.argmax(dim=fits[0])
        if self.ignore_index is None or target.is_floating_point():
            self.correct = (pred == target).sum() + self.correct
            self.total = target.numel() + self.total
            return
        counted = target != self.ignore_index
        self.correct = ((pred == target) & counted).sum() + self.correct
        self.total = counted.sum() + self.total  # (a device tensor: no host sync)

    def compute(self) -> float:
        total = int(self.total)
        return int(self.correct) / total if total else float("nan")


def _without(shape: torch.Size, dim: int) -> tuple[int, ...]:
    dim %= len(shape)
    return tuple(shape[:dim]) + tuple(shape[dim + 1:])


class MeanAbsoluteError(Metric):
    """Mean absolute difference between output and target (computed in fp32), element by
    element: outputs of another shape with as many elements (``(N, 1)`` against ``(N,)``)
    are compared as after a squeeze; others are refused."""

    name = "mae"
    sum_state = ("sum", "count")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sum = 0.0
        self.count = 0

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        if output.shape != target.shape:
            if output.numel() != target.numel():
                raise ValueError(f"mae compares output and target element by element; got "
                                 f"output {tuple(output.shape)} and target "
                                 f"{tuple(target.shape)} (broadcasting them would compare "
                                 f"every output with every target)")
            output = output.reshape(target.shape)  # (N, 1) against (N,): as after a squeeze
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
