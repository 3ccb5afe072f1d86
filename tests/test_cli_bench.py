"""The doctor, bench and demo commands: they run, their --json parses, bad names fail cleanly."""

import json
import math
import sys

import pytest
import torch

from mixprec import cli, hardware
from mixprec.benchmodels import MODELS, count_flops, get_model
from mixprec.commands import bench, doctor, peaks


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
    assert "(matmul: not measured, --no-measure)" in out and "median of" not in out
    code, _, err = run(capsys, "doctor", "--shape", "1,2")
    assert code == 2 and "--shape must be three positive integers" in err


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="an MPS machine has the device")
def test_doctor_refuses_a_device_torch_cannot_use(capsys):
    """mps without the backend, and meta, printed a table of 'supported' dtypes."""
    code, _, err = run(capsys, "doctor", "--device", "mps", "--no-measure")
    assert code == 2 and "torch cannot make a tensor there (no mps backend" in err
    code, _, err = run(capsys, "doctor", "--device", "meta", "--no-measure")
    assert code == 2 and "--device meta: a meta tensor holds no values" in err


@pytest.mark.parametrize("model", list(MODELS))
def test_bench_json_parses_and_rows_are_consistent(capsys, model):
    depth = None if model == "convnet" else 2  # (a convnet has no depth: refused)
    code, out, _ = run(capsys, "bench", "--model", model, "--levels", "O0,O2", "--steps", "2",
                       "--warmup", "1", "--width", "8", "--batch", "4",
                       *(["--depth", "2"] if depth else []), "--in-process", "--json")
    rep = json.loads(out)
    assert code == 0
    assert [r["row"] for r in rep["rows"]] == ["O0", "O2", "torch.autocast"]
    o0 = rep["rows"][0]
    assert o0["speedup"] == 1.0 and o0["dtype"] == "fp32"
    for r in rep["rows"]:
        assert r["ms_per_step"] > 0 and r["gflops"] > 0 and len(r["times_ms"]) == 2 * 3
        assert r["final_loss"] == r["final_loss"]  # not NaN
    assert rep["flops_per_step"] == count_flops(get_model(model, width=8, batch=4, depth=depth))


def test_a_size_the_model_does_not_have_is_refused(capsys):
    """``--depth`` for the convnet, ``--seq-len`` for nine-linear were ignored, silently."""
    code, _, err = run(capsys, "bench", "--model", "convnet", "--depth", "5", "--json")
    assert code == 2 and "the convnet model has no depth (its sizes: width, batch, " \
        "image_size)" in err
    code, _, err = run(capsys, "advise", "--model", "nine-linear", "--seq-len", "9")
    assert code == 2 and "the nine-linear model has no seq_len" in err


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
    assert "speed-up" in out and "torch.autocast" in out and "GEMM peak" in out


def test_bench_levels_accumulate_when_repeated(capsys):
    parse = cli.build_parser().parse_args
    assert parse(["bench", "--levels", "O0", "--levels", "O2,o3"]).levels == ["O0", "O2", "o3"]
    assert parse(["bench"]).levels is None  # every level
    code, out, _ = run(capsys, "bench", "--levels", "O0", "--levels", "O0,O1", "--no-reference",
                       "--steps", "1", "--warmup", "0", "--width", "8", "--batch", "4",
                       "--in-process", "--json")
    assert code == 0 and [r["row"] for r in json.loads(out)["rows"]] == ["O0", "O1"]


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
    assert rep["report"] == str(tmp_path / "demo-report.html")  # the fp16 run's, beside it
    page = (tmp_path / "demo-report.html").read_text()
    assert page.count("data:image/png;base64,") >= 3 and "What to do" in page
    records = (tmp_path / "demo-precision.jsonl").read_text().splitlines()
    assert len(records) == 2 and '"mixprec/loss_scale": 16777216.0' in records[0]
    closing = json.loads(records[1])  # the monitor closed: the run's 6 steps counted
    assert closing == {"step": 5, "mixprec/steps": 6.0,
                       "mixprec/skipped_steps": float(rep["runs"][-1]["skipped_steps"])}


def test_bench_runs_three_rounds_with_a_bar_on_a_terminal_only(capsys, monkeypatch):
    from mixprec.commands import progress
    parser = cli.build_parser()
    args = parser.parse_args(["bench"])
    assert args.repeat == 3 and args.no_progress is False
    assert progress.wanted(args) is False  # stderr captured: no terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert progress.wanted(args) is True
    assert progress.wanted(parser.parse_args(["bench", "--no-progress"])) is False
    rep = bench.run_bench(levels=("O0", "O2"), steps=1, warmup=0, reference=False,
                          isolate=False, show_progress=True, width=8, batch=4, depth=1)
    err = capsys.readouterr().err
    assert rep["repeat"] == 3 and all(len(r["times_ms"]) == 3 for r in rep["rows"])
    assert "mixprec bench nine-linear" in err and "round 3/3: O2" in err
    assert "6/7" in err and "GEMM peaks" in err  # 2 rows x 3 rounds, then the peaks


def _rounds(*ms_per_round):
    return [{"times_ms": [ms]} for ms in ms_per_round]


def test_bench_marks_a_row_whose_rounds_spread_more_than_it_differs_from_o0():
    rounds = {"O0": _rounds(100.0, 100.0, 100.0),
              "O2": _rounds(10.9, 160.0, 155.0),   # one round "9.16x": machine noise
              "O3": _rounds(60.0, 62.0, 61.0)}     # 1.61-1.67x: a real speed-up
    results = [{"row": name, "speedup": 100.0 / sorted(r["times_ms"][0] for r in rs)[1]}
               for name, rs in rounds.items()]
    bench.mark_noise(results, rounds)
    o0, o2, o3 = results
    assert o2["round_speedups"] == [9.174, 0.625, 0.645] and o2["noisy"] is True
    assert o2["spread"] == pytest.approx(100 / 10.9 - 0.625)
    assert o3["noisy"] is False and o0["noisy"] is False and o0["spread"] == 0.0
    alone = [{"row": "O2", "speedup": None}]  # no O0 row: no speed-up to judge
    bench.mark_noise(alone, {"O2": rounds["O2"]})
    assert alone[0]["noisy"] is False and alone[0]["round_speedups"] is None
    rep = bench.run_bench(levels=("O0", "O2"), steps=1, warmup=0, reference=False,
                          isolate=False, width=8, batch=4, depth=1)
    rep["rows"][1].update(o2, row="O2")
    text = bench.format_table(rep)
    line = next(line for line in text.splitlines() if line.startswith("O2"))
    assert "x~" in line
    assert "O2: noisy (~): its rounds ran at 9.17x, 0.62x, 0.65x of O0's speed" in text


def test_demo_counts_its_steps_on_a_bar(capsys, monkeypatch):
    import argparse

    from mixprec.commands import demo
    monkeypatch.setattr(demo, "RUNS", (("O0", "auto"), ("O2", "fp16")))
    args = argparse.Namespace(epochs=1, width=4, batch=1024, lr=0.1, seed=0, json=False)
    rows = demo.run_demo(args, None, show_progress=True)
    out, err = capsys.readouterr()
    assert len(rows) == 2 and "trained O2 fp16" in out
    assert "mixprec demo" in err and "/4 " in err and "O2 fp16" in err  # 2 runs x 2 steps


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
# Layout factors of the fake kernels: 1 everywhere unless a test sets them.
LAYOUT_SPEED = {"nn": 1.0, "nt": 1.0, "tn": 1.0, "tt": 1.0}


@pytest.fixture
def fake_kernels(monkeypatch):
    calls = []
    monkeypatch.setattr(sys.modules[__name__], "LAYOUT_SPEED", dict(LAYOUT_SPEED))

    def product_times(dtype, shape, device, budget_s, min_reps, warmup, layout="nn"):
        calls.append((dtype, tuple(shape), warmup + max(min_reps, 1)))
        rate = FAKE_RATES[dtype] * LAYOUT_SPEED[layout]
        return [2.0 * math.prod(shape) / (rate * 1e9)] * max(min_reps, 1)

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
    assert any(line.startswith("! above the GEMM peak even after re-probing it")
               for line in lines)
    assert "above the GEMM peak" not in bench.format_table(_report([0.5, 0.99]))


def _fake_peak(shape, gflops, full_size=True):
    """matmul_peaks' answer for one key whose three GEMMs all ran at ``gflops``."""
    gemm = {"gflops": gflops, "shape": list(shape), "full_size": full_size, "slow": False,
            "note": "", "spent_s": 0.0}
    return peaks.combined(shape, {name: dict(gemm) for name, _, _ in bench.TRAINING_GEMMS},
                           False)


@pytest.mark.parametrize("second, disturbed", [(1e-6, True), (1e6, False)])
def test_bench_reprobes_a_disturbed_peak_and_flags_it_in_the_json(monkeypatch, second, disturbed):
    probes = []

    def fake_peaks(keys, shape, device="cpu"):  # the first probe is far too low
        probes.append(list(keys))
        return {k: _fake_peak(shape, 1e-6 if len(probes) == 1 else second) for k in keys}

    monkeypatch.setattr(bench, "matmul_peaks", fake_peaks)
    rep = bench.run_bench(levels=("O0",), steps=1, warmup=0, reference=False, isolate=False,
                          width=8, batch=4, depth=2)
    assert probes == [["fp32"], ["fp32"]] and rep["peak_reprobed"] == ["fp32"]
    assert rep["matmul_peak_gflops"]["fp32"] == round(max(1e-6, second), 1)
    assert rep["rows"][0]["peak_exceeded"] is disturbed and rep["peak_disturbed"] is disturbed
    assert ("above the GEMM peak" in bench.format_table(rep)) is disturbed


def test_bench_peaks_follow_the_kernels_the_rows_run():
    peaks = bench.matmul_peaks(["fp32", "fp16", "fp16 native"], (32, 32, 32))
    emulated = not hardware.is_fast(torch.float16, "cpu")
    assert peaks["fp16"]["emulated"] is emulated and peaks["fp16 native"]["emulated"] is False
    assert all(p["gflops"] > 0 and p["full_size"] for p in peaks.values())


def test_the_gemm_peak_times_a_linear_layers_three_training_gemms_in_their_layouts(fake_kernels):
    # torch's CPU fp16 GEMM is ~8x faster for x @ W.t() than for x @ W; a probe of one product
    # in one layout put the rows that run all three above "100%" of it
    LAYOUT_SPEED.update(nn=1.0, nt=8.0, tn=4.0)
    (probe,) = bench.matmul_peaks(["fp32"], (64, 32, 16)).values()
    gemms = probe["gemms"]
    assert [(g["layout"], g["shape"]) for g in gemms.values()] == [
        ("nt", [64, 32, 16]), ("nn", [64, 16, 32]), ("tn", [16, 64, 32])]
    rates = [300.0 * f for f in (8.0, 1.0, 4.0)]
    assert [g["gflops"] for g in gemms.values()] == pytest.approx(rates)
    # a step that does nothing but these three GEMMs (equal FLOPs) runs at exactly the peak
    gemm_only_step = 3 / sum(1 / r for r in rates)
    assert probe["gflops"] == pytest.approx(gemm_only_step) and probe["full_size"]
    assert 300.0 < probe["gflops"] < 2400.0  # neither the nn product alone nor the fastest


def test_a_row_at_the_gemm_only_rate_is_at_100_percent_not_flagged(monkeypatch):
    gemm_only = 3 / (1 / 2400 + 1 / 400 + 1 / 1200)  # 800

    def fake_peaks(keys, shape, device="cpu"):
        return {k: peaks.combined(shape, {
            name: {"gflops": rate, "shape": list(shape), "full_size": True, "spent_s": 0.0}
            for (name, _, _), rate in zip(bench.TRAINING_GEMMS, (2400, 400, 1200))}, False)
            for k in keys}

    monkeypatch.setattr(bench, "matmul_peaks", fake_peaks)
    rep = bench.run_bench(levels=("O0",), steps=1, warmup=0, reference=False, isolate=False,
                          width=8, batch=4, depth=2)
    row = rep["rows"][0]
    assert row["peak_share"] == pytest.approx(row["gflops"] / gemm_only)
    row["gflops"], row["peak_share"] = gemm_only, 1.0
    text = bench.format_table(rep)
    line = next(line for line in text.splitlines() if line.startswith("O0"))
    assert " 100% " in line and "!" not in line and "above the GEMM peak" not in text
    assert "fp32 800 (2400/400/1200)" in text


def test_a_gemm_too_slow_to_probe_at_full_size_gives_no_percentage(monkeypatch, fake_kernels):
    # the native fp16 GEMM (0.27 GFLOP/s here) stops at a smaller shape: slower than at the
    # row's full shape, so it is no peak for the row (it read "243%!" blaming machine load)
    peaks = bench.matmul_peaks(["fp16 native"], (512, 2048, 2048), budget_s=1.0)
    assert peaks["fp16 native"]["full_size"] is False
    monkeypatch.setattr(bench, "matmul_peaks", lambda keys, shape, device="cpu": {
        k: _fake_peak(shape, 1e-9, full_size=False) for k in keys})
    rep = bench.run_bench(levels=("O0",), steps=1, warmup=0, reference=False, isolate=False,
                          width=8, batch=4, depth=2)
    row = rep["rows"][0]
    assert row["peak_share"] is None and not row["peak_exceeded"] and not rep["peak_disturbed"]
    assert rep["peak_reprobed"] == []
    text = bench.format_table(rep)
    line = next(line for line in text.splitlines() if line.startswith("O0"))
    assert line.split()[7] == "-" and "!" not in line and "above the GEMM peak" not in text
    assert "too slow to probe at full size within the budget" in text and "no % peak" in text


# ----------------------------------------------------------------- fp16 without master weights
TINY_GPT = {"width": 16, "batch": 2, "depth": 1, "seq_len": 8}


def test_o3_fp16_row_runs_a_sound_eps_and_says_why():
    o3 = bench.run_row("transformer", TINY_GPT, "O3", "fp16", steps=2, warmup=1)
    assert math.isfinite(o3["final_loss"])
    (note,) = o3["notes"]
    assert "AdamW's eps=1e-08 rounds to 0" in note and "0/0 = NaN" in note
    assert f"This row ran with eps={bench.FP16_STATE_EPS:g}" in note
    for level in ("O2", bench.REFERENCE):  # fp32 optimizer state: nothing changed, no note
        row = bench.run_row("transformer", TINY_GPT, level, "fp16", steps=1, warmup=0)
        assert row["notes"] == [] and math.isfinite(row["final_loss"])
    assert bench.run_row("transformer", TINY_GPT, "O3", "bf16", steps=1, warmup=0)["notes"] == []


def test_without_the_sound_eps_the_row_is_refused_up_front_not_a_nan_loss(monkeypatch):
    """The row the old bench ran (fp16 AdamW state, eps 1e-8) is refused by prepare."""
    monkeypatch.setattr(bench, "_fp16_state_eps", lambda opt, level, dtype: "")
    with pytest.raises(ValueError, match="eps below fp16's smallest normal"):
        bench.run_row("transformer", TINY_GPT, "O3", "fp16", steps=1, warmup=1)


def test_bench_transformer_fp16_prints_the_reason_under_the_table(capsys):
    code, out, _ = run(capsys, "bench", "--model", "transformer", "--dtype", "fp16", "--levels",
                       "O3", "--no-reference", "--steps", "1", "--warmup", "1", "--width", "16",
                       "--batch", "2", "--depth", "1", "--seq-len", "8", "--in-process")
    row = next(line for line in out.splitlines() if line.startswith("O3"))
    assert code == 0 and "nan" not in row and row.split()[5].endswith("(1)")
    assert "(1) O3: pure fp16 without master weights keeps the optimizer state in fp16" in out


def test_bench_table_footnotes_each_note():
    rep = _report([0.5, 0.6])
    rep["rows"][1].update(final_loss=math.nan, notes=["first reason", "second reason"])
    lines = bench.format_table(rep).splitlines()
    o1 = next(line for line in lines if line.startswith("O1"))
    assert "nan(1)(2)" in o1.split()
    assert "(1) O1: first reason" in lines and "(2) O1: second reason" in lines


def test_doctor_probes_the_gpu_by_default_where_torch_sees_one(monkeypatch):
    """On a GPU machine a bare `mixprec doctor` reports the GPU, not the host CPU."""
    assert doctor.resolve_device("cpu") == "cpu"
    assert doctor.resolve_device("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert doctor.resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert doctor.resolve_device("auto") == "cuda"
