"""What a loss scaler records during one iteration: each optimizer's stage (ready -> unscaled ->
stepped) with what its step carries, and the step counters.

A scaler keeps one :class:`OptimizerRecord` per optimizer seen since the last ``update()``, in a
:class:`StageBook`; the book enforces the call order of an iteration and is cleared by
``update()``.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = ["Stage", "OptimizerRecord", "QueuedStep", "StageBook", "Counters", "SEQUENCE",
           "check_not_stepped"]

#: The call order of one iteration, quoted by every error about it.
SEQUENCE = ("the order per iteration is scale(loss).backward() -> [unscale_(opt) or "
            "clip_grad_norm_(opt, ...)] -> step(opt) -> update()")


class Stage(enum.Enum):
    """Where an optimizer is in the current iteration."""

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclasses.dataclass
class OptimizerRecord:
    """One optimizer in the current iteration.

    Attributes:
        stage: its :class:`Stage`.
        found_inf: the 0-d inf/NaN flag of the gradients its step reads (None: not checked).
        grad_scale: the factor the gradients its step reads still carry (None: none).
        scaled: how many losses the scaler had scaled when they were unscaled (or a clip
            folded): one more since means scaled gradients were added to unscaled ones.
        bad_params: names of the parameters with non-finite gradients, set when this step
            reached the dynamic scaler's min-scale limit.
        folded_on: with a clip folded (no loss scale), the gradients it measured and their
            versions (:func:`.windows.versions`): a backward since changes them.
        kept_on: for a record an ``update()`` kept (unscaled or clipped, not stepped), the
            losses scaled then and the gradients' :func:`.windows.versions`: a scaled loss or a
            backward since ends it.
    """

    stage: Stage = Stage.READY
    found_inf: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None
    bad_params: list[str] | None = None
    scaled: int = 0  # the scaler's count of scaled losses when it was unscaled or clipped
    folded_on: list | None = None
    kept_on: list | None = None


@dataclasses.dataclass
class QueuedStep:
    """A step a scaler queued (``LossScaler.queue_step``).

    Attributes:
        optimizer: the optimizer stepped.
        record: its record in this iteration.
        owner: it owns the gradients its step reads.
        flag: the 0-d overflow flag its kernels skip on (None: the outcome is known).
        stepped: applied (True), skipped (False), or None until the flag is read.
    """

    optimizer: object
    record: OptimizerRecord
    owner: bool
    flag: torch.Tensor | None = None
    stepped: bool | None = None


@dataclasses.dataclass
class Counters:
    """Steps since the scaler was made (they travel in its ``state_dict``)."""

    skipped_steps: int = 0
    applied_steps: int = 0


class StageBook:
    """The :class:`OptimizerRecord` of each optimizer seen since the last ``update()``."""

    def __init__(self) -> None:
        self._records: dict[int, OptimizerRecord] = {}

    def __bool__(self) -> bool:
        return bool(self._records)

    def get(self, optimizer) -> OptimizerRecord | None:
        """The optimizer's record, or None when it was not seen in this iteration."""
        return self._records.get(id(optimizer))

    def ensure(self, optimizer) -> OptimizerRecord:
        """The optimizer's record, made (ready) when it was not seen in this iteration."""
        return self._records.setdefault(id(optimizer), OptimizerRecord())

    def ready(self, optimizer, what: str) -> OptimizerRecord:
        """The optimizer's record, which must still be ready for ``what`` (a call's name).

        Raises:
            RuntimeError: ``what`` comes after unscale_()/clip_grad_norm_() or step() on this
                optimizer in this iteration.
        """
        record = self.ensure(optimizer)
        if record.stage is not Stage.READY:
            done = ("unscale_() or clip_grad_norm_()" if record.stage is Stage.UNSCALED
                    else "step()")
            raise RuntimeError(f"{what} called on an optimizer after {done} since the last "
                               f"update(); {SEQUENCE}")
        return record

    def stepped(self) -> list[OptimizerRecord]:
        """The records of the optimizers stepped (or skipped) in this iteration."""
        return [r for r in self._records.values() if r.stage is Stage.STEPPED]

    def clear(self, keep: dict[int, OptimizerRecord] | None = None) -> None:
        """Start a new iteration (``keep``: records carried into it, by optimizer id)."""
        self._records = dict(keep or {})

    def unstepped(self) -> dict[int, OptimizerRecord]:
        """The records of the optimizers unscaled or clipped in this iteration, not stepped."""
        return {key: r for key, r in self._records.items() if r.stage is Stage.UNSCALED}

    def kept(self) -> dict[int, OptimizerRecord]:
        """The records an ``update()`` kept, by optimizer id."""
        return {key: r for key, r in self._records.items() if r.kept_on is not None}

    def discard_id(self, key: int) -> None:
        """Forget the record of the optimizer whose id is ``key``."""
        self._records.pop(key, None)

    def get_by_id(self, key: int) -> OptimizerRecord | None:
        """The record of the optimizer whose id is ``key``, or None."""
        return self._records.get(key)

    def discard(self, optimizer) -> None:
        """Forget ``optimizer``'s record (it is ready again)."""
        self._records.pop(id(optimizer), None)


def check_not_stepped(record: OptimizerRecord, what: str) -> None:
    """Raise RuntimeError when ``what`` (a call's name) comes after step() in this iteration."""
    if record.stage is Stage.STEPPED:
        raise RuntimeError(f"{what} called on an optimizer after step() since the last "
                           f"update(); {SEQUENCE}")
