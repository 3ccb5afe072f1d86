"""Which cells of a test matrix run: a pairwise subset always, a seeded sample of the rest.

A bug that depends on one factor value, or on how two of them meet (a level with a clip, an
optimizer with a dtype), shows in the subset of cells that covers every pair of factor values;
``make test`` runs that subset. The other cells re-cover those pairs in further combinations:
``make test-slow`` runs a random sample of them, drawn afresh each run, so that successive runs
reach every cell without one run paying for all of them.

A test takes its cells with ``@pytest.mark.matrix("a,b,c", cells)`` (in place of
``parametrize``); a cell's id is its values joined by ``-``. The environment steers the draw:

* ``MIXPREC_DIFF_SEED=<int>``: the seed (default: a fresh one). The run prints it in the
  header and in the summary, so ``MIXPREC_DIFF_SEED=<seed> make test-slow`` draws the same cells.
* ``MIXPREC_DIFF_SAMPLE=<n>``: how many of the remaining cells each matrix samples (default
  ``DEFAULT_SAMPLE``); ``all`` runs every cell.
* A cell named by its test id on the command line runs whatever the sample, so a failing cell
  reruns by its id alone: ``pytest 'tests/test_differential.py::test_x[O2-fp16-...]'``.
"""

import itertools
import os
import random

import pytest

SEED_VAR, SAMPLE_VAR = "MIXPREC_DIFF_SEED", "MIXPREC_DIFF_SAMPLE"
DEFAULT_SAMPLE = 32
SEED = pytest.StashKey[int]()


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


def cell_id(cell: tuple) -> str:
    return "-".join(map(str, cell))


def sample(cells: list[tuple], size: int | None, seed: int, salt: str) -> list[tuple]:
    """``size`` cells of ``cells`` drawn with ``seed`` (``salt`` keeps two matrices' draws
    apart), in the matrix's order; ``size`` None: all of them."""
    if size is None or size >= len(cells):
        return list(cells)
    drawn = set(random.Random(f"{seed}:{salt}").sample(range(len(cells)), size))
    return [c for k, c in enumerate(cells) if k in drawn]


def matrix_params(cells: list[tuple], size: int | None, seed: int, salt: str,
                  named: frozenset = frozenset()) -> list:
    """The pairwise subset of ``cells``, then a sample of the rest marked ``slow``, plus any
    cell whose id is in ``named``; as pytest params."""
    fast = set(pairwise(cells))
    rest = [c for c in cells if c not in fast]
    chosen = fast | set(sample(rest, size, seed, salt)) | {c for c in rest if cell_id(c) in named}
    return [pytest.param(*c, marks=() if c in fast else pytest.mark.slow, id=cell_id(c))
            for c in cells if c in chosen]


def sample_size() -> int | None:
    text = os.environ.get(SAMPLE_VAR, str(DEFAULT_SAMPLE)).strip().lower()
    if text == "all":
        return None
    if not text.isdigit():
        raise pytest.UsageError(f"{SAMPLE_VAR} must be a count of cells (0 or more) or 'all'; "
                                f"got {os.environ[SAMPLE_VAR]!r}")
    return int(text)


def named_ids(args: list[str], function: str) -> frozenset:
    """The ids of ``function``'s cells named on the command line (``path::function[id]``)."""
    key = f"::{function}["
    return frozenset(a.split(key, 1)[1][:-1] for a in args if key in a and a.endswith("]"))


# -- the plugin (tests/conftest.py loads it) ----------------------------------------------------
def pytest_configure(config):
    config.addinivalue_line("markers", "matrix(names, cells): parametrize over the pairwise "
                                       "subset of cells plus a seeded sample of the rest")
    sample_size()  # a bad MIXPREC_DIFF_SAMPLE fails here, once, not at each matrix
    inherited = getattr(config, "workerinput", {}).get(SEED_VAR)  # an xdist worker: the
    given = inherited if inherited is not None else os.environ.get(SEED_VAR)  # controller's
    try:
        config.stash[SEED] = (random.SystemRandom().randrange(1_000_000) if given is None
                              else int(given))
    except ValueError:
        raise pytest.UsageError(f"{SEED_VAR} must be an integer; got {given!r}") from None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist: every worker draws with the controller's seed, so all collect the same cells."""
    node.workerinput[SEED_VAR] = node.config.stash[SEED]


def pytest_generate_tests(metafunc):
    mark = metafunc.definition.get_closest_marker("matrix")
    if mark is None:
        return
    names, cells = mark.args
    name = metafunc.function.__name__
    metafunc.parametrize(names, matrix_params(cells, sample_size(), metafunc.config.stash[SEED],
                                              name, named_ids(metafunc.config.args, name)))


def _seed_line(config) -> str:
    seed, size = config.stash[SEED], sample_size()
    drawn = "all other cells" if size is None else f"{size} other cells a matrix"
    return (f"test matrices: the pairwise cells, and (marked slow) {drawn} drawn with seed "
            f"{seed}; {SEED_VAR}={seed} draws the same")


def pytest_report_header(config):
    return _seed_line(config)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The seed again at the end (``-q`` hides the header), when a sampled cell ran."""
    ran = itertools.chain.from_iterable(terminalreporter.stats.get(outcome, ()) for outcome in
                                        ("passed", "failed", "error", "skipped"))
    if any({"matrix", "slow"} <= set(getattr(r, "keywords", ())) for r in ran):
        terminalreporter.write_line(_seed_line(config))
