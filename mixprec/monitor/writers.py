"""Where a :class:`mixprec.PrecisionMonitor` sends its scalars, and how a run is read back.

A writer is any object with ``write(step, scalars)`` (``scalars``: name -> float) and
``close()``. Two ship here: :class:`JSONLWriter` (one JSON object per recorded step, plain
text, no dependency) and :class:`TensorBoardWriter` (event files through
``torch.utils.tensorboard``; ``pip install mixprec[tensorboard]``). :func:`read_run` reads
either back into ``{name: [(step, value), ...]}``, the form ``mixprec report`` plots.

A :class:`JSONLWriter` starts its file afresh by default, as one run's record (``mode="a"``
continues a file, for a resumed run); :func:`read_run` warns where a file's steps go back
(two runs in one file), naming the file and line.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import warnings
from collections.abc import Callable

__all__ = ["JSONLWriter", "TensorBoardWriter", "CallbackWriter", "read_run", "as_writers"]

_MODES = {"w": "a fresh file: the first recorded step replaces an existing one",
          "a": "append to an existing file (a resumed run continuing its record)"}


class JSONLWriter:
    """One JSON object per recorded step in ``path``: ``{"step": n, name: value, ...}``.

    The file is one run's record: by default (``mode="w"``) the first recorded step replaces a
    file already there, as ``open(path, "w")`` would (only the process that writes, the main
    one, touches the file); ``mode="a"`` appends to it instead, for a run resumed from a
    checkpoint. The file is opened for each line and closed after it, so a run that dies keeps
    every recorded step and nothing is left open. Non-finite values (an inf gradient norm) are
    written as the strings "inf", "-inf", "nan".

    Args:
        path: the file (created, with its folder).
        mode: ``"w"`` (default) or ``"a"``.

    Raises:
        ValueError: another ``mode``.
    """

    def __init__(self, path, mode: str = "w"):
        if mode not in _MODES:
            raise ValueError(f"JSONLWriter's mode must be one of "
                             f"{'; '.join(f'{k!r}: {v}' for k, v in _MODES.items())}; got "
                             f"{mode!r}")
        self.path = pathlib.Path(os.fspath(path))
        self.mode = mode
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fresh = mode == "w"  # the first write truncates
        self._last: tuple | None = None  # (step, offset, row, file size after) of its last line

    def write(self, step: int, scalars: dict) -> None:
        """Add ``{"step": step, **scalars}`` as one line (the first one of a ``mode="w"``
        writer replaces what the file held). More scalars for the step this writer wrote last
        (the monitor's closing count after a recorded last step) join that step's line: one
        object per step."""
        row = {"step": int(step), **{k: _finite_or_text(v) for k, v in scalars.items()}}
        if self._joins(row):
            offset, row = self._last[1], {**self._last[2], **row}
            with open(self.path, "r+b") as f:
                f.seek(offset)
                f.truncate()
                f.write((json.dumps(row) + "\n").encode("utf-8"))
        else:
            with open(self.path, "wb" if self._fresh else "ab") as f:
                offset = f.seek(0, os.SEEK_END)
                f.write((json.dumps(row) + "\n").encode("utf-8"))
        self._fresh = False
        self._last = (row["step"], offset, row, _size(self.path))

    def _joins(self, row: dict) -> bool:
        """The closing count of the step this writer wrote last, with the file as it left it
        (nothing appended by another writer, not rotated or truncated): it joins that line."""
        last = self._last
        return (last is not None and last[0] == row["step"] and set(row) - {"step"} <= _CLOSING
                and _size(self.path) == last[3])

    def close(self) -> None:
        """Nothing is held open."""

    def __repr__(self) -> str:
        return f"JSONLWriter({str(self.path)!r}, mode={self.mode!r})"


def _size(path: pathlib.Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


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


_CLOSING = {"mixprec/steps", "mixprec/skipped_steps"}  # what a closing record holds

def as_writers(writers) -> list:
    """``writers=`` as a list: one writer, or an iterable of writers.

    Raises:
        TypeError: something that is neither; a writer without ``write``/``close``.
    """
    if _is_writer(writers):
        return [writers]
    if isinstance(writers, (str, bytes, os.PathLike)) or not hasattr(writers, "__iter__"):
        hint = (f" (for a file: JSONLWriter({os.fspath(writers)!r}))"
                if isinstance(writers, (str, os.PathLike)) else "")
        raise TypeError(f"writers takes a writer or a list of writers; got "
                        f"{type(writers).__name__} {writers!r}{hint}")
    out = list(writers)
    for w in out:
        if not _is_writer(w):
            raise TypeError(f"a writer needs write(step, scalars) and close() methods; got "
                            f"{type(w).__name__}")
    return out


def _is_writer(obj) -> bool:
    return callable(getattr(obj, "write", None)) and callable(getattr(obj, "close", None))


def read_run(path) -> dict[str, list[tuple[int, float]]]:
    """A recorded run: scalar name -> ``[(step, value), ...]`` in step order.

    Args:
        path: a JSONL file (:class:`JSONLWriter`) or a TensorBoard folder (read with
            TensorBoard's own ``EventAccumulator``).

    A JSONL file whose steps go back (or repeat) holds a run resumed from a checkpoint
    (``JSONLWriter(path, mode="a")``): the records after the resume replace those of the same
    steps and later before it, so the series are the ones the uninterrupted run would have.

    Warns:
        RuntimeWarning: the last line is cut short (a run still writing, or killed while it
            wrote): the lines before it are read. Steps that go back to the first record's or
            before it: a new run appended, read as the later one (file and line named).

    Raises:
        FileNotFoundError: no such file or folder.
        ValueError: a file that is not the monitor's JSONL (the file and line named, with what
            is wrong there), or a folder with no scalars.
    """
    path = pathlib.Path(os.fspath(path))
    if not path.exists():
        raise FileNotFoundError(f"no run at {path}: give a JSONL file written by JSONLWriter or "
                                f"a TensorBoard log folder")
    series = _read_tensorboard(path) if path.is_dir() else _read_jsonl(path)
    if not series:
        runs = sorted({str(e.parent) for e in path.glob("*/**/events.out.tfevents*")}
                      if path.is_dir() else ())
        raise ValueError(f"{path} holds no scalars" + (
            f"; the runs are in its folders: give one of them, e.g. {runs[0]}" if runs else ""))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in sorted(series.items())}


def _read_jsonl(path: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    first = last = None  # the steps of the first and the previous row
    warned = False
    with open(path, encoding="utf-8", errors="replace") as f:  # (a binary file: its first
        lines = f.readlines()                                  # line is named below)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = _step(row.pop("step"))
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
            if number == len(lines) and not line.endswith("\n") and series:
                warnings.warn(f"{path}:{number} is cut short (a run still writing, or killed "
                              f"while it wrote): read up to line {number - 1}", RuntimeWarning,
                              stacklevel=3)
                break
            raise ValueError(f"{path}:{number} is not a JSON object with a 'step' (a whole "
                             f"number >= 0): {line.strip()[:80]!r}") from None
        if last is not None and (step < last or step == last and not set(row) <= _CLOSING):
            if step <= first and not warned:  # (not a resume from a checkpoint: a new run)
                warnings.warn(f"{path}:{number}: step {step} follows step {last}: the run "
                              f"starts again, read as the later run (JSONLWriter(path, "
                              f"mode='a') appends, for a run resumed from a checkpoint; the "
                              f"default starts the file afresh)", RuntimeWarning, stacklevel=3)
                warned = True
            for points in series.values():  # a run resumed at ``step`` (JSONLWriter's
                points[:] = [p for p in points if p[0] < step]  # mode="a"): its records
        first = step if last is None else first  # replace the earlier run's from that step
        last = step  # on (a closing count repeats the last record's step)
        for name, value in row.items():
            series.setdefault(name, []).append((step, _number(value, path, number, name)))
    return series


def _step(value) -> int:
    """A record's step: a whole number >= 0 (a JSON integer, or a float holding one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
            isinstance(value, float) and not value.is_integer()):
        raise ValueError(value)
    return int(value)


def _number(value, path, number: int, name: str) -> float:
    """A JSONL value as a float ("inf", "-inf" and "nan" included), or a ValueError naming
    the file, the line and the scalar."""
    try:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return float(value)
    except ValueError:
        pass
    raise ValueError(f"{path}:{number}: {name!r} is {value!r}, not a number (a JSONLWriter "
                     f"file holds numbers, and \"inf\", \"-inf\", \"nan\" as strings)")


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
