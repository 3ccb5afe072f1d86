"""``mixprec bench --model hf-...``: every row runs, the figures are there, and the rows agree."""

import json
import os
import subprocess
import sys

import pytest
import torch

from mixprec.cli import main
from mixprec.commands import hfbench

pytest.importorskip("transformers")
pytestmark = [pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning"),
    # a CPU without bf16 GEMMs (AVX2 only) warns at each bf16 row: these tests time nothing
    pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")]
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


def _fake_report(rows=("fp32", "autocast", "O2")):
    return {"model": "hf-gpt2", "what": "GPT-2 causal LM", "torch": "x", "threads": 1,
            "sizes": {"width": 32, "seq": 8, "batch": 1, "vocab": 64, "dtype": "bf16",
                      "depth": 2},
            "rows": [{"row": r, "ms_per_step": 2.0, "host_us_per_step": 100, "peak_mb": 1.0,
                      "final_loss": 4.0} for r in rows]}


def test_cli_options_reach_the_hf_bench(monkeypatch, capsys):
    seen = {}

    def fake(model_name, **kwargs):
        seen.update(kwargs)
        return _fake_report(kwargs["rows"])
    monkeypatch.setattr(hfbench, "run_hf_bench", fake)
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    assert main(["bench", "--model", "hf-gpt2", "--levels", "o0,O2", "--levels", "compact",
                 "--no-reference", "--steps", "3", "--warmup", "0", "--depth", "2", "--compile",
                 "--in-process", "--repeat", "6"]) == 0
    assert seen["rows"] == ["fp32", "O2", "compact"] and seen["compile"] is True
    assert (seen["steps"], seen["warmup"], seen["depth"], seen["rounds"]) == (3, 0, 2, 6)
    assert os.environ["KINETO_LOG_LEVEL"] == "6"  # the profiler's USDT lines silenced
    out = capsys.readouterr().out
    assert "2 layers" in out and hfbench.LEGEND["host"] in out and hfbench.LEGEND["peak"] in out
    assert hfbench.LEGEND["autocast"] not in out  # no autocast row, no fp8 row: not explained
    # the defaults: every row, the reference included, 2 steps after 2 warm-up
    seen.clear()
    assert main(["bench", "--model", "hf-gpt2"]) == 0
    assert seen["rows"] == list(hfbench.ROWS) and seen["compile"] is False
    assert "steps" not in seen and "warmup" not in seen  # run_hf_bench's own defaults
    capsys.readouterr()


@pytest.mark.parametrize("argv,expected", [
    (("--device", "cuda"), "--device cuda: the hf- models run on the CPU only"),
    (("--image-size", "8"), "--image-size: the hf- models take tokens"),
    (("--levels", "O2,O9"), "unknown row(s) ['O9'] for the hf- models; choose from fp32,"),
    (("--steps", "0"), "steps must be an integer >= 1; got 0"),
    (("--depth", "0"), "depth must be an integer >= 1; got 0"),
    (("--compile", "--warmup", "0"), "--compile) needs warmup >= 1: the first step compiles"),
])
def test_hf_bench_refuses_what_it_cannot_honour(monkeypatch, capsys, argv, expected):
    monkeypatch.setattr(hfbench, "_setup", None)  # nothing may be built: refused up front
    assert main(["bench", "--model", "hf-gpt2", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and expected in captured.err and captured.err.count("\n") == 1


def test_the_table_explains_its_columns():
    table = hfbench.format_hf_table(_fake_report(("fp32", "autocast", "O2", "fp8")))
    assert table.endswith("\n".join(hfbench.LEGEND.values()))
    assert "above 1.00x the row is slower" in table and "FP8 is emulated" in table
    assert "host us/step: CPU time of one step" in table


def test_compile_and_depth_reach_the_rows(monkeypatch):
    compiled = []

    def fake_compile(model, *args, **kwargs):  # records what the bench compiles, runs eagerly
        compiled.append(type(model).__name__)
        return model
    monkeypatch.setattr(torch, "compile", fake_compile)
    sizes = {"width": 32, "seq": 8, "batch": 1, "vocab": 64, "depth": 2}
    for row in ("fp32", "autocast", "O2"):
        model, opt, _ = hfbench._setup("hf-gpt2", row, sizes, compile=True)
        assert model.config.n_layer == 2
    assert compiled == ["GPT2LMHeadModel"]  # the mixprec row only
    assert opt.fused == "compile"  # and its master step, as Trainer(compile=True)


@pytest.mark.parametrize("quiet", [False, True])
def test_the_profiler_prints_no_usdt_lines_once_quieted(quiet):
    code = ("from mixprec.commands import hfbench\n"
            + ("hfbench.quiet_profiler()\n" if quiet else "")
            + "hfbench.live_bytes_peak(lambda: None)\n")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ("USDT" in proc.stderr) is not quiet  # without it, kineto prints them (the control)
