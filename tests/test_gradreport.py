"""grad_report: fractions against hand-built gradients, safe scales, the histogram, bad input."""

import math

import pytest
import torch
from torch import nn

from mixprec.debug.gradreport import GradReport, grad_report


def hand_built_linear() -> nn.Linear:
    """A Linear(5, 4) whose weight gradient has known counts in fp16 and whose bias has none."""
    model = nn.Linear(5, 4)
    g = torch.tensor([0.0] * 3             # exactly zero
                     + [2.0 ** -30] * 4    # underflow in fp16 (below 2^-25)
                     + [-(2.0 ** -20)] * 5  # fp16 subnormal
                     + [1.0] * 6           # normal
                     + [1e5, -1e5])        # overflow (fp16 max 65504)
    model.weight.grad = g.reshape(4, 5)
    return model


def test_fractions_of_a_hand_built_gradient():
    report = grad_report(hand_built_linear(), "fp16")
    assert isinstance(report, GradReport) and report.without_grad == ("bias",)
    w = report["weight"]
    assert (w.numel, w.dtype, w.max_abs) == (20, "fp32", 1e5)
    assert (w.zero, w.underflow, w.subnormal, w.overflow) == (3 / 20, 4 / 20, 5 / 20, 2 / 20)
    assert w.safe_scale_log2 == -1 and w.max_safe_scale == 0.5  # 1e5 / 2 = 5e4 <= 65504


def test_scale_moves_values_into_range():
    report = grad_report(hand_built_linear(), "fp16", scale=2.0 ** 10)
    w = report["weight"]
    assert (w.underflow, w.subnormal, w.overflow) == (0.0, 4 / 20, 2 / 20)
    assert w.safe_scale_log2 == -1  # the safe scale is for the unscaled gradient
    assert report.scale == 1024.0


def test_bf16_has_no_underflow_here():
    w = grad_report(hand_built_linear(), "bf16")["weight"]
    assert (w.underflow, w.subnormal, w.overflow) == (0.0, 0.0, 0.0)
    assert w.safe_scale_log2 == 111  # 1e5 ~ 2^16.6; bf16 max ~ 2^128


@pytest.mark.parametrize("fmt, max_abs, k", [
    ("fp16", 1.0, 15),                    # 2^15 fits, 2^16 = 65536 overflows
    ("fp16", 65504 / 2 ** 20, 20),
    ("fp16", 65519 / 2 ** 15, 15),        # rounds down to 65504: still finite
    ("fp16", 65520 / 2 ** 15, 14),        # rounds up to inf
    ("fp8_e4m3", 448.0, 0),
    ("fp8_e4m3", 464.0, 0),               # the tie rounds to 448
    ("fp8_e4m3", 465.0, -1),
    ("fp8_e5m2", 1.0, 15),
])
def test_largest_safe_power_of_two_scale(fmt, max_abs, k):
    model = nn.Linear(1, 1, bias=False, dtype=torch.float64)
    model.weight.grad = torch.tensor([[-max_abs]], dtype=torch.float64)
    stats = grad_report(model, fmt)["weight"]
    assert stats.safe_scale_log2 == k
    assert grad_report(model, fmt, scale=2.0 ** k)["weight"].overflow == 0.0
    assert grad_report(model, fmt, scale=2.0 ** (k + 1))["weight"].overflow == 1.0


def test_summary_across_parameters():
    model = nn.Linear(2, 2)
    model.weight.grad = torch.tensor([[1.0, 2.0 ** -40], [0.0, 4.0]])
    model.bias.grad = torch.tensor([2.0 ** -39, 2.0 ** -26])
    report = grad_report(model, "fp16")
    total = report.total
    assert (total.name, total.numel, total.max_abs) == ("(all)", 6, 4.0)
    assert total.underflow == 3 / 6 and total.zero == 1 / 6
    assert total.safe_scale_log2 == 13 == min(s.safe_scale_log2 for s in report.params)
    # at 2^13: 2^-40 -> 2^-27 and 2^-39 -> 2^-26 and 2^-26 -> 2^-13: two still underflow
    assert report.underflow_at_safe_scale == 2 / 6


def test_all_zero_gradient_has_no_safe_scale():
    model = nn.Linear(2, 2, bias=False)
    model.weight.grad = torch.zeros(2, 2)
    report = grad_report(model)
    assert report.total.safe_scale_log2 is None and report.total.max_safe_scale is None
    assert report.underflow_at_safe_scale is None and report.total.zero == 1.0
    assert "-" in str(report).splitlines()[-1]


def test_nonfinite_gradients_are_reported():
    model = nn.Linear(3, 1, bias=False)
    model.weight.grad = torch.tensor([[math.inf, math.nan, 2.0]])
    report = grad_report(model)
    assert report.total.max_abs == 2.0 and report.total.range.nonfinite == 2
    assert report.total.overflow == report.total.nonfinite == 2 / 3
    assert "2 gradient values (66.67%) are already inf/NaN, counted under 'overflow'" in str(report)


def test_overflow_counts_every_value_a_scaler_would_see_as_inf_or_nan():
    model = nn.Linear(3, 2)
    model.weight.grad = torch.full((2, 3), math.inf)
    model.bias.grad = torch.tensor([math.nan, 1e5])  # 1e5 overflows fp16
    report = grad_report(model, "fp16")
    w, b, total = report["weight"], report["bias"], report.total
    assert (w.overflow, w.nonfinite, w.safe_scale_log2) == (1.0, 1.0, None)
    assert (b.overflow, b.nonfinite, b.range.overflow) == (1.0, 0.5, 1)
    assert (total.overflow, total.nonfinite) == (1.0, 7 / 8)
    for s in (w, b, total):  # the columns of one row add up
        assert s.zero + s.underflow + s.range.representable_fraction + s.overflow == 1.0
    lines = str(report).splitlines()
    weight_row, total_row = lines[3].split(), lines[-3].split()
    assert weight_row[3] == "-" and weight_row[7] == "100.00%"  # no finite value to size
    assert total_row[0] == "(all)" and total_row[7] == "100.00%"
    assert "7 gradient values (87.50%) are already inf/NaN" in str(report)


def test_matches_torch_cast_on_a_real_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    (model(torch.randn(8, 16)).square().mean() * 1e-5).backward()
    scale = 2.0 ** -4
    report = grad_report(model, "fp16", scale=scale)
    for name, p in model.named_parameters():
        scaled = p.grad * scale  # exact: a power of two, far from fp32's limits
        as_fp16 = scaled.half()  # torch's own fp32 -> fp16 cast: one rounding
        expected_underflow = ((as_fp16 == 0) & (scaled != 0)).float().mean().item()
        expected_subnormal = ((as_fp16 != 0) & (as_fp16.abs() < 2.0 ** -14)).float().mean().item()
        assert report[name].underflow == pytest.approx(expected_underflow, abs=1e-12)
        assert report[name].subnormal == pytest.approx(expected_subnormal, abs=1e-12)
    assert 0 < report.total.underflow < 1 and report.total.subnormal > 0  # the test bites


def test_low_precision_and_sparse_gradients():
    model = nn.Linear(4, 4).to(torch.bfloat16)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    assert grad_report(model, "fp16")["weight"].dtype == "bf16"
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2, 2])).sum().backward()
    stats = grad_report(emb)["weight"]
    assert stats.numel == 6 and stats.max_abs == 2.0  # two looked-up rows, row 2 counted twice


def test_log2_counts_and_histogram(tmp_path):
    report = grad_report(hand_built_linear(), "fp16")
    lo, counts = report.log2_counts["weight"]
    assert lo == -30 and len(counts) == 16 - (-30) + 1  # 1e5 ~ 2^16.6
    assert (counts[0], counts[10], counts[30], counts[46], sum(counts)) == (4, 5, 6, 2, 17)
    assert report.log2_counts["(all)"] == report.log2_counts["weight"]
    path = report.histogram(tmp_path / "grads.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    report.histogram(tmp_path / "w.png", param="weight")
    assert (tmp_path / "w.png").exists()
    with pytest.raises(KeyError, match="bias"):
        report.histogram(tmp_path / "b.png", param="bias")


def test_str_is_a_table():
    text = str(grad_report(hand_built_linear(), "fp16"))
    lines = text.splitlines()
    assert lines[0] == "gradients x 1 -> fp16 (20 values in 1 parameters)"
    assert lines[1].split()[:4] == ["parameter", "numel", "dtype", "max|g|"]
    row = lines[3].split()
    assert (row[0] == "weight" and row[4:8] == ["15.00%", "20.00%", "25.00%", "10.00%"]
            and row[8] == "2^-1")
    assert "parameters without .grad: bias" in text


def test_bad_input():
    with pytest.raises(ValueError,
                       match=r"none of the 2 parameters of Linear has a gradient.*backward"):
        grad_report(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="none of the 0 parameters"):
        grad_report(nn.ReLU())
    with pytest.raises(TypeError, match="nn.Module"):
        grad_report(torch.ones(2))
    model = hand_built_linear()
    with pytest.raises(ValueError, match="unknown format"):
        grad_report(model, "fp12")
    with pytest.raises(ValueError, match="positive finite"):
        grad_report(model, scale=-1.0)
