"""trace_nonfinite (first inf/NaN, forward and backward, named by module) and op_stats."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks

import mixprec as mp
from mixprec import debug, oplists

FP16_MAX = 65504.0


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


class _BlowUpGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by 1e6 in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e6


class GradBomb(nn.Module):
    def forward(self, x):
        return _BlowUpGrad.apply(x)


def _fp16_net(fc2_weight=None, head_weight=None):
    torch.manual_seed(0)
    net = Net().half()
    with torch.no_grad():
        if fc2_weight is not None:
            net.encoder.fc2.weight.fill_(fc2_weight)
        if head_weight is not None:
            net.head.weight.fill_(head_weight)
    return net


def _hook_counts():
    return len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("pass_model, name", [(True, "encoder.fc2"), (False, "Linear")])
def test_forward_overflow_names_layer_and_op(pass_model, name):
    net = _fp16_net(fc2_weight=1e4)
    x = torch.full((3, 8), 10.0, dtype=torch.float16)
    with debug.trace_nonfinite(net if pass_model else None) as tracer:
        net(x)
    event = tracer.report.forward
    assert tracer.report.backward is None and tracer.report.first is event
    assert (event.phase, event.module, event.created) == ("forward", name, True)
    assert event.op == "aten.addmm.default"
    assert event.node is None
    assert [s.dtype for s in event.outputs] == [torch.float16]
    assert event.outputs[0].n_inf == 12 and event.outputs[0].absmax is None
    weight_stats = event.inputs[2]  # addmm(bias, x, weight.t())
    assert weight_stats.absmax == 1e4 and weight_stats.finite
    text = str(tracer.report)
    assert text.startswith(f"first non-finite in forward: {name} (aten.addmm.default)")


def test_a_ddp_wrapped_model_is_named_as_the_users_module():
    """Modules are named as in the user's model (``encoder.fc2``; the root by its class), not
    under DDP's ``module.`` prefix."""
    net = _fp16_net(fc2_weight=1e4)
    ddp = torch.nn.parallel.DistributedDataParallel.__new__(
        torch.nn.parallel.DistributedDataParallel)  # no process group needed to name modules
    torch.nn.Module.__init__(ddp)
    ddp.module = net
    with debug.trace_nonfinite(ddp) as tracer:
        net(torch.full((3, 8), 10.0, dtype=torch.float16))
    assert tracer.report.forward.module == "encoder.fc2"
    assert tracer._names[id(ddp)] == tracer._names[id(net)] == type(net).__name__


def test_forward_overflow_under_autocast_fp16():
    net = Net()
    with torch.no_grad():
        net.encoder.fc1.weight.fill_(1e4)  # fp32 is fine, fp16 is not
    x = torch.full((2, 8), 2.0)
    assert torch.isfinite(net(x)).all()
    with debug.trace_nonfinite(net) as tracer, torch.autocast("cpu", dtype=torch.float16):
        net(x)
    event = tracer.report.forward
    assert (event.module, event.op) == ("encoder.fc1", "aten.addmm.default")
    assert event.outputs[0].dtype == torch.float16
    assert all(s.dtype == torch.float16 for s in event.inputs)


def test_forward_overflow_of_a_cast_is_found_with_emulation():
    # Emulated fp16: the fp32 GEMM is finite, the rounding of its output to fp16 overflows.
    net = _fp16_net(fc2_weight=1e4)
    with debug.trace_nonfinite(net) as tracer, mp.emulate_fp16():
        net(torch.full((3, 8), 10.0, dtype=torch.float16))
    event = tracer.report.forward
    assert (event.module, event.op) == ("encoder.fc2", "aten._to_copy.default")
    assert event.inputs[0].dtype == torch.float32 and event.inputs[0].absmax > FP16_MAX


def test_clean_run_reports_none_and_removes_hooks():
    before = _hook_counts()
    net = _fp16_net()
    with debug.trace_nonfinite(net) as tracer:
        net(torch.randn(4, 8, dtype=torch.float16)).float().sum().backward()
    assert tracer.report is None
    assert _hook_counts() == before


def test_outputs_unchanged_by_tracing():
    net = Net()
    x = torch.randn(5, 8)
    expected = net(x)
    with debug.trace_nonfinite(net):
        got = net(x)
    assert torch.equal(got, expected)


# ----------------------------------------------------------------------------- backward


def test_backward_overflow_with_finite_forward_names_layer():
    net = _fp16_net(head_weight=300.0)
    x = torch.randn(3, 8, dtype=torch.float16)
    with debug.trace_nonfinite(net) as tracer:
        out = net(x)
        (out.float().sum() * 1000).backward()  # d/dx head = 1000 * 2 * 300 > 65504
    assert tracer.report.forward is None
    event = tracer.report.backward
    assert (event.phase, event.module, event.op, event.node) == (
        "backward", "head", "aten.mm.default", "AddmmBackward0")
    assert event.created and event.outputs[0].dtype == torch.float16
    assert str(tracer.report).startswith("first non-finite in backward: head (aten.mm.default")


def test_backward_overflow_in_custom_function_inside_nested_module():
    net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh(), GradBomb()), nn.Linear(4, 1))
    net.half()
    with debug.trace_nonfinite(net) as tracer:
        net(torch.randn(2, 4, dtype=torch.float16)).float().sum().backward()
    assert tracer.report.forward is None
    event = tracer.report.backward
    assert (event.module, event.op, event.node) == ("1.1", "aten.mul.Tensor", "_BlowUpGradBackward")
    assert event.inputs[0].finite and event.inputs[-1] == 1e6


def test_backward_through_a_loss_scaler():
    net = _fp16_net(head_weight=30.0)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 16)
    with debug.trace_nonfinite(net) as tracer:
        loss = net(torch.randn(3, 8, dtype=torch.float16)).float().square().mean()
        scaler.scale(loss).backward()
    # 2**16 * d(mean square)/d(out) exceeds fp16 as the fp32 gradient enters the fp16 model
    # through the backward of ``.float()``, which ran outside any module.
    event = tracer.report.backward
    assert tracer.report.forward is None and event.created
    assert (event.module, event.node) == (None, "ToCopyBackward0")
    assert event.op == "aten._to_copy.default"
    assert event.inputs[0].dtype == torch.float32 and event.inputs[0].absmax > FP16_MAX
    assert "(outside any module)" in str(event)


# ----------------------------------------------------------------------------- kinds and raising


class Masked(nn.Module):
    """Attention-style -inf mask; ``scale`` multiplies the scores (overflow when large)."""

    def __init__(self, scale=1.0, all_masked=False):
        super().__init__()
        self.scale, self.all_masked = scale, all_masked

    def forward(self, x):
        scores = x @ x.transpose(-1, -2) * self.scale
        mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
        if self.all_masked:
            mask[0] = True
        return scores.masked_fill(mask, float("-inf")).softmax(-1)


def test_minus_inf_mask_is_reported_as_inherited_not_created():
    with debug.trace_nonfinite() as tracer:
        out = Masked()(torch.randn(4, 3))
    assert torch.isfinite(out).all()
    event = tracer.report.forward
    assert (event.op, event.created) == ("aten.masked_fill.Scalar", False)
    assert "came in through an input" in str(event)


def test_a_real_overflow_wins_over_an_earlier_mask():
    with debug.trace_nonfinite() as tracer:
        Masked(scale=1e4)(torch.full((4, 3), 100.0, dtype=torch.float16))
    event = tracer.report.forward
    assert event.created and event.op == "aten.mul.Tensor" and event.module == "Masked"


def test_nan_from_infinities_is_created():
    with debug.trace_nonfinite() as tracer:
        out = Masked(all_masked=True)(torch.randn(4, 3))
    assert torch.isnan(out[0]).all()
    event = tracer.report.forward
    assert event.created and event.outputs[0].n_nan > 0 and "softmax" in event.op


def test_uninitialised_memory_is_not_an_overflow():
    with debug.trace_nonfinite() as tracer:
        for _ in range(50):  # garbage bits of torch.empty may read as inf/NaN: never report them
            torch.empty(64, 64)
            torch.empty_like(torch.ones(8)).new_empty((32,))
    assert tracer.report is None


def test_nonfinite_data_is_inherited():
    x = torch.tensor([[1.0, float("nan")]])
    with debug.trace_nonfinite() as tracer:
        nn.Linear(2, 2)(x)
    assert tracer.report.forward.created is False


class ScaleInPlace(nn.Module):
    def forward(self, x):
        return x.mul_(1e5)


def test_in_place_overflow_is_created():
    with debug.trace_nonfinite() as tracer:
        ScaleInPlace()(torch.full((2, 3), 10.0, dtype=torch.float16))
    event = tracer.report.forward
    assert (event.module, event.op, event.created) == ("ScaleInPlace", "aten.mul_.Tensor", True)
    with debug.trace_nonfinite() as tracer:
        ScaleInPlace()(torch.tensor([1.0, float("inf")]))
    assert tracer.report.forward.created is False


def test_sparse_and_meta_tensors_do_not_break_tracing():
    index, values = torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, float("inf")])
    with debug.trace_nonfinite() as tracer:
        sparse = torch.sparse_coo_tensor(index, values, (2, 2), check_invariants=False)
        sparse.to_dense()
        torch.empty(3, device="meta") * 2
    event = tracer.report.forward
    assert event.op == "aten._to_dense.default" and event.created is False


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_raise_on_first(phase):
    net = _fp16_net(fc2_weight=1e4) if phase == "forward" else _fp16_net(head_weight=300.0)
    scale = 1.0 if phase == "forward" else 1000.0
    before = _hook_counts()
    with pytest.raises(debug.NonFiniteError, match=f"first non-finite in {phase}") as info:
        with debug.trace_nonfinite(net, raise_on_first=True):
            (net(torch.full((3, 8), 10.0, dtype=torch.float16)).float().sum() * scale).backward()
    assert info.value.event.phase == phase
    assert info.value.event.module == ("encoder.fc2" if phase == "forward" else "head")
    assert _hook_counts() == before


def test_bad_model_and_reentry():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        debug.trace_nonfinite("net")
    tracer = debug.trace_nonfinite()
    with tracer, pytest.raises(RuntimeError, match="already active"):
        tracer.__enter__()


def test_tensor_stats_edge_cases():
    stats = debug.TensorStats.of(torch.tensor([FP16_MAX, -2.0, float("inf"), float("nan")]).half())
    assert (stats.n_inf, stats.n_nan) == (1, 1)
    assert (stats.min, stats.max, stats.absmax) == (-2.0, FP16_MAX, FP16_MAX)
    assert not stats.finite and "1 inf, 1 NaN" in str(stats)
    empty = debug.TensorStats.of(torch.empty(0))
    assert empty.finite and empty.absmax is None and str(empty) == "fp32[0]"


# ----------------------------------------------------------------------------- op_stats


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def test_op_stats_autocast_bf16_mlp_forward_and_backward():
    model, x = _mlp(), torch.randn(8, 16)
    with debug.op_stats() as stats:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
    assert stats.count(op="addmm", dtype=torch.bfloat16) == 3
    assert stats.count(op="aten.addmm.default", dtype="fp32") == 0
    # 3 weight gradients + 2 input gradients (the first layer's input needs none)
    assert stats.count(op="mm", dtype="bf16", phase="backward") == 5
    assert stats.count(op="mm", phase="forward") == 0
    assert stats.by_dtype()[torch.bfloat16] == stats.count(dtype="bf16")
    assert sum(stats.by_dtype().values()) == stats.total
    assert "t" not in stats.ops()  # views are not counted by default
    table = stats.table()
    assert table.splitlines()[0].split() == ["op", "dtype", "forward", "backward", "total", "op",
                                             "list", "name", "inputs"]
    assert any(line.split() == ["addmm", "bf16", "3", "0", "3", "linear", "bf16"]
               for line in table.splitlines())


# (torch's list name, ATen op it runs, call on a bf16 activation h)
TABLE_CASES = [
    ("softmax", "_softmax", lambda h: F.softmax(h, -1)),
    ("log_softmax", "_log_softmax", lambda h: F.log_softmax(h, -1)),
    ("mse_loss", "mse_loss", lambda h: F.mse_loss(h, torch.zeros_like(h))),
    ("smooth_l1_loss", "smooth_l1_loss", lambda h: F.smooth_l1_loss(h, torch.zeros_like(h))),
    ("gelu", "gelu", F.gelu),
]


@pytest.mark.parametrize("listed, aten, call", TABLE_CASES, ids=[c[0] for c in TABLE_CASES])
def test_op_stats_follow_torch_cpu_autocast_lists(listed, aten, call):
    layer, x = nn.Linear(8, 8), torch.randn(4, 8)
    with debug.op_stats() as stats, torch.autocast("cpu", dtype=torch.bfloat16):
        call(layer(x))
    expected = "fp32" if listed in oplists.TORCH_DEFAULTS["cpu"]["fp32"] else "bf16"
    assert stats.count(op=aten) == 1
    assert stats.count(op=aten, dtype=expected) == 1, stats.table()


# O2 keeps LayerNorm's parameters fp32 and, on CPU, feeds it bf16 activations: the kernel
# accumulates in fp32 and writes bf16, so its output dtype is bf16 (as at O3, whose LN weights
# are bf16 too; test_prepare checks the O2 numbers match fp32 to one bf16 ulp).
@pytest.mark.parametrize("level, linear, norm", [("O0", "fp32", "fp32"), ("O1", "bf16", "fp32"),
                                                 ("O2", "bf16", "bf16"), ("O3", "bf16", "bf16")])
def test_op_stats_show_each_level_does_what_it_says(level, linear, norm):
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    model = mp.prepare(model, level=level, dtype="bf16")
    with debug.op_stats() as stats:
        out = model(torch.randn(4, 8))
    assert stats.count(op="addmm") == 2, stats.table()
    assert stats.count(op="addmm", dtype=linear) == 2, stats.table()
    assert stats.count(op="native_layer_norm", dtype=norm) == 1, stats.table()
    assert out.dtype == (torch.bfloat16 if level == "O3" else torch.float32)


@pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_op_stats_show_fp16_emulation_at_each_level(level):
    model = mp.prepare(_mlp(), level=level, dtype="fp16")
    with debug.op_stats() as stats:
        out = model(torch.randn(4, 16))
        out.float().sum().backward()
    gemms = stats.count(op="addmm") + stats.count(op="mm")
    assert gemms == 3 + 5
    if mp.hardware.is_fast(torch.float16, "cpu"):
        return
    # emulated: every GEMM runs an fp32 kernel on fp16-rounded values, outputs rounded to fp16
    assert stats.count(op="addmm", dtype="fp32") + stats.count(op="mm", dtype="fp32") == gemms
    assert stats.count(op="_to_copy", dtype="fp16", phase="forward") >= 3, stats.table()
    param_dtype = torch.float32 if level == "O1" else torch.float16
    assert all(p.grad.dtype == param_dtype for p in model.parameters())


def test_op_stats_filters_views_nesting_and_bad_input():
    x = torch.randn(4, 4)
    with debug.op_stats(include_views=True) as outer:
        with debug.op_stats() as inner:
            y = x.t() @ x
    assert y.shape == (4, 4)
    assert outer.count(op="t") == 1 and inner.count(op="t") == 0
    assert outer.count(op="mm") == inner.count(op="mm") == 1
    assert inner.ops(dtype="fp32") == ["mm"] and inner.by_dtype(phase="backward") == {}
    with pytest.raises(ValueError, match="phase must be"):
        inner.count(phase="fwd")
    with pytest.raises(ValueError, match="dtype"):
        inner.count(dtype="fp17")
    assert "OpStats(total=1" in repr(inner)


def test_empty_op_stats_table():
    with debug.op_stats() as stats:
        pass
    assert stats.total == 0 and stats.table().splitlines()[-1].split() == ["total", "0", "0", "0"]


def test_grad_report_lives_in_debug():
    assert mp.debug.grad_report is debug.gradreport.grad_report
