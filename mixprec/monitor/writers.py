"""Where a :class:`mixprec.PrecisionMonitor` sends its scalars, and how a run is read back.

A writer is any object with ``write(step, scalars)`` (``scalars``: name -> float) and
``close()``. Two ship here: :class:`JSONLWriter` (one JSON object per recorded step, plain
text, no dependency) and :class:`TensorBoardWriter` (event files through
``torch.utils.tensorboard``; ``pip install mixprec[tensorboard]``). :func:`read_run` reads
either back into ``{name: [(step, value), ...]}``, the form ``mixprec report`` plots.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable

__all__ = ["JSONLWriter", "TensorBoardWriter", "CallbackWriter", "read_run"]


class JSONLWriter:
    """Append one JSON object per recorded step to ``path``: ``{"step": n, name: value, ...}``.

    The file is opened for each line and closed after it, so a run that dies keeps every
    recorded step and nothing is left open.
    Non-finite values (an inf gradient norm) are written as the strings "inf", "-inf", "nan".

    Args:
        path: the file (created, with its folder; an existing file is appended to).
    """

    def __init__(self, path):
        self.path = pathlib.Path(os.fspath(path))
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, scalars: dict) -> None:
        """Append ``{"step": step, **scalars}`` as one line."""
        row = {"step": int(step), **{k: _finite_or_text(v) for k, v in scalars.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        """Nothing is held open."""

    def __repr__(self) -> str:
        return f"JSONLWriter({str(self.path)!r})"


class TensorBoardWriter:
    """Scalars into TensorBoard event files under ``log_dir`` (``tensorboard --logdir``).

    Built on ``torch.utils.tensorboard.SummaryWriter``; needs the ``tensorboard`` package
    (``pip install mixprec[tensorboard]``). Each recorded step is flushed to disk.

    Args:
        log_dir: the run's folder.

    Raises:
        ImportError: tensorboard is not installed (the message names the extra).
    """

    def __init__(self, log_dir):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # pragma: no cover - the error names the extra
            raise ImportError("TensorBoardWriter needs the tensorboard package: "
                              "pip install 'mixprec[tensorboard]'") from exc
        self.log_dir = os.fspath(log_dir)
        self._writer = SummaryWriter(self.log_dir)

    def write(self, step: int, scalars: dict) -> None:
        """One scalar event per name at ``step``."""
        for name, value in scalars.items():
            self._writer.add_scalar(name, float(value), int(step))
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardWriter({self.log_dir!r})"


class CallbackWriter:
    """A writer that hands each recorded step to a function: ``fn(step, scalars)``.

    What the integrations use to log through a trainer's own loggers.

    Args:
        fn: called with the step and the scalars.
    """

    def __init__(self, fn: Callable[[int, dict], None]):
        if not callable(fn):
            raise TypeError(f"CallbackWriter takes a function; got {type(fn).__name__}")
        self.fn = fn

    def write(self, step: int, scalars: dict) -> None:
        """``fn(step, scalars)``."""
        self.fn(step, scalars)

    def close(self) -> None:
        """Nothing to close."""


def read_run(path) -> dict[str, list[tuple[int, float]]]:
    """A recorded run: scalar name -> ``[(step, value), ...]`` in step order.

    Args:
        path: a JSONL file (:class:`JSONLWriter`) or a TensorBoard folder (read with
            TensorBoard's own ``EventAccumulator``).

    Raises:
        FileNotFoundError: no such file or folder.
        ValueError: a file that is not the monitor's JSONL, or a folder with no scalars.
    """
    path = pathlib.Path(os.fspath(path))
    if not path.exists():
        raise FileNotFoundError(f"no run at {path}: give a JSONL file written by JSONLWriter or "
                                f"a TensorBoard log folder")
    series = _read_tensorboard(path) if path.is_dir() else _read_jsonl(path)
    if not series:
        raise ValueError(f"{path} holds no scalars")
    return {name: sorted(points) for name, points in sorted(series.items())}


def _read_jsonl(path: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step = int(row.pop("step"))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ValueError(f"{path}:{number} is not a JSON object with a 'step': "
                                 f"{line.strip()[:80]!r}") from None
            for name, value in row.items():
                series.setdefault(name, []).append((step, float(value)))
    return series


def _read_tensorboard(path: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as exc:  # pragma: no cover - the error names the extra
        raise ImportError("reading a TensorBoard folder needs the tensorboard package: "
                          "pip install 'mixprec[tensorboard]'") from exc
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def _finite_or_text(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)
