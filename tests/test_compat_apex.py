"""mixprec.compat.apex_amp: initialize (level table, overrides, errors, return shapes), O1 casts
by apex's lists (basic casts, promotion, RNNs, caching across train/eval), user functions.

The cast tests port what apex's own tests/L0/run_amp checked (test_basic_casts, test_promotion,
test_rnn, test_cache), on CPU and inside the forward of a model returned by initialize.
"""

import copy
import io
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.compat import apex_amp as amp
from mixprec.compat import apex_lists, apex_options
from mixprec.compat.apex_models import AffineBatchNorm
from mixprec.compat.apex_state import AMP

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

HALF, FLOAT, BF16 = torch.float16, torch.float32, torch.bfloat16


class Fn(nn.Module):
    """A model whose forward is ``fn(*inputs)``; ``modules`` hold the parameters it uses."""

    def __init__(self, fn, *modules):
        super().__init__()
        self.fn = fn
        self.mods = nn.ModuleList(modules)

    def forward(self, *inputs):
        return self.fn(*inputs)


def o1(fn, *modules, **kw):
    return amp.initialize(Fn(fn, *modules), opt_level="O1", verbosity=0, **kw)


# -- the level table and the overrides --------------------------------------------------------
@pytest.mark.parametrize("level,expected", [
    ("O0", (FLOAT, False, None, False, 1.0)),
    ("O1", (None, True, None, None, "dynamic")),
    ("O2", (HALF, False, True, True, "dynamic")),
    ("O3", (HALF, False, False, False, 1.0)),
])
def test_level_table(level, expected):
    p = apex_options.level_properties(level, HALF)
    assert (p.cast_model_type, p.patch_torch_functions, p.keep_batchnorm_fp32, p.master_weights,
            p.loss_scale) == expected
    assert apex_options.level_properties(level, BF16).cast_model_type == (
        BF16 if expected[0] is HALF else expected[0])


@pytest.mark.parametrize("kw,field,value", [
    ({"keep_batchnorm_fp32": "False"}, "keep_batchnorm_fp32", False),
    ({"keep_batchnorm_fp32": "True"}, "keep_batchnorm_fp32", True),
    ({"keep_batchnorm_fp32": False}, "keep_batchnorm_fp32", False),
    ({"loss_scale": "128.0"}, "loss_scale", 128.0),
    ({"loss_scale": 64}, "loss_scale", 64.0),
    ({"loss_scale": "dynamic"}, "loss_scale", "dynamic"),
    ({"master_weights": False}, "master_weights", False),
    ({"cast_model_type": False}, "cast_model_type", False),
    ({"cast_model_type": torch.bfloat16}, "cast_model_type", BF16),
    ({"patch_torch_functions": False}, "patch_torch_functions", False),
])
def test_overrides_at_o2(kw, field, value):
    props = apex_options.resolve_properties("O2", HALF, **kw)
    assert getattr(props, field) == value
    untouched = apex_options.level_properties("O2", HALF)
    for other in ("cast_model_type", "keep_batchnorm_fp32", "master_weights", "loss_scale"):
        if other != field:
            assert getattr(props, other) == getattr(untouched, other)


@pytest.mark.parametrize("level,kw,match", [
    ("O4", {}, "unexpected optimization level 'O4'"),
    ("01", {}, "not the number zero"),
    ("o1", {}, "capital letter O"),
    ("O1", {"keep_batchnorm_fp32": True}, "keep_batchnorm_fp32 must be None"),
    ("O1", {"keep_batchnorm_fp32": "False"}, "keep_batchnorm_fp32 must be None"),
    ("O1", {"master_weights": True}, "master_weights"),
    ("O1", {"master_weights": False}, "master_weights"),
    ("O1", {"cast_model_type": torch.float16}, "cast_model_type"),
    ("O2", {"patch_torch_functions": True}, "patch_torch_functions=True"),
    ("O0", {"patch_torch_functions": True}, "patch_torch_functions=True"),
])
def test_apex_runtime_errors(level, kw, match):
    with pytest.raises(RuntimeError, match=match):
        amp.initialize(nn.Linear(2, 2), opt_level=level, verbosity=0, **kw)


@pytest.mark.parametrize("kw,x_dtype,expected", [
    ({"cast_model_type": False}, HALF, (HALF, HALF)),          # nothing cast, O1 lists on
    ({"cast_model_type": torch.float32}, HALF, (FLOAT, FLOAT)),  # inputs, outputs cast to fp32
    ({"patch_torch_functions": False}, FLOAT, (FLOAT, FLOAT)),   # no O1 lists: all fp32
    ({"loss_scale": 128.0}, FLOAT, (HALF, FLOAT)),               # O1 lists: linear in fp16
])
def test_o1_accepts_what_apex_accepted(kw, x_dtype, expected):
    """Each override apex allowed at O1 is accepted and does what it says."""
    lin = nn.Linear(2, 2)
    model = amp.initialize(Fn(lambda x: (lin(x), x * 2), lin), opt_level="O1", verbosity=0, **kw)
    assert lin.weight.dtype == FLOAT  # O1 never casts the weights
    out, doubled = model(torch.randn(3, 2, dtype=x_dtype))
    assert (out.dtype, doubled.dtype) == expected
    scale = 128.0 if "loss_scale" in kw else 2.0 ** 16
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": scale, "unskipped": 0}}


@pytest.mark.parametrize("kw,exc,match", [
    ({"opt_level": 1}, TypeError, "opt_level must be a string"),
    ({"keep_batchnorm_fp32": 1, "opt_level": "O2"}, TypeError, "keep_batchnorm_fp32"),
    ({"keep_batchnorm_fp32": "yes", "opt_level": "O2"}, ValueError, "'True' or 'False'"),
    ({"loss_scale": "big"}, ValueError, "numeric string"),
    ({"loss_scale": [1.0]}, TypeError, "loss_scale"),
    ({"loss_scale": 0.0}, ValueError, "positive"),
    ({"master_weights": "yes", "opt_level": "O2"}, TypeError, "master_weights"),
    ({"cast_model_type": "fp16", "opt_level": "O2"}, TypeError, "cast_model_type"),
    ({"cast_model_type": torch.int8, "opt_level": "O2"}, ValueError, "cast_model_type"),
    ({"cast_model_outputs": "fp32"}, TypeError, "cast_model_outputs"),
    ({"num_losses": 0}, ValueError, "num_losses"),
    ({"num_losses": 1.5}, TypeError, "num_losses"),
    ({"enabled": 1}, TypeError, "enabled"),
    ({"dtype": "fp32"}, ValueError, "dtype must be 'fp16'"),
    ({"min_loss_scale": 4.0, "max_loss_scale": 2.0}, ValueError, "min_loss_scale"),
    ({"max_loss_scale": 0.0}, ValueError, "max_loss_scale"),
])
def test_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        amp.initialize(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1),
                       verbosity=0, **kw)


def test_bad_models_and_optimizers():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="models must be either"):
        amp.initialize("model", verbosity=0)
    with pytest.raises(TypeError, match="models must be either"):
        amp.initialize([model, 3], verbosity=0)
    with pytest.raises(TypeError, match="optimizers must be either"):
        amp.initialize(model, (torch.optim.SGD(model.parameters(), lr=1),), verbosity=0)
    with pytest.raises(RuntimeError, match="DataParallel"):
        amp.initialize(nn.DataParallel(nn.Linear(2, 2)), verbosity=0)
    with pytest.raises(RuntimeError, match="found weight with dtype torch.float16"):
        amp.initialize(nn.Linear(2, 2).half(), opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match="twice"):
        amp.initialize([model, model], verbosity=0)
    other = nn.Linear(2, 2)  # an optimizer over another model: the model would never train
    with pytest.raises(ValueError, match="none of the parameters of the models passed"):
        amp.initialize(nn.Linear(2, 2), torch.optim.SGD(other.parameters(), lr=1),
                       opt_level="O2", verbosity=0)
    own = nn.Linear(2, 2)  # (a tensor of its own beside the model's, a temperature: taken)
    amp.initialize(own, torch.optim.SGD([*own.parameters(), nn.Parameter(torch.ones(()))],
                                        lr=1), opt_level="O2", verbosity=0)


def test_optimizer_and_model_initialized_once():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1)
    model, amp_opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="only once"):
        amp.initialize(nn.Linear(2, 2), opt, verbosity=0)
    with pytest.raises(RuntimeError, match="only once"):
        amp.initialize(nn.Linear(2, 2), amp_opt, verbosity=0)
    with pytest.raises(RuntimeError, match="already set up"):
        amp.initialize(model, verbosity=0)
    with pytest.raises(RuntimeError, match="already set up"):
        amp.initialize(mp.prepare(nn.Linear(2, 2), level="O2", dtype="bf16"), verbosity=0)


def test_return_shapes_mirror_the_input():
    def fresh():
        m = nn.Linear(2, 2)
        return m, torch.optim.SGD(m.parameters(), lr=1)

    m0, o0 = fresh()
    m1, o1_ = fresh()
    out = amp.initialize(m0, verbosity=0)
    assert out is m0
    out = amp.initialize([m1], verbosity=0)
    assert isinstance(out, list) and out[0] is m1
    m, o = fresh()
    m_, o_ = amp.initialize(m, o, verbosity=0)
    assert m_ is m and isinstance(o_, amp.AmpOptimizer) and isinstance(o_, torch.optim.Optimizer)
    (m, o), (n, p) = fresh(), fresh()
    ms, os_ = amp.initialize([m, n], [o, p], verbosity=0)
    assert ms == [m, n] and isinstance(os_, list) and [x.inner for x in os_] == [o, p]
    (m, o), (n, _) = fresh(), fresh()
    ms, o_ = amp.initialize([m, n], o, verbosity=0)
    assert isinstance(ms, list) and isinstance(o_, amp.AmpOptimizer)
    m, o = fresh()
    m_, os_ = amp.initialize(m, [o], verbosity=0)
    assert m_ is m and isinstance(os_, list) and len(os_) == 1


def test_enabled_false_returns_inputs_and_scale_loss_is_a_no_op():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1)
    assert amp.initialize(model, opt, enabled=False) == (model, opt)
    assert amp.initialize([model], enabled=False) == [model]
    loss = model(torch.ones(1, 2)).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    assert model.forward.__self__ is model  # forward untouched


def test_initialize_prints_the_properties(capsys):
    amp.initialize(nn.Linear(2, 2), opt_level="O2", dtype="bf16")
    out = capsys.readouterr().out
    assert "O2: bf16 model, fp32 batchnorm, fp32 master weights" in out
    assert "keep_batchnorm_fp32    : True" in out and "loss_scale             : dynamic" in out
    amp.initialize(nn.Linear(2, 2), opt_level="O2", verbosity=0)
    assert capsys.readouterr().out == ""


# -- what each level does to a model ------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.ln = nn.LayerNorm(8)
        self.plain_bn = nn.BatchNorm1d(8, affine=False)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.plain_bn(self.ln(self.bn(self.fc(x))))
        return self.head(torch.relu(h)), h


@pytest.mark.parametrize("level,dtype", [("O2", "fp16"), ("O2", "bf16"), ("O3", "fp16")])
def test_o2_o3_cast_the_model_batchnorm_per_keep_batchnorm_fp32(level, dtype):
    low = mp.formats.get(dtype).torch_dtype
    model = amp.initialize(Net(), opt_level=level, dtype=dtype, verbosity=0)
    kept = FLOAT if level == "O2" else low
    assert model.fc.weight.dtype == low and model.head.weight.dtype == low
    assert model.bn.weight.dtype == kept and model.bn.running_mean.dtype == kept
    assert model.ln.weight.dtype == low          # apex keeps BatchNorm only
    assert model.plain_bn.running_mean.dtype == low  # ... and only affine ones
    out, hidden = model(torch.randn(6, 4))       # fp32 input cast at entry
    assert out.dtype == FLOAT and hidden.dtype == FLOAT  # outputs cast to fp32
    sd = model.state_dict()
    assert all(v.dtype == FLOAT for k, v in sd.items() if "num_batches" not in k)
    assert sd["bn.num_batches_tracked"].dtype == torch.int64
    assert model.state_dict(keep_vars=True)["fc.weight"] is model.fc.weight  # live params kept


@pytest.mark.parametrize("level,keep", [("O0", ()), ("O1", ()), ("O2", (AffineBatchNorm,)),
                                        ("O3", ())])
def test_models_are_prepared_through_one_engine(level, keep):
    models = [Net(), Net()]
    models = amp.initialize(models, opt_level=level, dtype="bf16", verbosity=0)
    engine = AMP.session.engine
    assert engine.models == models
    assert all(mp.policy_of(m) == engine.policy for m in models)
    assert engine.policy.keep_fp32 == keep
    assert mp.Policy.from_state_dict(engine.policy.state_dict()) == engine.policy
    with pytest.raises(RuntimeError, match="already set up"):
        amp.initialize(models[0], verbosity=0)


def test_affine_batchnorm_marks_only_affine_batchnorm_layers():
    assert isinstance(nn.BatchNorm2d(3), AffineBatchNorm)
    assert not isinstance(nn.BatchNorm1d(3, affine=False), AffineBatchNorm)
    assert not isinstance(nn.LayerNorm(3), AffineBatchNorm)
    with pytest.raises(TypeError, match="marker"):
        AffineBatchNorm()


def test_cast_model_outputs_and_o1_outputs():
    model = amp.initialize(Net(), opt_level="O2", dtype="bf16", cast_model_outputs=BF16,
                           verbosity=0)
    assert all(t.dtype == BF16 for t in model(torch.randn(6, 4)))
    model = amp.initialize(Net(), opt_level="O1", dtype="bf16", verbosity=0)
    out, hidden = model(torch.randn(6, 4))
    assert out.dtype == BF16  # O1 outputs are not cast (as apex): the last linear ran in bf16
    assert model.fc.weight.dtype == FLOAT
    model = amp.initialize(Net(), opt_level="O1", dtype="bf16", cast_model_outputs=FLOAT,
                           verbosity=0)
    assert model(torch.randn(6, 4))[0].dtype == FLOAT


def test_o0_casts_inputs_and_outputs_to_fp32():
    model = amp.initialize(Fn(lambda x: x * 2), opt_level="O0", verbosity=0)
    assert model(torch.ones(2, dtype=HALF)).dtype == FLOAT
    model = amp.initialize(Fn(lambda x: x * 2), opt_level="O2", cast_model_type=False, verbosity=0)
    assert model(torch.ones(2, dtype=HALF)).dtype == HALF  # no cast: inputs untouched


def test_no_global_patching():
    """O1 casts live in the returned model's forward only; torch itself is never touched."""
    before = (torch.mm, F.linear, torch.Tensor.__mul__, torch.sum)
    model = o1(lambda x, w: x @ w, nn.Linear(1, 1))
    w = torch.randn(4, 4)
    assert model(torch.randn(4, 4), w).dtype == HALF
    assert (torch.mm, F.linear, torch.Tensor.__mul__, torch.sum) == before
    assert (torch.randn(4, 4) @ w).dtype == FLOAT
    assert not torch.is_autocast_enabled("cpu")


# -- O1: apex's lists, ported from test_basic_casts ----------------------------------------------
ALWAYS_HALF = {FLOAT: HALF, HALF: HALF}
ALWAYS_FLOAT = {FLOAT: FLOAT, HALF: FLOAT}
MATCH_INPUT = {FLOAT: FLOAT, HALF: HALF}


def run_layer(fn, modules, expected, shape, backward=True):
    model = o1(fn, *modules)
    for in_dtype, out_dtype in expected.items():
        x = torch.randn(shape, dtype=in_dtype).requires_grad_()
        y = model(x)
        assert y.dtype == out_dtype, (in_dtype, y.dtype)
        if backward:
            y.float().sum().backward()
            assert x.grad.dtype == in_dtype


def test_linear_and_conv_are_half():
    lin = nn.Linear(8, 8)
    run_layer(lin, [lin], ALWAYS_HALF, (4, 8))
    run_layer(lambda x: F.linear(x, lin.weight, lin.bias), [lin], ALWAYS_HALF, (4, 8))
    conv = nn.Conv2d(3, 3, 3)
    run_layer(conv, [conv], ALWAYS_HALF, (2, 3, 6, 6))


@pytest.mark.parametrize("name,fn", [
    ("softmax", lambda x: F.softmax(x, dim=1)),
    ("softmax module", nn.Softmax(dim=1)),
    ("group_norm", nn.GroupNorm(2, 4)),
    ("layer_norm", nn.LayerNorm(6)),
    ("mse_loss", lambda x: F.mse_loss(x, torch.zeros_like(x, dtype=FLOAT))),
    ("sum method", lambda x: x.sum()),
    ("pow method", lambda x: x.pow(2.0)),
    ("pow operator", lambda x: x ** 2.0),
    ("exp", torch.exp),
    ("gelu", F.gelu),
    ("cumsum", lambda x: torch.cumsum(x, 0)),
    ("cpu", lambda x: x.cpu()),
])
def test_fp32_list_ops_are_float(name, fn):
    mods = [fn] if isinstance(fn, nn.Module) else []
    run_layer(fn, mods, ALWAYS_FLOAT, (2, 4, 6) if name == "group_norm" else (4, 6))


@pytest.mark.parametrize("name,fn", [
    ("relu", F.relu), ("relu module", nn.ReLU()), ("mean", lambda x: x.mean()),
    ("batch_norm train", nn.BatchNorm1d(6)),
])
def test_unlisted_ops_match_the_input(name, fn):
    mods = [fn] if isinstance(fn, nn.Module) else []
    run_layer(fn, mods, MATCH_INPUT, (4, 6))


def test_batch_norm_eval_matches_the_input():
    bn = nn.BatchNorm2d(3).eval()
    run_layer(bn, [bn], MATCH_INPUT, (2, 3, 4, 4), backward=False)
    run_layer(lambda x: F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias),
              [bn], MATCH_INPUT, (2, 3, 4, 4), backward=False)


@pytest.mark.parametrize("fn", [lambda x, o: x.matmul(o), lambda x, o: o.matmul(x),
                                lambda x, o: x @ o, lambda x, o: o @ x])
def test_matmul_method_and_operator_are_half(fn):
    other = torch.randn(6, 6)
    run_layer(lambda x: fn(x, other), [], ALWAYS_HALF, (6, 6))


def test_bf16_dtype_extension():
    lin = nn.Linear(8, 8)
    model = o1(lambda x: (lin(x), lin(x).softmax(-1)), lin, dtype="bf16")
    a, b = model(torch.randn(2, 8))
    assert a.dtype == BF16 and b.dtype == FLOAT


def test_o1_lists_resolve_and_do_not_overlap():
    lists = apex_lists.APEX_O1_LISTS
    names = [n for v in lists.values() for n in v]
    assert len(names) == len(set(names))
    mp.op_lists("cpu", "fp16", extend_defaults=False, low_precision_ops=lists["low_precision"],
                fp32_ops=lists["fp32"], promote_ops=lists["promote"])  # validates every name


# -- promotion (test_promotion) -------------------------------------------------------------
@pytest.mark.parametrize("fn", [torch.atan2, lambda x, y: x.atan2(y), torch.mul,
                                lambda x, y: x.mul(y), lambda x, y: x * y, torch.add,
                                lambda x, y: x - y, lambda x, y: x / y])
@pytest.mark.parametrize("xt,yt", [(FLOAT, FLOAT), (FLOAT, HALF), (HALF, FLOAT), (HALF, HALF)])
def test_binary_ops_match_the_widest_input(fn, xt, yt):
    model = o1(fn)
    x = torch.randn(5, dtype=xt).requires_grad_()
    out = model(x, torch.randn(5, dtype=yt))
    assert out.dtype == (FLOAT if FLOAT in (xt, yt) else HALF)
    out.float().sum().backward()
    assert x.grad.dtype == xt


def test_promotion_with_a_scalar_tensor_and_dot():
    """Where torch's own type promotion keeps fp16 (a 0-d fp32 operand), apex widened."""
    model = o1(torch.mul)
    assert model(torch.randn(4, dtype=HALF), torch.tensor(2.0)).dtype == FLOAT
    assert (torch.randn(4, dtype=HALF) * torch.tensor(2.0)).dtype == HALF  # outside the model
    assert o1(torch.dot)(torch.randn(4, dtype=HALF), torch.randn(4)).dtype == FLOAT


def test_cat_and_stack_match_the_widest():
    halves = [torch.randn(4, dtype=HALF) for _ in range(3)]
    model = o1(lambda *xs: (torch.cat(xs), torch.stack(xs)))
    assert [t.dtype for t in model(*halves, torch.randn(4))] == [FLOAT, FLOAT]
    assert [t.dtype for t in model(*halves, torch.randn(4, dtype=HALF))] == [HALF, HALF]


@pytest.mark.parametrize("xt,yt", [(FLOAT, HALF), (HALF, FLOAT), (HALF, HALF)])
def test_inplace_add_matches_self(xt, yt):
    model = o1(lambda x, y: x.add_(y))
    leaf = torch.randn(5, dtype=xt).requires_grad_()
    out = model(leaf.clone(), torch.randn(5, dtype=yt))
    assert out.dtype == xt
    out.float().sum().backward()
    assert leaf.grad.dtype == xt


# -- recurrent cells and layers (test_rnn) ----------------------------------------------------
@pytest.mark.parametrize("cell_type", [nn.RNNCell, nn.GRUCell, nn.LSTMCell])
def test_rnn_cells_are_half(cell_type):
    cell = cell_type(8, 8)
    lstm = cell_type is nn.LSTMCell

    def unroll(*xs):
        hidden = torch.zeros(3, 8, dtype=xs[0].dtype)
        hidden = (hidden, hidden.clone()) if lstm else hidden
        outs = []
        for x in xs:
            hidden = cell(x, hidden)
            outs.append(hidden[0] if lstm else hidden)
        return outs

    model = o1(unroll, cell)
    for typ in (FLOAT, HALF):
        xs = [torch.randn(3, 8, dtype=typ).requires_grad_() for _ in range(4)]
        outs = model(*xs)
        assert all(y.dtype == HALF for y in outs)
        outs[-1].float().sum().backward()
        assert all(x.grad.dtype == typ for x in xs)


@pytest.mark.parametrize("rnn_type,kw", [
    (nn.RNN, {"nonlinearity": "relu"}), (nn.RNN, {"num_layers": 2}),
    (nn.GRU, {"num_layers": 2, "bidirectional": True}), (nn.LSTM, {}),
    (nn.LSTM, {"num_layers": 2, "bidirectional": True}),
])
def test_rnn_layers_are_half(rnn_type, kw):
    rnn = rnn_type(8, 8, **kw)
    layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
    model = o1(lambda x, h: rnn(x, h)[0], rnn)
    for typ in (FLOAT, HALF):
        x = torch.randn(5, 3, 8, dtype=typ).requires_grad_()
        h = torch.zeros(layers, 3, 8, dtype=typ)
        out = model(x, (h, h.clone()) if rnn_type is nn.LSTM else h)
        assert out.dtype == HALF
        out[-1].float().sum().backward()
        assert x.grad.dtype == typ
    assert rnn.weight_ih_l0.grad.dtype == FLOAT


def test_rnn_packed_sequence_is_half():
    rnn = nn.RNN(8, 8, num_layers=2)
    model = o1(lambda packed, h: rnn(packed, h)[0], rnn)
    for typ in (FLOAT, HALF):
        x = torch.randn(5, 3, 8, dtype=typ).requires_grad_()
        packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 4, 2]))
        out = model(packed, torch.zeros(2, 3, 8, dtype=typ))
        assert out.data.dtype == HALF
        out.data.float().sum().backward()
        assert x.grad.dtype == typ


# -- cast caching across train / eval / train (test_cache) ----------------------------------
def _cache_case(kind):
    """A model with one fp32 weight, small integers so fp16 arithmetic is exact."""
    if kind == "low_precision":   # mm is on the low-precision list
        weight, ops = torch.arange(16.0).view(4, 4) / 8, lambda x, w: (x.mm(w)).mm(w).sum()
    elif kind == "fp32":          # pow is on the fp32 list
        weight, ops = torch.arange(8.0).view(2, 4), lambda x, w: (x + w.pow(2) + w.pow(2)).sum()
    else:                         # mul promotes
        weight, ops = torch.arange(8.0).view(2, 4), lambda x, w: ((x * w) * w).sum()
    module = nn.Module()
    module.weight = nn.Parameter(weight)
    return module, ops


@pytest.mark.parametrize("kind", ["low_precision", "fp32", "promote"])
def test_cast_cache_across_train_eval_train(kind):
    module, ops = _cache_case(kind)
    x = torch.ones(2 if kind != "low_precision" else 4, 4)
    model, opt = amp.initialize(Fn(lambda inp: ops(inp, module.weight), module),
                                torch.optim.SGD(module.parameters(), lr=1.0), opt_level="O1",
                                verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}})

    def train_step():
        module.weight.grad = None
        with amp.scale_loss(model(x), opt) as scaled:
            scaled.backward()
        assert module.weight.grad.dtype == FLOAT
        reference = module.weight.detach().clone().requires_grad_()
        ops(x, reference).backward()
        torch.testing.assert_close(module.weight.grad, reference.grad, rtol=0, atol=0)
        with torch.no_grad():
            module.weight -= 1.0

    train_step()
    with torch.no_grad():
        model(x)  # eval: casts made here must not be reused by the next training forward
    train_step()


# -- user functions: registration, decorators, disable_casts ----------------------------------
def test_register_float_function_on_torch(restore_apex_registrations):
    amp.register_float_function(torch, "sigmoid")  # the apex write-up's tip
    lin = nn.Linear(4, 4)
    model = o1(lambda x: torch.sigmoid(lin(x)), lin)
    assert model(torch.randn(2, 4)).dtype == FLOAT
    before = o1(lambda x: lin(x).sigmoid(), lin)
    assert before(torch.randn(2, 4)).dtype == FLOAT  # the method form is covered too


def test_register_half_function_moves_a_listed_op(restore_apex_registrations):
    amp.register_half_function(torch.nn.functional, "softmax")
    model = o1(lambda x: F.softmax(x, -1))
    assert model(torch.randn(2, 4)).dtype == HALF
    amp.register_promote_function(torch, "einsum")
    model = o1(lambda a, b: torch.einsum("ij,jk->ik", a, b))
    assert model(torch.randn(2, 2, dtype=HALF), torch.randn(2, 2)).dtype == FLOAT


def test_register_on_a_user_module(restore_apex_registrations):
    backend = types.ModuleType("fru_backend")

    def fru(x, h):
        return x * h

    backend.fru = fru
    sys.modules["fru_backend"] = backend
    try:
        amp.register_half_function(backend, "fru")
        model = o1(lambda x, h: backend.fru(x, h))
        assert model(torch.randn(3), torch.randn(3)).dtype == HALF
        assert backend.fru(torch.randn(3), torch.randn(3)).dtype == FLOAT  # inert outside O1
        amp.register_float_function(backend, "fru")  # re-registering replaces, never stacks
        assert model(torch.randn(3, dtype=HALF), torch.randn(3, dtype=HALF)).dtype == FLOAT
    finally:
        del sys.modules["fru_backend"]


def test_register_errors():
    with pytest.raises(ValueError, match="no function named 'nope'"):
        amp.register_half_function(torch, "nope")
    with pytest.raises(TypeError, match="name must be a string"):
        amp.register_float_function(torch, 3)


@pytest.mark.parametrize("decorator,expected", [
    (amp.half_function, {(FLOAT, FLOAT): HALF, (HALF, FLOAT): HALF}),
    (amp.float_function, {(FLOAT, FLOAT): FLOAT, (HALF, HALF): FLOAT}),
    (amp.promote_function, {(HALF, FLOAT): FLOAT, (HALF, HALF): HALF, (FLOAT, FLOAT): FLOAT}),
])
def test_decorators(decorator, expected):
    @decorator
    def add(a, b):
        return torch.add(a, b)  # add promotes anyway: the dtype shows what the decorator did

    model = o1(add)
    for (at, bt), out in expected.items():
        assert model(torch.ones(2, dtype=at), torch.ones(2, dtype=bt)).dtype == out
    assert add(torch.ones(2), torch.ones(2)).dtype == FLOAT  # outside an O1 forward: no cast
    assert add.__name__ == "add"


def test_disable_casts():
    @amp.half_function
    def f(x):
        return x

    def body(x):
        with amp.disable_casts():
            inside = (x @ x, f(x))
        return inside + (x @ x, f(x))

    model = o1(body)
    assert [t.dtype for t in model(torch.randn(3, 3))] == [FLOAT, FLOAT, HALF, HALF]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_initialized_models_pickle_and_deepcopy(level):
    torch.manual_seed(0)
    model = amp.initialize(Net(), opt_level=level, dtype="bf16", verbosity=0).eval()
    x = torch.randn(6, 4)
    expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    for clone in (loaded, copy.deepcopy(model)):
        got = clone(x)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert clone.forward.module is clone


def test_o2_model_state_dict_holds_the_exact_fp32_masters():
    """As at mixprec's O2: the model's state_dict() is the masters, not the fp16 rounding."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype="bf16", verbosity=0)
    with amp.scale_loss(model(torch.randn(4, 4)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    state = model.state_dict()
    masters = list(amp.master_params(opt))
    assert state["0.weight"].dtype == torch.float32
    assert torch.equal(state["0.weight"], masters[0])
    assert not torch.equal(state["0.weight"], model[0].weight.float())  # finer than bf16


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_optimizer_hooks_run_once_per_step_as_torch_runs_them(level):
    """torch's global step hooks, a hook on the user's optimizer before initialize and one on
    the returned optimizer each run once per step(), over every parameter (one step per
    iteration, as torch runs them on a plain optimizer); an LR scheduler still steps."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n_params = len(list(model.parameters()))
    calls = {"global pre": 0, "global post": 0, "user": 0, "returned": 0}
    seen = []

    def count(name):
        def hook(optimizer, args, kwargs):
            calls[name] += 1
            seen.append(sum(len(g["params"]) for g in optimizer.param_groups))
        return hook

    opt.register_step_pre_hook(count("user"))
    handles = [register_optimizer_step_pre_hook(count("global pre")),
               register_optimizer_step_post_hook(count("global post"))]
    try:
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, loss_scale=1.0)
        opt.register_step_pre_hook(count("returned"))
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            sched.step()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == {"global pre": 3, "global post": 3, "user": 3, "returned": 3}
    assert set(seen) == {n_params}
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
