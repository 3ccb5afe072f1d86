"""The doctor, bench and demo commands: they run, their --json parses, bad names fail cleanly."""

import json
import math

import pytest
import torch

from mixprec import cli, hardware
from mixprec.benchmodels import MODELS, count_flops, get_model
from mixprec.commands import bench, doctor


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
    (("--model", "resnet50"),
     "unknown model 'resnet50'; choose one of nine-linear, convnet, transformer"),
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


# ----------------------------------------------------------------------------- doctor's probe
# A CPU without fp16 hardware runs torch's native fp16 GEMM at ~0.27 GFLOP/s: 16 s for one
# 512x2048x2048 product. A fake kernel with that rate shows what the probe would run there.
FAKE_RATES = {torch.float32: 300.0, torch.bfloat16: 300.0, torch.float16: 0.27}  # GFLOP/s


@pytest.fixture
def fake_kernels(monkeypatch):
    calls = []

    def product_times(dtype, shape, device, budget_s, min_reps, warmup):
        calls.append((dtype, tuple(shape), warmup + max(min_reps, 1)))
        return [2.0 * math.prod(shape) / (FAKE_RATES[dtype] * 1e9)] * max(min_reps, 1)

    monkeypatch.setattr(doctor, "_product_times", product_times)
    return calls


def test_probe_shapes_climb_by_doubling():
    assert doctor.probe_shapes((512, 2048, 2048)) == [
        (128, 128, 128), (256, 256, 256), (512, 512, 512), (512, 1024, 1024), (512, 2048, 2048)]
    assert doctor.probe_shapes((64, 64, 64)) == [(64, 64, 64)]
    assert doctor.probe_shapes((1000, 300, 7))[-1] == (1000, 300, 7)


def test_slow_kernel_is_probed_small_within_the_budget(fake_kernels):
    probe = doctor.probe_matmul(torch.float16, (512, 2048, 2048), budget_s=1.0,
                                reference_gflops=300.0)
    assert probe["shape"] == [256, 256, 256] and not probe["full_size"] and probe["slow"]
    assert probe["gflops"] == pytest.approx(0.27)
    assert "1111x below fp32" in probe["note"] and "256x256x256 only" in probe["note"]
    # the work it did: every product the fake timed (warm-ups included) fits the budget
    work = sum(n * 2.0 * math.prod(shape) / (FAKE_RATES[dt] * 1e9) for dt, shape, n in fake_kernels)
    assert work <= 1.0 and probe["spent_s"] == pytest.approx(work)
    assert max(math.prod(shape) for _, shape, _ in fake_kernels) == 256 ** 3


def test_doctor_report_marks_the_slow_kernel_and_names_the_emulation(fake_kernels):
    rep = doctor.doctor_report(shape=(512, 2048, 2048), budget_s=1.0)
    fp32, fp16 = rep["dtypes"]["fp32"], rep["dtypes"]["fp16"]
    assert fp32["matmul_full_size"] and fp32["matmul_shape"] == [512, 2048, 2048]
    assert fp32["matmul_gflops"] == pytest.approx(300) and not fp32["matmul_slow"]
    assert fp16["matmul_slow"] and not fp16["matmul_full_size"]
    assert "below fp32" in fp16["matmul_note"]
    assert (torch.float16, (512, 2048, 2048)) not in [(dt, shape) for dt, shape, _ in fake_kernels]
    emulated = not hardware.is_fast(torch.float16, "cpu")
    assert ("emulates fp16" in fp16["mixprec"]) is emulated


def test_doctor_text_flags_the_slow_kernel(capsys, fake_kernels):
    code, out, _ = run(capsys, "doctor")
    row = next(line for line in out.splitlines() if line.startswith("fp16"))
    assert code == 0 and "0.27*" in row.split()
    assert "* fp16: slow: 1111x below fp32; measured at 256x256x256 only" in out


def test_doctor_budget_zero_runs_the_small_shape_only(capsys):
    rep = doctor.doctor_report(shape=doctor.DEFAULT_SHAPE, budget_s=0.0)
    for row in rep["dtypes"].values():
        assert row["matmul_shape"] == [128, 128, 128] and not row["matmul_full_size"]
        assert row["matmul_gflops"] > 0
    code, out, _ = run(capsys, "doctor", "--json", "--budget", "0")
    assert code == 0 and json.loads(out)["probe_budget_s"] == 0
    code, _, err = run(capsys, "doctor", "--budget", "-1")
    assert code == 2 and "budget_s must be >= 0" in err


# ----------------------------------------------------------------------------- bench's % peak

def _report(shares):
    rows = [{"row": f"O{i}", "dtype": "fp32", "ms_per_step": 10.0, "speedup": 1.0, "peak_mb": 1.0,
             "final_loss": 0.5, "gflops": 100.0 * s, "peak_share": s, "update_ms": 1.0,
             "update_share": 0.1} for i, s in enumerate(shares)]
    return {"model": "nine-linear", "sizes": {"width": 8}, "flops_per_step": 1e9, "steps": 2,
            "warmup": 1, "device": "cpu", "threads": 2, "torch": "x", "isolated": True,
            "compile": False, "gemm_shape": [8, 8, 8], "matmul_peak_gflops": {"fp32": 100.0},
            "rows": rows}


def test_bench_table_flags_a_share_above_the_peak():
    lines = bench.format_table(_report([0.5, 1.3])).splitlines()
    o0 = next(line for line in lines if line.startswith("O0"))
    o1 = next(line for line in lines if line.startswith("O1"))
    assert "50% " in o0 and "!" not in o0
    assert "130%!" in o1
    assert any(line.startswith("! above the matmul peak: the peak probe was disturbed")
               for line in lines)
    assert "disturbed" not in bench.format_table(_report([0.5, 0.99]))


@pytest.mark.parametrize("second, disturbed", [(1e-6, True), (1e6, False)])
def test_bench_reprobes_a_disturbed_peak_and_flags_it_in_the_json(monkeypatch, second, disturbed):
    probes = []

    def fake_peaks(keys, shape, device="cpu"):  # the first probe is far too low
        probes.append(list(keys))
        gflops = 1e-6 if len(probes) == 1 else second
        return {k: {"gflops": gflops, "shape": list(shape), "full_size": True, "slow": False,
                    "note": "", "emulated": False} for k in keys}

    monkeypatch.setattr(bench, "matmul_peaks", fake_peaks)
    rep = bench.run_bench(levels=("O0",), steps=1, warmup=0, reference=False, isolate=False,
                          width=8, batch=4, depth=2)
    assert probes == [["fp32"], ["fp32"]] and rep["peak_reprobed"] == ["fp32"]
    assert rep["matmul_peak_gflops"]["fp32"] == round(max(1e-6, second), 1)
    assert rep["rows"][0]["peak_exceeded"] is disturbed and rep["peak_disturbed"] is disturbed
    assert ("disturbed" in bench.format_table(rep)) is disturbed


def test_bench_peaks_follow_the_kernels_the_rows_run():
    peaks = bench.matmul_peaks(["fp32", "fp16", "fp16 native"], (32, 32, 32))
    emulated = not hardware.is_fast(torch.float16, "cpu")
    assert peaks["fp16"]["emulated"] is emulated and peaks["fp16 native"]["emulated"] is False
    assert all(p["gflops"] > 0 and p["full_size"] for p in peaks.values())
