"""Seeing a run: :class:`PrecisionMonitor` records a mixed-precision run over time into
TensorBoard, JSONL or a trainer's loggers, and ``mixprec report`` turns a record into a page.

* :mod:`~mixprec.monitor.monitor`: the monitor, driven by :class:`mixprec.MixedPrecision`;
* :mod:`~mixprec.monitor.statistics`: what it measures, on the device;
* :mod:`~mixprec.monitor.writers`: the writers, and :func:`read_run`;
* :mod:`~mixprec.monitor.report`: the HTML report, with :mod:`~mixprec.monitor.run` (the
  record it reads) and :mod:`~mixprec.monitor.plots` (its plots).
"""

from .monitor import PrecisionMonitor
from .writers import CallbackWriter, JSONLWriter, TensorBoardWriter, read_run

__all__ = ["PrecisionMonitor", "JSONLWriter", "TensorBoardWriter", "CallbackWriter", "read_run"]
