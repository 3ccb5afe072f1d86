import dataclasses

import pytest
import torch

import mixprec as mp
from mixprec import hardware
from mixprec.dtypes import dtype_name, to_dtype
from mixprec.policy import NormLayer, Policy, resolve_dtype

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("spec,expected", [
    ("fp32", FP32), ("float32", FP32), ("fp16", FP16), ("float16", FP16), ("half", FP16),
    ("bf16", BF16), ("bfloat16", BF16), (" BF16 ", BF16), (torch.bfloat16, BF16),
    ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2),
])
def test_to_dtype_accepts_every_spelling(spec, expected):
    assert to_dtype(spec) == expected


@pytest.mark.parametrize("bad,exc", [("fp12", ValueError), (torch.int32, ValueError),
                                     (16, TypeError), (None, TypeError)])
def test_to_dtype_rejects_bad_input_naming_it(bad, exc):
    with pytest.raises(exc, match="fp32"):
        to_dtype(bad)


@pytest.mark.parametrize("level,params,compute,output,master", [
    ("O0", FP32, FP32, FP32, False),
    ("O1", FP32, BF16, FP32, False),
    ("O2", BF16, BF16, FP32, True),
    ("O3", BF16, BF16, None, False),  # outputs as computed (an fp32 head's stay fp32)
])
def test_level_table_bf16(level, params, compute, output, master):
    p = Policy.from_level(level, "bf16")
    assert ((p.param_dtype, p.compute_dtype, p.output_dtype, p.master_weights)
            == (params, compute, output, master))
    assert p.loss_scale is None  # bf16 needs no loss scaling at any level
    assert p.autocast == (level in ("O1", "O2"))
    assert (p.keep_fp32 == (NormLayer,)) == (level == "O2")


@pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
@pytest.mark.parametrize("level,scale", [("O0", None), ("O1", "dynamic"), ("O2", "dynamic"),
                                         ("O3", None)])
def test_level_table_fp16_loss_scale(level, scale):
    assert Policy.from_level(level, "fp16").loss_scale == scale


def test_str_is_canonical():
    assert (str(Policy.from_level("O2", "bf16"))
            == "O2(params=bf16,compute=bf16,output=fp32,master=fp32)")
    assert str(Policy.from_level("O0")) == "O0(params=fp32,compute=fp32,output=fp32,master=none)"
    assert str(Policy.from_level("o3", "bf16")).startswith("O3(params=bf16")
    assert str(Policy.from_level("O1", "bf16").replace(output_dtype="bf16")).startswith("custom(")


def test_policy_is_frozen():
    p = Policy.from_level("O1", "bf16")
    with pytest.raises(AttributeError):
        p.param_dtype = BF16  # type: ignore[misc]


@pytest.mark.parametrize("level", ["O4", "o5", "", None, 2])
def test_bad_level_names_valid_ones(level):
    with pytest.raises(ValueError, match="'O0', 'O1', 'O2', 'O3'"):
        Policy.from_level(level, "bf16")


def test_bad_policy_fields():
    with pytest.raises(ValueError, match="loss_scale"):
        Policy(loss_scale=-1.0)
    with pytest.raises(TypeError, match="keep_fp32"):
        Policy(keep_fp32=(int,))
    for field in ("param_dtype", "compute_dtype"):  # prepare cast weights to e4m3, then died
        with pytest.raises(ValueError, match=rf"{field} must be a dtype a model trains in .*"
                                             r"got fp8_e4m3: FP8 GEMMs are fp8="):
            Policy(**{field: "fp8_e4m3"})


VALID_KEEP = "an nn.Module subclass .*, a qualified module name .*, or an iterable of them"


@pytest.mark.parametrize("keep, got", [
    (42, "got int 42"), (3.5, "got float 3.5"), ({"norm": True}, "got dict {'norm': True}"),
    (torch.nn.LayerNorm(4), r"got the module instance LayerNorm\(\.\.\.\) \(pass its type"),
])
@pytest.mark.parametrize("where", ["Policy", "prepare"])
def test_keep_fp32_of_the_wrong_type_is_named_with_what_is_valid(keep, got, where):
    with pytest.raises(TypeError, match=f"^keep_fp32 must be {VALID_KEEP}; {got}"):
        if where == "Policy":
            Policy(keep_fp32=keep)
        else:
            mp.prepare(torch.nn.Linear(4, 4), level="O2", dtype="bf16", keep_fp32=keep)


@pytest.mark.parametrize("where", ["Policy", "prepare"])
def test_keep_fp32_entries_are_checked_and_any_iterable_is_taken(where):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with pytest.raises(TypeError, match="entries must be nn.Module subclasses or qualified "
                                        "module names; got int 42"):
        if where == "Policy":
            Policy(keep_fp32=[torch.nn.Linear, 42])
        else:
            mp.prepare(net, level="O2", dtype="bf16", keep_fp32=[42])
    if where == "Policy":
        assert Policy(keep_fp32=(t for t in [torch.nn.Linear])).keep_fp32 == (torch.nn.Linear,)
    else:
        mp.prepare(net, level="O3", dtype="bf16", keep_fp32=(name for name in ["0"]))
        assert net[0].weight.dtype == FP32 and net[1].weight.dtype == BF16


def test_auto_resolves_from_capabilities(monkeypatch):
    caps = mp.device_capabilities("cpu")
    assert resolve_dtype("auto", "cpu", warn=False) == to_dtype(caps["auto_dtype"])
    assert caps["auto_reason"]
    monkeypatch.setenv("MIXPRECISION_AUTO_DTYPE", "fp32")
    with pytest.warns(mp.SlowDtypeWarning, match="fp32"):
        assert resolve_dtype("auto", "cpu") == FP32


def test_slow_dtype_warns_once(monkeypatch):
    monkeypatch.setattr(hardware, "_warned", set())
    monkeypatch.setattr(hardware, "_cpu_caps", lambda: {
        "name": "test CPU", "flags": [], "dtypes": {
            "fp32": {"supported": True, "fast": True, "why": "native"},
            "bf16": {"supported": True, "fast": False, "why": "no AVX512-BF16"},
            "fp16": {"supported": True, "fast": False, "why": "no AMX-FP16"}}})
    with pytest.warns(mp.SlowDtypeWarning, match="bf16 is not fast on test CPU: no AVX512-BF16"):
        resolve_dtype("bf16", "cpu")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_dtype("bf16", "cpu")  # second time: silent
    with pytest.warns(mp.SlowDtypeWarning, match="auto.*fp32"):
        assert resolve_dtype("auto", "cpu") == FP32


def test_device_capabilities_shape():
    caps = mp.device_capabilities()
    assert caps["device"] == "cpu"
    assert set(caps["dtypes"]) == {"fp32", "bf16", "fp16"}
    for info in caps["dtypes"].values():
        assert set(info) == {"supported", "fast", "why"}
    assert caps["auto_dtype"] in ("bf16", "fp16", "fp32")
    with pytest.raises(ValueError, match="device"):
        mp.device_capabilities("not-a-device")


@pytest.mark.cuda
def test_cuda_capabilities():
    caps = mp.device_capabilities("cuda")
    major, _ = torch.cuda.get_device_capability()
    assert caps["dtypes"]["bf16"]["fast"] == (major >= 8)
    assert caps["auto_dtype"] == ("bf16" if major >= 8 else "fp16" if major >= 7 else "fp32")


def test_dtype_name():
    assert [dtype_name(d) for d in (FP32, FP16, BF16)] == ["fp32", "fp16", "bf16"]


# -- the whole description: overrides, value equality, round trips ---------------------------
def test_policies_compare_by_value_and_print_what_differs():
    plain = Policy.from_level("O2", "bf16")
    extra = plain.replace(keep_fp32=plain.keep_fp32 + ("head",), level="O2")
    assert plain == Policy.from_level("O2", "bf16") and plain != extra
    assert str(plain) != str(extra)  # 0.2 printed both as plain O2
    assert str(extra) == ("O2(params=bf16,compute=bf16,output=fp32,master=fp32,"
                          "modules=[head:fp32])")
    custom = Policy(overrides={"encoder": "bf16", torch.nn.Linear: "fp32"})
    assert str(custom) == ("custom(params=fp32,compute=fp32,output=fp32,master=none,"
                           "modules=[encoder:bf16,Linear:fp32])")


@pytest.mark.parametrize("policy", [
    Policy.from_level("O2", "bf16"),
    Policy.from_level("O1", "fp16", warn=False).replace(
        overrides={"head": "fp32", torch.nn.Embedding: "fp32"}),
    Policy(param_dtype="bf16", compute_dtype="bf16", keep_fp32=(torch.nn.LayerNorm, "norm"),
           master_weights=True, loss_scale=128.0, cast_inputs=True),
])
def test_policy_state_dict_round_trips_by_value(policy):
    state = policy.state_dict()
    assert torch.load(io_round_trip(state), weights_only=True) == state  # plain data
    assert Policy.from_state_dict(state) == policy
    with pytest.raises(ValueError, match="keys"):
        Policy.from_state_dict({**state, "extra": 1})


def io_round_trip(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_overrides_pick_by_name_before_type_and_are_validated():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    policy = Policy(overrides=[("1", "fp32"), (torch.nn.Linear, "bf16")])
    assert policy.module_dtype(net[1], "1") == FP32
    assert policy.module_dtype(net[0], "0") == BF16
    assert Policy(keep_fp32="0").module_dtype(net[0], "0") == FP32
    with pytest.raises(TypeError, match="overrides entries must be"):
        Policy(overrides=[("1",)])
    with pytest.raises(ValueError, match="override dtype must be 'fp32', 'fp16' or 'bf16'"):
        Policy(overrides={"1": "fp8_e4m3"})
    with pytest.raises(TypeError, match=r"keep_fp32 must be an nn.Module subclass.*got int 42"):
        Policy(keep_fp32=42)
    with pytest.raises(ValueError, match="need master_weights=True"):
        Policy(master="kahan")


def test_prepare_applies_policy_overrides_and_records_to_float_marks():
    import mixprec as mp
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    mp.to_float(net[2], "fp32")
    policy = Policy.from_level("O2", "bf16").replace(overrides={"0": "fp32"}, level="O2")
    mp.prepare(net, policy=policy)
    assert net[0].weight.dtype == FP32 and net[2].weight.dtype == FP32
    recorded = mp.policy_of(net)
    assert recorded.modules == mp.PrecisionMap({NormLayer: "fp32", "0": "fp32", "2": "fp32"})
    assert recorded.overrides == ((NormLayer, FP32), ("0", FP32), ("2", FP32))
    assert "modules=[0:fp32,2:fp32]" in str(recorded)
    with pytest.raises(ValueError, match=r"name no module of the model: 'hed'"):
        mp.prepare(torch.nn.Sequential(torch.nn.Linear(2, 2)),
                   policy=Policy(overrides={"hed": "fp32"}))


@pytest.mark.parametrize("call, error, match", [
    (lambda: mp.Policy("fp64", "fp64"), ValueError, "param_dtype must be a dtype a model trains"),
    (lambda: mp.Policy.from_level("O0", "fp8_e4m3"), ValueError, "a training dtype must be"),
    (lambda: mp.prepare(torch.nn.Linear(2, 2), level="O0", dtype="fp64"), ValueError,
     "a training dtype must be"),
    (lambda: mp.Policy(loss_scale=2 ** 2000), ValueError, "loss_scale must be 'dynamic'"),
    (lambda: mp.Policy(loss_scale=1e-40), ValueError, "loss_scale must be 'dynamic'"),
    (lambda: mp.make_loss_scaler(10 ** 400, "fp16"), ValueError, "must be a finite number"),
    (lambda: mp.formats.range_report(torch.ones(2), "fp16", scale=10 ** 400), ValueError,
     "scale must be a positive finite number"),
    (lambda: mp.emulate_fp16("maybe"), ValueError, r"emulate_fp16\(enabled=\.\.\.\) must be"),
])
def test_values_a_run_cannot_use_are_refused_where_they_are_given(call, error, match):
    """Each was accepted and failed later (fp64 weights met fp32 inputs; an O0 'dtype' was not
    checked; a loss scale a float32 cannot hold), or raised a bare OverflowError (an int beyond
    float64), or named another argument (``mode`` for ``enabled``)."""
    with pytest.raises(error, match=match):
        call()


def test_unequal_policies_print_unequal():
    """``str(policy)`` (what ``policy_of`` shows) left out the loss scale and a level's changed
    switches: a static, a dynamic and no loss scale printed alike."""
    base = dict(param_dtype="fp16", compute_dtype="fp16", master_weights=True)
    shown = {str(mp.Policy(**base, loss_scale=s)) for s in (None, "dynamic", 1024.0)}
    assert len(shown) == 3
    o2 = mp.Policy.from_level("O2", "fp16")
    assert str(o2) == "O2(params=fp16,compute=fp16,output=fp32,master=fp32)"
    relabelled = dataclasses.replace(o2, autocast=False)  # (still labelled O2)
    assert str(relabelled) != str(o2) and "autocast=False" in str(relabelled)


def test_a_precision_map_finds_the_norm_marker_for_a_norm_type():
    """O2's map applies its NormLayer entry to a LayerNorm (``lookup``) but ``map[nn.LayerNorm]``
    raised KeyError and ``get`` gave None."""
    from torch import nn
    o2 = mp.Policy.from_level("O2", "bf16").modules
    assert o2[nn.LayerNorm] == o2.lookup(nn.LayerNorm(4), "ln") == o2.get(nn.BatchNorm2d)
    assert o2.get(nn.Linear) is None
    assert issubclass(mp.NormLayer, mp.NormLayer) and not issubclass(nn.Linear, mp.NormLayer)


@pytest.mark.parametrize("state", [[["a"]], [("x", "bf16", "extra")], ["linear"]])
def test_a_malformed_precision_map_state_names_the_entry(state):
    with pytest.raises(TypeError, match=r"list of \[key, precision\]; entry 0 is"):
        mp.PrecisionMap.from_state_dict(state)


def test_range_report_counts_what_the_scale_pushed_out_of_float64_as_overflow():
    """A value the scale takes beyond float64 counted as non-finite in the source, one it takes
    to 0 as an exact zero (both are about the source, per the docstring)."""
    big = mp.formats.range_report(torch.tensor([1e300], dtype=torch.float64), "fp16", scale=1e10)
    assert (big.overflow, big.nonfinite) == (1, 0)
    tiny = mp.formats.range_report(torch.tensor([1e-300], dtype=torch.float64), "fp16",
                                   scale=1e-30)
    assert (tiny.underflow, tiny.exact_zero) == (1, 0)
    source = mp.formats.range_report(torch.tensor([0.0, float("inf")]), "fp16", scale=2.0)
    assert (source.exact_zero, source.nonfinite) == (1, 1)


@pytest.mark.parametrize("text, match", [("0x1p-1080", "below the smallest float64 subnormal"),
                                         ("0x1p+2000", "beyond the float64 range")])
def test_explain_refuses_a_hex_literal_outside_float64(text, match):
    """``0x1p-1080`` was read as 0.0 (``float.fromhex`` rounds it), where ``2**-1080`` is
    refused."""
    from mixprec.commands.formats import parse_value
    with pytest.raises(ValueError, match=match):
        parse_value(text)
    assert parse_value("0x1.8p1") == 3.0
