"""The monitor's writers and reading a record back: one run per file, errors that name the file
and line, and ``mixprec report`` on what is not a mixprec record."""

import json

import pytest
import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec.cli import main
from mixprec.monitor import JSONLWriter, read_run
from mixprec.monitor.report import Run, advice

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_jsonl_writer_starts_a_fresh_file_and_appends_only_when_asked(tmp_path):
    path = tmp_path / "run.jsonl"
    for _ in range(2):  # two runs, one file: the second replaces the first
        writer = JSONLWriter(path)
        for step in (0, 5):
            writer.write(step, {"mixprec/loss": 1.0})
    assert [r["step"] for r in _lines(path)] == [0, 5]
    JSONLWriter(path)  # nothing recorded yet: the file is untouched (only the writer truncates)
    assert len(_lines(path)) == 2
    resumed = JSONLWriter(path, mode="a")
    resumed.write(10, {"mixprec/loss": 0.5})
    assert [r["step"] for r in _lines(path)] == [0, 5, 10]
    assert repr(resumed) == f"JSONLWriter({str(path)!r}, mode='a')"
    with pytest.raises(ValueError, match="mode must be one of 'w'.*'a'.*got 'x'"):
        JSONLWriter(path, mode="x")


def test_reading_two_runs_in_one_file_warns_naming_the_file_and_line(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps({"step": s, "mixprec/loss": 1.0}) + "\n"
                            for s in (0, 5, 10, 0, 5, 10)))
    with pytest.warns(RuntimeWarning) as caught:
        series = read_run(path)
    assert len(caught) == 1  # one warning per file
    assert str(caught[0].message).startswith(
        f"{path}:4: step 0 follows step 10: the run starts again, read as the later run")
    assert len(series["mixprec/loss"]) == 3
    path.write_text("".join(json.dumps({"step": s, "mixprec/loss": 1.0}) + "\n"
                            for s in (0, 5, 10)))
    read_run(path)  # one run: no warning (the suite turns warnings into errors)


@pytest.mark.parametrize("value", ['"fast"', "null", "true", "[1]"])
def test_a_value_that_is_not_a_number_names_the_file_line_and_scalar(tmp_path, value):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 0, "mixprec/loss": 1.0}\n'
                    f'{{"step": 1, "mixprec/loss": {value}}}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: 'mixprec/loss' is .*, not a number"):
        read_run(path)
    path.write_text('{"step": 0, "mixprec/grad_norm": "inf", "mixprec/loss": "nan"}\n')
    assert read_run(path)["mixprec/grad_norm"] == [(0, float("inf"))]  # what the writer writes


def test_the_report_refuses_a_run_without_mixprec_scalars(tmp_path, capsys):
    path = tmp_path / "other.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0, "lr": 0.1}) + "\n"
                            for s in (0, 1)))
    assert advice(Run(read_run(path)))[0].startswith("The run holds no mixprec scalars")
    for extra in ([], ["--json"]):
        assert main(["report", str(path), "-o", str(tmp_path / "r.html"), *extra]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and not (tmp_path / "r.html").exists()
        assert captured.err == (f"mixprec report: error: {path} holds no mixprec scalars (names "
                                f"starting 'mixprec/'), only loss, lr: not a PrecisionMonitor's "
                                f"record, nothing to report\n")


def test_the_report_command_names_a_missing_run_and_warns_of_two_runs(tmp_path, capsys):
    missing = tmp_path / "none.jsonl"
    assert main(["report", str(missing), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(
        f"mixprec report: error: no run at {missing}") and captured.err.count("\n") == 1
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"step": s, "mixprec/loss": 1.0}) + "\n"
                           for s in (0, 5, 0)))
    assert main(["report", str(two), "--json"]) == 0
    captured = capsys.readouterr()
    shown = json.loads(captured.out)  # the later run: one record, at step 0
    assert (shown["records"], shown["steps"], shown["steps_exact"]) == (1, 1, False)
    assert captured.err == (f"mixprec report: warning: {two}:3: step 0 follows step 5: the run "
                            f"starts again, read as the later run (JSONLWriter(path, mode='a') "
                            f"appends, for a run resumed from a checkpoint; the default starts "
                            f"the file afresh)\n")


def test_the_monitor_takes_one_writer_as_well_as_a_list(tmp_path):
    path = tmp_path / "p.jsonl"
    writer = JSONLWriter(path)
    monitor = mp.PrecisionMonitor(every=1, writers=writer)
    assert monitor.writers == [writer]
    model = torch.nn.Linear(4, 2)
    amp = mp.MixedPrecision("O2", "bf16", monitor=monitor)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    amp.backward(F.mse_loss(model(torch.randn(8, 4)).float(), torch.zeros(8, 2)))
    amp.step(opt)
    monitor.close()
    rows = _lines(path)  # the record, the closing count joining it
    assert [r["step"] for r in rows] == [0] and rows[0]["mixprec/steps"] == 1.0
    with pytest.raises(TypeError, match=r"writers takes a writer or a list of writers; got str "
                                        r"'p.jsonl' \(for a file: JSONLWriter\('p.jsonl'\)\)"):
        mp.PrecisionMonitor(writers="p.jsonl")
    with pytest.raises(TypeError, match="writers takes a writer or a list of writers; got int"):
        mp.PrecisionMonitor(writers=3)
    with pytest.raises(TypeError, match=r"write\(step, scalars\) and close\(\)"):
        mp.PrecisionMonitor(writers=[writer, object()])


def test_a_run_resumed_into_its_file_reads_as_the_uninterrupted_run(tmp_path):
    """JSONLWriter(path, mode="a") after a resume from the step-7 checkpoint of a run that died
    at step 12: its records from step 10 on replace the dead run's (the report counted two runs
    and kept, at step 10, whichever loss was larger)."""
    path = tmp_path / "run.jsonl"
    rows = [(0, 2.0), (5, 1.5), (10, 1.13), (10, 1.08), (15, 0.9)]  # the dead run to line 3
    path.write_text("".join(json.dumps({"step": s, "mixprec/loss": v}) + "\n" for s, v in rows)
                    + json.dumps({"step": 15, "mixprec/steps": 16.0}) + "\n")
    series = read_run(path)  # no warning: the suite turns warnings into errors
    assert series["mixprec/loss"] == [(0, 2.0), (5, 1.5), (10, 1.08), (15, 0.9)]
    assert series["mixprec/steps"] == [(15, 16.0)]


def test_a_last_line_cut_short_is_left_out_with_a_warning(tmp_path):
    """A run killed while it wrote (or still writing): the report refused the whole file."""
    path = tmp_path / "cut.jsonl"
    path.write_text('{"step": 0, "mixprec/loss": 1.0}\n{"step": 5, "mixprec/lo')
    with pytest.warns(RuntimeWarning, match=rf"{path}:2 is cut short .* read up to line 1"):
        assert read_run(path) == {"mixprec/loss": [(0, 1.0)]}
    path.write_text('{"step": 0, "mixprec/loss": 1.0}\n{"step": 5, "mixprec/lo\n'
                    '{"step": 6, "mixprec/loss": 1.0}\n')  # not the last line: an error
    with pytest.raises(ValueError, match=rf"{path}:2 is not a JSON object with a 'step'"):
        read_run(path)


@pytest.mark.parametrize("step", ["Infinity", "1.5", "true", "-5", '"3"'])
def test_a_step_that_is_not_a_whole_number_is_refused(tmp_path, step, capsys):
    """``Infinity`` gave an OverflowError traceback; 1.5 and true were read as 1, -5 as -5."""
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{{"step": {step}, "mixprec/loss": 1.0}}\n')
    with pytest.raises(ValueError, match=r"is not a JSON object with a 'step' \(a whole number"):
        read_run(path)
    assert main(["report", str(path), "--json"]) == 2
    assert capsys.readouterr().err.startswith("mixprec report: error: ")


def test_damaged_values_give_advice_not_a_traceback(tmp_path, capsys):
    """A loss scale of 0 (ZeroDivisionError) and an activation headroom of 5000 binades
    (OverflowError) in a foreign or damaged file: the report reads them."""
    path = tmp_path / "odd.jsonl"
    path.write_text("".join(json.dumps({"step": s, "mixprec/loss_scale": v,
                                        "mixprec/skipped_steps": float(s), "mixprec/0/act_amax":
                                        1.0, "mixprec/0/act_headroom": 5000.0}) + "\n"
                            for s, v in ((0, 1024.0), (1, 0.0), (2, 512.0))))
    assert main(["report", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 3


def test_a_hugging_face_trainers_tensorboard_log_is_read(tmp_path, capsys):
    """The Trainer's TensorBoard callback writes ``train/<name>``: the report said the log held
    no mixprec scalars. And a folder whose runs are in its sub-folders says so."""
    torch_tb = pytest.importorskip("torch.utils.tensorboard")
    run = tmp_path / "runs" / "Nov29_run"
    writer = torch_tb.SummaryWriter(str(run))
    for step in (0, 5):
        writer.add_scalar("train/mixprec/loss", 1.0 / (step + 1), step)
        writer.add_scalar("train/mixprec/loss_scale", 65536.0, step)
        writer.add_scalar("train/epoch", 0.1 * step, step)
    writer.close()
    assert main(["report", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 2
    assert main(["report", str(tmp_path / "runs"), "--json"]) == 2
    assert f"the runs are in its folders: give one of them, e.g. {run}" in capsys.readouterr().err
