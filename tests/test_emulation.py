"""fp16 emulation: fp32 arithmetic on fp16-rounded values, checked against torch's fp16 kernels."""

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec import emulation, hardware
from mixprec.debug import op_stats

FP16_EPS = 2.0 ** -10
GEMM_OPS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "convolution", "_trilinear",
            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math"}


def _r(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


# name -> (function, argument factory). Every entry reaches one EMULATED_FUNCTIONS callable.
CASES = {
    "mm": (torch.mm, lambda: (_r(64, 128), _r(128, 32))),
    "mm_odd": (torch.mm, lambda: (_r(7, 333), _r(333, 5))),
    "tensor_mm": (torch.Tensor.mm, lambda: (_r(9, 40), _r(40, 3))),
    "bmm": (torch.bmm, lambda: (_r(4, 16, 64), _r(4, 64, 8))),
    "matmul_broadcast": (torch.matmul, lambda: (_r(2, 3, 16, 32), _r(32, 8))),
    "operator_matmul": (lambda a, b: a @ b, lambda: (_r(5, 24), _r(24, 6))),
    "linear_3d": (F.linear, lambda: (_r(2, 5, 32), _r(16, 32), _r(16))),
    "addmm": (torch.addmm, lambda: (_r(16), _r(8, 32), _r(32, 16))),
    "baddbmm": (torch.baddbmm, lambda: (_r(3, 8, 16), _r(3, 8, 32), _r(3, 32, 16))),
    "addbmm": (torch.addbmm, lambda: (_r(8, 16), _r(3, 8, 32), _r(3, 32, 16))),
    "mv": (torch.mv, lambda: (_r(12, 40), _r(40))),
    "addmv": (torch.addmv, lambda: (_r(12), _r(12, 40), _r(40))),
    "conv1d": (F.conv1d, lambda: (_r(2, 4, 20), _r(6, 4, 5))),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1),
               lambda: (_r(2, 3, 10, 10), _r(8, 3, 3, 3), _r(8))),
    "conv3d": (F.conv3d, lambda: (_r(1, 2, 5, 6, 6), _r(3, 2, 3, 3, 3))),
    "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x, w, stride=2),
                         lambda: (_r(2, 4, 5, 5), _r(4, 3, 3, 3))),
    "sdpa": (F.scaled_dot_product_attention,
             lambda: (_r(2, 2, 8, 16), _r(2, 2, 8, 16), _r(2, 2, 8, 16))),
    "einsum": (lambda a, b: torch.einsum("bij,bjk->bik", a, b),
               lambda: (_r(2, 8, 32), _r(2, 32, 4))),
    "tensordot": (lambda a, b: torch.tensordot(a, b, 2), lambda: (_r(3, 4, 16), _r(4, 16, 5))),
    "bilinear": (F.bilinear, lambda: (_r(4, 5), _r(4, 6), _r(3, 5, 6), _r(3))),
}


def test_every_emulated_function_has_a_case():
    covered = {"mm", "bmm", "matmul", "linear", "addmm", "baddbmm", "addbmm", "mv", "addmv",
               "conv1d", "conv2d", "conv3d", "conv_transpose2d", "scaled_dot_product_attention",
               "einsum", "tensordot", "bilinear"}
    # the rest are exercised elsewhere: MultiheadAttention below, the other transposed convs
    # share conv_transpose2d's code path
    rest = {"multi_head_attention_forward", "conv_transpose1d", "conv_transpose3d"}
    assert set(emulation.EMULATED_FUNCTIONS.values()) == covered | rest


def _relerr(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _emulated(fn, args):
    with mp.emulate_fp16(), op_stats() as stats:
        out = fn(*args)
    return out, stats


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_ops_run_fp32_kernels_and_return_fp16(name):
    fn, make = CASES[name]
    args = make()
    out, stats = _emulated(fn, args)
    assert out.dtype == torch.float16
    gemms = {op for op in stats.ops() if op in GEMM_OPS}
    assert gemms, f"no GEMM/conv op ran: {stats.ops()}"
    assert not gemms & set(stats.ops(dtype="fp16")), stats.table()


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_matches_native_fp16_forward_and_gradients(name):
    fn, make = CASES[name]
    args = make()
    native = fn(*args)
    grad_out = torch.randn_like(native)
    native_grads = torch.autograd.grad(native, args, grad_out)
    emulated, _ = _emulated(fn, args)
    emulated_grads = torch.autograd.grad(emulated, args, grad_out)
    # Both are fp16 roundings of (nearly) the same fp32 sums: agreement within fp16 rounding.
    assert _relerr(emulated, native) < FP16_EPS
    for g_emu, g_nat in zip(emulated_grads, native_grads):
        assert g_emu.dtype == torch.float16
        assert _relerr(g_emu, g_nat) < FP16_EPS


def test_emulated_value_is_fp32_sum_of_fp16_products_rounded_once():
    a, b = torch.randn(33, 257), torch.randn(257, 17)
    a16, b16 = a.half(), b.half()
    with mp.emulate_fp16():
        out = a16 @ b16
    expected = (a16.double() @ b16.double()).half()  # exact products, one rounding
    # the fp32 accumulation may move a result by at most one fp16 ulp
    ulp = (expected.double().abs() * FP16_EPS).clamp_min(2.0 ** -24)
    ulps = (out.double() - expected.double()).abs() / ulp
    assert ulps.max() <= 1.0
    assert (out == expected).float().mean() > 0.95


EQUATIONS = {"ij->ji": 1, "ij->i": 1, "ii->i": 1, "ij,ij->ij": 2, "i,j->ij": 2, "ij,kj->ikj": 2,
             "ij,jk->ik": 2, "ij,ij->i": 2, "ij,ij": 2, "...j,jk->...k": 2, "ij,j->i": 2}


@pytest.mark.parametrize("equation", EQUATIONS)
def test_an_einsum_is_emulated_only_where_torch_runs_a_gemm_for_it(equation):
    """torch.autocast casts the bmm einsum runs for a contraction; a transpose, a reduction or an
    elementwise product stays fp32 (the emulation rounded every einsum to fp16)."""
    shapes = {"ij->ji": [(3, 4)], "ij->i": [(3, 4)], "ii->i": [(3, 3)], "i,j->ij": [(3,), (4,)],
              "ij,kj->ikj": [(3, 4), (5, 4)], "ij,jk->ik": [(3, 4), (4, 5)],
              "...j,jk->...k": [(3, 4), (4, 5)], "ij,j->i": [(3, 4), (4,)]}
    operands = [torch.randn(*shape) for shape in shapes.get(equation, [(3, 4), (3, 4)])]
    with torch.autocast("cpu", dtype=torch.float16):
        native = torch.einsum(equation, *operands)
        with mp.emulate_fp16(True):
            emulated = torch.einsum(equation, *operands)
    assert emulation.einsum_contracts((equation, *operands)) == (native.dtype == torch.float16)
    assert emulated.dtype == native.dtype
    if native.dtype == torch.float32:
        assert torch.equal(emulated, native)


def test_autocast_fp16_fp32_model_is_emulated_like_native_autocast():
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.float16):
        native = model(x)
        native.float().square().mean().backward()
    native_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16), mp.emulate_fp16(), op_stats() as stats:
        out = model(x)
    out.float().square().mean().backward()
    assert out.dtype == torch.float16
    assert stats.count(op="addmm", dtype="fp32") == 2 and stats.count(op="addmm", dtype="fp16") == 0
    assert _relerr(out, native) < FP16_EPS
    for p, g_nat in zip(model.parameters(), native_grads):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, p.grad.half().float()), "fp32 param grads must be fp16 values"
        assert _relerr(p.grad, g_nat) < 2 * FP16_EPS


def test_autocast_leaves_ops_outside_its_fp16_list_alone():
    # mv is not on torch's CPU low-precision list: autocast runs it in fp32, so must we.
    m, v = torch.randn(6, 5), torch.randn(5)
    with torch.autocast("cpu", dtype=torch.float16), mp.emulate_fp16():
        out = torch.mv(m, v)
    assert out.dtype == torch.float32
    assert torch.equal(out, m @ v)


@pytest.mark.parametrize("name", ["linear", "mm", "matmul", "conv2d", "bmm", "mv", "addmv",
                                  "einsum", "tensordot", "scaled_dot_product_attention"])
def test_autocast_table_agrees_with_torch_autocast(name):
    fn = {"linear": lambda a, b: F.linear(a, b),
          "conv2d": lambda a, b: F.conv2d(a[None, None], b[None, None]),
          "mv": lambda a, b: torch.mv(a, b[0]), "addmv": lambda a, b: torch.addmv(b[0], a, b[0]),
          "bmm": lambda a, b: torch.bmm(a[None], b[None]),
          "einsum": lambda a, b: torch.einsum("ij,jk->ik", a, b),
          "tensordot": lambda a, b: torch.tensordot(a, b, 1),
          "scaled_dot_product_attention":
              lambda a, b: F.scaled_dot_product_attention(a[None], b[None], b[None]),
          }.get(name, getattr(torch, name, None))
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        native_dtype = fn(a, b).dtype
    low = emulation.autocast_runs_in_low_precision(name, "cpu")
    expected = torch.float16 if low else torch.float32
    assert native_dtype == expected
    with torch.autocast("cpu", dtype=torch.float16), mp.emulate_fp16():
        assert fn(a, b).dtype == expected


@pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
def test_composes_with_mixprec_autocast_custom_lists():
    m, v, w = torch.randn(6, 5), torch.randn(5), torch.randn(3, 5)
    with op_stats() as stats, mp.autocast("fp16", device_type="cpu", fp32_ops=["linear"],
                                          low_precision_ops=["mv"], emulate_fp16=True):
        kept_fp32 = F.linear(m, w)  # moved to the fp32 list: not emulated
        moved_low = torch.mv(m, v)  # moved to the low-precision list: emulated
        default_low = m @ w.T  # on torch's list: emulated
    assert kept_fp32.dtype == torch.float32 and torch.allclose(kept_fp32, m @ w.T)
    assert moved_low.dtype == default_low.dtype == torch.float16
    assert stats.ops(dtype="fp16") == ["_to_copy"], stats.table()
    assert stats.count(op="mv", dtype="fp32") == 1 and stats.count(op="mm", dtype="fp32") == 2


def test_autocast_bf16_is_not_touched():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), mp.emulate_fp16(), op_stats() as stats:
        out = F.linear(x, w)
    assert out.dtype == torch.bfloat16
    assert stats.count(op="mm", dtype="bf16") == 1


def test_mixed_dtypes_keep_native_error_and_fp32_is_untouched():
    a16, b32 = torch.randn(3, 4, dtype=torch.float16), torch.randn(4, 2)
    with mp.emulate_fp16(), pytest.raises(RuntimeError):
        torch.mm(a16, b32)
    with mp.emulate_fp16():
        assert torch.equal(torch.mm(b32.T, b32), b32.T @ b32)


def test_out_argument_runs_natively():
    a, b = torch.randn(3, 4, dtype=torch.float16), torch.randn(4, 2, dtype=torch.float16)
    out = torch.empty(3, 2, dtype=torch.float16)
    with mp.emulate_fp16():
        torch.mm(a, b, out=out)
    assert torch.allclose(out.float(), (a.float() @ b.float()), rtol=FP16_EPS, atol=1e-3)


def test_multihead_attention_module_fp16():
    mha = nn.MultiheadAttention(16, 2, batch_first=True).half()
    x = torch.randn(2, 6, 16, dtype=torch.float16)
    native, _ = mha(x, x, x)
    with mp.emulate_fp16(), op_stats() as stats:
        emulated, weights = mha(x, x, x)
    assert emulated.dtype == weights.dtype == torch.float16
    assert not set(stats.ops(dtype="fp16")) & GEMM_OPS
    assert _relerr(emulated, native) < 2 * FP16_EPS


def _train(mode, steps=30):
    """A small fp16 (O3-style) or fp32 regression run; returns the loss trajectory."""
    torch.manual_seed(1)
    dtype = torch.float32 if mode == "fp32" else torch.float16
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 1))
    model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, 16)
    y = (x[:, :4].sum(1, keepdim=True)).tanh()
    ctx = mp.emulate_fp16() if mode == "emulated" else contextlib.nullcontext()
    losses = []
    with ctx:
        for _ in range(steps):
            loss = F.mse_loss(model(x.to(dtype)).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_training_run_emulated_tracks_native_fp16_and_fp32():
    native, emulated, full = _train("native"), _train("emulated"), _train("fp32")
    assert emulated[-1] < 0.6 * emulated[0], "the emulated run must learn"
    for a, b, c in zip(emulated, native, full):
        assert abs(a - b) <= 1e-2 * b + 1e-4
        assert abs(a - c) <= 5e-2 * c + 1e-3


@pytest.mark.parametrize("bad", ["yes", 1, None, "Auto"])
def test_bad_mode_is_value_error(bad):
    with pytest.raises(ValueError, match="mode must be 'auto', True or False"):
        emulation.emulation_context("cpu", torch.float16, bad)


def test_bad_device_type_and_dtype():
    with pytest.raises(ValueError, match="device_type"):
        emulation.emulation_context("gpu0", torch.float16, True)
    with pytest.raises(ValueError, match="dtype"):
        emulation.emulation_context("cpu", "fp17", True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "bf16"])
def test_only_fp16_is_ever_emulated(dtype):
    ctx = emulation.emulation_context("cpu", dtype, True)
    assert isinstance(ctx, contextlib.nullcontext)


def test_false_disables():
    assert isinstance(emulation.emulation_context("cpu", "fp16", False), contextlib.nullcontext)
    assert isinstance(mp.emulate_fp16(False), contextlib.nullcontext)


def test_auto_follows_hardware_and_notices_once(monkeypatch, caplog):
    monkeypatch.setattr(hardware, "is_fast", lambda dtype, device=None: True)
    assert isinstance(emulation.emulation_context("cpu", "fp16"), contextlib.nullcontext)
    monkeypatch.setattr(hardware, "is_fast", lambda dtype, device=None: False)
    monkeypatch.setattr(emulation, "_noticed", set())
    with caplog.at_level(logging.INFO, logger="mixprec"):
        first = emulation.emulation_context("cpu", "fp16")
        second = emulation.emulation_context(torch.device("cpu"), torch.float16, "auto")
    assert not isinstance(first, contextlib.nullcontext)
    assert not isinstance(second, contextlib.nullcontext)
    notices = [r for r in caplog.records if "emulating fp16" in r.getMessage()]
    assert len(notices) == 1


def test_emulation_is_thread_local():
    import threading

    a = torch.randn(4, 4, dtype=torch.float16)
    seen = {}

    def other():
        with op_stats() as stats:
            a @ a
        seen["ops"] = stats.ops(dtype="fp16")

    with mp.emulate_fp16():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert "mm" in seen["ops"]


@pytest.mark.cuda
def test_auto_does_not_emulate_on_tensor_core_gpus():
    if hardware.is_fast(torch.float16, "cuda"):
        assert isinstance(emulation.emulation_context("cuda", "fp16"), contextlib.nullcontext)
