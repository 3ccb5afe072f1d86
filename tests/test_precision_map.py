"""Per-module precision as one map: ``mp.PrecisionMap`` (qualified name or module type ->
``mp.Precision``) and the Policy that holds it (``Policy.modules``).

Checks: the errors construction gives (naming what was received); the lookup rule (exact name,
then the most specific type, markers below real classes, earlier entry on ties); the older
``keep_fp32=`` / ``overrides=`` / ``fp8_modules=`` arguments and ``to_float`` as entries of the
map (equal policies, bitwise equal forward and backward); ``state_dict`` round trips (also from
the older policy form); the advisor's output as a map that prepares and trains; and a
differential cell: a map putting one Linear in fp32 at O2 against a hand-written fp32-master
reference step.
"""

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec import Precision, PrecisionMap
from mixprec.advisor.planted import block_outlier_case
from mixprec.compat.apex_models import AffineBatchNorm

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

FP32, BF16 = torch.float32, torch.bfloat16


class MyLinear(nn.Linear):
    pass


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16),
                         nn.Linear(16, 4))


def data(n=12):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


# -- construction errors -----------------------------------------------------------------------
@pytest.mark.parametrize("build, error, message", [
    (lambda: PrecisionMap({42: "fp32"}), TypeError, r"nn.Module subclass or a qualified module "
                                                    r"name \(string\); got int 42"),
    (lambda: PrecisionMap({nn.Linear(2, 2): "fp32"}), TypeError,
     r"got the module instance Linear\(\.\.\.\) \(pass its type, Linear, or its qualified"),
    (lambda: PrecisionMap({"head": 3}), TypeError, r"value must be a mixprec.Precision.*got int 3"),
    (lambda: PrecisionMap({"head": "fp33"}), ValueError, r"value must be a dtype.*got 'fp33'"),
    (lambda: PrecisionMap("head"), TypeError, r"PrecisionMap takes a dict.*got str 'head'"),
    (lambda: PrecisionMap([("head",)]), TypeError, r"\(key, precision\) pairs; got tuple"),
    (lambda: Precision("fp8_e4m3"), ValueError, r"compute must be .*got 'fp8_e4m3'"),
    (lambda: Precision(compute=4), TypeError, r"Precision compute must be a string or a torch"),
    (lambda: Precision("fp32", gemm="tensorwise"), ValueError, r"not both"),
    (lambda: Precision("bf16", params="bf16"), ValueError, r"params can keep .*got 'bf16'"),
    (lambda: Precision(params="fp32"), ValueError, r"give compute= too"),
    (lambda: Precision(gemm="mx"), ValueError, r"gemm must be None, 'off'.*got str 'mx'"),
    (lambda: Precision(gemm=8), TypeError, r"gemm must be None, 'off'.*got int 8"),
    (lambda: mp.Policy(modules=42), TypeError, r"PrecisionMap takes a dict.*got int 42"),
    (lambda: mp.Policy(modules={nn.Linear: "tensorwise"}, fp8="mxfp8"), ValueError,
     r"one low-bit format; this policy gives mxfp8, tensorwise"),
    (lambda: mp.Policy(modules={"a": "tensorwise", "b": "mxfp8"}), ValueError,
     r"gives tensorwise, mxfp8"),
    (lambda: mp.Policy(fp8_modules=["a"]), ValueError, r"fp8_modules=\['a'\] names the layers "
                                                       r"that run in the low-bit format fp8="),
    (lambda: mp.Policy(keep_fp32="2", fp8="tensorwise", fp8_modules=["2"]), ValueError,
     r"fp8_modules names \['2'\], which the policy's modules map gives a compute dtype"),
    (lambda: mp.Policy(fp8="tensorwise", fp8_modules=[3]), TypeError,
     r"fp8_modules in a Policy must be qualified module names; got list \[3\]"),
])
def test_construction_errors_name_what_was_received(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_a_map_is_immutable_and_new_maps_come_from_updated_and_without():
    m = PrecisionMap({"head": "fp32"})
    with pytest.raises(AttributeError, match="immutable"):
        m.x = 1
    with pytest.raises(TypeError):
        m["head"] = "bf16"
    n = m.updated({nn.Linear: "bf16", "head": Precision("bf16", params="fp32")})
    assert list(n.items()) == [("head", Precision("bf16", params="fp32")),
                               (nn.Linear, Precision(BF16))]  # a replaced key keeps its place
    assert n.without(lambda k, v: k == "head") == {nn.Linear: "bf16"}
    assert m == PrecisionMap({"head": "fp32"}) and len(m) == 1 and "head" in m


# -- lookup --------------------------------------------------------------------------------------
def test_an_exact_name_beats_any_type():
    m = PrecisionMap({nn.Linear: "bf16", "4": "fp32", MyLinear: "fp16"})
    model = mlp()
    assert m.lookup(model[4], "4") == Precision("fp32")
    assert m.lookup(model[0], "0") == Precision("bf16")
    assert m.lookup(model[3], "3") is None  # a LayerNorm: no entry, it inherits
    assert m["4"] == Precision("fp32")
    with pytest.raises(KeyError):
        m["0"]  # a name lookup is exact
    assert m.get("0") is None


@pytest.mark.parametrize("order", ["base first", "subclass first"])
def test_the_most_specific_type_wins_whatever_the_order(order):
    entries = [(nn.Module, Precision(gemm="off")), (nn.Linear, Precision("fp32")),
               (MyLinear, Precision("bf16"))]
    m = PrecisionMap(entries if order == "base first" else entries[::-1])
    assert m.lookup(MyLinear(2, 2), "x") == Precision("bf16")
    assert m.lookup(nn.Linear(2, 2), "x") == Precision("fp32")
    assert m.lookup(nn.ReLU(), "x") == Precision(gemm="off")
    assert m[MyLinear] == Precision("bf16") and m[nn.Linear] == Precision("fp32")
    assert m[nn.Conv2d] == Precision(gemm="off")  # its most specific base with an entry
    assert PrecisionMap({nn.Linear: "fp32"}).get(nn.Conv2d) is None


def test_a_marker_ranks_below_real_classes_and_ties_go_to_the_earlier_entry():
    for entries in ([(mp.NormLayer, "fp32"), (nn.LayerNorm, "bf16")],
                    [(nn.LayerNorm, "bf16"), (mp.NormLayer, "fp32")]):
        m = PrecisionMap(entries)
        assert m.lookup(nn.LayerNorm(4), "n") == Precision("bf16")
        assert m.lookup(nn.RMSNorm(4), "n") == Precision("fp32")  # only the marker matches
    bn = nn.BatchNorm1d(4)  # both markers match it, at the same rank: the earlier entry
    assert PrecisionMap({AffineBatchNorm: "bf16", mp.NormLayer: "fp32"}).lookup(bn, "") \
        == Precision("bf16")
    assert PrecisionMap({mp.NormLayer: "fp32", AffineBatchNorm: "bf16"}).lookup(bn, "") \
        == Precision("fp32")


def test_resolve_gives_every_module_and_refuses_unknown_names():
    model = mlp()
    m = PrecisionMap({nn.Linear: "bf16", "4": "fp32"})
    resolved = m.resolve(model)
    assert list(resolved) == ["", "0", "1", "2", "3", "4"]
    assert resolved["4"] == Precision("fp32") and resolved["2"] == Precision("bf16")
    assert resolved["1"] == resolved[""] == Precision()  # no entry: it inherits
    with pytest.raises(ValueError, match=r"names? no module of the model: '44' \(did you mean "
                                         r"'4'\?\)"):
        PrecisionMap({"44": "fp32"}).resolve(model)


# -- the older arguments are entries of the map ------------------------------------------------
def test_the_older_arguments_give_equal_policies():
    assert mp.Policy(keep_fp32=[nn.LayerNorm]) == mp.Policy(
        modules=PrecisionMap({nn.LayerNorm: Precision("fp32")}))
    assert mp.Policy(overrides={"0": "bf16", nn.Linear: "fp32"}, keep_fp32=["4"]) == mp.Policy(
        modules={"0": "bf16", nn.Linear: "fp32", "4": "fp32"})
    tw = mp.Policy(fp8="tensorwise", fp8_modules=["2"])
    assert tw == mp.Policy(modules={"2": Precision(gemm="tensorwise")})
    assert tw.fp8 == "tensorwise" and tw.fp8_modules == ("2",)
    none = mp.Policy(fp8="tensorwise", fp8_modules=[])  # no layer: the map says so
    assert none.modules == {nn.Module: Precision(gemm="off")} and none.fp8_modules == ()
    assert mp.Policy(fp8="tensorwise").fp8_modules is None  # prepare chooses
    o2 = mp.Policy.from_level("O2", "bf16")
    assert o2.modules == {mp.NormLayer: "fp32"} and o2.keep_fp32 == (mp.NormLayer,)
    assert o2.replace(keep_fp32="4") == o2.replace(modules=o2.modules.updated({"4": "fp32"}))


def _forward_backward(model, x, y):
    out = model(x)
    F.mse_loss(out, y).backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_keep_fp32_and_overrides_compute_bitwise_as_the_map(level):
    x, y = data()
    base = mp.Policy.from_level(level, "bf16")
    old = mp.prepare(mlp(), level=level, dtype="bf16", keep_fp32=["2"])
    new = mp.prepare(mlp(), policy=base.replace(
        modules=base.modules.updated({"2": Precision("fp32")}), level=level))
    assert mp.policy_of(old) == mp.policy_of(new)
    assert new[2].weight.dtype == FP32 and new[0].weight.dtype == BF16
    (a, ga), (b, gb) = _forward_backward(old, x, y), _forward_backward(new, x, y)
    assert torch.equal(a, b) and all(torch.equal(g, h) for g, h in zip(ga, gb))
    over = mp.prepare(mlp(), policy=base.replace(overrides={"0": "fp32"}, level=level))
    mapped = mp.prepare(mlp(), policy=base.replace(modules=base.modules.updated({"0": "fp32"}),
                                                   level=level))
    (a, ga), (b, gb) = _forward_backward(over, x, y), _forward_backward(mapped, x, y)
    assert torch.equal(a, b) and all(torch.equal(g, h) for g, h in zip(ga, gb))


def test_fp8_modules_and_gemm_entries_convert_the_same_layers_bitwise():
    pytest.importorskip("torchao.float8")
    torch.manual_seed(0)

    def build():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                             nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    torch.manual_seed(0)
    old = mp.prepare(build(), level="O1", dtype="bf16", fp8="tensorwise", fp8_modules=["2"])
    torch.manual_seed(0)
    new = mp.prepare(build(), policy=mp.Policy.from_level("O1", "bf16").replace(
        modules={"2": "tensorwise"}, level="O1"))
    assert mp.fp8_modules(old) == mp.fp8_modules(new) == ["2"]
    assert mp.policy_of(old) == mp.policy_of(new)
    (a, ga), (b, gb) = _forward_backward(old, x, y), _forward_backward(new, x, y)
    assert torch.equal(a, b) and all(torch.equal(g, h) for g, h in zip(ga, gb))
    torch.manual_seed(0)  # a type entry: every eligible Linear, recorded by name
    typed = mp.prepare(build(), policy=mp.Policy.from_level("O1", "bf16").replace(
        modules={nn.Linear: "tensorwise", "4": Precision(gemm="off")}))
    assert mp.fp8_modules(typed) == ["0", "2"]  # "4" is off; "6" has 4 outputs (not 16k)
    assert mp.policy_of(typed).modules == {"0": "tensorwise", "2": "tensorwise"}


def _marked():
    model = mlp()
    mp.to_float(model[2], "fp32")
    return model


def test_keep_fp32_to_float_and_a_map_entry_are_one_setting():
    """The three spellings of "this module in fp32" (docs/levels.md) give one policy and one
    model: the same parameter dtypes and bitwise the same output."""
    o2 = mp.Policy.from_level("O2", "bf16")
    prepared = [mp.prepare(mlp(), level="O2", dtype="bf16", keep_fp32=["2"]),
                mp.prepare(_marked(), level="O2", dtype="bf16"),
                mp.prepare(mlp(), policy=o2.replace(modules=o2.modules.updated({"2": "fp32"}),
                                                    level="O2"))]
    x, _ = data()
    first = prepared[0]
    assert first[2].weight.dtype == torch.float32 and first[0].weight.dtype == torch.bfloat16
    for model in prepared[1:]:
        assert mp.policy_of(model) == mp.policy_of(first)
        assert [p.dtype for p in model.parameters()] == [p.dtype for p in first.parameters()]
        assert torch.equal(model(x), first(x))


def test_to_float_is_recorded_as_an_entry_and_replays_bitwise():
    x, y = data()
    marked = mlp()
    mp.to_float(marked[2], "fp32")
    mp.prepare(marked, level="O2", dtype="bf16")
    recorded = mp.policy_of(marked)
    assert recorded.modules == {mp.NormLayer: "fp32", "2": "fp32"}
    assert "modules=[2:fp32]" in str(recorded)  # policy_of shows the map
    with pytest.raises(ValueError, match=r"\['2'\] are marked to_float and given a low-bit"):
        mp.prepare(_marked(), level="O1",
                   dtype="bf16", fp8="tensorwise", fp8_modules=["2"])
    replay = mp.prepare(mlp(), policy=recorded)  # no mark: the entry alone
    (a, ga), (b, gb) = _forward_backward(marked, x, y), _forward_backward(replay, x, y)
    assert torch.equal(a, b) and all(torch.equal(g, h) for g, h in zip(ga, gb))


# -- state_dict ------------------------------------------------------------------------------------
def test_maps_and_policies_round_trip_through_state_dict():
    m = PrecisionMap({mp.NormLayer: "fp32", MyLinear: Precision("bf16", params="fp32"),
                      "0": Precision(gemm="mxfp8"), nn.Module: Precision(gemm="off")})
    state = m.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == state  # plain data
    assert state[1][0] == {"type": f"{__name__}:MyLinear"}
    assert PrecisionMap.from_state_dict(state) == m
    policy = mp.Policy.from_level("O2", "bf16").replace(modules=m)
    assert mp.Policy.from_state_dict(policy.state_dict()) == policy
    with pytest.raises(ValueError, match="can't be imported"):
        PrecisionMap.from_state_dict([[{"type": "nowhere:Thing"}, Precision().to_data()]])


def test_a_policy_saved_in_the_older_form_loads_as_the_map():
    older = {"param_dtype": "bf16", "compute_dtype": "bf16", "output_dtype": "fp32",
             "keep_fp32": [{"type": "mixprec.norms:NormLayer"}, "head"],
             "master_weights": True, "loss_scale": None, "autocast": True, "cast_inputs": True,
             "level": "O2", "overrides": [["0", "fp32"]], "master": "fp32",
             "state_dtype": "fp32", "fp8": "tensorwise", "fp8_modules": ["2"]}
    policy = mp.Policy.from_state_dict(older)
    assert policy.modules == {"0": "fp32", mp.NormLayer: "fp32", "head": "fp32",
                              "2": Precision(gemm="tensorwise")}  # overrides, then keep_fp32


# -- the advisor's output is a map -------------------------------------------------------------
def _train(policy, steps=40):
    model, (x, y), loss_fn = block_outlier_case()
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy=policy)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.slow
def test_the_advisors_map_holds_its_decisions_and_its_policy_trains():
    pytest.importorskip("torchao.float8")
    model, batch, loss_fn = block_outlier_case()
    advice = mp.advise(model, batch, loss_fn, formats=("bf16", "fp8_e4m3"))
    decisions = advice.precision_map("bf16", fp8="tensorwise")
    # "3" reads the normalised outlier (per-tensor FP8 flushes its other inputs); "7": 10 outputs
    assert decisions == {"0": Precision(gemm="tensorwise"), "3": Precision(gemm="off"),
                         "5": Precision(gemm="tensorwise")}
    assert advice.precision_map("bf16") == {}  # nothing unsafe in bf16, no format asked
    policy = advice.policy("O2", "bf16", fp8="tensorwise")
    assert policy.modules == PrecisionMap({mp.NormLayer: "fp32"}).updated(decisions)
    model, losses = _train(policy)
    assert mp.fp8_modules(model) == ["0", "5"]
    _, plain = _train(mp.Policy.from_level("O2", "bf16"))
    assert losses[-1] < 0.6 * losses[0]  # measured: 2.32 -> 1.11 in 40 AdamW steps
    assert abs(losses[-1] - plain[-1]) < 0.05 * plain[-1]  # bf16 alone: 1.10


# -- differential: one Linear in fp32 at O2 ----------------------------------------------------
def _reference_step(masters, x, y, lr, entry):
    """One SGD step as written by hand: fp32 masters, layers 0 and 4 in bf16 (their weights the
    masters rounded), layer 2 as ``entry`` says, the loss in fp32."""
    w0, b0, w2, b2, n_w, n_b, w4, b4 = (m.clone().requires_grad_() for m in masters)
    leaves = [w0, b0, w2, b2, n_w, n_b, w4, b4]
    h = F.relu(F.linear(x.to(BF16), w0.to(BF16), b0.to(BF16)))
    if entry == "fp32":
        h = F.linear(h.float(), w2, b2)
    else:  # bf16 compute, fp32 parameters cast for the call
        h = F.linear(h, w2.to(BF16), b2.to(BF16))
    h = F.layer_norm(h, (16,), n_w, n_b)  # fp32 island: as it comes (CPU: bf16 reads fp32 params)
    out = F.linear(h.to(BF16), w4.to(BF16), b4.to(BF16)).float()
    loss = F.mse_loss(out, y)
    loss.backward()
    return loss, [m - lr * t.grad.float() for m, t in zip(masters, leaves)]


@pytest.mark.parametrize("entry", ["fp32", "bf16+fp32 params"])
def test_a_map_entry_at_O2_matches_the_hand_written_reference(entry):
    value = Precision("fp32") if entry == "fp32" else Precision("bf16", params="fp32")
    model = mlp()
    masters = [p.detach().clone() for p in model.parameters()]
    base = mp.Policy.from_level("O2", "bf16")
    policy = base.replace(modules=base.modules.updated({"2": value}), level="O2")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy)
    assert model[2].weight.dtype == FP32 and model[4].weight.dtype == BF16
    for step in range(3):
        x, y = data()
        x = x + step
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        ref_loss, masters = _reference_step(masters, x, y, 0.1, entry)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        exported = mp.fp32_state_dict(model, opt)
        for (name, got), want in zip(exported.items(), masters):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


def test_a_second_name_of_a_shared_module_is_refused_naming_the_first():
    """``keep_fp32=["block.0"]`` for a Linear also registered as ``proj`` said no module had
    that name and suggested the ReLU 'block.1'."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.block = nn.Sequential(self.proj, nn.ReLU())

    with pytest.raises(ValueError, match=r"names 'block.0', a module also registered as "
                                         r"'proj'.*use 'proj'"):
        mp.prepare(Net(), level="O2", dtype="bf16", keep_fp32=["block.0"])
    model = mp.prepare(Net(), level="O2", dtype="bf16", keep_fp32=["proj"])
    assert model.block[0].weight.dtype == torch.float32
