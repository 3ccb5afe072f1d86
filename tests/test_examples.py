"""The examples/ programs (the MindSpore and PaddlePaddle AMP guides' and the apex O0-O3
write-up's example programs in mixprec form) run at their tiny size and print what the originals
print."""

import importlib.util
import math
from pathlib import Path

import pytest

pytestmark = [pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning"),
              pytest.mark.usefixtures("restore_apex_registrations")]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mindspore_lenet(capsys):
    results = _load("mindspore_lenet").main(["--tiny"])
    out = capsys.readouterr().out
    # MindSpore's LossMonitor line, once per epoch (2 steps per epoch at the tiny size)
    assert out.count("epoch: 2 step: 2, loss is ") == 4
    assert set(results) == {"O2 + FixedLossScaleManager(1024.0, drop_overflow_update=False)",
                            "O2 + DynamicLossScaleManager()", "O3, loss_scale_manager=None",
                            "manual: conv1.to_float(float16), the rest fp32"}
    for r in results.values():
        assert math.isfinite(r["loss"]) and 1.5 < r["loss"] < 3.0   # ~ln(10): random labels
    fixed = results["O2 + FixedLossScaleManager(1024.0, drop_overflow_update=False)"]
    assert fixed["scale"] == 1024
    dynamic = results["O2 + DynamicLossScaleManager()"]
    assert dynamic["scale"] == 2.0 ** 24 / 2 ** dynamic["skipped"]  # backs off from 2**24
    # and may grow past it: MindSpore's manager has no ceiling below fp32's range
    manager = _load("mindspore_lenet").RUNS["O2 + DynamicLossScaleManager()"]["loss_scale"]()
    assert manager.get_scale() == 2.0 ** 24 and manager.config.max_scale == 2.0 ** 127
    assert "O2(params=fp16,compute=fp16,output=fp32,master=fp32)" in out


def test_paddle_nine_linear(capsys):
    results = _load("paddle_nine_linear").main(["--tiny", "--dtype", "bf16"])
    out = capsys.readouterr().out
    for label in ("float32 mode", "AMP-O1 mode", "AMP-O2 mode"):
        assert f"{label}: " in out and " sec per step" in out
    assert out.count("loss: [") == 4
    fp32 = results["float32"][0]
    for label in ("AMP-O1", "AMP-O2"):
        loss, seconds = results[label]
        assert abs(loss - fp32) < 0.02 * fp32 and seconds > 0   # same training, bf16 compute
    assert "| time per step |" in out


def test_apex_o0_o3(capsys):
    results = _load("apex_o0_o3").main(["--tiny"])
    out = capsys.readouterr().out
    for level in ("O0", "O1", "O2", "O3"):
        assert f"{level} step 6: loss " in out and f"{level}: " in out and " ms per step" in out
        losses = results[level]["losses"]
        assert len(losses) == 6 and losses[-1] < losses[0] / 2
    # O1 and O2 stay within 3% of the fp32 (O0) loss at every step
    for level in ("O1", "O2"):
        for a, b in zip(results[level]["losses"], results["O0"]["losses"]):
            assert abs(a - b) <= 0.03 * b
