"""bench/precision_recipes.py at its ``--quick`` size: every row of both tables is there (trained,
or refused with mixprec's message), the losses are finite and fall, and the bytes columns are
``mp.bytes_per_parameter``'s figures: their parts add up to the total, they follow from the
share of 16-bit weights, and one row recomputed here gives the same dict."""

import contextlib
import importlib.util
import io
import json
import math
import pathlib
import sys

import pytest
import torch

import mixprec as mp

pytest.importorskip("transformers")
pytest.importorskip("torchao.optim")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = ("weights", "masters", "compensation", "optimizer_state")

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning"),
              pytest.mark.filterwarnings("ignore:.*_stable_hash_for_caching.*:UserWarning"),
              pytest.mark.filterwarnings(  # inductor's compile of the compact-master kernels
                  r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")]


def load_bench():
    name = "precision_recipes_bench"
    if name not in sys.modules:  # dataclasses look their module up in sys.modules
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "precision_recipes.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    bench = load_bench()
    path = tmp_path_factory.mktemp("recipes") / "out.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.main(["--quick", "--steps", "4", "--json", str(path)])
    return bench, json.loads(path.read_text()), out.getvalue()


def test_every_row_is_in_both_tables(report):
    bench, rep, text = report
    names = [r.name for r in bench.master_recipes()]
    assert list(rep["masters"]) == names and len(names) == 1 + 4 * 3
    assert list(rep["formats"]) == ["bf16", "fp8", "mxfp8"]
    for name, row in [*rep["masters"].items(), *rep["formats"].items()]:
        assert f"| {name} |" in text
        if "refused" in row:  # only a master this mixprec may not have yet
            assert name.startswith("split") and "split" in row["refused"]
            assert f"| {name} | refused: " in text
    assert "command: python bench/precision_recipes.py --quick --steps 4" in text
    assert f"torch {torch.__version__}" in text and "machine: " in text


def test_losses_are_finite_and_fall(report):
    _, rep, _ = report
    trained = [r for r in [*rep["masters"].values(), *rep["formats"].values()]
               if "refused" not in r]
    assert len(trained) >= 12
    for row in trained:
        assert row["finite"] and math.isfinite(row["loss"])
        assert row["loss"] < row["first_loss"]
    base = rep["masters"]["fp32 / fp32"]["loss"]
    for row in trained:  # four steps from one init: every recipe is still close to the others
        assert abs(row["loss"] / base - 1) < 0.02
    assert rep["formats"]["bf16"] == rep["masters"]["fp32 / fp32"]
    assert rep["formats"]["bf16"]["lowbit_layers"] == 0
    for fmt in ("fp8", "mxfp8"):  # the first and last Linear-like layers stay in bf16
        row = rep["formats"][fmt]
        assert row["lowbit_layers"] == row["gemm_layers"] - 2 > 0


def test_bytes_columns_follow_bytes_per_parameter(report):
    _, rep, _ = report
    rows = {k: v for k, v in rep["masters"].items() if "refused" not in v}
    for name, row in rows.items():
        b = row["bytes"]
        assert b["gradients"] == 0  # measured after zero_grad(set_to_none=True)
        assert b["total"] == pytest.approx(sum(b[k] for k in PARTS), rel=1e-12)
    assert rows["fp32 (O0)"]["bytes"]["weights"] == 4.0
    low = 4 - rows["fp32 / fp32"]["bytes"]["weights"]  # 2 bytes saved per 16-bit parameter
    assert 0.9 < low / 2 <= 1  # nearly all of GPT-2's parameters are 16-bit at O2
    for name, row in rows.items():
        b = row["bytes"]
        master, state = name.split(" / ") if " / " in name else ("O0", "fp32")
        if master == "split":  # the 16-bit remainder: 2 bytes per 16-bit parameter
            assert b["masters"] + b["compensation"] == pytest.approx(low, abs=1e-9)
        else:
            expected = {"O0": (0, 0), "fp32": (2 * low, 0), "kahan": (0, low),
                        "stochastic": (0, 0)}[master]
            assert (b["masters"], b["compensation"]) == pytest.approx(expected, abs=1e-9)
        step_counters = 0.1  # a 4-byte step count per tensor: well under 0.1 B/param here
        if state in ("fp32", "bf16"):
            moments = 8 if state == "fp32" else 4
            assert moments <= b["optimizer_state"] < moments + step_counters
        else:  # 8-bit codes with fp32 block scales; tensors under torchao's min_size keep fp32
            assert 2 < b["optimizer_state"] < 8


def test_a_row_recomputed_gives_the_same_bytes(report):
    bench, rep, _ = report
    recipe = next(r for r in bench.master_recipes() if r.name == "kahan / bf16")
    torch.manual_seed(0)
    model = bench.build_model(bench.QUICK)
    opt = bench.make_optimizer(model.parameters(), recipe.state)
    model, opt = mp.prepare(model, opt, **recipe.prepare_options())
    model(**bench.make_batches(bench.QUICK, bench.QUICK_BATCH, 1)[0]).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert mp.bytes_per_parameter(model, opt) == rep["masters"]["kahan / bf16"]["bytes"]
