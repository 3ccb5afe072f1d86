"""mp.MixedPrecision: one engine, the step order once, the same numbers as mp.Trainer."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

OVERFLOW_AT = 2


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def data(n=6):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]
    x, y = batches[OVERFLOW_AT]
    batches[OVERFLOW_AT] = (x, torch.full_like(y, float("nan")))  # NaN gradients: it must skip
    return batches


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_manual_loop_on_the_engine_is_bitwise_the_trainer(level, dtype):
    batches = data()
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    trainer = mp.Trainer(model, F.mse_loss, opt, level=level, dtype=dtype, loss_scale="dynamic",
                         scheduler=sched, max_grad_norm=0.5, progress=False)
    history = trainer.fit(batches)

    model2 = net()
    amp = mp.MixedPrecision(level=level, dtype=dtype, loss_scale="dynamic")
    model2, opt2 = amp.setup(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2))
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.9)
    applied = []
    for x, y in batches:
        amp.backward(F.mse_loss(model2(x), y))
        applied.append(amp.step(opt2, max_grad_norm=0.5))
        opt2.zero_grad()
        if applied[-1]:
            sched2.step()
    assert applied == [not s for s in history.skipped] and applied[OVERFLOW_AT] is False
    for p, q in zip(trainer.model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert amp.scaler.get_scale() == trainer.scaler.get_scale()
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_several_optimizers_and_models_share_one_scaler_that_updates_once_per_step():
    """A GAN's shape: two networks, two optimizers, one engine."""
    gen, disc = net(), net()
    amp = mp.MixedPrecision(level="O2", dtype="fp16", loss_scale=2.0 ** 10)
    gen, opt_g = amp.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.1))
    disc, opt_d = amp.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1))
    assert isinstance(opt_g, mp.MasterWeightOptimizer) and len(amp.models) == 2
    before = [p.detach().clone() for p in disc.parameters()]
    x = torch.randn(4, 8)
    amp.backward(gen(x).float().mean() + disc(x).float().mean() * float("inf"))
    assert amp.step(opt_g, opt_d) is False  # the discriminator overflowed
    assert all(torch.equal(p, q) for p, q in zip(disc.parameters(), before))
    assert amp.scaler.skipped_steps == 1 and amp.scaler.applied_steps == 1


def test_one_model_with_two_optimizers_gets_masters_for_both():
    model = net()
    first, rest = list(model[0].parameters()), list(model[1:].parameters())
    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    model, a, b = amp.setup(model, torch.optim.SGD(first, lr=0.1), torch.optim.Adam(rest))
    assert model[0].weight.dtype == torch.bfloat16
    assert a.master_param(model[0].weight).dtype == torch.float32
    state = model.state_dict()
    assert torch.equal(state["0.weight"], a.master_param(model[0].weight))
    assert torch.equal(state["3.weight"], b.master_param(model[3].weight))


def test_state_dict_round_trips_and_another_policy_is_refused_showing_both():
    amp = mp.MixedPrecision(level="O2", dtype="fp16")
    model = net()
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    amp.backward(model(torch.randn(4, 8)).float().mean())
    amp.step(opt)
    state = amp.state_dict()
    again = mp.MixedPrecision(level="O2", dtype="fp16")
    again.load_state_dict(copy.deepcopy(state))
    assert again.scaler.state_dict() == amp.scaler.state_dict()
    other = mp.MixedPrecision(level="O1", dtype="fp16")
    with pytest.raises(ValueError, match=r"made under the policy O2\(params=fp16.*but this run "
                                         r"uses O1\(params=fp32"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"keys \['policy', 'scaler'\]"):
        again.load_state_dict({"scaler": state["scaler"]})


def test_bad_input_is_refused_clearly():
    amp = mp.MixedPrecision(level="O2")  # dtype auto: resolved on the model's device
    assert amp.policy is None
    with pytest.raises(RuntimeError, match=r"call setup\(model, optimizer\) first"):
        amp.backward(torch.ones((), requires_grad=True))
    with pytest.raises(ValueError, match="'O0', 'O1', 'O2', 'O3'; got 'O5'"):
        mp.MixedPrecision(level="O5")
    with pytest.raises(ValueError, match="not both"):
        mp.MixedPrecision(level="O2", policy=mp.Policy())
    with pytest.raises(TypeError, match="policy must be a mixprec.Policy"):
        mp.MixedPrecision(policy="O2")
    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    model = net()
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="needs the optimizer"):
        amp.step()
    for wrong in (model, None, "opt"):  # (an AttributeError deep inside the step)
        with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
            amp.step(wrong)
    with pytest.raises(ValueError, match="max_grad_norm must be None or a positive finite"):
        amp.step(opt, max_grad_norm=-1)
    with pytest.raises(RuntimeError, match="already prepared"):
        amp.setup(model)
    with pytest.raises(TypeError, match="nn.Module"):
        amp.setup("model")


@pytest.mark.parametrize("kwargs,match", [
    ({"loss_scale": "dyn"}, "loss scaler spec must be"),
    ({"loss_scale": -5}, "scale must be positive"),
    ({"master": "fp16"}, "master must be one of"),
    ({"state_dtype": "int8"}, "state_dtype must be one of")])
def test_dtype_auto_refuses_at_construction_what_no_dtype_takes(kwargs, match):
    """dtype="auto" resolves at setup; an option no dtype could take is refused now, as with
    an explicit dtype (it was accepted until setup)."""
    with pytest.raises(ValueError, match=match):
        mp.MixedPrecision(level="O2", **kwargs)
    assert mp.MixedPrecision(level="O2", master="stochastic", state_dtype="bf16").policy is None


def test_a_step_before_setup_is_refused_saying_to_set_up():
    amp = mp.MixedPrecision(level="O1", dtype="bf16")
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"set up no model: write model, opt = "
                                           r"amp.setup\(model, opt\) first"):
        amp.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_an_o3_clip_measures_the_norm_in_fp32(dtype):
    """Finite fp16 gradients whose total norm (128000) is beyond fp16's 65504: torch's clip
    measured it in fp16 (inf), zeroed every gradient and the step applied nothing; a bf16
    norm was a bf16 rounding of the true one."""
    amp = mp.MixedPrecision(level="O3", dtype=dtype, loss_scale=1.0)
    model = nn.Linear(64, 64, bias=False)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    amp.backward(model(torch.ones(1, 64, dtype=model.weight.dtype)).float().sum())
    model.weight.grad.fill_(2000.0)  # finite, the total beyond fp16's range
    before = model.weight.detach().float().clone()
    norm = amp.clip_grad_norm_(opt, 1.0)
    assert norm.dtype == torch.float32 and float(norm) == 128000.0
    assert amp.step(opt)
    moved = (model.weight.detach().float() - before).norm()
    assert float(moved) == pytest.approx(1.0, rel=1e-2)


def test_a_sparse_gradient_s_norm_sums_its_repeated_indices():
    """An embedding's sparse gradient holds a row once per use: the norm is of the summed rows
    (it was of the uncoalesced values: 0.8871 for 0.8894 here)."""
    torch.manual_seed(0)
    amp = mp.MixedPrecision(level="O0")
    model = nn.Embedding(10, 4, sparse=True)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    amp.backward(model(torch.tensor([1, 1, 2, 1])).sum() * 0.1)
    true = model.weight.grad.to_dense().norm()
    assert torch.equal(amp.grad_norm(opt), true)


def test_backward_of_several_losses_says_what_to_write():
    amp = mp.MixedPrecision(level="O1", dtype="bf16")
    model = amp.setup(net())
    loss = model(torch.randn(2, 8)).float().sum()
    with pytest.raises(TypeError, match=r"one loss tensor; got list: .*amp.backward\(l1 \+ l2\)"):
        amp.backward([loss, loss])


def _backward_once(level, dtype, loss_scale, master=None):
    amp = mp.MixedPrecision(level=level, dtype=dtype, loss_scale=loss_scale, master=master)
    model = net()
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    x, y = data()[0]
    amp.backward(F.mse_loss(model(x), y) * 100)  # gradients of a few units: the clip bites
    scale = amp.scaler.get_scale() if amp.scaler.is_enabled() else 1.0
    true = {n: p.grad.float() / scale for n, p in model.named_parameters()}
    before = {k: v.clone() for k, v in mp.fp32_state_dict(model).items()}
    return amp, model, opt, true, before


CLIP_CASES = [("O1", "fp16", 1024.0), ("O2", "fp16", 1024.0), ("O2", "bf16", None)]


@pytest.mark.parametrize("level, dtype, loss_scale, master, atol", [
    *(case + (None, 1e-6) for case in CLIP_CASES),
    ("O2", "fp16", 1024.0, "kahan", 1e-6),  # the fp32 copies of the 16-bit gradients clamped
    ("O2", "bf16", None, "split", 1e-6),
    ("O2", "bf16", None, "kahan", 3e-5),  # a bf16 compensation: about 16 significant bits
])
def test_clip_grad_value_clamps_the_true_gradients_the_step_uses(level, dtype, loss_scale,
                                                                 master, atol):
    amp, model, opt, true, before = _backward_once(level, dtype, loss_scale, master)
    assert not amp.is_unscaled(opt)
    amp.clip_grad_value_(opt, 0.05)
    assert amp.is_unscaled(opt)
    assert amp.step(opt) is True and not amp.is_unscaled(opt)
    after = mp.fp32_state_dict(model)
    assert any((g.abs() > 0.05).any() for g in true.values())
    for name, grad in true.items():  # SGD(lr=1): the update is minus the clamped true gradient
        torch.testing.assert_close(after[name], before[name] - grad.clamp(-0.05, 0.05),
                                   rtol=0, atol=atol)


@pytest.mark.parametrize("level, dtype, loss_scale", CLIP_CASES)
def test_grad_norm_is_the_true_norm_before_and_after_unscaling(level, dtype, loss_scale):
    amp, model, opt, true, _ = _backward_once(level, dtype, loss_scale)
    expected = torch.stack([g.norm() for g in true.values()]).norm()
    torch.testing.assert_close(amp.grad_norm(opt), expected, rtol=1e-5, atol=0)
    amp.unscale_(opt)
    torch.testing.assert_close(amp.grad_norm(opt), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("level, dtype, loss_scale", CLIP_CASES)
def test_after_clip_grad_norm_torch_code_reads_what_the_step_uses(level, dtype, loss_scale):
    """At O2 the clip was folded into the step: ``p.grad`` read 10.8 against a clip of 1 (fp16:
    still scaled). Now the clipped, true gradients are read (the model's rounded to 16 bits),
    and the update is bitwise the one of a clip inside the step (``max_grad_norm``)."""
    amp, model, opt, true, before = _backward_once(level, dtype, loss_scale)
    total = amp.clip_grad_norm_(opt, 1.0)
    assert total.item() > 2.0
    stepped = [p.grad for g in opt.param_groups for p in g["params"]]
    torch.testing.assert_close(torch.stack([g.float().norm() for g in stepped]).norm(),
                               torch.tensor(1.0), rtol=1e-5, atol=0)
    for name, p in model.named_parameters():  # 16-bit gradients: the fp32 ones rounded
        torch.testing.assert_close(p.grad.float(), true[name] / total, rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(amp.grad_norm(opt), torch.tensor(1.0), rtol=1e-5, atol=0)
    assert amp.step(opt) is True
    amp2, again, opt2, _, _ = _backward_once(level, dtype, loss_scale)
    amp2.step(opt2, max_grad_norm=1.0)
    ours, theirs = mp.fp32_state_dict(model), mp.fp32_state_dict(again)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


CLIP_PATHS = {
    "step(max_grad_norm)": lambda amp, opt: amp.step(opt, max_grad_norm=1.0),
    "clip_grad_norm_": lambda amp, opt: (amp.clip_grad_norm_(opt, 1.0), amp.step(opt)),
    "unscale_ + clip_grad_norm_": lambda amp, opt: (amp.unscale_(opt),
                                                    amp.clip_grad_norm_(opt, 1.0), amp.step(opt)),
    "clip_grad_value_": lambda amp, opt: (amp.clip_grad_value_(opt, 0.05), amp.step(opt)),
}


@pytest.mark.parametrize("path", CLIP_PATHS)
def test_every_clip_steps_split_bit_for_bit_as_fp32_masters(path):
    """One clipping path for every method: each clip acts on fp32 gradients (fp32 masters', a
    compact optimizer's fp32 copies of its 16-bit ones), so split's masters stay fp32 masters'
    bit for bit (clipped in bf16, they were 5e-5 apart)."""
    kept = []
    for master in ("fp32", "split"):
        amp, model, opt, _, _ = _backward_once("O2", "bf16", None, master)
        CLIP_PATHS[path](amp, opt)
        kept.append(mp.fp32_state_dict(model, opt))
    assert all(torch.equal(kept[0][k], kept[1][k]) for k in kept[0])


@pytest.mark.parametrize("master, dtype, loss_scale", [
    ("split", "bf16", None), ("kahan", "bf16", None), ("stochastic", "bf16", None),
    ("kahan", "fp16", 1024.0)])
def test_a_compact_clip_before_the_step_is_the_clip_inside_it(master, dtype, loss_scale):
    """``clip_grad_norm_`` then ``step`` makes the fp32 gradients with the step's arithmetic
    (``settle_grads_``): bitwise ``step(max_grad_norm=)``, for every compact method (bf16
    gradients clipped in place were 8e-4 off with SGD at lr 1)."""
    kept = []
    for path in ("clip_grad_norm_", "step(max_grad_norm)"):
        amp, model, opt, _, _ = _backward_once("O2", dtype, loss_scale, master)
        CLIP_PATHS[path](amp, opt)
        kept.append(mp.fp32_state_dict(model, opt))
    assert all(torch.equal(kept[0][k], kept[1][k]) for k in kept[0])


def test_a_clip_folded_into_the_step_refuses_value_clipping_and_grad_norm():
    amp, model, opt, _, _ = _backward_once("O2", "fp16", 1024.0)
    amp.scaler.clip_grad_norm_(opt, 1.0)  # the scaler folds; the engine's clip applies it
    with pytest.raises(RuntimeError, match="clip by value or by norm"):
        amp.clip_grad_value_(opt, 0.1)
    with pytest.raises(RuntimeError, match="use the norm it returned"):
        amp.grad_norm(opt)
    with pytest.raises(ValueError, match="clip_value must be a positive finite number"):
        amp.clip_grad_value_(opt, float("inf"))


@pytest.mark.parametrize("case", ["backoff", "growth", "new scale"])
@pytest.mark.parametrize("level, master", [("O1", None), ("O2", "fp32"), ("O2", "kahan")])
def test_an_accumulation_window_kept_open_across_a_scale_update_sums_true_gradients(
        case, level, master):
    """One engine, two optimizers: ``o1`` stepped every micro-batch (each step updates the
    scale), ``o2`` accumulating over two. A scale update inside ``o2``'s window (a backoff from
    an overflow in ``o1``'s part only, a growth, ``update(new_scale)``) rescales ``o2``'s
    gradients to the new scale, so its step applies the sum of the true gradients (it unscaled
    both micro-batches by the new scale: a backoff counted the first twice, 58% off)."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        return model, torch.optim.SGD(model[0].parameters(), lr=0.0), torch.optim.SGD(
            model[2].parameters(), lr=1.0)

    torch.manual_seed(1)
    batches = [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(2)]
    reference, _, _ = make()
    for x, y in batches:
        (F.mse_loss(reference(x), y) / 2).backward()
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=1 if case == "growth"
                                  else 2000)
    model, o1, o2 = make()
    amp = mp.MixedPrecision(level=level, dtype="fp16", loss_scale=scaler, master=master,
                            emulate_fp16=False)
    model, o1, o2 = amp.setup(model, o1, o2)
    before = mp.fp32_state_dict(model, o2)["2.weight"]
    for i, (x, y) in enumerate(batches):
        amp.backward(F.mse_loss(model(x).float(), y) / 2)
        if i == 0 and case == "backoff":
            model[0].weight.grad[0, 0] = float("inf")  # an overflow in o1's part only
        stepped = amp.step(o1)
        o1.zero_grad()
        if i == 0 and case == "new scale":
            amp.scaler.update(3.0 * 2 ** 8)  # (not a power of two: rounded once)
        assert stepped == (i > 0 or case != "backoff")
    assert amp.scaler.get_scale() == {"backoff": 2.0 ** 9, "growth": 2.0 ** 12,
                                      "new scale": 768.0}[case]
    assert amp.step(o2)
    applied = before - mp.fp32_state_dict(model, o2)["2.weight"]  # lr 1: the gradient
    true = reference[2].weight.grad  # (fp16 arithmetic: 3e-4 of the largest off here)
    assert (applied - true).abs().max() <= 2e-3 * true.abs().max()


@pytest.mark.parametrize("case", ["growth", "one-sided overflow"])
def test_two_optimizers_stepped_one_call_each_unscale_by_the_scale_the_gradients_carry(case):
    """``amp.step(o1); amp.step(o2)`` after one backward: the first call updates the scale, and
    the second unscales by the scale its gradients carry, not the new one (with SGD its update
    was halved after a growth and doubled after a backoff that only o1's overflow caused)."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        return (model, torch.optim.SGD(model[0].parameters(), lr=0.1),
                torch.optim.SGD([*model[1].parameters(), *model[3].parameters()], lr=0.1))

    torch.manual_seed(2)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    if case == "one-sided overflow":  # at 2^17 layer 0's fp16 gradients overflow, layer 3's not
        x[:, 0] = 3e3
    scaler = (mp.DynamicLossScaler(init_scale=2.0 ** 8, growth_interval=1) if case == "growth"
              else mp.DynamicLossScaler(init_scale=2.0 ** 17))
    reference, _, ref2 = make()
    F.mse_loss(reference(x), y).backward()
    ref2.step()
    model, o1, o2 = make()
    amp = mp.MixedPrecision(level="O2", dtype="fp16", loss_scale=scaler, emulate_fp16=False)
    model, o1, o2 = amp.setup(model, o1, o2)
    amp.backward(F.mse_loss(model(x).float(), y))
    assert (amp.step(o1), amp.step(o2)) == ((True, True) if case == "growth" else (False, True))
    kept = mp.fp32_state_dict(model, o2)
    for name in ("3.weight", "3.bias", "1.weight"):
        torch.testing.assert_close(kept[name], reference.state_dict()[name], rtol=1e-3,
                                   atol=1e-4)
