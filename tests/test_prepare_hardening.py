"""What a new user hit with mixprec 0.1: nested to_float, pickling, conflicts, fp32 state dicts."""

import copy
import io

import pytest
import torch
from torch import nn

import mixprec as mp

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16
LEVELS = ["O0", "O1", "O2", "O3"]


def five_linear():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.conv2(torch.relu(self.bn(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))


def computed_in(model, x, op):
    """The dtypes the given ATen op computed in during one forward."""
    with mp.debug.op_stats() as stats:
        model(x)
    return {dt for (name, dt, _), n in stats.counts.items() if name == op and n}


# ---------------------------------------------------------------- 1. to_float nests
@pytest.mark.parametrize("level", [None, *LEVELS])
def test_nested_to_float_computes_each_module_in_its_own_dtype(level):
    """0.1: `mat1 and mat2 must have the same dtype` at the first forward."""
    net = five_linear()
    mp.to_float(net, "bf16")
    mp.to_float(net[2], "fp32")
    if level is not None:
        mp.prepare(net, level=level, dtype="bf16")
    x = torch.randn(4, 8)
    out = net(x)
    assert out.dtype in (BF16, FP32) and torch.isfinite(out).all()
    with mp.debug.op_stats() as stats:
        net(x)
    assert stats.count(op="addmm", dtype="bf16") == 2 and stats.count(op="addmm", dtype="fp32") == 1
    # to_float keeps a parameter's storage (cast at compute); O2/O3 store 16-bit weights
    stored = BF16 if level in ("O2", "O3") else FP32
    assert net[0].weight.dtype == stored and net[2].weight.dtype == FP32


@pytest.mark.parametrize("level", [None, *LEVELS])
def test_fp32_batchnorm_inside_a_bf16_cnn(level):
    """0.1: `Input type (float) and bias type (BFloat16) should be the same`."""
    model = CNN()
    mp.to_float(model, "bf16")
    mp.to_float(model.bn, "fp32")
    if level is not None:
        mp.prepare(model, level=level, dtype="bf16")
    x = torch.randn(2, 3, 6, 6)
    out = model(x)
    assert torch.isfinite(out).all()
    assert computed_in(model, x, "convolution") == {BF16}
    stored = BF16 if level in ("O2", "O3") else FP32
    assert model.bn.running_mean.dtype == FP32 and model.conv2.weight.dtype == stored


def test_a_to_float_island_inside_an_o3_model_hands_back_the_surrounding_dtype():
    net = five_linear()
    mp.to_float(net[2], "fp32")
    mp.prepare(net, level="O3", dtype="bf16")  # no autocast: 0.1 crashed at net[4]
    x = torch.randn(4, 8)
    assert net(x).dtype == BF16
    assert computed_in(net, x, "addmm") == {BF16, FP32}


# ---------------------------------------------------------------- 2. prepared models pickle
def roundtrip(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("level", LEVELS)
def test_prepared_models_pickle_and_deepcopy_at_every_level(level, dtype):
    """0.1: `Can't pickle local object '_fixed_precision_context.<locals>.factory'` at O2/O3."""
    model = CNN()
    mp.to_float(model.head, "fp32")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mp.prepare(model, opt, level=level, dtype=dtype)
    x = torch.randn(2, 3, 6, 6)
    model.eval()
    expected = model(x)
    for clone in (roundtrip(model), copy.deepcopy(model)):
        assert str(mp.policy_of(clone)) == str(mp.policy_of(model))
        torch.testing.assert_close(clone(x), expected, rtol=0, atol=0)
        assert clone.forward.module is clone if level != "O0" else True
        clone(x).float().sum().backward()  # and it still trains
        assert all(p.grad is not None for p in clone.parameters())


# ---------------------------------------------------------------- 3. conflicts and typos
def test_a_to_float_mark_in_another_16_bit_format_is_refused_at_prepare():
    net = five_linear()
    mp.to_float(net, "bf16")
    with pytest.raises(ValueError, match=r"module 'the model itself' was marked to_float\(bf16\)"
                                         r".*computes in fp16.*dtype='bf16'"):
        mp.prepare(net, level="O2", dtype="fp16")
    assert mp.policy_of(net) is None
    mp.prepare(net, level="O2", dtype="bf16")  # the same format is fine
    marked = five_linear()
    mp.to_float(marked[2], "fp32")  # so is fp32
    mp.prepare(marked, level="O2", dtype="fp16")


def test_keep_fp32_names_must_match_a_module_with_a_did_you_mean():
    model = CNN()
    with pytest.raises(ValueError, match=r"'bnn' \(did you mean 'bn'\?\)"):
        mp.prepare(model, level="O2", dtype="bf16", keep_fp32=["bnn"])
    with pytest.raises(ValueError, match=r"'nonexistent.layer'"):
        mp.prepare(model, level="O2", dtype="bf16", keep_fp32=["head", "nonexistent.layer"])
    assert mp.policy_of(model) is None


def test_a_meta_device_model_is_refused_with_the_way_out():
    with torch.device("meta"):
        model = five_linear()
    with pytest.raises(ValueError, match=r"meta device.*to_empty"):
        mp.prepare(model, level="O2", dtype="bf16")
    with pytest.raises(ValueError, match=r"meta device"):
        mp.to_float(model, "bf16")


# ---------------------------------------------------------------- 4. fp32 state dicts
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_o2_state_dict_is_the_exact_masters_and_loads_into_an_fp32_model(dtype):
    model = five_linear()
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level="O2",
                            dtype=dtype)
    for _ in range(3):  # updates smaller than a low-precision ulp: masters and weights differ
        opt.zero_grad()
        (model(torch.randn(4, 8)).square().mean() * 1e-3).backward()
        opt.step()
    sd = model.state_dict()
    assert {v.dtype for v in sd.values()} == {FP32}
    for name, p in model.named_parameters():
        assert torch.equal(sd[name], opt.master_param(p))
    assert any(not torch.equal(sd[n], p.float()) for n, p in model.named_parameters())
    plain = five_linear()
    plain.load_state_dict(sd)  # a plain fp32 model takes it as it is
    assert torch.equal(plain[0].weight, opt.master_param(model[0].weight))
    assert torch.equal(mp.fp32_state_dict(model, opt)["0.weight"], sd["0.weight"])
    assert sd["0.weight"].data_ptr() != model[0].weight.data_ptr()


def test_loading_an_fp32_state_dict_sets_masters_exactly_and_weights_to_their_rounding():
    source = five_linear()
    with torch.no_grad():
        source[0].weight.add_(2 ** -12)  # below a bf16 ulp of most weights
    model = five_linear()
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level="O2",
                            dtype="bf16")
    model.load_state_dict(source.state_dict())
    assert torch.equal(opt.master_param(model[0].weight), source[0].weight)
    assert torch.equal(model[0].weight, source[0].weight.to(BF16))
    assert torch.equal(model.state_dict()["0.weight"], source[0].weight)


def test_o3_state_dict_is_exact_upcasts_and_keep_vars_still_gives_the_parameters():
    model = CNN()
    mp.prepare(model, level="O3", dtype="bf16")
    sd = model.state_dict()
    assert sd["conv1.weight"].dtype == FP32 and sd["bn.running_var"].dtype == FP32
    assert sd["bn.num_batches_tracked"].dtype == torch.int64
    assert torch.equal(sd["conv1.weight"], model.conv1.weight.float())
    raw = model.state_dict(keep_vars=True)
    assert raw["conv1.weight"] is model.conv1.weight  # the tensors themselves, untouched
    fresh = CNN()
    fresh.load_state_dict(sd)


def test_hugging_face_save_pretrained_round_trips_to_an_fp32_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mp.prepare(model, opt, level="O2", dtype="bf16")
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.save_pretrained(tmp_path)
    # the weights on disk are fp32; transformers >= 5 loads in the dtype its config records
    # (the training dtype, read off the model's parameters), so ask for fp32 there
    major = int(transformers.__version__.split(".")[0])
    loaded = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path, **({"dtype": FP32} if major >= 5 else {}))
    assert loaded.transformer.h[0].attn.c_attn.weight.dtype == FP32
    master = opt.master_param(model.transformer.h[0].attn.c_attn.weight)
    assert torch.equal(loaded.transformer.h[0].attn.c_attn.weight, master)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps), lambda ps: torch.optim.AdamW(ps, eps=1e-6)])
def test_o3_fp16_with_adam_state_in_fp16_is_refused(make):
    """Pure fp16 Adam: (1 - beta2) * g^2 rounds to 0 for |g| <= 5.46e-3 (sqrt(2^-25 / 1e-3); the
    boundary is measured in tests/test_docs_numbers.py), the update divides by eps
    (0 in fp16 at 1e-8): the weights turn inf/NaN. Refused, with the ways out."""
    model = five_linear()
    with pytest.raises(ValueError, match=r"rounds to 0 in fp16 for every \|grad\| <= 5\.46e-03"
                                         r".*inf/NaN weights.*level='O2'.*dtype='bf16'"):
        mp.prepare(model, make(model.parameters()), level="O3", dtype="fp16")
    assert all(p.dtype == FP32 for p in model.parameters())  # refused before anything changed
    mp.prepare(model, make(model.parameters()), level="O2", dtype="fp16")  # fp32 state: fine
    big_eps = five_linear()  # finite, but Adam's normalisation is lost for small gradients
    with pytest.warns(UserWarning, match="normalisation is lost"):
        mp.prepare(big_eps, torch.optim.Adam(big_eps.parameters(), eps=1e-4), level="O3",
                   dtype="fp16")
    sgd_model = five_linear()  # SGD's momentum in fp16 is sound
    mp.prepare(sgd_model, torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9),
               level="O3", dtype="fp16")


def test_o3_fp16_rmsprop_with_its_state_in_fp16_is_refused_too():
    """RMSprop's (1 - alpha) * g^2 underflows the same way: at its defaults (eps 1e-8) every
    weight went inf at the first step, accepted silently (then each step was skipped, blaming
    the forward). The eps bound is printed whole (it read 'eps >= 6.1e-05' for a refused
    6.1e-5)."""
    model = five_linear()
    with pytest.raises(ValueError, match=r"RMSprop .*alpha=0\.99.*\(1 - alpha\) \* grad\^2 "
                                         r"rounds to 0.*eps >= 6\.103515625e-05 \(2\^-14\)"):
        mp.prepare(model, torch.optim.RMSprop(model.parameters(), lr=1e-3), level="O3",
                   dtype="fp16")
    with pytest.raises(ValueError, match=r"eps >= 6\.103515625e-05"):
        mp.prepare(model, torch.optim.AdamW(model.parameters(), eps=6.1e-5), level="O3",
                   dtype="fp16")


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adagrad(ps, lr=1e-2),  # (its sums made in its constructor)
    lambda ps: torch.optim.AdamW(ps, lr=1e-2)])  # (stepped once in fp32 before prepare)
def test_o3_casts_optimizer_state_made_before_prepare(make):
    """O3 trains the 16-bit parameters with their optimizer as torch's would after a cast:
    state made before ``prepare`` stayed fp32 (Adagrad trained 4.6e-2 apart from the model cast
    by hand; an AdamW stepped before failed at its next step). Cast in place: the groups the
    user holds stay the optimizer's (own, review: a load round trip replaced them), and
    gradients zeroed in place (fp32) are cast with the state."""
    torch.manual_seed(0)
    model = five_linear()
    reference = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(reference.parameters())
    x = torch.randn(4, 8)
    for m, o in ((model, opt), (reference, ref_opt)):  # (a step in fp32 before the cast)
        m(x).sum().backward()
        o.step()
        o.zero_grad(set_to_none=False)
    reference = reference.bfloat16()
    ref_opt.load_state_dict(ref_opt.state_dict())  # (torch's load casts the state)
    group = opt.param_groups[0]
    model, opt = mp.prepare(model, opt, level="O3", dtype="bf16")
    assert opt.param_groups[0] is group
    for m, o in ((model, opt), (reference, ref_opt)):
        for _ in range(3):
            m(x.bfloat16()).float().sum().backward()
            o.step()
            o.zero_grad()
    assert all(v.dtype == torch.bfloat16 for s in opt.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k != "step")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_custom_op_lists_pickle_by_name():
    """Tensor.__pow__ is a Python wrapper pickle can't look up: contexts pickle op names."""
    model = five_linear()
    mp.prepare(model, level="O1", dtype="bf16", fp32_ops=["pow"], low_precision_ops=["gelu"])
    loaded = roundtrip(model)
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert loaded.forward.context.targets.keys() == model.forward.context.targets.keys()
