"""What :meth:`mixprec.Trainer.fit` records: per-step loss, scale, skips and rate; per-epoch
metrics."""

from __future__ import annotations

import dataclasses

__all__ = ["History"]


@dataclasses.dataclass
class History:
    """What a :meth:`Trainer.fit` recorded.

    Attributes:
        loss: per optimizer step, the mean loss of its micro-batches (unscaled).
        loss_scale: per step, the loss scale the step used.
        skipped: per step, True when the update was skipped (non-finite gradients).
        lr: per step, the learning rate the step used (first parameter group).
        epochs: per epoch, a dict of metrics (``epoch``, ``loss``, train metrics, ``val_*``).
        overflows: what ``diagnose_overflow=True`` found: one dict per distinct first cause
            (``step``, ``scale``, ``cause``, ``report``, ``repeats``: later steps with it).
    """

    loss: list = dataclasses.field(default_factory=list)
    loss_scale: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    lr: list = dataclasses.field(default_factory=list)
    epochs: list = dataclasses.field(default_factory=list)
    overflows: list = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.loss)

    def metric(self, name: str) -> list:
        """The per-epoch values of one metric (e.g. ``"val_accuracy"``)."""
        return [e[name] for e in self.epochs if name in e]

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, list(state.get(f.name, [])))
