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
        f"{path}:4: step 0 follows step 10 (line 3): the file holds more than one run")
    assert len(series["mixprec/loss"]) == 6
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
    shown = json.loads(captured.out)  # two records; to the last one's step 5: 6 steps
    assert (shown["records"], shown["steps"], shown["steps_exact"]) == (2, 6, False)
    assert captured.err == (f"mixprec report: warning: {two}:3: step 0 follows step 5 (line 2): "
                            f"the file holds more than one run, read as one (JSONLWriter(path, "
                            f"mode='a') appends; the default starts the file afresh)\n")


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
