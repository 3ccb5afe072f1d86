"""tests/slow_tests.txt, the measured list of tests `make test` leaves out, names real tests."""

import pathlib
import re

from conftest import SLOW_LIST, slow_ids
from slow_list import slow_tests

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_listed_test_exists():
    ids = slow_ids()
    assert len(ids) > 50, len(ids)
    for node in ids:
        path, _, name = node.partition("::")
        function = re.sub(r"\[.*$", "", name).split("::")[-1]
        source = (ROOT / path).read_text()
        assert re.search(rf"^\s*(async )?def {re.escape(function)}\(", source, re.M), node


def test_the_list_is_what_slow_list_writes_from_a_durations_report():
    report = ("1.50s call     tests/test_a.py::test_x[1]\n"
              "0.60s setup    tests/test_a.py::test_y\n0.50s call     tests/test_a.py::test_y\n"
              "0.20s call     tests/test_a.py::test_z\n(3 durations < 0.005s hidden.)\n")
    assert slow_tests(report, 1.0) == [(1.5, "tests/test_a.py::test_x[1]"),
                                       (1.1, "tests/test_a.py::test_y")]
    assert SLOW_LIST.read_text().startswith("# Tests `make test` leaves out")
