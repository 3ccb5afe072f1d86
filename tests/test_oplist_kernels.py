"""The op-list casts at the dispatcher (mixprec.oplists.kernels) against the Python mode they
replace in eager code: the same values and gradients bit for bit, nothing left registered, other
threads untouched."""

import threading

import pytest
import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec.autocast import _OpListMode, _resolve
from mixprec.oplists import kernels

BF16 = torch.bfloat16

CALLS = {
    "softmax": lambda x: torch.softmax(x, -1) + x.softmax(-1) + F.softmax(x, dim=-1),
    "log_softmax": lambda x: F.log_softmax(x, -1) + x.log_softmax(-1),
    "logsumexp": lambda x: torch.logsumexp(x, -1, keepdim=True) + x,
    "layer_norm": lambda x: F.layer_norm(x, (8,), torch.ones(8), torch.zeros(8)),
    "group_norm": lambda x: F.group_norm(x.reshape(4, 4, 2), 2),
    "rms_norm": lambda x: F.rms_norm(x, (8,)),
}


def _run(fn, x, via_mode: bool, target):
    x = x.detach().requires_grad_()
    ops = ((name, target) for name in CALLS)
    with torch.autocast("cpu", dtype=BF16):
        y = torch.nn.functional.linear(x, torch.eye(8))  # bf16, as a layer's output
        if via_mode:
            with _OpListMode("cpu", _resolve(tuple(ops))):
                out = fn(y)
        else:
            with kernels.active("cpu", dict(ops)):
                out = fn(y)
    out.float().sum().backward()
    return out, x.grad


@pytest.mark.parametrize("target", [torch.float32, "low", "promote"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_kernel_matches_the_mode_bit_for_bit(name, target):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    out, grad = _run(CALLS[name], x, False, target)
    ref_out, ref_grad = _run(CALLS[name], x, True, target)
    assert out.dtype == ref_out.dtype
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)


def test_every_cpu_addition_goes_to_the_dispatcher():
    ctx = mp.autocast("bf16", device_type="cpu").context
    assert set(ctx.kernels) == set(mp.oplists.MIXPREC_FP32_ADDITIONS) and not ctx.mode_targets
    custom = mp.autocast("bf16", device_type="cpu", fp32_ops=["linear"]).context
    assert custom.kernels and custom.mode_targets  # linear has a torch kernel: the mode keeps it


def test_active_only_inside_the_block():
    x = torch.randn(2, 8)
    with mp.autocast("bf16", device_type="cpu"):
        assert torch.softmax(x.to(BF16), -1).dtype == torch.float32
    assert ("cpu", "softmax") in kernels._registry.registered
    assert kernels.targets_in_force() is None
    with torch.autocast("cpu", dtype=BF16):
        assert torch.softmax(x.to(BF16), -1).dtype == BF16  # torch's own list again


def test_other_threads_keep_torch_lists():
    seen, inside, done = [], threading.Event(), threading.Event()

    def plain():
        inside.wait(timeout=30)
        with torch.autocast("cpu", dtype=BF16):
            seen.append(torch.softmax(torch.ones(2, 2, dtype=BF16), -1).dtype)
        done.set()

    t = threading.Thread(target=plain)
    t.start()
    with mp.autocast("bf16", device_type="cpu"):
        inside.set()
        done.wait(timeout=30)
        here = torch.softmax(torch.ones(2, 2, dtype=BF16), -1).dtype
    t.join(timeout=30)
    assert seen == [BF16] and here == torch.float32


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")
def test_prepared_model_under_compile_is_one_graph_with_the_same_values():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Softmax(-1))
    model = mp.prepare(net, level="O1", dtype="bf16")
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch.testing.assert_close(torch.compile(model)(x), model(x), rtol=1e-6, atol=1e-6)
