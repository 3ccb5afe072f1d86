"""``mixprec bench --model hf-...``: every row runs, the figures are there, and the rows agree."""

import json

import pytest

from mixprec.cli import main
from mixprec.commands import hfbench

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")
TINY = {"width": 32, "seq": 8, "batch": 2, "vocab": 64, "rounds": 1, "steps": 1, "warmup": 1}


@pytest.mark.parametrize("name", sorted(hfbench.HF_MODELS))
def test_rows_and_figures(name):
    rep = hfbench.run_hf_bench(name, rows=("fp32", "autocast", "O2"), **TINY)
    rows = {r["row"]: r for r in rep["rows"]}
    assert list(rows) == ["fp32", "autocast", "O2"]
    for r in rows.values():
        assert r["ms_per_step"] > 0 and r["host_us_per_step"] > 0 and r["peak_mb"] > 0
    # two steps on one batch from one seed: the levels train the same function (bf16 tolerance)
    assert rows["O2"]["final_loss"] == pytest.approx(rows["fp32"]["final_loss"], rel=0.02)
    table = hfbench.format_hf_table(rep)
    assert "| O2 |" in table and "host us/step" in table


@pytest.mark.slow
def test_cli_json(capsys):
    assert main(["bench", "--model", "hf-gpt2", "--width", "32", "--batch", "1", "--seq-len", "8",
                 "--repeat", "1", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["row"] for r in rep["rows"]] == list(hfbench.ROWS)


def test_bad_input():
    with pytest.raises(ValueError, match="hf-gpt2"):
        hfbench.run_hf_bench("gpt2")
    with pytest.raises(ValueError, match="O9"):
        hfbench.run_hf_bench("hf-gpt2", rows=("O9",))


def test_live_bytes_peak_counts_what_is_held():
    import torch

    def hold():
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(1 << 20, dtype=torch.uint8)
        del a, b
    assert hfbench.live_bytes_peak(hold) == 2 << 20
