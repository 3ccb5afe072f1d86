"""Where FP8 pays (mixprec.fp8.speed): the shape model, the once-per-prepare warning on CUDA
(driven here with a CUDA device class imposed on a CPU model), and the advisor's per-layer
estimate."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.fp8 import speed

pytest.importorskip("torchao")
pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")


def test_estimate_grows_with_width_and_crosses_bf16_between_1024_and_4096_on_sm90():
    widths = [768, 1024, 2048, 4096, 8192]
    sm90 = [speed.estimate(w, w, "cuda-sm90") for w in widths]
    assert sm90 == sorted(sm90)
    assert sm90[0] < sm90[1] < 1.0 < sm90[3]  # GPT-2's 768 and 1024 lose; 4096 gains
    assert 1.3 < speed.estimate(4096, 11008, "cuda-sm90") < 2.0  # a 7B MLP; below FP8's 2x
    assert speed.estimate(4096, 4096, "cuda-sm90", tokens=64) < 1.0  # few tokens: casts dominate
    assert speed.estimate(4096, 4096, "cpu") is None  # emulated: no speed to estimate
    assert speed.estimate(4096, 4096, "cuda-old") is None


@pytest.mark.parametrize("bad", [0, -16, 16.0, True, None])
def test_estimate_refuses_a_bad_dimension(bad):
    with pytest.raises(ValueError, match="in_features must be a positive integer"):
        speed.estimate(bad, 64)


def test_device_classes_by_compute_capability():
    assert speed._class_of_capability(9, 0) == "cuda-sm90"
    assert speed._class_of_capability(8, 9) == "cuda-sm89"
    assert speed._class_of_capability(8, 0) == "cuda-old"
    assert speed._class_of_capability(10, 0) == "cuda-sm100"
    assert speed._class_of_capability(12, 0) == "cuda-sm100"
    assert speed.device_class("cpu") == "cpu"


def _net(width):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 16))


def test_prepare_on_a_gpu_warns_once_with_the_small_layers_shapes(monkeypatch):
    monkeypatch.setattr(speed, "device_class", lambda device: "cuda-sm90")
    with pytest.warns(speed.FP8SpeedWarning) as record:
        mp.prepare(_net(64), level="O2", dtype="bf16", fp8="tensorwise")
    ours = [w for w in record if w.category is speed.FP8SpeedWarning]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert "converts 2 of 2 layers" in text and "64x64 (2 layers, ~0.01x)" in text
    assert "cuda-sm90" in text and "not calibrated on a GPU" in text


def test_prepare_does_not_warn_where_fp8_pays_or_on_the_cpu(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", speed.FP8SpeedWarning)
        mp.prepare(_net(64), level="O2", dtype="bf16", fp8="tensorwise")  # CPU: documented
        monkeypatch.setattr(speed, "device_class", lambda device: "cuda-sm90")
        monkeypatch.setattr(speed, "TOKENS", 8192)
        model = mp.prepare(_net(4096), level="O2", dtype="bf16", fp8="tensorwise")
    assert mp.fp8_modules(model) == ["2", "4"]


def test_prepare_on_the_cpu_warns_once_that_fp8_is_emulated(monkeypatch):
    monkeypatch.setattr(speed, "_emulated_warned", set())
    with pytest.warns(speed.FP8EmulatedWarning, match=r"fp8='tensorwise' on a CPU: .*emulates "
                      r"the low-bit GEMMs of the 2 converted layers, slower than bf16"):
        mp.prepare(_net(64), level="O2", dtype="bf16", fp8="tensorwise")
    with warnings.catch_warnings():
        warnings.simplefilter("error", speed.FP8EmulatedWarning)
        mp.prepare(_net(64), level="O2", dtype="bf16", fp8="rowwise")  # once per process
    # a speed note, as a slow dtype's: the suite's filter for those covers it
    assert issubclass(speed.FP8EmulatedWarning, mp.SlowDtypeWarning)


def test_advisor_reports_each_layers_expected_fp8_speed():
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    x, y = torch.randn(8, 4, 32), torch.randint(0, 16, (8, 4))
    advice = mp.advise(net, (x, y), lambda out, t: F.cross_entropy(out.flatten(0, 1),
                                                                   t.flatten()),
                       formats=("bf16",))
    assert [a.gemm for a in advice.layers] == [(32, 32, 64), (32, 64, 16)]
    speeds = advice.fp8_speed("cuda-sm90")
    assert speeds["0"] == pytest.approx(speed.estimate(32, 64, "cuda-sm90", 32))
    assert set(speeds) == {"0", "2"}  # the Linear layers the advisor measured
    assert all(v is None for v in advice.fp8_speed("cpu").values())
    assert "0: 32 x 32 -> 64:" in advice.speed_table() and "not calibrated" in advice.speed_table()
    assert advice.to_dict()["layers"][0]["gemm"] == [32, 32, 64]
