"""tests/covering.py: which cells of a test matrix run."""

import itertools

import pytest
from covering import SAMPLE_VAR, matrix_params, named_ids, pairwise, sample, sample_size

CELLS = list(itertools.product("abc", "xy", "pqr", "01"))


def pairs(cell):
    return set(itertools.combinations(enumerate(cell), 2))


def test_the_pairwise_subset_holds_every_pair_of_the_matrix_in_fewer_cells():
    fast = pairwise(CELLS)
    assert set(fast) < set(CELLS) and fast == sorted(fast, key=CELLS.index)
    assert set().union(*map(pairs, fast)) == set().union(*map(pairs, CELLS))
    assert pairwise([]) == []


def test_a_seed_draws_the_same_sample_and_another_seed_another():
    rest = [c for c in CELLS if c not in pairwise(CELLS)]
    drawn = sample(rest, 5, seed=1, salt="m")
    assert len(drawn) == 5 and set(drawn) <= set(rest) and drawn == sorted(drawn, key=rest.index)
    assert sample(rest, 5, seed=1, salt="m") == drawn
    assert sample(rest, 5, seed=2, salt="m") != drawn
    assert sample(rest, 5, seed=1, salt="other matrix") != drawn
    assert sample(rest, None, seed=1, salt="m") == sample(rest, 99, seed=1, salt="m") == rest


def test_params_are_the_pairwise_cells_then_a_slow_sample_and_the_cells_named():
    fast = pairwise(CELLS)
    named = next(c for c in CELLS if c not in fast)
    params = matrix_params(CELLS, 0, seed=1, salt="m", named=frozenset({"-".join(named)}))
    assert [p.values for p in params] == [c for c in CELLS if c in fast or c == named]
    assert {p.id for p in params if p.marks} == {"-".join(named)}
    assert all(m.name == "slow" for p in params for m in p.marks)
    assert len(matrix_params(CELLS, 3, seed=1, salt="m")) == len(fast) + 3


def test_a_cell_is_named_by_its_test_id_on_the_command_line():
    args = ["tests/test_x.py::test_cell[O2-fp16-no clip]", "tests/test_x.py::test_other[a-b]",
            "tests/test_x.py", "-k", "test_cell"]
    assert named_ids(args, "test_cell") == {"O2-fp16-no clip"}


@pytest.mark.parametrize("text,size", [("all", None), ("ALL", None), ("0", 0), (" 12 ", 12)])
def test_the_sample_size_comes_from_the_environment(monkeypatch, text, size):
    monkeypatch.setenv(SAMPLE_VAR, text)
    assert sample_size() == size


@pytest.mark.parametrize("text", ["-1", "half", "1.5"])
def test_a_bad_sample_size_is_refused_naming_what_is_valid(monkeypatch, text):
    monkeypatch.setenv(SAMPLE_VAR, text)
    with pytest.raises(pytest.UsageError, match=rf"count of cells.*'all'; got '{text}'"):
        sample_size()
