"""A fast subset of a test matrix: the cells that cover every pair of factor values.

A bug that depends on one factor value, or on how two of them meet (a level with a clip, an
optimizer with a dtype), shows in the pairwise subset; ``make test`` runs it, and the remaining
cells are marked ``slow`` for ``make test-all``.
"""

import itertools

import pytest


def pairwise(cells: list[tuple]) -> list[tuple]:
    """A small subset of ``cells`` holding every pair of values that two factors take together
    in some cell of ``cells`` (greedy: the cell covering most uncovered pairs first; ties to the
    earlier cell, so the subset is the same on every run and every xdist worker)."""
    covers = [{(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(c), 2)}
              for c in cells]
    uncovered = set().union(*covers) if cells else set()
    chosen = set()
    while uncovered:
        best = max(range(len(cells)), key=lambda k: len(covers[k] & uncovered))
        chosen.add(best)
        uncovered -= covers[best]
    return [c for k, c in enumerate(cells) if k in chosen]  # in the matrix's order


def fast_pairwise(cells: list[tuple], ids=None) -> list:
    """``cells`` as pytest params, all but a pairwise subset marked ``slow``."""
    fast = set(pairwise(cells))
    return [pytest.param(*c, marks=() if c in fast else pytest.mark.slow,
                         id=None if ids is None else ids(c)) for c in cells]
