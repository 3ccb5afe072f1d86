"""Evaluating a :class:`mixprec.Trainer`'s model: mean loss and metrics, without gradients."""

from __future__ import annotations

import copy
from typing import Iterable

import torch

__all__ = ["evaluate"]


def evaluate(trainer, data: Iterable) -> dict:
    """Mean loss (weighted by batch size) and metrics over ``data``, without gradients.

    Under ddp/fsdp a ``DataLoader`` is split over the ranks (a ``DistributedSampler``, which
    repeats a few samples when the dataset does not divide evenly) and the sums are reduced,
    so every rank returns the same numbers.

    Raises:
        ValueError: empty data.
    """
    data = trainer.strategy.loader(data)
    metrics = [copy.deepcopy(m) for m in trainer.metrics]
    for m in metrics:
        m.reset()
    was_training = trainer.model.training
    trainer.model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for batch in data:
                batch = trainer.prepare_batch(batch)
                loss, output = trainer.forward_loss(batch)
                size = batch.size()
                total, count = total + float(loss) * size, count + size
                trainer.update_metrics(metrics, output, batch)
    finally:
        trainer.model.train(was_training)
    total, count = trainer.strategy.sum([total, count], trainer.device)
    if count == 0:
        raise ValueError("evaluation data is empty (0 batches)")
    return {"loss": total / count, **trainer.strategy.metric_values(metrics, trainer.device)}
