import copy

import pytest
import torch
from testmodels import make
from torch import nn

import mixprec as mp
from mixprec.policy import NORM_LAYERS

BF16, FP32 = torch.bfloat16, torch.float32
MODELS = ["mlp", "cnn", "transformer"]
LEVELS = ["O0", "O1", "O2", "O3"]
COMPUTE = (nn.Linear, nn.Conv2d)


def _record_outputs(model):
    seen = {}

    def hook(name):
        def fn(mod, args, out):
            if isinstance(out, torch.Tensor):
                seen[name] = out.dtype
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, COMPUTE + NORM_LAYERS)]
    return seen, handles


def _expected_param_dtype(level, module):
    if level in ("O0", "O1"):
        return FP32
    if level == "O2" and isinstance(module, NORM_LAYERS):
        return FP32
    return BF16


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("level", LEVELS)
def test_dtypes_follow_the_level_table(name, level):
    model, x, _ = make(name)
    model = mp.prepare(model, level=level, dtype="bf16")
    for mod_name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            assert p.dtype == _expected_param_dtype(level, mod), (mod_name, p.dtype)
        for b_name, b in mod.named_buffers(recurse=False):
            if b.is_floating_point():
                assert b.dtype == _expected_param_dtype(level, mod), (mod_name, b_name)
            else:
                assert b.dtype == torch.int64  # num_batches_tracked is never cast
    seen, handles = _record_outputs(model)
    out = model(x)
    for h in handles:
        h.remove()
    compute = {"O0": FP32, "O1": BF16, "O2": BF16, "O3": BF16}[level]
    norm_out = {"O0": FP32, "O1": FP32, "O2": BF16, "O3": BF16}[level]
    for mod_name, mod in model.named_modules():
        if mod_name not in seen:
            continue
        want = norm_out if isinstance(mod, NORM_LAYERS) else compute
        if level == "O1" and isinstance(mod, nn.modules.batchnorm._BatchNorm):
            want = BF16  # torch's mixed kernel: bf16 activations, fp32 statistics and params
        assert seen[mod_name] == want, (mod_name, seen[mod_name], want)
    assert out.dtype == (BF16 if level == "O3" else FP32)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_norm_layers_compute_in_fp32(level):
    """A kept norm layer normalises in fp32: its output is the fp32 result of its input."""
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 4))
    mp.prepare(model, level=level, dtype="bf16")
    seen = {}
    model[1].register_forward_hook(lambda m, a, out: seen.update(x=a[0], out=out))
    model(torch.randn(8, 16) * 100)
    x = seen["x"]
    assert x.dtype == BF16  # what the Linear before it produced
    ln = model[1]
    exact = nn.functional.layer_norm(x.float(), (64,), ln.weight.float(), ln.bias.float())
    if level == "O1":  # the op list runs layer_norm in fp32: the fp32 result itself
        assert seen["out"].dtype == FP32
        torch.testing.assert_close(seen["out"], exact, rtol=0, atol=0)
    else:  # fp32 accumulation with bf16 activations: the fp32 result, rounded (1 ulp)
        assert seen["out"].dtype == BF16
        torch.testing.assert_close(seen["out"].float(), exact, rtol=2 ** -8, atol=1e-5)
        assert (seen["out"] == exact.to(BF16)).float().mean() > 0.99


def test_o2_batchnorm_matches_fp32_normalisation():
    """O2 BatchNorm reads bf16 activations with fp32 statistics: fp32 numbers up to rounding."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(16)
    reference = copy.deepcopy(bn)
    model = nn.Sequential(bn)
    mp.prepare(model, level="O2", dtype="bf16")
    x = (torch.randn(8, 16, 6, 6) * 3 + 1).to(BF16)
    seen = {}
    bn.register_forward_hook(lambda m, a, o: seen.update(out=o))
    model(x)
    out = seen["out"]
    exact = reference(x.float()).to(BF16)
    assert out.dtype == BF16 and bn.running_var.dtype == FP32 and bn.weight.dtype == FP32
    ulp = exact.float().abs().clamp_min(2 ** -126) * 2 ** -7
    assert ((out.float() - exact.float()).abs() <= ulp).all()  # at most one bf16 ulp
    torch.testing.assert_close(bn.running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, reference.running_var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("level", LEVELS)
def test_few_steps_reduce_the_loss(name, level):
    model, x, y = make(name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = mp.prepare(model, opt, level=level, dtype="bf16")
    losses = []
    for _ in range(8):
        loss = nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9, losses


def test_o2_masters_are_fp32_and_model_holds_rounded_masters():
    model, x, y = make("mlp")
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = mp.prepare(model, opt, level="O2", dtype="bf16")
    assert isinstance(opt, mp.MasterWeightOptimizer)
    # the masters start as the exact fp32 weights, not their bf16 rounding
    for p, ref in zip(model.parameters(), reference.parameters()):
        master = opt.master_param(p)
        assert master.dtype == FP32 and torch.equal(master, ref)
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in model.parameters():
        master = opt.master_param(p)
        assert p.dtype == BF16 and torch.equal(p, master.to(BF16))


def test_o2_with_all_fp32_keeps_optimizer_params():
    model, _, _ = make("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, opt = mp.prepare(model, opt, level="O2", dtype="bf16")
    bn_params = {id(p) for p in model.bn1.parameters()}
    inner = [p for g in opt.param_groups for p in g["params"]]
    assert all(id(p) in bn_params or p.dtype == FP32 for p in inner)
    assert any(id(p) in bn_params for p in inner)  # fp32 norm params are stepped directly


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, t):
        return self.head(self.embed(t))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_tied_weight_is_one_tensor_in_the_state_dict(level):
    """Both keys hold one fp32 tensor (O3 made an upcast per key: safetensors and
    save_pretrained wrote the tied weight twice)."""
    model = mp.prepare(Tied(), level=level, dtype="bf16")
    state = model.state_dict()
    assert state["embed.weight"].dtype == FP32
    assert state["head.weight"].untyped_storage().data_ptr() == \
        state["embed.weight"].untyped_storage().data_ptr()


def test_tied_parameters_are_cast_once():
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mp.prepare(model, opt, level="O2", dtype="bf16")
    assert model.head.weight is model.embed.weight and model.head.weight.dtype == BF16
    assert sum(len(g["params"]) for g in opt.param_groups) == 1
    loss = model(torch.tensor([[1, 2, 3]])).float().logsumexp(-1).sum()
    loss.backward()
    opt.step()
    assert torch.equal(model.embed.weight, opt.master_param(model.embed.weight).to(BF16))


def test_keep_fp32_by_type_and_name():
    model, x, _ = make("mlp")
    mp.prepare(model, level="O2", dtype="bf16", keep_fp32=["4"])
    assert model[4].weight.dtype == FP32 and model[0].weight.dtype == BF16
    seen, _ = _record_outputs(model)
    model(x)
    assert seen["4"] == FP32  # an fp32 module's output is fp32
    model2, _, _ = make("mlp")
    mp.prepare(model2, level="O3", dtype="bf16", keep_fp32=nn.Linear)
    assert all(p.dtype == FP32 for p in model2.parameters())


def test_policy_of_and_prepare_twice():
    model, _, _ = make("mlp")
    assert mp.policy_of(model) is None
    mp.prepare(model, level="O1", dtype="bf16")
    assert str(mp.policy_of(model)) == "O1(params=fp32,compute=bf16,output=fp32,master=none)"
    with pytest.raises(RuntimeError, match="already prepared"):
        mp.prepare(model, level="O2", dtype="bf16")


@pytest.mark.parametrize("bad", [None, "model", 3])
def test_policy_of_refuses_what_is_not_a_module(bad):
    with pytest.raises(TypeError, match=f"policy_of takes an nn.Module.*got {type(bad).__name__}"):
        mp.policy_of(bad)


def test_prepared_model_still_trains_under_state_dict_round_trip():
    model, x, _ = make("mlp")
    mp.prepare(model, level="O2", dtype="bf16")
    sd = model.state_dict()
    assert all(v.dtype == FP32 for v in sd.values())  # the exact upcasts of the bf16 weights
    fresh, _, _ = make("mlp")
    mp.prepare(fresh, level="O2", dtype="bf16").load_state_dict(sd)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("master", ["fp32", "split"])
def test_a_load_into_a_sub_module_sets_its_masters_exactly(master):
    """``model[0].load_state_dict(pretrained)`` after prepare (a backbone loaded for
    fine-tuning) rounded the values into the bf16 weights and the masters took that rounding
    (8.9e-4 off the loaded values, for good); a load through the model was exact. Both are
    exact now, and a deep copy's sub-module loads into the copy only."""
    def mlp(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    pretrained = mlp(1)
    model = mlp(0)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0), level="O2",
                            dtype="bf16", master=master)
    copied = copy.deepcopy(model)
    model[0].load_state_dict(pretrained[0].state_dict())
    model(torch.randn(4, 8)).float().sum().backward()
    opt.step()  # lr 0: nothing moves
    for name in ("weight", "bias"):
        assert torch.equal(model.state_dict()[f"0.{name}"], getattr(pretrained[0], name))
        assert torch.equal(getattr(model[0], name),
                           getattr(pretrained[0], name).to(torch.bfloat16))
    assert torch.equal(copied.state_dict()["0.weight"], mlp(0)[0].weight)
    copied[0].load_state_dict(pretrained[0].state_dict())
    assert torch.equal(copied.state_dict()["0.weight"], pretrained[0].weight)
    for keep_vars in (False, True):  # its own (16-bit) state dict back: the masters as they were
        copied[0].load_state_dict(copied[0].state_dict(keep_vars=keep_vars))
        assert torch.equal(copied.state_dict()["0.weight"], pretrained[0].weight)
    half = {k: v.half() for k, v in pretrained[0].state_dict().items()}  # an fp16 checkpoint:
    copied[0].load_state_dict(half)                                      # exact in the masters
    assert torch.equal(copied.state_dict()["0.weight"], half["weight"].float())


@pytest.mark.parametrize("how", ["sub-module", "model"])
def test_kahan_pairs_hold_loaded_fp16_values_exactly(how):
    """A Kahan pair kept a stale compensation where the loaded 16-bit value minus it was a bf16
    number; the weight was then no nearest rounding of the pair, the step's check took it as
    a direct write and dropped the compensation: values up to 100% off (6.5e-5 read back as
    -1.7e-6). fp16 values (11 bits) fit a pair (about 16): held exactly, through a step."""
    torch.manual_seed(7)
    values = {k: v.half() for k, v in nn.Linear(64, 64).state_dict().items()}
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64))
    model, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.0), level="O2",
                            dtype="bf16", master="kahan")
    if how == "sub-module":
        model[0].load_state_dict(values)
    else:
        model.load_state_dict({"0." + k: v for k, v in values.items()})
    model(torch.randn(2, 64)).float().sum().backward()
    opt.step()  # lr 0
    assert torch.equal(model.state_dict()["0.weight"], values["weight"].float())


def test_a_sub_module_called_in_a_custom_backward_computes_in_its_dtype():
    """Outside torch's checkpoint, a prepared sub-module called from a custom autograd
    Function's backward gets its region's autocast (the recomputation rule kept the state of
    the backward's call: fp32 at O1, a dtype error at O2)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1), nn.Linear(8, 8))
    model, _ = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2",
                          dtype="bf16", fp32_ops=["softmax"])
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(model[0](g).dtype)
            return g

    Probe.apply(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert seen == [torch.bfloat16]


def test_custom_op_lists_through_prepare():
    model, x, _ = make("mlp")
    mp.prepare(model, level="O1", dtype="bf16", fp32_ops=["linear"])
    seen, _ = _record_outputs(model)
    model(x)
    assert set(seen.values()) == {FP32}
    with pytest.raises(ValueError, match="autocast"):
        mp.prepare(make("mlp")[0], level="O3", dtype="bf16", fp32_ops=["linear"])


# ---------------------------------------------------------------- to_float

def test_to_float_mindspore_pattern_inner_wins_either_order():
    for order in ("outer-first", "inner-first"):
        net, x, _ = make("mlp")
        if order == "outer-first":
            mp.to_float(net, "bf16")
            mp.to_float(net[4], "fp32")
        else:
            mp.to_float(net[4], "fp32")
            mp.to_float(net, "bf16")
        # the storage stays fp32 (to_float casts at compute, as MindSpore does)
        assert net[0].weight.dtype == FP32 and net[4].weight.dtype == FP32, order
        with mp.debug.op_stats() as stats:
            out = net(x)
        # net[0] and net[2] multiply in bf16, net[4] in fp32, and its fp32 output is the net's
        assert stats.count(op="addmm", dtype="bf16") == 2, order
        assert stats.count(op="addmm", dtype="fp32") == 1, order
        assert out.dtype == FP32


def test_to_float_runs_exactly_in_dtype_even_under_autocast():
    layer = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(2))
    mp.to_float(layer, "fp32")
    x = torch.tensor([[1.0 + 2 ** -12, 1.0]])
    with mp.autocast("bf16", device_type="cpu"):
        assert layer(x)[0, 0].item() == 1.0 + 2 ** -12


def test_to_float_then_prepare_respects_marks():
    net, x, _ = make("mlp")
    mp.to_float(net[0], "fp32")
    mp.prepare(net, level="O2", dtype="bf16")
    assert net[0].weight.dtype == FP32 and net[2].weight.dtype == BF16
    assert net(x).dtype == FP32
    with pytest.raises(RuntimeError, match="before mp.prepare"):
        mp.to_float(net[2], "fp32")


# ---------------------------------------------------------------- bad input

def test_bad_input():
    model, _, _ = make("mlp")
    with pytest.raises(ValueError, match="'O0', 'O1', 'O2', 'O3'; got 'O4'"):
        mp.prepare(model, level="O4")
    with pytest.raises(ValueError, match="fp12"):
        mp.prepare(model, level="O2", dtype="fp12")
    with pytest.raises(TypeError, match="nn.Module"):
        mp.prepare(lambda x: x, level="O1")
    other = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="not parameters of the model"):
        mp.prepare(model, torch.optim.SGD(other.parameters(), lr=0.1), level="O2", dtype="bf16")
    with pytest.raises(TypeError, match="optimizer"):
        mp.prepare(model, "sgd", level="O2", dtype="bf16")
    with pytest.raises(ValueError, match="unknown op name"):
        mp.prepare(model, level="O1", dtype="bf16", fp32_ops=["nope"])
    with pytest.raises(ValueError, match="both"):
        mp.prepare(model, level="O1", dtype="bf16", fp32_ops=["add"], low_precision_ops=["add"])
    with pytest.raises(ValueError, match="floating"):
        mp.to_float(model, torch.int32)
    with pytest.raises(TypeError, match="nn.Module"):
        mp.to_float("model", "bf16")
    assert mp.policy_of(model) is None and all(p.dtype == FP32 for p in model.parameters())


def test_prepared_model_deepcopies_and_pickles():
    import io
    model, x, _ = make("mlp")
    mp.prepare(model, level="O2", dtype="bf16")
    clone = copy.deepcopy(model)
    assert clone.forward.module is clone  # the wrapper follows the copy
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert str(mp.policy_of(loaded)) == str(mp.policy_of(model))
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fp16_levels_run_and_train(level):
    model, x, y = make("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = mp.prepare(model, opt, level=level, dtype="fp16")
    out = model(x)
    assert out.dtype == (torch.float16 if level == "O3" else FP32)
    assert model.conv1.weight.dtype == (FP32 if level == "O1" else torch.float16)
    loss0 = nn.functional.cross_entropy(out.float(), y)
    loss0.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


class Rotary(nn.Module):
    """A rotary embedding's frequencies (a non-persistent buffer, as Hugging Face's Llama keeps
    them) beside a persistent floating buffer and a projection."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8),
                             persistent=False)
        self.register_buffer("scale", torch.full((8,), 0.3))

    def forward(self, x, positions):
        angles = positions.float()[:, None] * self.inv_freq.float()[None, :]
        rot = torch.cat([angles.cos(), angles.sin()], dim=-1)
        return self.proj(x * self.scale) * rot


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_non_persistent_buffer_stays_fp32_under_autocast(level):
    """O2 keeps a derived constant (a non-persistent buffer: rotary frequencies) in fp32, where
    bf16 put a Llama's rotary angle at position 8191 1.5 rad off; a persistent buffer is cast
    as before, and O3 (pure 16-bit, no autocast) casts both."""
    model = mp.prepare(Rotary(), level=level, dtype="bf16")
    assert model.inv_freq.dtype == (torch.float32 if level == "O2" else torch.bfloat16)
    assert model.scale.dtype == torch.bfloat16
    assert "inv_freq" not in model.state_dict()
    positions = torch.arange(8192)
    angles = positions.float()[:, None] * model.inv_freq.float()[None, :]
    exact = positions.float()[:, None] * Rotary().inv_freq[None, :]
    worst = float((angles - exact).abs().max())
    assert (worst == 0.0) if level == "O2" else (worst > 0.1)
    out = model(torch.randn(8192, 8), positions)
    assert torch.isfinite(out).all()


def test_a_pure_16_bit_model_cast_to_fp32_computes_in_fp32():
    """O3 casts the inputs to its dtype without autocast: after ``model.float()`` (to evaluate
    or export in fp32) they follow the parameters (the first GEMM raised a dtype mismatch)."""
    torch.manual_seed(0)
    model = mp.prepare(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
                       level="O3", dtype="bf16")
    x = torch.randn(4, 16)
    assert model(x).dtype == torch.bfloat16
    plain = copy.deepcopy(model).float()
    model.float()
    assert model[0].weight.dtype == torch.float32
    out = model(x)
    assert out.dtype == torch.float32
    with torch.no_grad():
        expected = model[2](torch.relu(model[0](x)))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert plain(x).dtype == torch.float32


class SeqCheckpointed(nn.Module):
    def __init__(self, checkpointed):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                                  nn.LayerNorm(16), nn.Linear(16, 4))
        self.checkpointed = checkpointed

    def forward(self, x):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint_sequential(self.body, 2, x,
                                                                use_reentrant=False)
        return self.body(x)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_checkpoint_sequential_inside_a_forward_computes_as_the_plain_forward(level):
    """``checkpoint_sequential`` over a Sequential inside the model's forward: the same outputs
    and gradients as the plain forward, bit for bit, at every level."""
    runs = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = mp.prepare(SeqCheckpointed(checkpointed), level=level, dtype="bf16")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        out = model(x)
        out.float().pow(2).sum().backward()
        runs.append((out.detach(), [p.grad for p in model.parameters()]))
    (a, ga), (b, gb) = runs
    assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(torch.equal(g, h) for g, h in zip(ga, gb))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_an_fp64_model_at_a_16_bit_level_is_refused(level):
    """``model.double()`` prepared at O2/O3 kept every weight fp64 (fp64 is left alone, as by
    torch.autocast) while its policy said 16 bits, and failed at the first matmul of its
    16-bit inputs ("mat1 and mat2 must have the same dtype"); refused up front. O1 keeps it,
    and an fp64 parameter beside fp32 ones stays fp64 at O2."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match=r"every floating parameter .* float64 \(4 of them\)"
                       r".*model\.float\(\)"):
        mp.prepare(model, level=level, dtype="bf16")
    assert mp.prepare(model, level="O1", dtype="bf16")[0].weight.dtype == torch.float64
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).double())
    mixed = mp.prepare(mixed, level="O2", dtype="bf16")
    assert mixed[0].weight.dtype == torch.bfloat16 and mixed[1].weight.dtype == torch.float64


def test_preparing_a_model_around_a_prepared_one_is_refused():
    """A model holding a sub-module prepared at O2 (or a sub-module of a prepared model) was
    accepted: its masters started from the bf16 rounding and its state_dict came from the first
    prepare's stale masters (9.4e-4 off after 20 steps)."""
    torch.manual_seed(0)
    child = nn.Linear(4, 4)
    child_opt = torch.optim.SGD(child.parameters(), lr=0.1)
    mp.prepare(child, child_opt, level="O2", dtype="bf16")
    parent = nn.Sequential(nn.Linear(4, 4), child)
    with pytest.raises(RuntimeError, match=r"sub-module '1' was prepared already, with an "
                                           r"optimizer that keeps its masters"):
        mp.prepare(parent, torch.optim.SGD(parent.parameters(), lr=0.1), level="O2",
                   dtype="bf16")
    model = mp.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), level="O3", dtype="bf16")
    with pytest.raises(RuntimeError, match="this module is part of a prepared model"):
        mp.prepare(model[1], level="O2", dtype="bf16")
    # a prepare that casts no parameters may wrap one that cast none (apex's O1 tests do)
    inner = mp.prepare(nn.Linear(4, 4), level="O1", dtype="bf16")
    outer = mp.prepare(nn.Sequential(inner), level="O1", dtype="bf16")
    assert outer(torch.randn(2, 4)).dtype == torch.float32
    # models sharing a part, prepared with one optimizer (apex's initialize([m1, m2], opt))
    from mixprec.compat import apex_amp
    shared = nn.Linear(4, 4)
    m1, m2 = nn.Sequential(shared, nn.Linear(4, 2)), nn.Sequential(shared, nn.Linear(4, 3))
    opt = torch.optim.SGD(list(m1.parameters()) + list(m2[1].parameters()), lr=0.1)
    (m1, m2), opt = apex_amp.initialize([m1, m2], opt, opt_level="O2", verbosity=0)
    assert m2(torch.randn(2, 4)).shape == (2, 3)


@pytest.mark.parametrize("master", ["fp32", "split", "kahan"])
def test_the_model_keeps_its_fp32_values_when_the_optimizer_is_collected(master):
    """A training function that returns the model alone: once the optimizer was collected the
    model's state_dict() (and mp.fp32_state_dict) held the 16-bit weights upcast, 9.3e-4 off
    the masters (split's and Kahan's exact values lost for good); mp.fp32_state_dict of a
    module holding the prepared model ignored its masters. A copy made with its optimizer
    keeps them too once the copied optimizer is gone."""
    import copy
    import gc

    def fit():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = mp.prepare(model, opt, level="O2", dtype="bf16", master=master)
        for _ in range(3):
            model(torch.randn(16, 8)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = fit()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert not torch.equal(want["0.weight"], model[0].weight.float())  # (fp32 values)
    outer = nn.ModuleDict({"net": model})
    assert all(torch.equal(v, want[k[len("net."):]])
               for k, v in mp.fp32_state_dict(outer).items())
    twin, twin_opt = copy.deepcopy((model, opt))
    del opt, twin_opt
    gc.collect()
    for m in (model, twin):
        assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
        assert all(torch.equal(v, want[k]) for k, v in mp.fp32_state_dict(m).items())


@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_an_optimizer_collected_inside_a_trace_records_nothing_there(master):
    """The collector may finalize an optimizer while someone else traces (``torch.export``'s
    modes, a dispatch mode): handing its fp32 values to the model ran ops and a grad-mode
    change that the trace recorded (``torch.export`` failed with ``KeyError:
    _set_grad_enabled``); now the trace sees nothing, and the model keeps the values."""
    import gc

    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    def recorder(base, hook: str):
        """A ``base`` mode that records every call it sees (its ``hook`` method)."""
        def record(self, func, types, args=(), kwargs=None):
            self.calls.append(func)
            return func(*args, **(kwargs or {}))
        mode = type("Recorder", (base,), {hook: record})()
        mode.calls = []
        return mode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            level="O2", dtype="bf16", master=master)
    model(torch.randn(4, 8)).float().square().mean().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    functions = recorder(TorchFunctionMode, "__torch_function__")
    ops = recorder(TorchDispatchMode, "__torch_dispatch__")
    with functions, ops:
        del opt
        gc.collect()
    assert functions.calls == [] and ops.calls == []
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("master", ["fp32", "split"])
def test_a_load_with_assign_is_refused_on_a_prepared_model(master):
    """assign=True replaced the parameters: fp32 ones with fp32 masters (the optimizer then
    stepped tensors no longer in the model), split's kept bf16 but unlinked (the loaded fp32
    precision dropped)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    model, _ = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level="O2",
                          dtype="bf16", master=master)
    for target, values in ((model, sd), (model[0], {k[2:]: v for k, v in sd.items()
                                                    if k.startswith("0.")})):
        with pytest.raises(RuntimeError, match=r"load_state_dict\(assign=True\) into a "
                                               r"prepared model"):
            target.load_state_dict(values, assign=True)
    model.load_state_dict(sd)  # without assign=: exact
    assert torch.equal(model.state_dict()["0.weight"], sd["0.weight"])


def test_an_optimizer_of_several_models_leaves_each_its_own_values():
    """apex's initialize([A, B], [oa, ob]) links every model to every optimizer: when B's
    optimizer was collected, A's companions took B's masters too (a full fp32 copy of B held
    for as long as A lived)."""
    import gc

    from mixprec.compat import apex_amp
    from mixprec.statedict import companions_of
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b))
    (a, b), (oa, ob) = apex_amp.initialize([a, b], [oa, ob], opt_level="O2", verbosity=0)
    del ob
    gc.collect()
    own = {id(p) for p in a.parameters()}
    assert all(id(p) in own for p in companions_of(a).pairs())
