"""Progress of the long ``mixprec`` commands (``bench``, ``demo``): a tqdm bar on stderr, shown
only where stderr is a terminal and ``--no-progress`` is not given, so that piped or ``--json``
output stays clean."""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

__all__ = ["add_option", "wanted", "bar", "say"]


def add_option(parser: argparse.ArgumentParser) -> None:
    """``--no-progress``."""
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (shown on stderr only when it is a terminal)")


def wanted(args: argparse.Namespace) -> bool:
    """Whether to show a bar: stderr is a terminal and ``--no-progress`` was not given."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def bar(total: int, desc: str, show: bool, unit: str = "it") -> tqdm:
    """A bar of ``total`` units on stderr (a silent no-op one when ``show`` is False)."""
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not show, leave=False,
                dynamic_ncols=True, unit=unit)


def say(line: str, show: bool) -> None:
    """Print ``line`` to stdout; around a shown bar, without breaking it."""
    if show:
        tqdm.write(line, file=sys.stdout)
    else:
        print(line, flush=True)
