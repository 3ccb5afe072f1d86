"""`mixprec report`: the page from a real recorded run, its advice in words, the command line, and
the page opened in a real browser (headless Chromium through Selenium; skipped without one)."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.monitor import JSONLWriter, TensorBoardWriter, read_run
from mixprec.monitor.report import Run, advice, render, write_report

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
pytest.importorskip("matplotlib")


def record(writer, level="O3", steps=60, every=5, lr=1e-4):
    """A small run whose middle layer holds weights in [1.5, 2.5): at O3 its updates round away."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                          nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight.add_(2.0)
    monitor = mp.PrecisionMonitor(every=every, writers=[writer])
    amp = mp.MixedPrecision(level, "bf16", monitor=monitor)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=lr))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        amp.backward(F.mse_loss(model(x).float(), y))
        amp.step(opt)
        opt.zero_grad()
    monitor.close()
    return monitor


@pytest.fixture(scope="module")
def o3_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "precision.jsonl"
    record(JSONLWriter(path))
    return path


def test_advice_names_the_layer_that_loses_its_updates_at_o3_and_none_at_o2(o3_run, tmp_path):
    lines = advice(Run(read_run(o3_run)))
    assert lines[0].startswith("Layer 2 lost 9") and "from step 0" in lines[0]
    assert "master weights" in lines[0]
    o2 = tmp_path / "o2.jsonl"
    record(JSONLWriter(o2), level="O2", steps=20)
    assert advice(Run(read_run(o2)))[0].startswith("No precision problem was seen")


def test_advice_on_a_collapsing_loss_scale_skips_underflow_and_headroom():
    steps = list(range(0, 100, 10))
    series = {
        "mixprec/loss_scale": [(s, 2.0 ** 16 / 2 ** (s // 10)) for s in steps],
        "mixprec/skipped_steps": [(s, s // 10) for s in steps],
        "mixprec/h.3.mlp/grad_underflow": [(s, 0.0 if s < 50 else 0.2) for s in steps],
        "mixprec/h.3.mlp/act_amax": [(s, 700.0 * (s + 1)) for s in steps],
        "mixprec/h.3.mlp/act_headroom": [(s, math.log2(65504 / (700.0 * (s + 1))))
                                         for s in steps],
    }
    lines = advice(Run(series))
    assert any(line.startswith("The loss scale collapsed from 65536 (step 0) to 128 (step 90)")
               for line in lines)
    # no closing count in the record: counted to its last step, and said so
    assert any(line.startswith("9 of the first 91 steps were skipped") for line in lines)
    assert any(line.startswith("Layer h.3.mlp: 20.0% of its nonzero gradients fall below fp16's "
                               "smallest normal number from step 50") for line in lines)
    assert any(line.startswith("Layer h.3.mlp's outputs came within 0.0 binades of fp16's "
                               "largest value at step 90") for line in lines)


@pytest.mark.parametrize("scale, cure", [
    (1.0, "No loss scale was in use, so no scale setting avoids them"),
    (1024.0, "A longer growth_interval= makes the growth attempts that overflow (each a "
             "skipped step) rarer; bf16 (no loss scale) has none.")])
def test_skip_advice_fits_whether_the_loss_was_scaled(scale, cure):
    """A bf16 run (no loss scale) with a NaN loss was told to set hysteresis= or use bf16; an
    fp16 run was told hysteresis= avoids skips, which makes them more frequent."""
    steps = list(range(10))
    run = Run({"mixprec/loss_scale": [(s, scale) for s in steps],
               "mixprec/skipped_steps": [(s, float(s >= 3)) for s in steps],
               "mixprec/steps": [(9, 10.0)]})
    [line] = [a for a in advice(run) if "steps were skipped" in a]
    assert line.startswith("1 of 10 steps were skipped") and cure in line
    assert ("trace_nonfinite" in line) == (scale == 1.0)


def test_the_page_is_self_contained_with_every_plot(o3_run, tmp_path):
    page = write_report(o3_run, tmp_path / "r.html").read_text()
    assert page.count('src="data:image/png;base64,') == 5  # loss, norm, three heatmaps
    assert "<script" not in page and "http" not in page.replace("http-equiv", "")
    assert "Layer 2 lost" in page and "What to do" in page


def test_a_tensorboard_folder_gives_the_same_page_as_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    record(TensorBoardWriter(tmp_path / "tb"), steps=20)
    record(JSONLWriter(tmp_path / "p.jsonl"), steps=20)
    tb, jl = Run(read_run(tmp_path / "tb")), Run(read_run(tmp_path / "p.jsonl"))
    assert tb.layers == jl.layers and tb.steps == jl.steps
    assert advice(tb) == advice(jl)
    assert render(tb.series).count("data:image/png") == 5


def test_the_command_writes_the_page_and_refuses_a_missing_run(o3_run, tmp_path):
    env_cmd = [sys.executable, "-m", "mixprec", "report"]
    out = subprocess.run([*env_cmd, str(o3_run), "-o", str(tmp_path / "x" / "r.html")],
                         capture_output=True, text=True, check=True)
    assert "report:" in out.stdout and (tmp_path / "x" / "r.html").exists()
    shown = json.loads(subprocess.run([*env_cmd, str(o3_run), "--json"], capture_output=True,
                                      text=True, check=True).stdout)
    assert shown["layers"] == ["0", "2", "4"] and shown["format"] == "bf16"
    bad = subprocess.run([*env_cmd, str(tmp_path / "none.jsonl")], capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "no run at" in bad.stderr


def skipping_run(path, close=True):
    """40 fp16 steps, recorded every 5 (steps 0 to 35): 7 skipped by an inf loss, 4 of them
    after the last record (steps 36-39)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    monitor = mp.PrecisionMonitor(every=5, writers=JSONLWriter(path))
    amp = mp.MixedPrecision("O2", "fp16", monitor=monitor,
                            loss_scale=mp.DynamicLossScaler(init_scale=2.0 ** 8))
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = F.mse_loss(model(x).float(), y)
        amp.backward(loss * math.inf if step in (2, 11, 20, 36, 37, 38, 39) else loss)
        amp.step(opt)
        opt.zero_grad()
    if close:
        monitor.close()
    return path


def test_the_report_counts_every_step_and_prints_what_the_page_shows(tmp_path, capsys):
    from mixprec import cli
    run = skipping_run(tmp_path / "run.jsonl")
    assert cli.main(["report", str(run), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["steps"], shown["steps_exact"], shown["records"], shown["skipped_steps"]) == (
        40, True, 8, 7.0)
    assert any(a.startswith("7 of 40 steps were skipped") for a in shown["advice"])
    assert cli.main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    rows = dict(line.split("  ", 1) for line in lines[:6])
    assert {k: v.strip() for k, v in rows.items()} == {
        "steps": "40", "records": "8, steps 0 to 35", "layers watched": "2",
        "training format": "fp16", "loss": rows["loss"].strip(),
        "loss scale": "32 to 256, 32 at step 35"}
    assert "skipped steps    7 of 40 (18%)" in lines
    assert "worst layers:" in lines and any(line.startswith("  update lost: ") for line in lines)
    assert "what to do:" in lines and "  - 7 of 40 steps were skipped" in text
    assert lines[-1] == f"report: {(tmp_path / 'r.html').resolve()}"
    # not closed: counted to the last record, and said so
    open_run = Run(read_run(skipping_run(tmp_path / "open.jsonl", close=False)))
    assert (open_run.step_count, open_run.count_exact, open_run.skipped()) == (36, False, 3.0)
    assert any(a.startswith("3 of the first 36 steps were skipped") for a in advice(open_run))


# -- in a real browser -----------------------------------------------------------------------------
def _chrome():
    webdriver = pytest.importorskip("selenium.webdriver")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no chromium and chromedriver installed (Debian: apt-get install chromium "
                    "chromium-driver)")
    return webdriver, browser, driver


def test_the_page_renders_in_headless_chromium(o3_run, tmp_path):
    webdriver, browser, driver_path = _chrome()
    from selenium.webdriver.chrome.service import Service
    page = write_report(o3_run, tmp_path / "report.html")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(page.resolve().as_uri())
        images = driver.find_elements("tag name", "img")
        assert len(images) == 5
        sizes = [driver.execute_script("return [arguments[0].complete, "
                                       "arguments[0].naturalWidth, arguments[0].naturalHeight]",
                                       img) for img in images]
        assert all(done and w > 300 and h > 100 for done, w, h in sizes), sizes
        assert "Layer 2 lost" in driver.find_element("tag name", "ul").text
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1200, height + 100)  # the whole page in the screenshot
        shot = tmp_path / "report.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        driver.quit()


def test_report_names_a_file_that_is_not_text(tmp_path, capsys):
    """A binary file gave a bare UnicodeDecodeError message naming neither file nor line, where
    the docs promise both."""
    from mixprec import cli
    path = tmp_path / "plot.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    assert cli.main(["report", str(path)]) == 2
    assert f"{path}:1 is not a JSON object with a 'step'" in capsys.readouterr().err


def test_skips_on_the_scale_s_way_down_are_told_to_start_lower():
    """A dynamic scale that started far above where it settled skipped a step per halving:
    the advice names the scale to start at."""
    steps = list(range(0, 40, 4))
    scale = [2.0 ** 24 / 2 ** min(s, 10) for s in steps]
    run = Run({"mixprec/loss_scale": list(zip(steps, scale)),
               "mixprec/skipped_steps": [(s, float(min(s, 10))) for s in steps],
               "mixprec/steps": [(36, 40.0)]})
    [line] = [a for a in advice(run) if "steps were skipped" in a]
    assert ("The scale started at 1.67772e+07 and settled near 16384: init_scale=16384 starts "
            "there, without the skips on the way down.") in line
