"""Compact masters (Kahan compensation, stochastic rounding) and bf16 moments, against fp32.

Tolerances:

* sub-ulp accumulation: 64 SGD steps of 2**-10 on weights of 1.0 (a quarter of the bf16 ulp
  2**-7, under the half ulp that rounding to nearest loses): plain bf16 stays at 1.0; Kahan's
  weight + compensation equals the fp32 result 1.0625 exactly (every partial sum is
  representable); stochastic rounding's mean over 4096 weights is within 5 standard deviations
  of 1.0625 (sd = 2**-7 * sqrt(64 * p(1-p)) / sqrt(4096) per weight path, p = 1/4).
* unbiasedness of stochastic rounding: mean rounding error over 2**16 draws within 5 standard
  deviations (sqrt(p(1-p)/N) ulps) of zero, for values at several fractions of an ulp.
* a skipped step (inf gradient) leaves weights, compensation, moments and the rounding
  generator bitwise equal; a resumed run equals the uninterrupted one bitwise.
"""

import copy

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.commands.plan import plan_report
from mixprec.masters.rounding import RoundingGenerator, noise16, stochastic_round
from mixprec.optim import CompactMasterOptimizer
from mixprec.optim.states import COMPENSATION_KEY, REMAINDER_KEY
from mixprec.parallel.plan import plan

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")

MASTERS = ("split", "kahan", "stochastic")
BUFFERED = ("split", "kahan")  # the methods with a per-parameter buffer
STATES = ("fp32", "bf16")


def bf16_weights(n=4096, value=1.0):
    return nn.Parameter(torch.full((n,), value, dtype=torch.bfloat16))


# -- sub-ulp accumulation -------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, "auto"])
@pytest.mark.parametrize("master", MASTERS)
def test_updates_below_half_an_ulp_accumulate_as_in_fp32(master, fused):
    w = bf16_weights()
    opt = CompactMasterOptimizer(torch.optim.SGD([w], lr=2.0 ** -10), master, fused=fused)
    plain = bf16_weights()
    plain_opt = torch.optim.SGD([plain], lr=2.0 ** -10)
    for _ in range(64):
        w.grad = torch.full_like(w, -1.0)
        plain.grad = torch.full_like(plain, -1.0)
        opt.step()
        plain_opt.step()
    assert torch.equal(plain, torch.ones_like(plain))  # round to nearest lost every update
    value = opt.fp32_values()[w]
    if master in BUFFERED:
        assert torch.equal(value, torch.full_like(value, 1.0625))
        assert torch.equal(w, torch.full_like(w, 1.0625))
    else:
        sd = 2.0 ** -7 * (64 * 0.25 * 0.75) ** 0.5 / 4096 ** 0.5
        assert abs(value.mean().item() - 1.0625) < 5 * sd


# -- stochastic rounding --------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [1 / 3, 0.5, 0.01, 0.9])
@pytest.mark.parametrize("base", [1.0, -3.0, 1e-30])
def test_stochastic_rounding_is_unbiased(base, fraction):
    lo = torch.tensor(base, dtype=torch.bfloat16).float()
    hi = torch.nextafter(lo.bfloat16(), torch.tensor(float("inf"), dtype=torch.bfloat16)).float()
    if base < 0:  # towards zero is "down" in magnitude for negatives
        hi = torch.nextafter(lo.bfloat16(), torch.tensor(0.0, dtype=torch.bfloat16)).float()
    x = torch.full((2 ** 16,), (lo + fraction * (hi - lo)).item())
    fraction = ((x[0] - lo) / (hi - lo)).item()  # the fraction x really sits at in fp32
    r = stochastic_round(x, RoundingGenerator(7).keys(1)[0]).float()
    assert set(r.unique().tolist()) <= {lo.item(), hi.item()}
    err = ((r - x) / (hi - lo)).mean().item()
    sd = (fraction * (1 - fraction) / x.numel()) ** 0.5
    assert abs(err) < 5 * sd + 1e-12


def test_stochastic_rounding_passes_specials_and_keeps_exact_values():
    key = RoundingGenerator().keys(1)[0]
    x = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1.5, -2.0])
    r = stochastic_round(x, key)
    assert torch.equal(r.float(), x)
    assert torch.isnan(stochastic_round(torch.tensor([float("nan")]), key)).all()


def test_random_bits_are_uniform_and_differ_per_key():
    like = torch.empty(2 ** 16)
    a = noise16(torch.tensor(1, dtype=torch.int32), like).float()
    b = noise16(torch.tensor(2, dtype=torch.int32), like).float()
    assert abs(a.mean().item() / 65535 - 0.5) < 0.01
    assert abs(a.std().item() / 65535 - 12 ** -0.5) < 0.01
    assert (a != b).float().mean() > 0.99


@pytest.mark.parametrize("master", MASTERS)
def test_torchs_fused_and_single_tensor_steps_agree(master):
    """``fused=False`` (the inner AdamW's own single-tensor step on the loaded values) and
    ``"auto"`` (torch's fused kernel on them) agree: split and Kahan to the fp32 arithmetic's
    rounding (2^-14 relative: a flipped rounding of the 16-bit state), stochastic rounding to
    an ulp of bf16 where a value an fp32 ulp apart rounds the other way."""
    torch.manual_seed(0)
    base = nn.Linear(32, 32)
    models, opts = [], []
    for fused in (False, "auto"):
        model = copy.deepcopy(base).bfloat16()
        models.append(model)
        opts.append(CompactMasterOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                           master, state_dtype="bf16", fused=fused))
    torch.manual_seed(1)
    grads = [torch.randn(32, 32).bfloat16() for _ in range(4)]
    for g in grads:
        for model, opt in zip(models, opts):
            model.weight.grad, model.bias.grad = g.clone(), g[0].clone()
            opt.step()
    a, b = (opt.fp32_values()[m.weight] for opt, m in zip(opts, models))
    if master == "stochastic":
        torch.testing.assert_close(a, b, rtol=2.0 ** -7, atol=0)
        assert (a != b).float().mean() < 0.01
    else:
        torch.testing.assert_close(a, b, rtol=2.0 ** -14, atol=1e-7)


# -- the bf16 moment stall ------------------------------------------------------------------------
def test_bf16_moments_follow_fp32_where_rounding_to_nearest_stalls():
    """exp_avg_sq with beta2=0.999 from 1.0 towards g^2 = 4: the increment 0.003 is under half a
    bf16 ulp of 1.0 (0.0039): to nearest, the state never moves; stochastically it tracks fp32."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.zeros(4096))
    opt = mp.MasterWeightOptimizer(torch.optim.Adam([p], lr=0.0, betas=(0.9, 0.999)),
                                   state_dtype="bf16", fused=False)
    ref = torch.ones(4096)
    p.grad = torch.full_like(p, 2.0)
    opt.step()
    opt.state[p]["exp_avg_sq"] = torch.ones(4096, dtype=torch.bfloat16)
    nearest = torch.ones(4096, dtype=torch.bfloat16)
    for _ in range(500):
        p.grad = torch.full_like(p, 2.0)
        opt.step()
        ref = ref * 0.999 + 0.001 * 4.0
        nearest = (nearest.float() * 0.999 + 0.001 * 4.0).to(torch.bfloat16)
    state = opt.state[p]["exp_avg_sq"]
    assert state.dtype == torch.bfloat16
    assert torch.equal(nearest, torch.ones_like(nearest))  # stalled
    assert abs(state.float().mean().item() - ref[0].item()) < 0.01 * ref[0].item()


# -- prepare, protocol, skip, resume --------------------------------------------------------------
def make(master, state_dtype, seed=0, opt_cls=torch.optim.AdamW, **kwargs):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    opt = opt_cls(net.parameters(), lr=1e-2, **kwargs)
    return mp.prepare(net, opt, level="O2", dtype="bf16", master=master,
                      state_dtype=state_dtype)


def data(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)


def train(model, opt, scaler, steps, start=0):
    for i in range(start, start + steps):
        x, y = data(i)
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def everything(model, opt):
    return (copy.deepcopy([p.detach() for p in model.parameters()]),
            copy.deepcopy(opt.state_dict()))


def assert_bitwise(a, b):
    pa, sa = a
    pb, sb = b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    torch.testing.assert_close(sa, sb, rtol=0, atol=0)


@pytest.mark.parametrize("state_dtype", STATES)
@pytest.mark.parametrize("master", MASTERS)
def test_prepare_wraps_in_a_compact_optimizer_with_the_policy(master, state_dtype):
    model, opt = make(master, state_dtype)
    assert isinstance(opt, CompactMasterOptimizer)
    assert mp.policy_of(model).master == master
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    comp = opt.compensation(model[0].weight)
    assert (comp is not None) == (master in BUFFERED)
    if comp is not None:
        assert comp.dtype == mp.masters.resolve(master).buffer_dtype(torch.bfloat16)
    train(model, opt, mp.DynamicLossScaler(), 2)
    moments = [v for k, v in opt.state[model[0].weight].items() if k.startswith("exp_avg")]
    assert {m.dtype for m in moments} == {mp.policy_of(model).state_dtype}


@pytest.mark.parametrize("state_dtype", STATES)
@pytest.mark.parametrize("master", MASTERS)
def test_a_skipped_step_leaves_everything_bitwise_untouched(master, state_dtype):
    model, opt = make(master, state_dtype)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    train(model, opt, scaler, 2)
    before = everything(model, opt)
    generator = opt.rounding.state_dict().clone()
    x, y = data(99)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    model[0].weight.grad[0, 0] = float("inf")
    scaler.clip_grad_norm_(opt, 1.0)
    assert scaler.step(opt) is False
    scaler.update()
    opt.zero_grad()
    assert_bitwise(before, everything(model, opt))
    assert torch.equal(generator, opt.rounding.state_dict())


@pytest.mark.parametrize("state_dtype", STATES)
@pytest.mark.parametrize("master", MASTERS)
def test_resume_from_state_dicts_is_bitwise(master, state_dtype):
    model, opt = make(master, state_dtype)
    scaler = mp.DynamicLossScaler()
    train(model, opt, scaler, 3)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
             scaler.state_dict())
    train(model, opt, scaler, 3, start=3)
    model2, opt2 = make(master, state_dtype, seed=5)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    # the buffers made before the load are dropped for the loaded ones (they were kept too:
    # 2 bytes per parameter more, for the rest of the run)
    held = mp.bytes_per_parameter(model, opt)["compensation"]
    assert mp.bytes_per_parameter(model2, opt2)["compensation"] == held
    assert opt2.held_tensors()["compensation"] == []
    scaler2 = mp.DynamicLossScaler()
    scaler2.load_state_dict(saved[2])
    train(model2, opt2, scaler2, 3, start=3)
    assert_bitwise(everything(model, opt), everything(model2, opt2))
    assert mp.bytes_per_parameter(model2, opt2)["compensation"] == held


def test_a_kahan_checkpoint_before_the_first_step_carries_the_initial_compensation():
    model, opt = make("kahan", "fp32")
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    assert any(COMPENSATION_KEY in entry for entry in saved[1]["state"].values())
    model2, opt2 = make("kahan", "fp32", seed=5)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    scaler, scaler2 = mp.DynamicLossScaler(), mp.DynamicLossScaler()
    train(model, opt, scaler, 3)
    train(model2, opt2, scaler2, 3)
    assert_bitwise(everything(model, opt), everything(model2, opt2))


@pytest.mark.parametrize("master", MASTERS)
def test_trainer_save_and_load_resume_bitwise(master, tmp_path):
    def trainer():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
        return mp.Trainer(net, torch.nn.functional.mse_loss,
                          torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                          level="O2", dtype="bf16", master=master, state_dtype="bf16",
                          progress=False)

    batches = [data(i) for i in range(6)]
    whole = trainer()
    whole.fit(batches, epochs=1)
    first = trainer()
    first.fit(batches[:3], epochs=1)
    first.save(tmp_path / "ckpt.pt")
    second = trainer()
    second.load(tmp_path / "ckpt.pt")
    for b in batches[3:]:
        second.train_step([b])
    a, b = (mp.fp32_state_dict(t.model, t.optimizer) for t in (whole, second))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fp32_state_dict_is_weight_plus_compensation_and_loads_back():
    model, opt = make("kahan", "fp32")
    train(model, opt, mp.NoLossScaler(), 3)
    w, c = model[0].weight, opt.compensation(model[0].weight)
    assert c.abs().max() > 0
    state = mp.fp32_state_dict(model)
    assert torch.equal(state["0.weight"], w.float() + c.float())
    assert torch.equal(model.state_dict()["0.weight"], state["0.weight"])
    fresh, fresh_opt = make("kahan", "fp32", seed=3)
    fresh.load_state_dict(state)
    assert torch.equal(fresh[0].weight, w)
    assert torch.equal(fresh_opt.compensation(fresh[0].weight), c)
    plain = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    plain.load_state_dict(state)


def test_the_compensation_starts_as_what_the_cast_lost():
    torch.manual_seed(0)
    net = nn.Linear(8, 8)
    exact = net.weight.detach().clone()
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2",
                          dtype="bf16", master="kahan")
    torch.testing.assert_close(opt.fp32_values()[net.weight], exact, rtol=2.0 ** -16, atol=0)


# max |compensated value - fp32 reference| after 5 steps of lr 1e-3 on weights |w| <= 1/8
# (measured: kahan 3.5e-6 with fp32 moments, 4.2e-5 with bf16 ones; stochastic 2.3e-3, i.e.
# a few bf16 ulps of 1/8, 2**-10)
# split: exact fp32 masters stepped by the same torch step as the reference: bitwise with fp32
# moments; bf16 moments as kahan's.
GENERIC_TOL = {("split", "fp32"): 0.0, ("split", "bf16"): 1e-4,
               ("kahan", "fp32"): 1e-5, ("kahan", "bf16"): 1e-4,
               ("stochastic", "fp32"): 5 * 2.0 ** -10, ("stochastic", "bf16"): 5 * 2.0 ** -10}


@pytest.mark.parametrize("state_dtype", STATES)
@pytest.mark.parametrize("name", ["rmsprop", "adagrad"])
@pytest.mark.parametrize("master", MASTERS)
def test_any_torch_optimizer_runs_through_fp32_copies(master, name, state_dtype):
    cls = {"rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad}[name]
    torch.manual_seed(0)
    w = nn.Parameter(nn.Linear(64, 64).weight.detach().bfloat16())
    ref = nn.Parameter(w.detach().float())
    opt = CompactMasterOptimizer(cls([w], lr=1e-3), master, state_dtype=state_dtype)
    ref_opt = cls([ref], lr=1e-3)
    for i in range(5):
        g = torch.randn(64, 64, generator=torch.Generator().manual_seed(i)).bfloat16()
        w.grad, ref.grad = g, g.float()
        opt.step()
        ref_opt.step()
    err = (opt.fp32_values()[w] - ref.detach()).abs().max().item()
    assert err <= GENERIC_TOL[(master, state_dtype)]
    assert opt.state[w]["step"].item() == 5
    assert (COMPENSATION_KEY in opt.state[w]) == (master == "kahan")
    assert (REMAINDER_KEY in opt.state[w]) == (master == "split")


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
@pytest.mark.parametrize("master", MASTERS)
def test_a_parameter_listed_twice_is_refused_before_the_model_is_cast(master):
    """torch's optimizer steps a parameter listed twice in its groups twice (and warns that
    this will be an error); a compact method steps each weight once, so the two would differ
    silently (half the update of a shared bias): refused, by prepare before it casts the
    model, by the optimizer and by add_param_group."""
    a, b = nn.Linear(4, 8), nn.Linear(8, 8)
    b.bias = a.bias  # shared, and listed through both layers
    model = nn.Sequential(a, b)
    twice = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(8,\) is listed twice.*list each parameter "
                                         r"once"):
        mp.prepare(model, twice, level="O2", dtype="bf16", master=master)
    assert a.weight.dtype == torch.float32 and mp.policy_of(model) is None
    low = nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="listed twice"):
        CompactMasterOptimizer(torch.optim.SGD([low.weight, low.bias, low.weight], lr=0.1),
                               master=master)
    opt = CompactMasterOptimizer(torch.optim.SGD([low.weight], lr=0.1), master=master)
    with pytest.raises(ValueError, match="listed twice"):
        opt.add_param_group({"params": [low.bias, low.bias]})
    assert len(opt.param_groups) == 1


@pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
def test_fp16_kahan_with_loss_scaling_and_the_refusals():
    torch.manual_seed(0)
    net = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="stochastic.*bf16"):
        mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2", dtype="fp16",
                   master="stochastic")
    with pytest.raises(ValueError, match="master_weights=True"):
        mp.prepare(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                   level="O3", dtype="bf16", master="kahan")
    net = nn.Linear(4, 4)
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2",
                          dtype="fp16", master="kahan")
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 10)
    scaler.scale(net(torch.randn(2, 4)).float().sum()).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
    with pytest.raises(RuntimeError, match=r"fp16 gradients of \d+ model parameter"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="closure or a grad_scale"):
        opt.step(lambda: 0.0, grad_scale=torch.tensor(2.0))
    with pytest.raises(RuntimeError, match="wrapped in a CompactMasterOptimizer"):
        opt.inner.step()

@pytest.mark.parametrize("master", MASTERS)
def test_fused_compile_steps_as_auto_any_optimizer(master):
    """A compact step compiles nothing: ``fused="compile"`` is ``"auto"``'s step, bit for bit,
    for torch's fused AdamW and for RMSprop (which has no fused kernel)."""
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                 lambda ps: torch.optim.RMSprop(ps, lr=1e-2)):
        runs = []
        for fused in ("auto", "compile"):
            torch.manual_seed(0)
            net = nn.Linear(8, 8).bfloat16()
            opt = CompactMasterOptimizer(make(net.parameters()), master, fused=fused)
            for i in range(3):
                net(torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
                    .bfloat16()).float().sum().backward()
                opt.step()
                opt.zero_grad()
            runs.append([p.detach().clone() for p in net.parameters()])
        for a, b in zip(*runs):
            assert torch.equal(a, b)


# -- bytes per parameter --------------------------------------------------------------------------
# AdamW, after zero_grad(set_to_none=True): what persists between steps
EXPECTED = {("fp32", "fp32"): 14, ("fp32", "bf16"): 10, ("split", "fp32"): 12,
            ("split", "bf16"): 8, ("kahan", "fp32"): 12, ("kahan", "bf16"): 8,
            ("stochastic", "fp32"): 10, ("stochastic", "bf16"): 6}


@pytest.mark.parametrize("master,state_dtype", list(EXPECTED))
def test_bytes_per_parameter_counts_what_is_held(master, state_dtype):
    """Exact up to Adam's step counters and the rounding generator's state (5 kB per optimizer):
    0.01 bytes per parameter on these 0.5M parameters."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    net, opt = mp.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3), level="O2",
                          dtype="bf16", master=master, state_dtype=state_dtype)
    net(torch.randn(2, 512)).float().sum().backward()
    opt.step()
    held = mp.bytes_per_parameter(net, opt)
    assert held["gradients"] == 2
    opt.zero_grad(set_to_none=True)
    got = mp.bytes_per_parameter(net, opt)
    assert got["gradients"] == 0
    assert got["total"] == pytest.approx(EXPECTED[(master, state_dtype)], abs=0.01)
    assert got["masters"] == (4 if master == "fp32" else 0)
    assert got["compensation"] == (2 if master in BUFFERED else 0)
    # parameters added to the optimizer from outside the model are not the model's bytes (their
    # state inflated optimizer_state: 8 B/param of state read as 126)
    extra = nn.Linear(512, 512).to(torch.bfloat16)
    opt.add_param_group({"params": list(extra.parameters())})
    extra(torch.randn(2, 512).bfloat16()).float().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert mp.bytes_per_parameter(net, opt) == pytest.approx(got, abs=0.01)


def test_plan_knows_the_compact_options():
    n = 1_000_000
    single = {(m, s): plan(n, level="O2", strategy="single", master=m, state_dtype=s)
              for m, s in EXPECTED}
    for key, p in single.items():  # the plan counts the 16-bit gradient too
        assert p.bytes_per_parameter() == EXPECTED[key] + 2
    fsdp = plan(n, level="O2", strategy="fsdp", world=4, master="kahan", state_dtype="bf16")
    assert fsdp.total * 4 / n == 10  # 16-bit shards, compensation and moments sharded
    with pytest.raises(ValueError, match="master-weight level"):
        plan(n, level="O3", master="kahan")
    _, rows, text = plan_report(n, level="O2", strategy="single", world=1,
                                master="stochastic", state_dtype="bf16")
    assert "* single       1  O2 stochastic/bf16" in text
    assert len({(r.master, r.state_dtype) for r in rows}) == 8


def test_fp16_kahan_weights_below_its_normal_range_keep_their_compensation_in_state_dicts():
    """fp16 can't hold half an ulp of a weight under 2^-13, so a Kahan compensation there is a
    whole ulp: the model's state dict still holds weight + compensation (it took such a pair
    for a weight written directly and kept the bare weight: 1009 of 4096 elements here), and a
    resume from plain state dicts is bitwise."""
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        with torch.no_grad():
            model[0].weight.mul_(1e-3)  # most weights under 2^-13
        amp = mp.MixedPrecision(level="O2", dtype="fp16", master="kahan")
        return (amp, *amp.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3,
                                                       momentum=0.9)))

    def train(amp, model, opt, seeds):
        for seed in seeds:
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))
            amp.backward(model(x).float().pow(2).mean())
            amp.step(opt)
            opt.zero_grad()

    amp, model, opt = build()
    train(amp, model, opt, range(5))
    weight = model[0].weight
    assert int(((opt.compensation(weight).abs() > 0) & (weight.abs() < 2 ** -13)).sum()) > 500
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    assert torch.equal(saved["model"]["0.weight"], opt.fp32_values()[weight])
    amp2, model2, opt2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(amp, model, opt, range(5, 8))
    train(amp2, model2, opt2, range(5, 8))
    for a, b in zip(opt.fp32_values().values(), opt2.fp32_values().values()):
        assert torch.equal(a, b)
