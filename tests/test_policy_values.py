"""Policies compare by value (the level is a label), and the precision keywords' refusals say
what is valid and what to do."""

import pytest
import torch

import mixprec as mp
from mixprec import Policy

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
O2_ONLY = "master weights exist at level O2 only (or in a Policy with master_weights=True)"


# -- the level is a label --------------------------------------------------------------------------
def test_a_level_with_a_master_method_equals_the_same_policy_built_by_replace():
    engine = mp.MixedPrecision(level="O2", dtype="bf16", master="kahan").policy
    built = Policy.from_level("O2", "bf16").replace(master="kahan")
    assert engine == built and hash(engine) == hash(built)
    assert built.level == "O2" and str(built) == str(engine)  # replace keeps the label here
    unlabelled = built.replace(level=None)
    assert unlabelled.level is None and unlabelled == engine and hash(unlabelled) == hash(engine)
    assert len({engine, unlabelled}) == 1
    # what changes a number still counts, and a change outside prepare's keywords drops the label
    assert built != built.replace(master="split")
    assert built != built.replace(state_dtype="bf16")
    other = built.replace(output_dtype="bf16")
    assert other.level is None and other != built
    assert built != "O2" and Policy() == Policy(level=None) == Policy(level="O0")


def _engine(policy=None, **keywords):
    amp = mp.MixedPrecision(policy=policy) if policy is not None else mp.MixedPrecision(
        **keywords)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 2))
    amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return amp


def test_a_checkpoint_loads_into_a_numerically_identical_policy_and_not_into_another():
    saved = _engine(level="O2", dtype="bf16", master="kahan").state_dict()
    assert saved["policy"]["level"] == "O2"
    same = _engine(Policy.from_level("O2", "bf16").replace(master="kahan", level=None))
    same.load_state_dict(saved)  # only the label differs
    back = _engine(level="O2", dtype="bf16", master="kahan")
    back.load_state_dict(same.state_dict())  # and the other way round
    for different in (_engine(level="O2", dtype="bf16", master="split"),
                      _engine(Policy.from_level("O2", "bf16").replace(state_dtype="bf16"))):
        with pytest.raises(ValueError, match="was made under the policy O2.*master=kahan.*but "
                                             "this run uses"):
            different.load_state_dict(saved)


# -- the refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("state_dtype", ["int8", "fp16", "half", "fp64", "fp8_e4m3",
                                         torch.float16, "nonsense"])
def test_a_bad_state_dtype_lists_only_the_valid_ones(state_dtype):
    valid = "state_dtype must be one of 'fp32', 'bf16' (or torch.float32, torch.bfloat16); got "
    with pytest.raises(ValueError) as info:
        mp.MixedPrecision(level="O2", dtype="bf16", master="kahan", state_dtype=state_dtype)
    assert str(info.value) == valid + repr(state_dtype)
    with pytest.raises(TypeError, match=r"state_dtype must be one of 'fp32', 'bf16' .*got int 3"):
        Policy.from_level("O2", "bf16").replace(state_dtype=3)
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    with pytest.raises(ValueError) as info:  # the optimizers' own check
        mp.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 state_dtype=state_dtype)
    assert str(info.value) == f"state_dtype must be 'fp32' or 'bf16'; got {state_dtype!r}"


@pytest.mark.parametrize("level,why", [
    ("O0", "fp32 training"), ("O1", "its parameters stay fp32"),
    ("O3", "pure 16-bit: the optimizer updates the 16-bit parameters themselves")])
@pytest.mark.parametrize("master", ["split", "kahan", "stochastic"])
def test_a_master_method_outside_o2_says_use_o2(level, why, master):
    expected = f"master={master!r}: {O2_ONLY}; level {level} has none ({why}): use level='O2'"
    with pytest.raises(ValueError) as info:
        mp.MixedPrecision(level=level, dtype="bf16", master=master)
    assert str(info.value) == expected  # no state_dtype the user never passed
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError) as info:
        mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level=level, dtype="bf16",
                   master=master)
    assert str(info.value) == expected


def test_the_other_master_refusals_name_what_was_passed():
    with pytest.raises(ValueError) as info:  # fp32 masters at O3: there are none
        mp.MixedPrecision(level="O3", dtype="bf16", master="fp32")
    assert str(info.value).startswith(f"master='fp32': {O2_ONLY}; level O3 has none")
    for master in ("split", "stochastic"):  # (at O3 fp16 the fp16 advice came first, and
        with pytest.raises(ValueError) as info:  # sent the user to master='kahan', refused)
            mp.MixedPrecision(level="O3", dtype="fp16", master=master)
        assert str(info.value).startswith(f"master='{master}': {O2_ONLY}; level O3 has none")
    with pytest.raises(ValueError) as info:
        mp.MixedPrecision(level="O1", dtype="bf16", state_dtype="bf16")
    assert str(info.value).startswith(f"state_dtype='bf16': {O2_ONLY}; level O1 has none")
    with pytest.raises(ValueError) as info:
        mp.MixedPrecision(level="O1", dtype="bf16", master="kahan", state_dtype="bf16")
    assert str(info.value).startswith(f"master='kahan' and state_dtype='bf16': {O2_ONLY}")
    with pytest.raises(ValueError, match=r"^master='kahan': level O2 has master weights only "
                                         r"with a 16-bit dtype; here the parameters are fp32"):
        mp.MixedPrecision(level="O2", dtype="fp32", master="kahan")
    with pytest.raises(ValueError, match=r"^master='split': how an optimizer updates 16-bit "
                                         r"parameters through master weights, which need "
                                         r"master_weights=True"):
        Policy(param_dtype="bf16", compute_dtype="bf16", master="split")
    # what is consistent stays accepted: fp32 masters where the parameters are fp32 already
    assert mp.MixedPrecision(level="O1", dtype="bf16", master="fp32").policy.level == "O1"
