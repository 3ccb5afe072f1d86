import pytest
import torch

from mixprec.compat.apex_state import AMP


def pytest_collection_modifyitems(config, items):
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
