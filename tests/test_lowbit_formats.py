"""Low-bit GEMM formats as typed components (``mp.lowbit``): shorthands resolve once to equal
formats and equal policies, policies round-trip through ``state_dict``, each format owns its
validation and eligibility rule, NVFP4 is refused by ``prepare`` with the reason, the block
casts match their definitions, and no code outside ``mixprec/lowbit`` branches on a format's
name.
"""

import ast
import pathlib

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.lowbit import MXFP8, NVFP4, Float8, blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHORTHANDS = ("tensorwise", "rowwise", "rowwise_gw_hp", "mxfp8", "nvfp4")


def test_every_shorthand_resolves_to_its_format_and_gives_equal_policies():
    assert mp.lowbit.shorthands() == SHORTHANDS
    formats = [Float8("tensorwise"), Float8("rowwise"), Float8("rowwise_gw_hp"), MXFP8(),
               NVFP4()]
    for short, fmt in zip(SHORTHANDS, formats):
        assert mp.lowbit.resolve(short) == fmt == short and str(fmt) == short
        assert mp.Policy(fp8=short) == mp.Policy(fp8=fmt)
        assert hash(mp.Policy(fp8=short)) == hash(mp.Policy(fp8=fmt))
        assert mp.Policy(fp8=short).fp8 is not short  # resolved to the component
    assert Float8("rowwise") != Float8("tensorwise") and MXFP8() != MXFP8(wgrad_hp=True)
    assert MXFP8() != "tensorwise" and Float8() != "bogus"


@pytest.mark.parametrize("fp8", [None, "rowwise", "mxfp8", MXFP8(wgrad_hp=True), "nvfp4"])
def test_a_policy_round_trips_through_its_state_dict(fp8):
    names = None if fp8 is None else ["a"]  # layer names need a format to run in
    policy = mp.Policy.from_level("O2", "bf16", warn=False).replace(fp8=fp8, fp8_modules=names)
    state = policy.state_dict()
    assert mp.Policy.from_state_dict(state) == policy
    assert state["fp8"] == (None if fp8 is None else policy.fp8.to_data())
    if fp8 == MXFP8(wgrad_hp=True):  # no shorthand: the format's fields
        assert state["fp8"] == {"format": "mxfp8", "wgrad_hp": True, "emulate": None}
    assert (f"fp8={policy.fp8},fp8_modules=1" in str(policy)) == (fp8 is not None)


def test_bad_formats_are_refused_by_the_component():
    with pytest.raises(ValueError, match="Float8's recipe must be one of 'tensorwise'"):
        Float8("e4m3")
    with pytest.raises(TypeError, match="MXFP8's wgrad_hp must be True or False; got 'yes'"):
        MXFP8(wgrad_hp="yes")
    with pytest.raises(ValueError, match="fp8 must be None or one of 'tensorwise'.*got 'mx'"):
        mp.Policy(fp8="mx")
    with pytest.raises(TypeError, match="fp8 must be None, a mixprec.lowbit format"):
        mp.Policy(fp8=8)
    with pytest.raises(ValueError, match="low-bit format 'fp6'"):
        mp.lowbit.resolve({"format": "fp6"})
    with pytest.raises(ValueError, match="name 'mxfp8' is taken by MXFP8"):
        class Other(MXFP8):
            pass
        mp.lowbit.register(Other)


def test_each_format_names_its_own_block_in_the_reasons_it_gives():
    assert Float8().why_ineligible(48, 16) is None
    assert "MXFP8 GEMMs (blocks of 32) need both to be multiples of 32" in \
        MXFP8().why_ineligible(48, 64)
    assert NVFP4().why_ineligible(48, 16) is None
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                          nn.Linear(48, 64), nn.Linear(64, 8))
    with pytest.warns(UserWarning, match=r"'2' has dimensions 64 x 48: MXFP8 GEMMs \(blocks of "
                                         r"32\) need both to be multiples of 32"):
        prepared = mp.prepare(model, level="O0", fp8="mxfp8")
    assert mp.policy_of(prepared).fp8_modules == ()
    assert mp.policy_of(mp.prepare(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48),
                                                 nn.Linear(48, 64), nn.Linear(64, 8)),
                                   level="O0", fp8="tensorwise")).fp8_modules == ("1", "2")


def test_nvfp4_is_measured_but_prepare_refuses_it_naming_why():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    with pytest.raises(RuntimeError, match="torchao 0.18's NVFP4 training path runs Triton "
                                           "kernels on CUDA GPUs only"):
        mp.prepare(model, level="O0", fp8="nvfp4")
    assert mp.policy_of(model) is None and not mp.fp8_modules(model)  # left as it was


def test_native_mx_kernels_are_refused_off_sm100():
    pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    with pytest.raises(RuntimeError, match=r"need an sm100 \(Blackwell\) GPU; this model is on "
                                           r"cpu"):
        mp.prepare(model, level="O0", fp8=MXFP8(emulate=False))
    assert not MXFP8().native(torch.device("cpu"))


def test_e2m1_rounding_is_round_to_nearest_even_on_its_eight_values():
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert torch.equal(blocks.round_e2m1(values), values)
    assert torch.equal(blocks.round_e2m1(-values), -values)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert torch.equal(blocks.round_e2m1(ties), torch.tensor([0, 1, 1, 2, 2, 4, 4.0]))
    assert torch.equal(blocks.round_e2m1(torch.tensor([0.26, 2.6, 5.1, 7.0])),
                       torch.tensor([0.5, 3, 6, 6.0]))


def test_the_mx_cast_is_a_power_of_two_per_block_and_e4m3_elements():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    x[1, 40] = 1e4  # a large value coarsens its own block only
    q = blocks.fake_quant(x, blocks.MX, -1)
    for row in range(3):
        for start in (0, 32):
            block = x[row, start:start + 32]
            scale = 2.0 ** torch.ceil(torch.log2(block.abs().max() / 448))
            want = (block / scale).to(torch.float8_e4m3fn).float() * scale
            assert torch.equal(q[row, start:start + 32], want)
    assert torch.equal(q[1, :32], blocks.fake_quant(x[1:2, :32], blocks.MX, -1)[0])
    amax, saturated, flushed, largest, ratio = blocks.fractions(x, blocks.MX, -1)
    assert float(saturated) == 0 and float(amax) == 1e4
    assert float(largest) == 2.0 ** 5 and float(ratio) >= 2.0 ** 5  # 1e4/448 -> 2^5


def test_an_nvfp4_block_whose_scale_rounds_to_zero_is_zeroed_and_counted_flushed():
    """The e4m3 block scale of a block far below the tensor's amax rounds to 0: the block
    dequantizes to zeros (it was kept at scale 1, and reported unflushed)."""
    x = torch.cat([torch.full((16,), 0.0).index_fill(0, torch.tensor([0]), 1e6),
                   torch.linspace(0.3, 1.0, 16)]).reshape(1, 32)
    q = blocks.fake_quant(x, blocks.NVFP4, -1)
    assert float(q[0, 0]) == pytest.approx(1e6, rel=0.25)
    assert torch.equal(q[0, 16:], torch.zeros(16))
    amax, saturated, flushed, largest, ratio = blocks.fractions(x, blocks.NVFP4, -1)
    assert (float(amax), float(saturated)) == (1e6, 0.0)
    assert float(ratio) == 1.0 and float(largest) > 0  # the flushed block has no scale
    assert float(flushed) == pytest.approx(16 / 17, rel=1e-6)  # the 16 of block 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_makes_the_whole_nvfp4_tensor_nan_and_mx_its_block(bad):
    """NVFP4's tensor scale comes from the tensor's amax: one inf/NaN makes every value NaN (the
    other rows were clamped finite values: -61.4 came back as -6); MX's scale is per block."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 32, generator=g) * 50
    x[0, 3] = bad
    q = blocks.fake_quant(x, blocks.NVFP4, -1)
    assert torch.isnan(q).all()
    assert float(blocks.fractions(x, blocks.NVFP4, -1)[1]) == 1.0
    mx = blocks.fake_quant(x, blocks.MX, -1)
    assert torch.isfinite(mx[1]).all() and not torch.isfinite(mx[0]).all()


def test_no_code_outside_the_formats_branches_on_a_format_name():
    """String constants equal to a shorthand (docstrings aside) appear only in
    mixprec/lowbit, where each format registers its own."""
    found = []
    for path in sorted((ROOT / "mixprec").rglob("*.py")):
        if "lowbit" in path.relative_to(ROOT / "mixprec").parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                           ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value in SHORTHANDS
                    and id(node) not in docstrings):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert found == []
