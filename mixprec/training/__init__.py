"""The training API: :class:`Trainer`, its :class:`History`, callbacks and metrics.

* :mod:`.trainer`: the Trainer (prepare, scale, accumulate, clip, step, resume).
* :mod:`.state`: checkpoint state and RNG snapshots for exact resume (its files are written and
  checked through :mod:`mixprec.integrity`).
* :mod:`.strategy`, :mod:`.sharded`: one process, DDP or FSDP2 (``Trainer(strategy=...)``).
* :mod:`.history`, :mod:`.callbacks`, :mod:`.metrics`.
"""

from .callbacks import Callback, FP8Monitor, LossMonitor, ModelCheckpoint, ProgressBar
from .history import History
from .metrics import Accuracy, MeanAbsoluteError, Metric, make_metrics
from .trainer import Trainer

__all__ = ["Trainer", "History", "Callback", "LossMonitor", "ModelCheckpoint", "ProgressBar",
           "FP8Monitor",
           "Metric", "Accuracy", "MeanAbsoluteError", "make_metrics"]
