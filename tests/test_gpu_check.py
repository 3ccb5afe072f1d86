"""bench/gpu_check.py (``make gpu-check``) on a CPU: without CUDA it stops with a clear message and
a non-zero status; its tiny smoke mode runs the rows and prints the table; a row that fails (as
CUDA's out-of-memory error would) or cannot run (no torchao) is reported while the others run;
the table's ratios and notes."""

import importlib.util
import pathlib

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| model")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_says_so_and_exits_non_zero(check, capsys):
    assert check.main(["--device", "cuda"]) == 2
    assert check.main(["--check-cuda"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and torch.__version__ in err and "--device cpu --tiny" in err


def test_tiny_smoke_run_prints_one_table_with_device_torch_and_commit(check, capsys, tmp_path):
    out = tmp_path / "table.md"
    assert check.main(["--device", "cpu", "--tiny", "--models", "gpt2", "--eager-only",
                       "--rows", "fp32,autocast,O2", "--rounds", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text().strip() == text.strip()
    assert f"torch {torch.__version__}" in text and "device: CPU" in text and "commit " in text
    rows = _rows(text)
    assert [r[1] for r in rows] == ["fp32", "autocast", "O2"]
    for r in rows:
        assert r[0] == "GPT-2 124M (tiny)" and r[2] == "eager"
        assert float(r[3]) > 0 and float(r[6]) > 0  # ms/step, loss
    assert rows[1][4] == "1.00 (autocast)"


def test_a_failing_row_is_reported_and_the_others_run(check, capsys, monkeypatch):
    real = check.gpu_rows.make_row

    def make_row(row, *args):
        if row == "O1":  # what torch raises when a CUDA allocation fails
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(row, *args)
    monkeypatch.setattr(check.gpu_rows, "make_row", make_row)
    monkeypatch.setattr(check.gpu_rows, "fp8_problem", lambda device: "torchao is not installed")
    assert check.main(["--device", "cpu", "--tiny", "--models", "gpt2", "--eager-only",
                       "--rows", "autocast,O1,O2-fp8", "--rounds", "1"]) == 0
    rows = {r[1]: r for r in _rows(capsys.readouterr().out)}
    assert rows["O1"][3] == "-" and "failed: OutOfMemoryError: CUDA out of memory" in rows["O1"][7]
    assert rows["O2-fp8"][7] == "skipped: torchao is not installed"
    assert float(rows["autocast"][3]) > 0


def test_groups_past_the_budget_are_listed_as_not_run(check, capsys):
    assert check.main(["--device", "cpu", "--tiny", "--models", "gpt2,llama", "--rows", "O2",
                       "--budget", "-1"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 3  # gpt2 eager, llama eager, gpt2 compiled
    assert all(r[3] == "-" and r[7] == "not run: past the -1 s budget" for r in rows)


def test_table_ratios_and_notes(check):
    def res(row, ms, compiled=False, **kw):
        return {"model": "m", "row": row, "compiled": compiled, "ms": ms, "peak_mb": 100.4,
                "compile_s": None, "loss": 1.23456, "fp8_layers": 0, "note": "", **kw}
    results = [res("autocast", 50.0), res("autocast-fp16", 40.0), res("O2-fp16", 44.0),
               res("O2-fp8", 75.0, fp8_layers=12), res("autocast", 25.0, True, compile_s=30.04),
               res("O2", 30.0, True, compile_s=33.0), res("split", None, note="failed: X")]
    rows = _rows(check.table(results, "device: X", {"m": "Model"}))
    assert [r[4] for r in rows] == ["1.00 (autocast)", "0.80 (autocast)",
                                    "1.10 (autocast-fp16)", "1.50 (autocast)",
                                    "1.00 (autocast)", "1.20 (autocast)", "-"]
    assert rows[3][7] == "12 FP8 layers" and rows[5][7] == "compile 33.0 s"
    assert rows[5][2] == "compiled" and rows[0][5] == "100" and rows[0][6] == "1.2346"
    assert rows[6][3] == "-" and rows[6][7] == "failed: X"


def _fp8_wide():
    spec = importlib.util.spec_from_file_location("fp8_wide", ROOT / "bench/fp8_wide.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_fp8_wide_without_cuda_exits_non_zero(capsys):
    assert _fp8_wide().main([]) == 2
    assert "fp8_wide.py --device cpu --tiny" in capsys.readouterr().err


@pytest.mark.slow
def test_fp8_wide_tiny_smoke_run_converts_the_same_layers_both_ways(capsys):
    pytest.importorskip("torchao")
    assert _fp8_wide().main(["--device", "cpu", "--tiny", "--eager", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = {r[1]: r for r in _rows(out)}
    assert list(rows) == ["autocast", "O2", "O2-fp8", "torchao-fp8"]
    assert rows["O2-fp8"][7] == rows["torchao-fp8"][7] == "6 FP8 layers"
    assert "mixprec O2 fp8 / torchao fp8:" in out
