"""FP8 Linear layers through torchao: what is converted, that it computes through float8, how it
composes with the levels, state dicts, resume, and the errors.

An FP8 path cannot match an fp32 step, so these tests check what it must do instead: a chosen
layer's output and gradients equal an obviously correct FP8 GEMM (operands rounded through a
dynamically scaled float8 cast, then multiplied in fp32); the model's output and gradients lie
within FP8's error of the same level without FP8 (measured: output ~4%, weight gradients
~5-20%); layers not chosen compute bitwise as without FP8; state dicts stay fp32 and load into a
plain model; resume is bitwise.
"""

import copy
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.fp8 import choice
from mixprec.lowbit import fp8sim

pytest.importorskip("torchao.float8")

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUT_TOL = 0.1    # relative output error of an FP8 model against the same level without FP8
GRAD_TOL = 0.35  # relative weight-gradient error (the output gradient is e5m2: 2 mantissa bits)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64),
                         nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 10))


def batch(n=16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def quant(t, dtype, axis=None):
    """``t`` through a float8 cast with a dynamic scale (fmax / amax; rowwise, with ``axis``:
    per slice, rounded down to a power of two, as torchao's rowwise recipes do), in fp32."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax() if axis is None else t.abs().amax(dim=axis, keepdim=True)
    scale = (fmax / amax.double().clamp(min=1e-12)).float()
    if axis is not None:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------- which layers
def test_default_choice_keeps_first_last_and_odd_shapes_in_16_bits():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 40),
                          nn.Linear(40, 64), nn.Linear(64, 64), nn.Linear(64, 16))
    model = mp.prepare(model, level="O2", dtype="bf16", fp8="tensorwise")
    assert mp.fp8_modules(model) == ["1", "4"]  # 2 and 3 touch 40 (not a multiple of 16)
    assert mp.policy_of(model).fp8_modules == ("1", "4")
    assert type(model[0]) is nn.Linear and type(model[5]) is nn.Linear


def test_policy_kept_layers_and_attention_projections_are_never_chosen():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.a, self.b, self.out = (nn.Linear(32, 32) for _ in range(4))
            self.attn = nn.MultiheadAttention(32, 2, batch_first=True)

        def forward(self, x):
            x = self.b(self.a(self.inp(x)))
            return self.out(self.attn(x, x, x)[0])

    model = mp.prepare(Net(), level="O2", dtype="bf16", keep_fp32=["a"], fp8="tensorwise")
    assert mp.fp8_modules(model) == ["b"]
    assert torch.isfinite(model(torch.randn(2, 5, 32))).all()
    reasons = choice.ineligible(Net(), mp.Policy(keep_fp32=("a",), fp8="tensorwise"))
    assert "MultiheadAttention" in reasons["attn.out_proj"] and "fp32" in reasons["a"]


def test_names_and_callables_resolve_to_names_in_the_policy():
    model = mp.prepare(net(), level="O2", dtype="bf16", fp8="rowwise",
                       fp8_modules=lambda module, name: module.out_features == 64)
    assert mp.fp8_modules(model) == ["0", "2"]  # a callable may take the first layer
    assert mp.policy_of(model).fp8_modules == ("0", "2")
    model = mp.prepare(net(), level="O1", dtype="bf16", fp8="tensorwise", fp8_modules=["4"])
    assert mp.fp8_modules(model) == ["4"] and mp.policy_of(model).fp8_modules == ("4",)


def test_bad_choices_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiples of 16"):
        mp.prepare(nn.Sequential(nn.Linear(32, 40), nn.Linear(40, 8)), level="O2", dtype="bf16",
                   fp8="tensorwise", fp8_modules=["0"])
    with pytest.raises(ValueError, match=r"did you mean '2'"):
        mp.prepare(net(), level="O2", dtype="bf16", fp8="tensorwise", fp8_modules=["2 "])
    with pytest.raises(ValueError, match="LayerNorm, not an nn.Linear"):
        mp.prepare(net(), level="O2", dtype="bf16", fp8="tensorwise", fp8_modules=["3"])
    with pytest.raises(ValueError, match="needs fp8="):
        mp.prepare(net(), level="O2", dtype="bf16", fp8_modules=["2"])
    with pytest.raises(ValueError, match="fp8 must be None or one of"):
        mp.prepare(net(), level="O2", dtype="bf16", fp8="e4m3")
    with pytest.raises(ValueError, match="disagrees"):
        mp.prepare(net(), policy=mp.Policy.from_level("O2", "bf16").replace(fp8="rowwise"),
                   fp8="tensorwise")
    with pytest.raises(TypeError, match="callable"):
        mp.prepare(net(), level="O2", dtype="bf16", fp8="tensorwise", fp8_modules=3)


def test_fp8_without_torchao_is_an_import_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8 fails
    with pytest.raises(ImportError, match=r"pip install mixprec\[fp8\]"):
        mp.prepare(net(), level="O2", dtype="bf16", fp8="tensorwise")


# ----------------------------------------------------------------- the numbers
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_chosen_layer_computes_an_fp8_gemm(recipe):
    model = mp.prepare(net(), level="O0", fp8=recipe, fp8_modules=["2"])
    layer = model[2]
    x = torch.randn(16, 64, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    w, b = layer.weight.detach(), layer.bias.detach()
    rowwise = recipe == "rowwise"
    want = quant(x.detach(), E4M3, -1 if rowwise else None) @ \
        quant(w.t(), E4M3, 0 if rowwise else None)
    g_dtype = E4M3 if rowwise else E5M2
    want_gw = (quant(x.detach(), E4M3, 0 if rowwise else None).t()
               @ quant(g, g_dtype, 0 if rowwise else None)).t()
    want_gx = quant(g, g_dtype, -1 if rowwise else None) @ \
        quant(w.t(), E4M3, -1 if rowwise else None).t()
    # fp32 accumulation; rowwise GEMMs return bf16 (torch._scaled_mm has no fp32 output for
    # rowwise scales): their results are the reference's rounded to bf16 (twice in the backward
    # GEMMs: the product, then the scales applied), to 2 bf16 ulps
    tol = dict(rtol=2.0 ** -7, atol=1e-5) if rowwise else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y - b, want, **tol)  # the bias is added after the GEMM
    torch.testing.assert_close(layer.weight.grad, want_gw, **tol)
    torch.testing.assert_close(x.grad, want_gx, **tol)
    assert rel(y - b, x.detach() @ w.t()) > 1e-3  # and not an fp32 GEMM
    # the advisor's simulation: the same GEMMs, rowwise ones rounded to bf16 as the layer's
    xs = x.detach().clone().requires_grad_()
    sim = fp8sim.float8_matmul(xs, w.t().clone().requires_grad_(), rowwise=rowwise)
    sim.backward(g)
    assert torch.equal(sim, sim.bfloat16().float()) == rowwise
    torch.testing.assert_close(sim, want, **tol)
    torch.testing.assert_close(xs.grad, x.grad, rtol=2.0 ** -8 if rowwise else 1e-5, atol=1e-6)


def test_op_stats_see_the_float8_casts_of_each_chosen_layer():
    model = mp.prepare(net(), level="O2", dtype="bf16", fp8="tensorwise")
    x, y = batch()
    with mp.debug.op_stats() as stats:
        F.cross_entropy(model(x), y).backward()
    n = len(mp.fp8_modules(model))
    assert n == 2
    assert stats.count(op="_to_copy", dtype=E4M3, phase="forward") == 2 * n  # input, weight
    assert stats.count(op="_to_copy", dtype=E5M2, phase="backward") == 2 * n  # grad_output x2
    assert stats.count(op="_to_copy", dtype=E4M3, phase="backward") == 2 * n


def _run(model, x, y):
    out = model(x)
    F.cross_entropy(out.float(), y).backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    return out.detach().float(), grads


LEVELS = [("O0", "bf16"), ("O1", "bf16"), ("O2", "bf16"), ("O3", "bf16"), ("O1", "fp16"),
          ("O2", "fp16")]


@pytest.mark.parametrize("level,dtype", LEVELS)
def test_fp8_composes_with_the_level(level, dtype):
    x, y = batch()
    base = mp.prepare(net(), level=level, dtype=dtype)
    fp8 = mp.prepare(net(), level=level, dtype=dtype, fp8="tensorwise")
    assert [type(m).__name__ for m in fp8] == ["Linear", "ReLU", "Float8Linear", "LayerNorm",
                                                "Float8Linear", "GELU", "Linear"]
    for (name, p), q in zip(base.named_parameters(), fp8.parameters()):
        assert p.dtype == q.dtype, name  # storage per the level, FP8 layers included
    out_a, grads_a = _run(base, x, y)
    out_b, grads_b = _run(fp8, x, y)
    assert torch.isfinite(out_b).all()
    assert 1e-3 < rel(out_b, out_a) < OUT_TOL
    for name in ("2.weight", "4.weight", "6.weight"):
        assert rel(grads_b[name], grads_a[name]) < GRAD_TOL, name


def test_layers_not_chosen_compute_bitwise_as_without_fp8():
    """Given the inputs and output gradients they receive in the FP8 model, the layers not
    chosen give bitwise the outputs and weight gradients of the model without FP8."""
    x, y = batch()
    x.requires_grad_(True)  # so every layer's backward hook fires with its input's gradient
    fp8 = mp.prepare(net(), level="O2", dtype="bf16", fp8="tensorwise")
    base = mp.prepare(net(), level="O2", dtype="bf16")
    unchosen = ["0", "1", "3", "5", "6"]
    seen, grads_in = {}, {}
    for name in unchosen:
        fp8[int(name)].register_forward_hook(
            lambda m, a, out, n=name: seen.__setitem__(n, (a[0].detach(), out.detach())))
        fp8[int(name)].register_full_backward_pre_hook(
            lambda m, g, n=name: grads_in.__setitem__(n, g[0].detach()))
    F.cross_entropy(fp8(x), y).backward()
    outs = {}
    for name in unchosen:  # each layer of the plain model reads what its twin read
        layer = base[int(name)]
        layer.register_forward_pre_hook(
            lambda m, a, n=name: (seen[n][0].clone().requires_grad_(True),))
        layer.register_forward_hook(lambda m, a, out, n=name: outs.__setitem__(n, out))
    base(x)
    for name in unchosen:
        assert torch.equal(outs[name], seen[name][1]), name
        params = list(base[int(name)].parameters())
        if params:
            got = torch.autograd.grad(outs[name], params, grads_in[name])
            for p, g in zip(fp8[int(name)].parameters(), got):
                assert torch.equal(p.grad, g), name


def test_o2_trains_fp32_masters_and_the_state_dict_stays_fp32():
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mp.prepare(model, opt, level="O2", dtype="bf16", fp8="tensorwise")
    assert isinstance(opt, mp.MasterWeightOptimizer)
    x, y = batch()
    for _ in range(3):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    sd = model.state_dict()
    assert list(sd) == list(net().state_dict())
    assert all(v.dtype == torch.float32 for v in sd.values())
    masters = opt.masters_by_param()
    assert torch.equal(sd["2.weight"], masters[model[2].weight])
    plain = net()
    plain.load_state_dict(sd)
    fresh = mp.prepare(net(), level="O2", dtype="bf16", fp8="tensorwise")
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x), model(x))


def test_a_prepared_fp8_model_deep_copies_and_pickles(tmp_path):
    model = mp.prepare(net(), level="O2", dtype="bf16", fp8="tensorwise")
    x, _ = batch()
    twin = copy.deepcopy(model)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert mp.fp8_modules(twin) == mp.fp8_modules(loaded) == ["2", "4"]
    assert torch.equal(twin(x), model(x)) and torch.equal(loaded(x), model(x))


def _trainer(callbacks=()):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return mp.Trainer(model, F.cross_entropy, opt, level="O2", dtype="bf16", fp8="tensorwise",
                      progress=False, callbacks=callbacks)


def test_trainer_resume_is_bitwise(tmp_path):
    data = [batch(8) for _ in range(4)]
    whole = _trainer()
    whole.fit(data, epochs=2)
    first = _trainer()
    first.fit(data, epochs=1)
    first.save(tmp_path / "ckpt.pt")
    second = _trainer()
    second.load(tmp_path / "ckpt.pt")
    second.fit(data, epochs=2)
    a = mp.fp32_state_dict(whole.model, whole.optimizer)
    b = mp.fp32_state_dict(second.model, second.optimizer)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert whole.history.loss == second.history.loss
    assert whole.policy.fp8_modules == ("2", "4") == second.policy.fp8_modules


def test_engine_carries_fp8_in_its_policy_and_refuses_another():
    amp = mp.MixedPrecision("O2", "bf16", fp8="tensorwise", fp8_modules=["2"])
    model = net()
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert amp.policy.fp8 == "tensorwise" and amp.policy.fp8_modules == ("2",)
    assert mp.fp8_modules(model) == ["2"]
    state = amp.state_dict()
    assert mp.Policy.from_state_dict(state["policy"]) == amp.policy
    other = mp.MixedPrecision("O2", "bf16")
    other.setup(net())
    with pytest.raises(ValueError, match="fp8=tensorwise"):
        other.load_state_dict(state)


def test_engine_with_a_callable_records_the_chosen_names_in_the_model():
    amp = mp.MixedPrecision("O1", "bf16", fp8="tensorwise",
                            fp8_modules=lambda module, name: name == "4")
    model = amp.setup(net())
    assert mp.policy_of(model).fp8_modules == ("4",)
    assert amp.policy.fp8_modules is None  # the run left the choice to each model


@pytest.mark.slow
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")
def test_compiled_training_matches_eager_within_rounding():
    data = [batch(8) for _ in range(3)]
    eager = _trainer()
    eager.fit(data, epochs=1)
    model = net()
    compiled = mp.Trainer(model, F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          level="O2", dtype="bf16", fp8="tensorwise", progress=False,
                          compile=True)
    compiled.fit(data, epochs=1)
    assert compiled.history.loss == pytest.approx(eager.history.loss, rel=2e-2)


# ----------------------------------------------------------------- Hugging Face GPT-2
def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                  n_positions=32, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def test_gpt2_conv1d_layers_run_in_fp8_and_keep_their_state_dict():
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    base = mp.prepare(_gpt2(), level="O2", dtype="bf16")
    model = mp.prepare(_gpt2(), level="O2", dtype="bf16", fp8="tensorwise")
    names = mp.fp8_modules(model)
    assert "transformer.h.0.attn.c_attn" not in names  # the first GEMM layer stays
    assert "lm_head" not in names                      # so does the last
    assert "transformer.h.1.mlp.c_fc" in names and len(names) == 7
    assert type(model.get_submodule("transformer.h.1.mlp.c_fc")).__name__ == "Float8Conv1D"
    a = base(input_ids=ids, labels=ids)
    b = model(input_ids=ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    assert 1e-4 < rel(b.logits, a.logits) < OUT_TOL
    assert abs(b.loss.item() - a.loss.item()) < 0.02 * a.loss.item()
    w = "transformer.h.1.mlp.c_fc.weight"
    ga = dict(base.named_parameters())[w].grad
    gb = dict(model.named_parameters())[w].grad
    assert rel(gb, ga) < GRAD_TOL
    sd = model.state_dict()
    reference = _gpt2().state_dict()
    assert list(sd) == list(reference)
    assert all(sd[k].shape == reference[k].shape and sd[k].dtype == torch.float32 for k in sd)
    plain = _gpt2()
    plain.load_state_dict(sd)


# -- a choice that converts nothing ----------------------------------------------------------------
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.pool(self.conv(x)).flatten(1)


NOTHING_CHOSEN = {
    "a conv net": (ConvNet, r"has none \(its layers with parameters: Conv2d\)"),
    "only first and last Linear": (
        lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)),
        r"'0' is the model's first or last GEMM layer.*'2' is the model's first or last"),
    "odd dimensions": (
        lambda: nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 24), nn.Linear(24, 16)),
        r"'1' has dimensions 64 x 24: FP8 GEMMs need both to be multiples of 16"),
}


@pytest.mark.parametrize("case", NOTHING_CHOSEN)
def test_a_default_choice_that_converts_nothing_warns_once_with_each_reason(case):
    build, reason = NOTHING_CHOSEN[case]
    with pytest.warns(UserWarning, match="converts no layer") as record:
        model = mp.prepare(build(), level="O1", dtype="bf16", fp8="tensorwise")
    fp8_warnings = [w for w in record if "converts no layer" in str(w.message)]
    assert len(fp8_warnings) == 1
    assert re.search(reason, str(fp8_warnings[0].message))
    assert mp.fp8_modules(model) == []
    assert mp.policy_of(model).fp8_modules == ()
    assert "fp8_modules=0" in str(mp.policy_of(model))


def test_a_callable_that_picks_nothing_warns_and_an_explicit_empty_list_does_not():
    with pytest.warns(UserWarning, match="'2' was not picked by the fp8_modules callable"):
        mp.prepare(net(), level="O1", dtype="bf16", fp8="tensorwise",
                   fp8_modules=lambda mod, name: False)
    model = mp.prepare(net(), level="O1", dtype="bf16", fp8="tensorwise", fp8_modules=[])
    assert mp.fp8_modules(model) == []  # what was asked for: nothing to say


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise", "mxfp8"])
def test_a_layer_registered_under_two_names_computes_in_fp8_under_both(fp8):
    """torchao swaps a module under its first name only: a Linear registered twice (one layer,
    listed once by mp.fp8_modules) was split, the second copy computing in bf16 without a
    word. It stays one layer, FP8 under both names."""
    shared = nn.Linear(64, 64)
    seq = nn.Sequential(nn.Linear(32, 64), shared, nn.Linear(64, 64), shared, nn.Linear(64, 16))
    seq = mp.prepare(seq, level="O2", dtype="bf16", fp8=fp8)
    assert mp.fp8_modules(seq) == ["1", "2"] and seq[1] is seq[3]
    stats = mp.debug.fp8_stats(seq)
    seq(torch.randn(32, 32)).float().sum().backward()
    assert stats.to_dict()["1"]["input"]["calls"] == 2


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise", "rowwise_gw_hp"])
def test_inference_mode_computes_as_no_grad(fp8):
    """torchao's rowwise casts failed on inference tensors (an AssertionError: "aten.reshape
    with axiswise scaling is not supported yet"); under torch.inference_mode an FP8 layer
    computes as under torch.no_grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64),
                          nn.Linear(64, 16))
    model = mp.prepare(model, level="O2", dtype="bf16", fp8=fp8)
    x = torch.randn(32, 32)
    with torch.no_grad():
        expected = model(x)
    with torch.inference_mode():
        got = model(x)
    assert torch.equal(got, expected)
