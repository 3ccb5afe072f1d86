import threading

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import mixprec as mp
from mixprec import oplists

BF16, FP32 = torch.bfloat16, torch.float32


def _x(*shape):
    return torch.randn(*shape)


# Sample calls, one per op name: how to run it on fp32 inputs. Tests are generated from the op
# tables for every op that has a sample here.
SAMPLES = {
    "mm": lambda: torch.mm(_x(4, 4), _x(4, 4)),
    "bmm": lambda: torch.bmm(_x(2, 4, 4), _x(2, 4, 4)),
    "addmm": lambda: torch.addmm(_x(4), _x(4, 4), _x(4, 4)),
    "baddbmm": lambda: torch.baddbmm(_x(2, 4, 4), _x(2, 4, 4), _x(2, 4, 4)),
    "addbmm": lambda: torch.addbmm(_x(4, 4), _x(2, 4, 4), _x(2, 4, 4)),
    "linear": lambda: F.linear(_x(4, 4), _x(3, 4)),
    "matmul": lambda: torch.matmul(_x(4, 4), _x(4, 4)),
    "conv1d": lambda: F.conv1d(_x(1, 2, 8), _x(3, 2, 3)),
    "conv2d": lambda: F.conv2d(_x(1, 2, 6, 6), _x(3, 2, 3, 3)),
    "conv3d": lambda: F.conv3d(_x(1, 2, 4, 4, 4), _x(3, 2, 3, 3, 3)),
    "conv_transpose1d": lambda: F.conv_transpose1d(_x(1, 2, 8), _x(2, 3, 3)),
    "conv_transpose2d": lambda: F.conv_transpose2d(_x(1, 2, 6, 6), _x(2, 3, 3, 3)),
    "prelu": lambda: F.prelu(_x(2, 3), torch.full((1,), 0.25)),
    "scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(
        _x(1, 2, 4, 8), _x(1, 2, 4, 8), _x(1, 2, 4, 8)),
    "mse_loss": lambda: F.mse_loss(_x(4).to(BF16), _x(4).to(BF16)),
    "l1_loss": lambda: F.l1_loss(_x(4).to(BF16), _x(4).to(BF16)),
    "smooth_l1_loss": lambda: F.smooth_l1_loss(_x(4).to(BF16), _x(4).to(BF16)),
    "huber_loss": lambda: F.huber_loss(_x(4).to(BF16), _x(4).to(BF16)),
    "nll_loss": lambda: F.nll_loss(_x(4, 3).to(BF16), torch.tensor([0, 1, 2, 0])),
    "kl_div": lambda: F.kl_div(_x(4).to(BF16), _x(4).to(BF16), reduction="sum"),
    "binary_cross_entropy_with_logits": lambda: F.binary_cross_entropy_with_logits(
        _x(4).to(BF16), torch.rand(4).to(BF16)),
    "cdist": lambda: torch.cdist(_x(3, 4).to(BF16), _x(2, 4).to(BF16)),
    "prod": lambda: torch.prod(_x(4).to(BF16)),
    "trace": lambda: torch.trace(_x(3, 3).to(BF16)),
    "softmax": lambda: torch.softmax(_x(4, 4).to(BF16), -1),
    "log_softmax": lambda: torch.log_softmax(_x(4, 4).to(BF16), -1),
    "logsumexp": lambda: torch.logsumexp(_x(4, 4).to(BF16), -1),
    "layer_norm": lambda: F.layer_norm(_x(4, 4).to(BF16), (4,)),
    "group_norm": lambda: F.group_norm(_x(2, 4, 3).to(BF16), 2),
    "batch_norm": lambda: F.batch_norm(_x(4, 3).to(BF16), torch.zeros(3), torch.ones(3)),
    "instance_norm": lambda: F.instance_norm(_x(2, 3, 5).to(BF16)),
    "rms_norm": lambda: F.rms_norm(_x(4, 4).to(BF16), (4,)),
    "cat": lambda: torch.cat([_x(2).to(BF16), _x(2)]),
    "stack": lambda: torch.stack([_x(2).to(BF16), _x(2)]),
}
EXPECTED = {"low_precision": BF16, "fp32": FP32, "promote": FP32}


def _cases(lists):
    return [(name, policy) for policy, names in lists.items()
            for name in sorted(names) if name in SAMPLES]


@pytest.mark.parametrize("name,policy", _cases(oplists.TORCH_DEFAULTS["cpu"]))
def test_torch_cpu_table_matches_torch_autocast(name, policy):
    """The data table says what torch.autocast really does on CPU."""
    with torch.autocast("cpu", dtype=BF16):
        out = SAMPLES[name]()
    assert out.dtype == EXPECTED[policy]


@pytest.mark.parametrize("name,policy", _cases(mp.op_lists("cpu", "bf16")))
def test_effective_cpu_lists_match_mp_autocast(name, policy):
    with mp.autocast("bf16", device_type="cpu"):
        out = SAMPLES[name]()
    assert out.dtype == EXPECTED[policy]


@pytest.mark.parametrize("name", sorted(oplists.MIXPREC_FP32_ADDITIONS & set(SAMPLES)))
def test_additions_are_fp32_only_with_extend_defaults(name):
    with mp.autocast("bf16", device_type="cpu", extend_defaults=False):
        assert SAMPLES[name]().dtype == BF16  # torch's CPU list runs it in its input dtype
    with mp.autocast("bf16", device_type="cpu"):
        assert SAMPLES[name]().dtype == FP32


def test_op_lists_shape_and_moves():
    lists = mp.op_lists("cpu", "bf16")
    assert set(lists) == {"low_precision", "fp32", "promote"}
    assert ("mm" in lists["low_precision"] and "softmax" in lists["fp32"]
            and "cat" in lists["promote"])
    moved = mp.op_lists("cpu", "bf16", low_precision_ops=["softmax", "add"], fp32_ops=["mm"])
    assert "softmax" in moved["low_precision"] and "softmax" not in moved["fp32"]
    assert ("add" in moved["low_precision"] and "mm" in moved["fp32"]
            and "mm" not in moved["low_precision"])
    assert "softmax" in mp.op_lists("cuda", "fp16")["fp32"]


def _dtypes_of_ops(**kw):
    x, w = _x(4, 4), _x(4, 4)
    with mp.autocast("bf16", device_type="cpu", **kw):
        return {
            "torch.add": torch.add(x, w).dtype, "Tensor.add": x.add(w).dtype,
            "x + y": (x + w).dtype,
            "mul": (x * w).dtype, "gelu": F.gelu(x).dtype, "softmax": x.softmax(-1).dtype,
            "mm": torch.mm(x, w).dtype, "x @ y": (x @ w).dtype, "linear": F.linear(x, w).dtype,
        }


def test_custom_lists_change_exactly_the_named_ops():
    base = _dtypes_of_ops()
    assert base == {"torch.add": FP32, "Tensor.add": FP32, "x + y": FP32, "mul": FP32, "gelu": FP32,
                    "softmax": FP32, "mm": BF16, "x @ y": BF16, "linear": BF16}
    moved = _dtypes_of_ops(low_precision_ops=["add", "gelu"], fp32_ops=["linear"])
    changed = {k for k in base if base[k] != moved[k]}
    assert changed == {"torch.add", "Tensor.add", "x + y", "gelu", "linear"}
    assert moved["linear"] == FP32 and moved["x + y"] == BF16


def test_moved_op_computes_in_target_precision():
    x = torch.tensor([[1.0 + 2 ** -12, 3.0]])
    w = torch.eye(2)
    with mp.autocast("bf16", device_type="cpu", fp32_ops=["linear"]):
        exact = F.linear(x, w)
    with mp.autocast("bf16", device_type="cpu"):
        rounded = F.linear(x, w)
    assert exact[0, 0].item() == 1.0 + 2 ** -12
    assert rounded[0, 0].item() == 1.0  # 2**-12 is below bf16's half-ulp at 1.0


def test_gradients_flow_through_moved_ops():
    x = _x(3, 4).requires_grad_()
    with mp.autocast("bf16", device_type="cpu", low_precision_ops=["softmax"]):
        y = torch.softmax(x @ _x(4, 4), -1)
    assert y.dtype == BF16
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == FP32 and torch.isfinite(x.grad).all()


def test_disabled_and_nested():
    x = _x(2, 2)
    with mp.autocast("bf16", device_type="cpu", enabled=False):
        assert (x @ x).dtype == FP32
    with mp.autocast("bf16", device_type="cpu", low_precision_ops=["add"]):
        with mp.autocast("bf16", device_type="cpu", enabled=False):
            assert (x + x).dtype == FP32 and (x @ x).dtype == FP32
        assert (x + x).dtype == BF16
    assert (x + x).dtype == FP32 and not torch.is_autocast_enabled("cpu")


def test_the_innermost_block_s_lists_apply_as_torch_autocast_s_do():
    """An inner block, or a prepared model's own forward, computes with its own lists inside an
    enclosing block that moved ops (the enclosing mode and kernels kept casting: linear in
    fp32 inside an inner block that left it low; softmax in fp32 inside torch's exact lists)."""
    x, w = _x(2, 4), _x(3, 4)
    cpu = {"device_type": "cpu"}
    with mp.autocast("bf16", **cpu, fp32_ops=["linear"], low_precision_ops=["gelu"]):
        assert F.linear(x, w).dtype == FP32 and F.gelu(x).dtype == BF16
        with mp.autocast("bf16", **cpu):
            assert F.linear(x, w).dtype == BF16 and F.gelu(x).dtype == FP32
            assert torch.softmax(x.bfloat16(), -1).dtype == FP32  # mixprec's default lists
            with mp.autocast("bf16", **cpu, extend_defaults=False):
                assert torch.softmax(x.bfloat16(), -1).dtype == BF16  # torch's lists exactly
        assert F.linear(x, w).dtype == FP32  # the enclosing lists again
    net = mp.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)), level="O1", dtype="bf16")
    alone = net(x)
    with mp.autocast("bf16", **cpu, fp32_ops=["linear"]):
        assert torch.equal(net(x), alone)


def test_the_innermost_block_s_lists_apply_under_torch_compile_too():
    """Traced, the enclosing block's mode still saw what an inner block (or a prepared model's
    forward) left to autocast and cast it to its own targets: linear in fp32 inside a default
    inner block, layer_norm in fp32 inside torch's exact lists. Compiled as eager."""
    x, w = _x(2, 4), _x(3, 4)
    cpu = {"device_type": "cpu"}
    net = mp.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)), level="O1", dtype="bf16")
    outer = mp.autocast("bf16", **cpu, fp32_ops=["linear", "gelu"])
    inner = mp.autocast("bf16", **cpu)
    exact = mp.autocast("bf16", **cpu, extend_defaults=False)

    def f(x):
        with outer:
            a = F.linear(x, w)
            with inner:
                b, g = F.linear(x, w), F.gelu(x.bfloat16())
            with exact:
                n = F.layer_norm(x.bfloat16(), (4,))
            return a, b, g, n, net(x)

    class Own(TorchFunctionMode):  # a mode of the user's own between the blocks
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    emulating = mp.autocast("fp16", **cpu, emulate_fp16=True)  # its own mode under its lists

    def g(x):
        with outer, Own():
            with emulating:
                return F.gelu(x.half()), F.linear(x, w)

    for fn, dtypes in ((f, [FP32, BF16, BF16, BF16, FP32]), (g, [torch.float16] * 2)):
        eager = fn(x)
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager")(x)
        assert [t.dtype for t in eager] == dtypes
        assert [t.dtype for t in compiled] == dtypes
        for a, b in zip(eager, compiled):
            assert torch.equal(a, b)


def test_a_moved_op_called_with_out_writes_the_callers_tensor():
    """As torch.autocast leaves an out= call: the result goes into ``out`` (it went into a cast
    copy, and ``out`` kept its old values)."""
    a, o = _x(3), torch.zeros(3)
    twice, exp = a + a, torch.exp(a)
    with mp.autocast("bf16", device_type="cpu", low_precision_ops=["add", "exp"]):
        assert torch.add(a, a, out=o) is o and torch.equal(o, twice)
        assert torch.exp(a, out=o) is o and torch.equal(o, exp)


@pytest.mark.parametrize("name", ["__add__", "Tensor.__add__", "torch.Tensor.__add__"])
def test_an_operator_method_names_its_op(name):
    """``"__add__"`` was accepted and cast nothing (``x + y`` reaches ``Tensor.add``): it names
    the op ``add``, which covers the operator."""
    x = _x(2, 2).bfloat16()
    with mp.autocast("bf16", device_type="cpu", fp32_ops=[name]):
        assert (x + x).dtype == FP32 and torch.add(x, x).dtype == FP32
    with pytest.raises(ValueError, match="both"):
        mp.autocast("bf16", device_type="cpu", fp32_ops=[name], low_precision_ops=["add"])


def test_fp32_dtype_means_disabled():
    ac = mp.autocast("fp32", device_type="cpu")
    with ac:
        assert not torch.is_autocast_enabled("cpu")
    assert not ac.enabled


def test_decorator_and_reentry():
    ac = mp.autocast("bf16", device_type="cpu", low_precision_ops=["add"])

    @ac
    def f(x, depth):
        y = x + x
        return [y.dtype] + (f(x, depth - 1) if depth else [])

    assert f(_x(2), 2) == [BF16] * 3
    with ac:
        with ac:
            assert (_x(2) + _x(2)).dtype == BF16
        assert (_x(2) + _x(2)).dtype == BF16
    assert not torch.is_autocast_enabled("cpu")


def test_decorator_is_thread_safe():
    @mp.autocast("bf16", device_type="cpu", low_precision_ops=["add"])
    def f():
        return (_x(8) + _x(8)).dtype

    results = []
    threads = [threading.Thread(target=lambda: results.append(f())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [BF16] * 4


def test_exception_inside_block_restores_state():
    with pytest.raises(ZeroDivisionError):
        with mp.autocast("bf16", device_type="cpu", low_precision_ops=["add"]):
            raise ZeroDivisionError
    assert not torch.is_autocast_enabled("cpu")
    assert (_x(2) + _x(2)).dtype == FP32


def test_no_mode_without_custom_lists():
    """With torch's lists only, mp.autocast is exactly torch.autocast: nothing intercepts ops."""
    ac = mp.autocast("bf16", device_type="cpu", extend_defaults=False)
    assert ac.context.targets == {}
    assert mp.autocast("bf16", device_type="cpu").context.targets  # the CPU additions need the mode


@pytest.mark.parametrize("kw,match", [
    ({"low_precision_ops": ["not_an_op"]}, "unknown op name 'not_an_op'"),
    ({"fp32_ops": ["sofmax"]}, "did you mean 'softmax'"),
    ({"low_precision_ops": ["add"], "fp32_ops": ["add"]}, "both"),
    ({"dtype": "fp12"}, "fp12"),
    ({"device_type": "tpu"}, "device_type"),
])
def test_bad_input(kw, match):
    kw.setdefault("device_type", "cpu")
    with pytest.raises(ValueError, match=match):
        mp.autocast(**{"dtype": "bf16", **kw})


def test_bad_list_type():
    with pytest.raises(TypeError, match="low_precision_ops"):
        mp.autocast("bf16", device_type="cpu", low_precision_ops=3)


@pytest.mark.cuda
def test_cuda_custom_lists():
    x = torch.randn(4, 4, device="cuda")
    with mp.autocast("fp16", device_type="cuda", low_precision_ops=["softmax"], fp32_ops=["mm"]):
        assert x.softmax(-1).dtype == torch.float16
        assert torch.mm(x, x).dtype == FP32


# -- promote_ops: the widest input dtype, never cast down ------------------------------------
def _promote_dtypes(x, y, **kw):
    with mp.autocast("bf16", device_type="cpu", **kw):
        return {"mul": torch.mul(x, y).dtype, "x * y": (x * y).dtype,
                "atan2": torch.atan2(x, y).dtype, "dot": torch.dot(x.flatten(), y.flatten()).dtype}


@pytest.mark.parametrize("xdt,ydt,expected", [
    (BF16, FP32, FP32), (FP32, BF16, FP32), (BF16, BF16, BF16), (FP32, FP32, FP32),
    (torch.float16, BF16, FP32),
])
def test_promote_ops_cast_to_the_widest_input(xdt, ydt, expected):
    x, y = _x(4).to(xdt), _x(4).to(ydt)
    got = _promote_dtypes(x, y, promote_ops=["mul", "atan2", "dot"])
    assert got == {"mul": expected, "x * y": expected, "atan2": expected, "dot": expected}


def test_promote_ops_differ_from_torch_type_promotion():
    """A 0-d fp32 tensor does not promote a bf16 tensor in torch; a promote op widens it."""
    x, s = _x(4).to(BF16), torch.tensor(3.0)
    with mp.autocast("bf16", device_type="cpu"):
        assert torch.mul(x, s).dtype == BF16
    with mp.autocast("bf16", device_type="cpu", promote_ops=["mul"]):
        assert torch.mul(x, s).dtype == FP32
        # dot refuses mixed dtypes natively; promoted, it runs in fp32
    with mp.autocast("bf16", device_type="cpu", promote_ops=["dot"]):
        assert torch.dot(_x(4).to(BF16), _x(4)).dtype == FP32
    with pytest.raises(RuntimeError):
        torch.dot(_x(4).to(BF16), _x(4))


def test_promote_op_is_not_cast_down_by_autocast():
    """matmul is low precision by default; promoted, it keeps fp32 inputs in fp32."""
    a = _x(4, 4)
    with mp.autocast("bf16", device_type="cpu", promote_ops=["matmul"]):
        assert torch.matmul(a, a).dtype == FP32
        assert torch.matmul(a.to(BF16), a.to(BF16)).dtype == BF16
        assert torch.matmul(a.to(BF16), a).dtype == FP32
        y = _x(4, 4).requires_grad_()
        torch.matmul(y.to(BF16), a).sum().backward()
    assert y.grad.dtype == FP32


def test_promote_sequence_op():
    ys = [_x(3).to(BF16) for _ in range(3)]
    with mp.autocast("bf16", device_type="cpu", promote_ops=["cat"]):  # cat: torch promotes it too
        assert torch.cat(ys + [_x(3)]).dtype == FP32
        assert torch.cat(ys).dtype == BF16
    lists = mp.op_lists("cpu", "bf16", promote_ops=["mul", "atan2"])
    assert {"mul", "atan2", "cat"} <= set(lists["promote"])
    assert "mul" not in lists["low_precision"] and "mul" not in lists["fp32"]


@pytest.mark.parametrize("kw", [
    {"promote_ops": ["mul"], "fp32_ops": ["mul"]},
    {"promote_ops": ["cat"], "low_precision_ops": ["cat"]},
])
def test_promote_ops_validated_like_the_others(kw):
    with pytest.raises(ValueError, match="named in both"):
        mp.autocast("bf16", device_type="cpu", **kw)
    with pytest.raises(ValueError, match="unknown op name 'mull'"):
        mp.autocast("bf16", device_type="cpu", promote_ops=["mull"])
    with pytest.raises(TypeError, match="promote_ops"):
        mp.op_lists("cpu", "bf16", promote_ops=5)


@pytest.mark.parametrize("kwargs", [{"enabled": "no"}, {"cache_enabled": "x"},
                                    {"extend_defaults": 0}])
def test_switches_take_a_bool_only(kwargs):
    """``mp.autocast(enabled="no")`` turned autocast on (``bool("no")``); a bad
    ``cache_enabled`` was refused by torch's message about ``enabled``."""
    name = next(iter(kwargs))
    with pytest.raises(TypeError, match=rf"mp\.autocast\({name}=\.\.\.\) must be True or False"):
        mp.autocast("bf16", device_type="cpu", **kwargs)
