"""The run behind docs/monitoring.md: a config-built GPT-2 trained at O3 bf16 (16-bit weights, no
masters) and at O2 bf16 (fp32 masters) on the same batches, each recorded by a PrecisionMonitor
every 10 steps; writes both JSONL records and reports, prints their advice, and (where headless
Chromium and Selenium are installed) a screenshot of the O3 report's page.

    .venv/bin/python bench/monitor_docs.py [--steps 300] [--out mixprec-out/monitor]
        [--screenshot docs/monitoring-report.png]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import warnings

import torch

import mixprec as mp
from mixprec.monitor import JSONLWriter
from mixprec.monitor.report import Run, advice, write_report
from mixprec.monitor.writers import read_run

SIZE = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=512, seq=64, batch=8)


def train(level: str, steps: int, path: pathlib.Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        n_layer=SIZE["n_layer"], n_embd=SIZE["n_embd"], n_head=SIZE["n_head"],
        vocab_size=SIZE["vocab_size"], n_positions=SIZE["seq"], bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    path.unlink(missing_ok=True)
    monitor = mp.PrecisionMonitor(every=10, writers=[JSONLWriter(path)])
    amp = mp.MixedPrecision(level, "bf16", monitor=monitor)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, SIZE["vocab_size"], (steps, SIZE["batch"], 1), generator=g)
    for step in range(steps):  # counting sequences from random starts: learnable
        ids = (starts[step] + torch.arange(SIZE["seq"])) % SIZE["vocab_size"]
        amp.backward(model(input_ids=ids, labels=ids).loss)
        amp.step(opt)
        opt.zero_grad(set_to_none=True)
    monitor.close()


def screenshot(page: pathlib.Path, png: pathlib.Path, height: int) -> bool:
    """The top ``height`` pixels of ``page`` in headless Chromium; False without a browser."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return False
    browser, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver_path is None:
        return False
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--user-data-dir={page.parent / 'chromium-profile'}",
                 f"--window-size=1100,{height}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(page.resolve().as_uri())
        driver.save_screenshot(str(png))
    finally:
        driver.quit()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="mixprec-out/monitor")
    parser.add_argument("--screenshot", default=None)
    parser.add_argument("--height", type=int, default=2600)
    args = parser.parse_args()
    warnings.simplefilter("ignore", mp.SlowDtypeWarning)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for level in ("O3", "O2"):
        record = out / f"gpt2-{level}.jsonl"
        train(level, args.steps, record)
        page = write_report(record, out / f"gpt2-{level}.html",
                            f"GPT-2 ({SIZE['n_layer']} layers, width {SIZE['n_embd']}, config-"
                            f"built) at {level} bf16, AdamW 3e-4")
        print(f"{level}: {page}")
        for line in advice(Run(read_run(record))):
            print(f"  - {line}")
        if level == "O3" and args.screenshot:
            shot = pathlib.Path(args.screenshot)
            print(f"  screenshot: {shot}" if screenshot(page, shot, args.height)
                  else "  no screenshot: chromium, chromedriver or selenium missing")


if __name__ == "__main__":
    main()
