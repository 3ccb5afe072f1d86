import os
import pathlib

import pytest
import torch

from mixprec.compat.apex_state import AMP

pytest_plugins = ["covering"]  # which cells of a test matrix run (@pytest.mark.matrix)

SLOW_LIST = pathlib.Path(__file__).with_name("slow_tests.txt")

# One intra-op thread per test process, and in the processes tests launch: `make test` runs two
# pytest workers on two cores, and torch's default (a thread per core in each) has every small op
# wait at a thread barrier for a thread the other worker keeps off its core, which costs the tiny
# models here far more than the op itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def slow_ids() -> set[str]:
    """The ids tests/slow_tests.txt lists (measured >= 0.3 s): marked ``slow`` at collection."""
    return {line.split()[1] for line in SLOW_LIST.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    listed = set() if os.environ.get("MIXPREC_NO_SLOW_LIST") else slow_ids()  # make slow-list
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):  # the mark, not a keyword: a checkout in a
            # folder named "cuda" has "cuda" among every test's keywords
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def restore_apex_registrations():
    """apex_amp.register_*_function changes process-wide lists (as apex's did): undo it after."""
    saved = AMP.snapshot()
    yield
    AMP.restore(saved)
