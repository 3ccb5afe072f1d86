"""The doctor, bench and demo commands: they run, their --json parses, bad names fail cleanly."""

import json

import pytest

from mixprec import cli
from mixprec.benchmodels import MODELS, count_flops, get_model


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_doctor_json_reports_dtypes_throughput_and_auto(capsys):
    code, out, _ = run(capsys, "doctor", "--json", "--shape", "64,64,64")
    rep = json.loads(out)
    assert code == 0
    assert set(rep["dtypes"]) == {"fp32", "bf16", "fp16"}
    assert all(row["matmul_gflops"] > 0 for row in rep["dtypes"].values())
    assert rep["auto_dtype"] in ("bf16", "fp16", "fp32") and rep["auto_reason"]


def test_doctor_text_and_bad_shape(capsys):
    code, out, _ = run(capsys, "doctor", "--no-measure")
    assert code == 0 and "dtype='auto' ->" in out
    code, _, err = run(capsys, "doctor", "--shape", "1,2")
    assert code == 2 and "--shape must be three positive integers" in err


@pytest.mark.parametrize("model", list(MODELS))
def test_bench_json_parses_and_rows_are_consistent(capsys, model):
    code, out, _ = run(capsys, "bench", "--model", model, "--levels", "O0,O2", "--steps", "2",
                       "--warmup", "1", "--width", "8", "--batch", "4", "--depth", "2",
                       "--in-process", "--json")
    rep = json.loads(out)
    assert code == 0
    assert [r["row"] for r in rep["rows"]] == ["O0", "O2", "torch.autocast"]
    o0 = rep["rows"][0]
    assert o0["speedup"] == 1.0 and o0["dtype"] == "fp32"
    for r in rep["rows"]:
        assert r["ms_per_step"] > 0 and r["gflops"] > 0 and len(r["times_ms"]) == 2
        assert r["final_loss"] == r["final_loss"]  # not NaN
    assert rep["flops_per_step"] == count_flops(get_model(model, width=8, batch=4, depth=2))


@pytest.mark.slow
def test_bench_isolated_rows_report_memory(capsys):
    code, out, _ = run(capsys, "bench", "--levels", "O0,O2", "--steps", "1", "--warmup", "1",
                       "--width", "512", "--batch", "64", "--no-reference", "--json")
    rep = json.loads(out)
    o0, o2 = rep["rows"]
    # 9 x 512 x 512 weights: 9.4 MB of fp32 weights plus as much of gradients, at least
    assert o0["peak_mb"] > 15
    assert o2["peak_mb"] > 0
    assert rep["isolated"] is True


def test_bench_text_table(capsys):
    code, out, _ = run(capsys, "bench", "--levels", "O0,O1", "--steps", "1", "--warmup", "0",
                       "--width", "8", "--batch", "4", "--in-process")
    assert code == 0
    assert "speed-up" in out and "torch.autocast" in out and "matmul peak" in out


@pytest.mark.parametrize("argv,expected", [
    (("--model", "resnet50"), "unknown model 'resnet50'; choose one of nine-linear, convnet, transformer"),
    (("--levels", "O1,O5"), "unknown level(s) ['O5']; choose from O0, O1, O2, O3"),
    (("--steps", "0"), "steps must be a positive integer"),
    (("--width", "-3"), "width must be a positive integer"),
])
def test_bench_bad_input_exits_2_with_one_line(capsys, argv, expected):
    code, out, err = run(capsys, "bench", "--in-process", *argv)
    assert code == 2 and out == ""
    assert expected in err and err.count("\n") == 1


def test_demo_runs_and_writes_the_plot(capsys, tmp_path):
    code, out, _ = run(capsys, "demo", "--epochs", "1", "--width", "4", "--batch", "256",
                       "--out", str(tmp_path), "--json")
    rep = json.loads(out)
    assert code == 0
    assert [(r["level"], r["dtype"]) for r in rep["runs"]][-1] == ("O2", "fp16")
    assert len(rep["runs"]) == 5 and rep["runs"][0]["speedup"] == 1.0
    assert all(0 <= r["test_accuracy"] <= 1 and len(r["loss"]) == 6 for r in rep["runs"])
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert rep["plot"] == str(tmp_path / "demo.png")


def test_bench_repeat_pools_the_steps_of_all_rounds(capsys):
    code, out, _ = run(capsys, "bench", "--levels", "O0", "--no-reference", "--steps", "3",
                       "--warmup", "0", "--repeat", "2", "--width", "8", "--batch", "4",
                       "--in-process", "--json")
    (row,) = json.loads(out)["rows"]
    assert code == 0 and len(row["times_ms"]) == 6 and len(row["update_times_ms"]) == 6
    times = sorted(row["times_ms"])
    assert times[2] <= row["ms_per_step"] <= times[3]  # the median of the pooled steps
