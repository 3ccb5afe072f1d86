"""Loss scaling: arithmetic, call order, skipping, differential runs against fp32 controls."""

import copy
import dataclasses
import io
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.scaling import DynamicConfig, ScaleState, adjust_scale
from mixprec.scaling.windows import unchanged, versions

INF = float("inf")
TOL = {"rtol": 1e-5, "atol": 1e-7}


# ----------------------------------------------------------------------------- helpers
def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def compute_loss(model, i, inf=False):
    x, y = batch(i)
    dtype = next(model.parameters()).dtype
    loss = F.mse_loss(model(x.to(dtype)).float(), y)
    return loss * INF if inf else loss


def snapshot(model, opt):
    """Bitwise copy of parameters and the full optimizer state (incl. masters, step counts)."""
    return copy.deepcopy({"params": [p.detach() for p in model.parameters()],
                          "opt": opt.state_dict()})


def assert_tree_equal(a, b, **tol):
    if isinstance(a, torch.Tensor):
        if tol:
            torch.testing.assert_close(a, b, **tol)
        else:
            assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_tree_equal(a[k], b[k], **tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_tree_equal(x, y, **tol)
    else:
        assert a == b


def grads_of(opt):
    return [p.grad for g in opt.param_groups for p in g["params"]]


SCALERS = {
    "dynamic": lambda: mp.DynamicLossScaler(init_scale=128.0, growth_interval=1),
    "static": lambda: mp.StaticLossScaler(128.0),
    "none": mp.NoLossScaler,
}


# ----------------------------------------------------------------------------- pure arithmetic
def run_adjust(config, init, overflows):
    state, scales = ScaleState.initial(init, config.hysteresis), []
    for found in overflows:
        state = adjust_scale(state, torch.tensor(float(found)), config)
        scales.append(state.scale.item())
    return state, scales


def test_adjust_scale_grows_after_interval_and_backs_off_on_overflow():
    cfg = DynamicConfig(growth_interval=2)
    _, scales = run_adjust(cfg, 128.0, [0, 0, 0, 1, 0, 0])
    assert scales == [128.0, 256.0, 256.0, 128.0, 128.0, 256.0]


def test_adjust_scale_is_pure():
    state = ScaleState.initial(64.0, 2)
    before = state.to_numbers()
    new = adjust_scale(state, torch.tensor(1.0), DynamicConfig(hysteresis=2))
    assert state.to_numbers() == before
    assert new.hysteresis_tracker.item() == 1 and new is not state


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_hysteresis_backs_off_after_that_many_overflows_in_a_row(hysteresis):
    cfg = DynamicConfig(hysteresis=hysteresis, growth_interval=1000)
    # A clean step in between refills the hysteresis: no backoff from 1 + 1 overflows when h >= 2.
    _, scales = run_adjust(cfg, 1024.0, [1, 0] + [1] * hysteresis)
    assert scales[0] == (512.0 if hysteresis == 1 else 1024.0)
    assert scales[-1] == scales[-2] / 2
    assert all(s == scales[1] for s in scales[1:-1])


def test_growth_stops_at_max_scale_and_never_reaches_inf():
    fmax = torch.finfo(torch.float32).max
    _, scales = run_adjust(DynamicConfig(growth_interval=1, max_scale=fmax), 2.0 ** 126, [0] * 4)
    assert scales[0] == 2.0 ** 127 and scales[-1] == fmax and all(math.isfinite(s) for s in scales)
    _, scales = run_adjust(DynamicConfig(growth_interval=1, max_scale=512.0), 256.0, [0] * 3)
    assert scales == [512.0, 512.0, 512.0]


def test_backoff_stops_at_min_scale_and_counts_skips_there():
    state, scales = run_adjust(DynamicConfig(min_scale=2.0), 8.0, [1] * 5)
    assert scales == [4.0, 2.0, 2.0, 2.0, 2.0]
    assert state.skips_at_min.item() == 3  # overflows taken at scale 2
    state = adjust_scale(state, torch.tensor(0.0), DynamicConfig(min_scale=2.0))
    assert state.skips_at_min.item() == 0


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, match", [
    ({"growth_factor": 1.0}, "growth_factor must be > 1"),
    ({"growth_factor": 0.5}, "growth_factor must be > 1"),
    ({"backoff_factor": 0.0}, r"backoff_factor must be in the open interval \(0, 1\)"),
    ({"backoff_factor": 1.0}, "backoff_factor"),
    ({"backoff_factor": 1.5}, "backoff_factor"),
    ({"init_scale": 0.0}, "init_scale must be positive"),
    ({"init_scale": -4.0}, "init_scale must be positive"),
    ({"init_scale": INF}, "init_scale must be a finite number"),
    ({"init_scale": float("nan")}, "init_scale must be a finite number"),
    ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, "min_scale must be <= max_scale"),
    ({"hysteresis": 0}, "hysteresis must be an integer >= 1"),
    ({"growth_interval": 0}, "growth_interval must be an integer >= 1"),
    ({"max_skips_at_min": 0}, "max_skips_at_min"),
    ({"init_scale": 2.0 ** 30}, r"init_scale must lie in \[min_scale, max_scale\]"),
    ({"max_scale": INF}, "max_scale must be a finite number"),
])
def test_dynamic_rejects_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mp.DynamicLossScaler(**kwargs)


@pytest.mark.parametrize("scale", [0.0, -1.0, INF, float("nan"), True])
def test_static_rejects_bad_scale(scale):
    with pytest.raises(ValueError, match="scale must be"):
        mp.StaticLossScaler(scale)


def test_static_rejects_non_bool_skip_on_overflow():
    with pytest.raises(TypeError, match="skip_on_overflow must be a bool"):
        mp.StaticLossScaler(8.0, skip_on_overflow="yes")


@pytest.mark.parametrize("kind", SCALERS)
def test_call_order_is_enforced(kind):
    scaler, model = SCALERS[kind](), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"update\(\) called before any step\(\)"):
        scaler.update()
    scaler.scale(compute_loss(model, 0)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"on an optimizer after unscale_\(\)"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called on this optimizer"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"after step\(\) since the last update\(\)"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match=r"update\(\) called before any step\(\)"):
        scaler.update()


@pytest.mark.parametrize("kind", ["dynamic", "static", "checking"])
def test_closures_are_rejected(kind):
    scaler = (mp.NoLossScaler(skip_nonfinite=True) if kind == "checking" else SCALERS[kind]())
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(compute_loss(model, 0)).backward()
    closure = lambda: compute_loss(model, 0)  # noqa: E731
    with pytest.raises(TypeError, match="does not take a closure"):
        scaler.step(opt, closure)
    with pytest.raises(TypeError, match="does not take a closure"):
        scaler.step(opt, closure=closure)


@pytest.mark.parametrize("scaler", [mp.NoLossScaler, lambda: mp.DynamicLossScaler(enabled=False)],
                         ids=["none", "disabled"])
def test_a_scaler_that_neither_scales_nor_checks_steps_with_a_closure(scaler):
    """As a disabled ``torch.amp.GradScaler``: the closure runs inside the optimizer's step
    (LBFGS calls it again), and the step is the optimizer's own."""
    model, ref = make_model(), make_model()
    ref.load_state_dict(model.state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    scaler = scaler()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    ref_opt = torch.optim.LBFGS(ref.parameters(), lr=0.1, max_iter=4)

    def closure(m, o):
        o.zero_grad()
        loss = compute_loss(m, 0)
        loss.backward()
        return loss
    assert scaler.step(opt, lambda: closure(model, opt)) is True
    scaler.update()
    ref_opt.step(lambda: closure(ref, ref_opt))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), start))


def test_step_passes_closure_none_and_extra_arguments_through():
    model, scaler = make_model(), mp.StaticLossScaler(2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(compute_loss(model, 0)).backward()
    assert scaler.step(opt, closure=None) is True


def test_bad_arguments_to_scale_and_step():
    scaler = mp.DynamicLossScaler()
    with pytest.raises(TypeError, match="floating-point tensor"):
        scaler.scale(1.5)
    with pytest.raises(TypeError, match="floating-point tensor"):
        scaler.scale(torch.tensor(3))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        scaler.step("sgd")
    with pytest.raises(TypeError, match="nn.Module"):
        scaler.attach("model")


# ----------------------------------------------------------------------------- make_loss_scaler
@pytest.mark.parametrize("spec, dtype, expected", [
    ("auto", "fp16", mp.DynamicLossScaler),
    ("auto", torch.float16, mp.DynamicLossScaler),
    ("auto", "bf16", mp.NoLossScaler),
    ("auto", "fp32", mp.NoLossScaler),
    ("dynamic", None, mp.DynamicLossScaler),
    ("none", None, mp.NoLossScaler),
    (None, "fp16", mp.NoLossScaler),
    (256, None, mp.StaticLossScaler),
])
def test_make_loss_scaler(spec, dtype, expected):
    scaler = mp.make_loss_scaler(spec, dtype)
    assert type(scaler) is expected
    if expected is mp.StaticLossScaler:
        assert scaler.get_scale() == 256.0


@pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
@pytest.mark.parametrize("level, dtype, expected", [
    ("O0", "fp16", mp.NoLossScaler), ("O1", "fp16", mp.DynamicLossScaler),
    ("O2", "fp16", mp.DynamicLossScaler), ("O3", "fp16", mp.NoLossScaler),
    ("O1", "bf16", mp.NoLossScaler), ("O2", "bf16", mp.NoLossScaler),
])
def test_make_loss_scaler_follows_the_level_table(level, dtype, expected):
    policy = mp.Policy.from_level(level, dtype)
    assert type(mp.make_loss_scaler("auto", policy)) is expected


def test_make_loss_scaler_passes_scalers_through_and_rejects_junk():
    scaler = mp.StaticLossScaler(8.0)
    assert mp.make_loss_scaler(scaler) is scaler
    with pytest.raises(ValueError, match="needs the training dtype"):
        mp.make_loss_scaler("auto")
    with pytest.raises(ValueError, match="'auto', 'dynamic', 'none'"):
        mp.make_loss_scaler("sometimes")
    with pytest.raises(TypeError, match="loss scaler spec"):
        mp.make_loss_scaler([128])
    with pytest.raises(ValueError, match="scale must be positive"):
        mp.make_loss_scaler(-2.0)


# ----------------------------------------------------------------------------- skipping
PLAIN_OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),
                    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
                    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)}


@pytest.mark.parametrize("scaling,bad,opt_name,warm", [
    ("dynamic", "inf", "sgd-momentum", 2), ("dynamic", "inf", "adam", 2),
    ("dynamic", "inf", "adamw", 2), ("dynamic", "nan", "adamw", 2),
    ("static", "nan", "sgd", 0), ("static", "inf", "adam", 2)])
def test_skipped_step_leaves_params_and_all_optimizer_state_untouched(scaling, bad, opt_name,
                                                                      warm):
    """An inf or a NaN in the gradients of a plain torch optimizer, under either scaler: the
    step is skipped and parameters, moments, momentum buffers and step counts stay bitwise
    (after ``warm`` clean steps, so they exist; with none, no state is created)."""
    model = make_model()
    opt = PLAIN_OPTIMIZERS[opt_name](model.parameters())
    scaler = (mp.DynamicLossScaler(init_scale=1024.0) if scaling == "dynamic"
              else mp.StaticLossScaler(4.0))
    for i in range(warm):
        opt.zero_grad()
        scaler.scale(compute_loss(model, i)).backward()
        assert scaler.step(opt) is True
        scaler.update()
    before = snapshot(model, opt)
    opt.zero_grad()
    scaler.scale(compute_loss(model, warm) * float(bad)).backward()
    assert scaler.step(opt) is False
    scaler.update()
    assert_tree_equal(snapshot(model, opt), before)
    assert scaler.get_scale() == (512.0 if scaling == "dynamic" else 4.0)
    assert (scaler.skipped_steps, scaler.applied_steps) == (1, warm)


def test_static_without_skip_applies_overflowing_steps():
    model, scaler = make_model(), mp.StaticLossScaler(4.0, skip_on_overflow=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(compute_loss(model, 0, inf=True)).backward()
    assert scaler.step(opt) is True
    scaler.update()
    assert not torch.isfinite(model[0].weight).all()


@pytest.mark.parametrize("make", [mp.NoLossScaler, lambda: mp.DynamicLossScaler(enabled=False)],
                         ids=["NoLossScaler", "dynamic-disabled"])
def test_disabled_scaling_is_a_no_op(make):
    scaler, model = make(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = compute_loss(model, 0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)
    assert_tree_equal([p.grad for p in model.parameters()], expected)
    assert scaler.step(opt) is True
    scaler.update()
    scaler.load_state_dict(scaler.state_dict())
    assert scaler.applied_steps == 1


def test_scale_accepts_lists_of_losses():
    scaler = mp.StaticLossScaler(8.0)
    a, b = torch.tensor(1.0), torch.tensor(2.0)
    assert_tree_equal(scaler.scale([a, b]), [torch.tensor(8.0), torch.tensor(16.0)])
    assert isinstance(scaler.scale((a,)), tuple)


# ----------------------------------------------------------------------------- differential runs
@pytest.mark.parametrize("kind, inf_step, expected_scales", [
    ("dynamic", 2, [256.0, 512.0, 256.0, 512.0, 1024.0]),
    ("static", 2, [128.0] * 5),
    ("none", None, [1.0] * 5),
])
def test_differential_against_fp32_control(kind, inf_step, expected_scales):
    """The scaled run matches an fp32 control that skips the same step; the scale path is exact."""
    scaler, model, control = SCALERS[kind](), make_model(), make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    copt = torch.optim.Adam(control.parameters(), lr=1e-2)
    scales = []
    for i in range(5):
        bad = i == inf_step
        opt.zero_grad()
        copt.zero_grad()
        scaler.scale(compute_loss(model, i, inf=bad)).backward()
        assert scaler.step(opt) is (not bad)
        scaler.update()
        scales.append(scaler.get_scale())
        compute_loss(control, i).backward()
        if not bad:
            copt.step()
            assert_tree_equal(grads_of(opt), grads_of(copt), **TOL)
        assert_tree_equal(list(model.parameters()), list(control.parameters()), **TOL)
        assert_tree_equal(opt.state_dict(), copt.state_dict(), **TOL)
    assert scales == expected_scales
    assert scaler.skipped_steps == (inf_step is not None)


def test_gradient_accumulation_scales_every_micro_batch_and_unscales_once():
    scaler, model, control = mp.DynamicLossScaler(init_scale=2.0 ** 10), make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    copt = torch.optim.SGD(control.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        for micro in range(3):
            scaler.scale(compute_loss(model, 3 * step + micro) / 3).backward()
            (compute_loss(control, 3 * step + micro) / 3).backward()
        assert scaler.step(opt)
        scaler.update()
        copt.step()
        assert_tree_equal(grads_of(opt), grads_of(copt), **TOL)
        opt.zero_grad()
        copt.zero_grad()
    assert_tree_equal(list(model.parameters()), list(control.parameters()), **TOL)


def test_clipping_after_unscale_sees_true_gradients():
    scaler, model, control = mp.DynamicLossScaler(init_scale=2.0 ** 12), make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    copt = torch.optim.SGD(control.parameters(), lr=0.5)
    scaler.scale(compute_loss(model, 0)).backward()
    scaler.unscale_(opt)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    compute_loss(control, 0).backward()
    cnorm = nn.utils.clip_grad_norm_(control.parameters(), max_norm=0.05)
    assert norm.item() > 0.05  # clipping is active
    torch.testing.assert_close(norm, cnorm, **TOL)
    assert scaler.step(opt)  # step() does not unscale a second time
    scaler.update()
    copt.step()
    assert_tree_equal(list(model.parameters()), list(control.parameters()), **TOL)


def _rel(applied, true) -> float:
    return float((applied - true).abs().max() / true.abs().max())


@pytest.mark.parametrize("reload", [False, True])
def test_an_open_window_is_rescaled_once_per_gradient_when_the_next_backward_comes(reload):
    """Plain torch optimizers on a bare scaler, all stepped once (so the scaler knows them):
    ``oa`` and ``ob`` share a weight and stay open across a backoff caused by ``o1``; the next
    scaled backward rescales the shared gradient once (twice made the step half the true
    sum), a state-dict round trip of the scaler in between changes nothing, and ``oa``'s step
    applies both micro-batches."""
    torch.manual_seed(0)
    lin0, lin1 = nn.Linear(4, 4), nn.Linear(4, 2)
    o1 = torch.optim.SGD(lin0.parameters(), lr=0.0)
    oa = torch.optim.SGD([lin1.weight], lr=1.0)
    ob = torch.optim.SGD([lin1.weight, lin1.bias], lr=0.0)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    xs = [torch.randn(8, 4) for _ in range(3)]
    scaler.scale(lin1(lin0(xs[0])).pow(2).mean()).backward()
    for opt in (o1, oa, ob):
        scaler.step(opt)
    scaler.update()
    for opt in (o1, oa, ob):
        opt.zero_grad()
    ref0, ref1 = copy.deepcopy(lin0), copy.deepcopy(lin1)
    for x in xs[1:]:
        ref1(ref0(x)).pow(2).mean().backward()
    before = lin1.weight.detach().clone()
    scaler.scale(lin1(lin0(xs[1])).pow(2).mean()).backward()
    lin0.weight.grad[0, 0] = float("inf")
    assert not scaler.step(o1)
    scaler.update()
    if reload:
        scaler.load_state_dict(scaler.state_dict())
    o1.zero_grad()
    scaler.scale(lin1(lin0(xs[2])).pow(2).mean()).backward()
    assert scaler.step(o1) and scaler.step(oa)
    assert scaler.get_scale() == 2.0 ** 7
    assert _rel(before - lin1.weight.detach(), ref1.weight.grad) < 1e-6


def test_two_steps_after_one_backward_near_the_top_of_fp16_after_a_growth():
    """``amp.step(o1); amp.step(o2)`` after one backward, o1's update growing the scale while
    o2's fp16 gradients times the scale lie within 2x of fp16's largest: o2 unscales by the
    scale they carry, untouched (a rescale to the grown scale made them inf and skipped o2)."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        return (model, torch.optim.SGD(model[0].parameters(), lr=0.0),
                torch.optim.SGD(model[1].parameters(), lr=1.0))

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    reference, _, _ = make()
    F.mse_loss(reference(x), y).backward()
    true = reference[1].weight.grad
    init = 2.0 ** math.ceil(math.log2(32752 / true.abs().max().item()))
    model, o1, o2 = make()
    amp = mp.MixedPrecision(level="O2", dtype="fp16", emulate_fp16=False,
                            loss_scale=mp.DynamicLossScaler(init_scale=init, growth_interval=1))
    model, o1, o2 = amp.setup(model, o1, o2)
    before = mp.fp32_state_dict(model, o2)["1.weight"]
    amp.backward(F.mse_loss(model(x).float(), y))
    assert amp.step(o1) and amp.step(o2)
    assert _rel(before - mp.fp32_state_dict(model, o2)["1.weight"], true) < 2e-3


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("how", ["clip", "unscale", "by hand"])
def test_an_optimizer_clipped_before_another_ones_update_steps_as_in_one_call(dtype, how):
    """``amp.clip_grad_norm_(o2); amp.step(o1); amp.step(o2)`` (each ``amp.step`` updates the
    scale; Lightning's manual optimization clipping both optimizers before stepping them): o2's
    record stays until its step, which is bitwise the one ``amp.step(o1, o2)`` takes (the update
    dropped it: at fp16 o2 stepped unclipped, or its gradients were unscaled a second time, as
    ``torch.amp.GradScaler`` does); by hand with plain optimizers too. A backward since ends
    the kept record."""
    def run(together: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        o1 = torch.optim.SGD(model[0].parameters(), lr=0.1)
        o2 = torch.optim.SGD(model[1].parameters(), lr=0.1)
        x, y = torch.randn(8, 8), torch.randn(8, 4)
        if how == "by hand":
            scaler = (mp.DynamicLossScaler(init_scale=2.0 ** 8) if dtype == "fp16"
                      else mp.NoLossScaler())
            for _ in range(2):
                scaler.scale(F.mse_loss(model(x), y)).backward()
                scaler.unscale_(o2)
                torch.nn.utils.clip_grad_norm_(model[1].parameters(), 0.05)
                scaler.step(o1)
                if not together:
                    scaler.update()
                scaler.step(o2)
                scaler.update()
                model.zero_grad()
            return [p.detach().clone() for p in model.parameters()]
        amp = mp.MixedPrecision(level="O2", dtype=dtype, emulate_fp16=False)
        model, o1, o2 = amp.setup(model, o1, o2)
        for _ in range(2):
            amp.backward(F.mse_loss(model(x).float(), y))
            if how == "clip":
                amp.clip_grad_norm_(o2, 0.05)
            else:
                amp.unscale_(o2)
            if together:
                assert amp.step(o1, o2)
            else:
                assert amp.step(o1) and amp.step(o2)
            model.zero_grad()
        return [t.clone() for t in mp.fp32_state_dict(model, o2).values()]

    apart, together = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(apart, together))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in model)
    amp = mp.MixedPrecision(level="O2", dtype=dtype, emulate_fp16=False)
    model, o1, o2 = amp.setup(model, o1, o2)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    amp.backward(F.mse_loss(model(x).float(), y))
    amp.clip_grad_norm_(o2, 0.05)
    assert amp.step(o1)
    assert amp.scaler.stage_of(o2) in ("folded", "unscaled")
    model.zero_grad()
    amp.backward(F.mse_loss(model(x).float(), y))  # new gradients: the kept record ends
    assert amp.scaler.stage_of(o2) == "ready"
    assert amp.step(o2)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_an_optimizer_unscaled_every_iteration_to_log_but_not_stepped_is_never_refused(dtype):
    """A frozen phase: o2's parameters have no gradients (or o2 is stepped every third
    iteration only), and each iteration unscales it to log a norm, then steps o1 and updates:
    the record kept across each update ends with the next scaled loss (a record of no
    gradients is not kept), so the next unscale is taken, not refused as a second one."""
    torch.manual_seed(0)
    lin0, lin1 = nn.Linear(4, 4), nn.Linear(4, 2)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (lin0, lin1))
    scaler = (mp.DynamicLossScaler(init_scale=2.0 ** 8) if dtype == "fp16"
              else mp.NoLossScaler(skip_nonfinite=True))
    x = torch.randn(8, 4)
    for it in range(6):
        lin1.requires_grad_(it >= 3)
        o1.zero_grad()
        o2.zero_grad(set_to_none=it % 2 == 0)
        scaler.scale(lin1(lin0(x)).pow(2).mean()).backward()
        scaler.unscale_(o1)
        scaler.unscale_(o2)
        assert scaler.step(o1)
        if it % 3 == 2:
            assert scaler.step(o2)
        scaler.update()


def _two_linears(lr: float):
    """Two fp32 layers, an SGD optimizer each, and an input (seeded)."""
    torch.manual_seed(0)
    lin0, lin1 = nn.Linear(4, 4), nn.Linear(4, 2)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=lr) for m in (lin0, lin1))
    return lin0, lin1, o1, o2, torch.randn(8, 4)


def test_a_kept_record_that_ended_is_not_kept_again_by_a_later_update():
    """o2 unscaled (to log) and not stepped in one iteration; in the next, a new backward, o1's
    step and update, then o2's step: its record from the first iteration ended with the new
    backward, and the update that followed must not keep it again with the new gradients (the
    step then took them as unscaled: an update 256 times too large)."""
    def run(log: bool):
        lin0, lin1, o1, o2, x = _two_linears(lr=0.1)
        scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
        scaler.scale(lin1(lin0(x)).pow(2).mean()).backward()
        if log:
            scaler.unscale_(o2)
        scaler.step(o1)
        scaler.update()
        o1.zero_grad()
        o2.zero_grad()
        scaler.scale(lin1(lin0(x)).pow(2).mean()).backward()
        scaler.step(o1)
        scaler.update()
        scaler.step(o2)
        scaler.update()
        return [p.detach().clone() for p in lin1.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


@pytest.mark.parametrize("zeroed", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_backward_onto_gradients_unscaled_before_an_update_is_refused_as_within_one(dtype,
                                                                                     zeroed):
    """``backward; unscale_(o1); step(o2); update(); backward; step(o1)``: under a loss scale
    o1's gradients are then unscaled ones plus scaled ones, which the step divided by the
    scale silently (-0.43x the true sum); refused as within an iteration. Zeroed first, the
    step is the true one; without a scale (bf16) the sum is true and is stepped."""
    def run(unscale_first: bool):
        lin0, lin1, o1, o2, x = _two_linears(lr=1.0)
        scaler = (mp.DynamicLossScaler(init_scale=16.0) if dtype == "fp16"
                  else mp.NoLossScaler(skip_nonfinite=True))
        scaler.scale(lin1(lin0(x)).pow(2).mean()).backward()
        if unscale_first:
            scaler.unscale_(o1)
        scaler.step(o2)
        scaler.update()
        if zeroed:
            o1.zero_grad()
        scaler.scale(lin1(lin0(x)).pow(2).mean()).backward()
        assert scaler.step(o1)
        return [p.detach().clone() for p in lin0.parameters()]

    if dtype == "fp16" and not zeroed:
        with pytest.raises(RuntimeError, match="after a backward that followed unscale_"):
            run(True)
    else:
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7)
                   for a, b in zip(run(True), run(False)))


def test_recorded_gradients_are_unchanged_only_while_they_are_the_same_tensors_unwritten():
    """The id of a freed gradient is reused by the next one: a record by id and version took a
    new gradient for the old one; a weak reference tells them apart."""
    a, b = torch.zeros(3), torch.zeros(3)
    recorded = versions([a, b])
    assert unchanged(recorded, [a, b])
    assert not unchanged(recorded, [a])
    assert not unchanged(recorded, [a, torch.zeros(3)])
    b.add_(1)
    assert not unchanged(recorded, [a, b])
    held = id(a)
    del a
    fresh = [torch.zeros(3) for _ in range(64)]  # (some may reuse the freed id)
    assert not any(unchanged(recorded[:1], [t]) for t in fresh if id(t) == held)
    assert not unchanged(recorded[:1], fresh[:1])


def test_a_scaler_that_stepped_optimizers_pickles_and_copies_without_them():
    """The optimizers a scaler knows (to rescale an accumulation window across an update) are
    held weakly and left out of a pickle or a deep copy; the copy scales and steps."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mp.DynamicLossScaler(init_scale=8.0)
    scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
    assert scaler.step(opt)
    scaler.update()
    for copied in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert len(copied._windows.known) == 0 and copied.get_scale() == 8.0
        copied.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
        assert copied.step(opt)


def test_several_losses_and_optimizers_only_the_overflowing_one_skips():
    scaler = mp.DynamicLossScaler(init_scale=128.0, growth_interval=1)
    a, b = make_model(seed=1), make_model(seed=2)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    b_before = snapshot(b, opt_b)
    a_before = [p.detach().clone() for p in a.parameters()]
    shared = compute_loss(a, 0)
    loss_a = shared + 0.5 * compute_loss(b, 0).detach()
    loss_b = compute_loss(b, 1, inf=True) + 0.0 * shared  # b overflows
    scaler.scale(loss_a).backward(retain_graph=True)
    scaler.scale(loss_b).backward()
    assert scaler.step(opt_a) is True
    assert scaler.step(opt_b) is False
    scaler.update()
    assert scaler.get_scale() == 64.0  # backed off once, not once per optimizer
    assert_tree_equal(snapshot(b, opt_b), b_before)
    assert not any(torch.equal(p, q) for p, q in zip(a.parameters(), a_before))
    assert (scaler.applied_steps, scaler.skipped_steps) == (1, 1)


def test_gradient_penalty_double_backward_matches_control():
    """Scale the loss, take create_graph grads, unscale them by hand, add the penalty, backward."""
    def penalised_step(model, opt, scaler):
        x, y = batch(0)
        loss = F.mse_loss(model(x), y)
        scaled = scaler.scale(loss) if scaler else loss
        grads = torch.autograd.grad(scaled, list(model.parameters()), create_graph=True)
        inv = 1.0 / scaler.get_scale() if scaler else 1.0
        penalty = sum((g * inv).pow(2).sum() for g in grads)
        total = loss + 0.1 * penalty
        (scaler.scale(total) if scaler else total).backward()
        if scaler:
            applied = scaler.step(opt)
            scaler.update()
            return applied
        return opt.step()

    scaler, model, control = mp.DynamicLossScaler(init_scale=2.0 ** 10), make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copt = torch.optim.SGD(control.parameters(), lr=0.1)
    assert penalised_step(model, opt, scaler)
    penalised_step(control, copt, None)
    assert_tree_equal(grads_of(opt), grads_of(copt), **TOL)
    assert_tree_equal(list(model.parameters()), list(control.parameters()), **TOL)


def test_none_and_empty_gradients():
    model = make_model()
    unused = nn.Linear(3, 3)       # gets no gradient
    empty = nn.Parameter(torch.zeros(0, 4))
    opt = torch.optim.Adam([*model.parameters(), *unused.parameters(), empty], lr=1e-2)
    scaler = mp.DynamicLossScaler(init_scale=64.0)
    scaler.scale(compute_loss(model, 0) + empty.sum()).backward()
    assert unused.weight.grad is None
    assert scaler.step(opt) is True
    scaler.update()
    only_none = torch.optim.SGD(unused.parameters(), lr=0.1)   # all gradients None
    scaler.scale(compute_loss(model, 1)).backward()
    assert scaler.step(only_none) is True
    scaler.update()
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SparseAdam(p, lr=1e-2), lambda p: torch.optim.SGD(p, lr=0.1),
], ids=["sparse-adam", "sgd"])
def test_sparse_gradients(make_opt):
    torch.manual_seed(0)
    emb, cemb = nn.Embedding(10, 3, sparse=True), None
    cemb = copy.deepcopy(emb)
    opt, copt = make_opt(emb.parameters()), make_opt(cemb.parameters())
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    idx = torch.tensor([1, 1, 2, 7, 1])  # duplicates: an uncoalesced sparse gradient
    scaler.scale(emb(idx).pow(2).sum()).backward()
    assert not emb.weight.grad.is_coalesced()
    assert scaler.step(opt) is True
    scaler.update()
    cemb(idx).pow(2).sum().backward()
    copt.step()
    assert emb.weight.grad.is_coalesced()
    torch.testing.assert_close(emb.weight.grad.to_dense(), cemb.weight.grad.to_dense(), **TOL)
    torch.testing.assert_close(emb.weight, cemb.weight, **TOL)
    before = emb.weight.detach().clone()
    opt.zero_grad()
    scaler.scale(emb(idx).sum() * INF).backward()
    assert scaler.step(opt) is False
    scaler.update()
    assert torch.equal(emb.weight, before)


# ----------------------------------------------------------------------------- persistent overflow
def overflow_forever(scaler, model, opt, steps):
    for i in range(steps):
        opt.zero_grad()
        scaler.scale(compute_loss(model, i, inf=True)).backward()
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("attach, name", [(True, "2.weight"), (False, "param_groups[0][2]")])
def test_persistent_overflow_at_min_scale_raises_naming_parameters(attach, name):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mp.DynamicLossScaler(init_scale=4.0, min_scale=1.0, max_skips_at_min=3)
    if attach:
        scaler.attach(model)
    overflow_forever(scaler, model, opt, 4)  # 4 -> 2 -> 1, then skips at 1: 1, 2
    with pytest.raises(mp.NonFiniteGradientsError, match="3 steps in a row") as info:
        overflow_forever(scaler, model, opt, 1)
    assert any(p.startswith(f"{name} shape (2, 8)") for p in info.value.parameters)
    assert name in str(info.value) and "inf" in str(info.value)
    assert scaler.get_scale() == 1.0 and scaler.skipped_steps == 5


def test_a_clean_step_resets_the_skips_at_min():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mp.DynamicLossScaler(init_scale=1.0, max_skips_at_min=2, growth_interval=100)
    for _ in range(5):
        overflow_forever(scaler, model, opt, 1)
        opt.zero_grad()
        scaler.scale(compute_loss(model, 0)).backward()
        assert scaler.step(opt)
        scaler.update()
    with pytest.raises(mp.NonFiniteGradientsError):
        overflow_forever(scaler, model, opt, 2)


def test_no_limit_when_max_skips_at_min_is_none():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mp.DynamicLossScaler(init_scale=1.0, max_skips_at_min=None)
    overflow_forever(scaler, model, opt, 12)
    assert scaler.skipped_steps == 12


# ----------------------------------------------------------------------------- checkpoints
def test_state_dict_round_trip_keeps_every_counter():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mp.DynamicLossScaler(init_scale=16.0, growth_interval=3, hysteresis=2, min_scale=4.0,
                                  max_scale=2.0 ** 10, max_skips_at_min=5)
    for i, bad in enumerate([0, 1, 1, 1, 1, 0, 1]):  # 16 -> 8 -> 4 (hysteresis 2), then at min
        opt.zero_grad()
        scaler.scale(compute_loss(model, i, inf=bool(bad))).backward()
        scaler.step(opt)
        scaler.update()
    sd = scaler.state_dict()
    assert set(sd["state"]) == {f.name for f in dataclasses.fields(ScaleState)}
    assert set(sd["config"]) == {f.name for f in dataclasses.fields(DynamicConfig)}
    assert sd["state"] == {"scale": 4.0, "growth_tracker": 0, "hysteresis_tracker": 1,
                           "skips_at_min": 1}
    assert sd["counters"] == {"skipped_steps": 5, "applied_steps": 2}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    restored = mp.DynamicLossScaler()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.state_dict() == sd
    assert restored.config == scaler.config
    # both continue identically
    for s in (scaler, restored):
        for i in range(4):
            opt.zero_grad()
            s.scale(compute_loss(model, i, inf=i == 1)).backward()
            s.step(opt)
            s.update()
    assert restored.state_dict() == scaler.state_dict()


def test_static_state_dict_round_trip():
    scaler = mp.StaticLossScaler(32.0, skip_on_overflow=False)
    restored = mp.StaticLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.get_scale() == 32.0 and restored.skip_on_overflow is False


def test_loads_a_torch_grad_scaler_state_dict():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=4.0, growth_interval=5)
    for i in range(3):
        opt.zero_grad()
        gs.scale(compute_loss(model, i)).backward()
        gs.step(opt)
        gs.update()
    scaler = mp.DynamicLossScaler()
    scaler.load_state_dict(gs.state_dict())
    assert scaler.get_scale() == 1024.0
    assert (scaler.config.growth_factor, scaler.config.growth_interval) == (4.0, 5)
    assert scaler.state_dict()["state"]["growth_tracker"] == 3
    for i in range(2):  # two more clean steps complete the interval of 5
        opt.zero_grad()
        scaler.scale(compute_loss(model, i)).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 4096.0


@pytest.mark.parametrize("sd, match", [
    ({}, "empty"),
    ({"kind": "static", "config": {}, "state": {}, "counters": {}}, "from a 'static' loss scaler"),
    ({"kind": "dynamic", "config": {}}, "missing"),
    ({"scale": 2.0, "_growth_tracker": 0}, "GradScaler state_dict must have keys"),
])
def test_load_state_dict_rejects_foreign_or_broken_dicts(sd, match):
    with pytest.raises(ValueError, match=match):
        mp.DynamicLossScaler().load_state_dict(sd)


def test_load_state_dict_validates_values_before_assigning():
    scaler = mp.DynamicLossScaler(init_scale=8.0)
    sd = scaler.state_dict()
    sd["state"]["scale"] = INF
    with pytest.raises(ValueError, match="scale'\\] must be a finite number"):
        scaler.load_state_dict(sd)
    sd = scaler.state_dict()
    sd["config"]["backoff_factor"] = 2.0
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.load_state_dict(sd)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30).state_dict()
    with pytest.raises(ValueError, match="outside \\[min_scale, max_scale\\]"):
        scaler.load_state_dict(gs)
    assert scaler.config == mp.DynamicLossScaler().config and scaler.get_scale() == 8.0


def test_static_and_none_reject_dynamic_state():
    sd = mp.DynamicLossScaler().state_dict()
    for scaler in (mp.StaticLossScaler(), mp.NoLossScaler()):
        with pytest.raises(ValueError, match="from a 'dynamic' loss scaler"):
            scaler.load_state_dict(sd)


def test_every_scaler_loads_a_grad_scalers_state_dict_as_far_as_it_can_hold_it():
    """Static: the GradScaler's scale becomes its fixed one; none: a disabled GradScaler's
    (empty) state, and an enabled one's is refused, saying where it loads."""
    theirs = torch.amp.GradScaler("cpu", init_scale=512.0)
    static = mp.StaticLossScaler(128.0, max_consecutive_skips=3)
    static.load_state_dict(theirs.state_dict())
    assert static.get_scale() == 512.0 and static.max_consecutive_skips == 3
    with pytest.raises(ValueError, match="empty"):
        static.load_state_dict(torch.amp.GradScaler("cpu", enabled=False).state_dict())
    with pytest.raises(ValueError, match="must have keys"):
        static.load_state_dict({"scale": 2.0})
    assert static.get_scale() == 512.0
    none = mp.NoLossScaler()
    none.load_state_dict(torch.amp.GradScaler("cpu", enabled=False).state_dict())
    with pytest.raises(ValueError, match="load it into a DynamicLossScaler"):
        none.load_state_dict(theirs.state_dict())


@pytest.mark.parametrize("make", [lambda: mp.DynamicLossScaler(init_scale=64.0),
                                  lambda: mp.StaticLossScaler(64.0)], ids=["dynamic", "static"])
@pytest.mark.parametrize("call", ["step", "unscale_", "clip_grad_norm_"])
def test_a_scaler_that_never_scaled_a_loss_refuses_to_unscale(make, call):
    """As torch.amp.GradScaler refuses it: the gradients of a plain loss.backward() would be
    divided by the scale. After a loaded state (a resumed run) it steps."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = make()
    args = (opt, 1.0) if call == "clip_grad_norm_" else (opt,)
    with pytest.raises(RuntimeError, match=call + r"\(\) before any scaler.scale\(loss\).*Write "
                                           r"scaler.scale\(loss\).backward\(\)"):
        getattr(scaler, call)(*args)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    resumed = make()
    resumed.load_state_dict(scaler.state_dict())
    getattr(resumed, call)(*args)
    assert mp.NoLossScaler().step(opt)  # nothing to unscale
    assert mp.StaticLossScaler(1.0).step(opt)  # a unit scale: dividing by it changes nothing


def test_public_names_are_exported():
    for name in ("DynamicLossScaler", "StaticLossScaler", "NoLossScaler", "make_loss_scaler",
                 "NonFiniteGradientsError"):
        assert name in mp.__all__ and getattr(mp, name) is getattr(mp.scaling, name)
    assert issubclass(mp.NonFiniteGradientsError, RuntimeError)


# ----------------------------------------------------------------------------- master weights
LOW = [torch.bfloat16, torch.float16]


def master_setup(dtype, seed=0):
    model = make_model(dtype, seed)
    return model, mp.MasterWeightOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_master_optimizer_gets_fp32_master_grads_unscaled(dtype):
    model, opt = master_setup(dtype)
    control, copt = master_setup(dtype)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 12)
    scaler.scale(compute_loss(model, 0)).backward()
    scaler.unscale_(opt)
    compute_loss(control, 0).backward()
    copt.unscale_grads_(None)
    assert all(g.dtype == torch.float32 for g in grads_of(opt))
    assert_tree_equal(grads_of(opt), grads_of(copt), **TOL)
    # the model's own low-precision grads read as unscaled too (their rounding of the masters')
    torch.testing.assert_close(model[0].weight.grad, grads_of(opt)[0].to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_master_differential_against_unscaled_control(dtype):
    """Same low-precision model and masters; only the scaling differs (powers of two are exact)."""
    model, opt = master_setup(dtype)
    control, copt = master_setup(dtype)
    scaler = mp.DynamicLossScaler(init_scale=128.0, growth_interval=1)
    scales = []
    for i in range(5):
        bad = i == 2
        opt.zero_grad()
        copt.zero_grad()
        before = snapshot(model, opt)
        scaler.scale(compute_loss(model, i, inf=bad)).backward()
        assert scaler.step(opt) is (not bad)
        scaler.update()
        scales.append(scaler.get_scale())
        compute_loss(control, i).backward()
        if bad:
            assert_tree_equal(snapshot(model, opt), before)  # params, masters, Adam state
        else:
            copt.step()
        assert_tree_equal(list(model.parameters()), list(control.parameters()), **TOL)
        assert_tree_equal(opt.state_dict(), copt.state_dict(), **TOL)
    assert scales == [256.0, 512.0, 256.0, 512.0, 1024.0]


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_master_optimizer_recovers_after_a_skipped_step(zero):
    model, opt = master_setup(torch.float16)
    scaler = mp.DynamicLossScaler(init_scale=8.0)
    scaler.scale(compute_loss(model, 0, inf=True)).backward()
    assert scaler.step(opt) is False
    scaler.update()
    (opt if zero == "optimizer" else model).zero_grad()
    scaler.scale(compute_loss(model, 1)).backward()
    assert scaler.step(opt) is True
    scaler.update()


def test_master_optimizer_error_names_model_parameters():
    model, opt = master_setup(torch.bfloat16)
    scaler = mp.DynamicLossScaler(init_scale=1.0, max_skips_at_min=2).attach(model)
    with pytest.raises(mp.NonFiniteGradientsError) as info:
        overflow_forever(scaler, model, opt, 2)
    names = [p.split(" ")[0] for p in info.value.parameters]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]


# ----------------------------------------------- the guides' claim: scaling rescues small gradients
TINY = 2.0 ** -20  # makes every gradient small enough to underflow in fp16 (min subnormal 2^-24)


def train_tiny_gradients(dtype, scaler, steps=40):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)
    inner = torch.optim.SGD(model.parameters(), lr=0.1 / TINY)  # same update size as lr=0.1
    opt = inner if dtype == torch.float32 else mp.MasterWeightOptimizer(inner)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g))
    losses, zero_fractions = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x.to(dtype)).float(), y)
        losses.append(loss.item())
        scaler.scale(loss * TINY).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        zero_fractions.append((grads == 0).float().mean().item())
        scaler.step(opt)
        scaler.update()
    return losses, zero_fractions


def test_fp16_without_scaling_stalls_and_dynamic_scaling_tracks_fp32(record_property):
    fp32, _ = train_tiny_gradients(torch.float32, mp.NoLossScaler())
    plain, zeros_plain = train_tiny_gradients(torch.float16, mp.NoLossScaler())
    scaled, zeros_scaled = train_tiny_gradients(torch.float16, mp.DynamicLossScaler())
    zero_fraction = sum(zeros_plain) / len(zeros_plain)
    record_property("fp16_zero_grad_fraction_without_scaling", zero_fraction)
    record_property("final_losses_fp32_fp16plain_fp16scaled", (fp32[-1], plain[-1], scaled[-1]))
    assert zero_fraction > 0.8, zero_fraction            # measured ~0.98
    assert max(zeros_scaled) < 0.01
    assert fp32[-1] < 0.25 * fp32[0]                      # the fp32 run learns
    assert plain[-1] > 0.7 * plain[0]                     # fp16 without scaling barely moves
    assert scaled[-1] == pytest.approx(fp32[-1], rel=0.02)  # with scaling it tracks fp32
    for a, b in zip(scaled, fp32):
        assert a == pytest.approx(b, rel=0.02, abs=1e-3)


# ----------------------------------------------------------------------------- with mp.prepare
@pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_prepared_fp16_model_with_dynamic_scaling_tracks_fp32_control(level):
    """fp16 autocast (and masters at O2) plus dynamic scaling vs fp32; inf injected at step 2.

    Stated tolerance: fp16 rounding of activations/weights, so atol 5e-4, rtol 2e-3 on the
    parameters after 5 SGD steps (measured max abs diff ~1e-4); the scale path is still exact.
    """
    model = make_model()
    control = make_model()
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level=level,
                            dtype="fp16")
    copt = torch.optim.SGD(control.parameters(), lr=0.1)
    assert isinstance(mp.make_loss_scaler("auto", mp.policy_of(model)), mp.DynamicLossScaler)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=1)
    scales = []
    for i in range(5):
        bad = i == 2
        opt.zero_grad()
        copt.zero_grad()
        scaler.scale(compute_loss(model, i, inf=bad)).backward()
        assert scaler.step(opt) is (not bad)
        scaler.update()
        scales.append(scaler.get_scale())
        compute_loss(control, i).backward()
        if not bad:
            copt.step()
    assert scales == [2.0 ** 11, 2.0 ** 12, 2.0 ** 11, 2.0 ** 12, 2.0 ** 13]
    for p, q in zip(model.parameters(), control.parameters()):
        torch.testing.assert_close(p.float(), q, atol=5e-4, rtol=2e-3)


# ----------------------------------------------------------------------------- torch.amp drop-in
ALL_SCALERS = [lambda: mp.DynamicLossScaler(init_scale=256.0),
               lambda: mp.StaticLossScaler(128.0), lambda: mp.NoLossScaler()]


@pytest.mark.parametrize("make", ALL_SCALERS, ids=["dynamic", "static", "none"])
def test_every_state_dict_loads_into_torch_grad_scaler(make):
    """0.1: `KeyError: 'scale'` from torch.amp.GradScaler.load_state_dict."""
    scaler = make()
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(scaler.state_dict())
    assert torch_scaler.get_scale() == scaler.get_scale()
    assert torch_scaler.get_growth_factor() == scaler.get_growth_factor()
    assert torch_scaler.get_backoff_factor() == scaler.get_backoff_factor()
    assert torch_scaler.get_growth_interval() == scaler.get_growth_interval()
    clone = make()
    clone.load_state_dict(scaler.state_dict())  # and our own format still round-trips


def test_enabled_stays_as_made_when_a_state_dict_loads():
    """An enabled scaler that loaded a disabled one's state stopped scaling (enabled False,
    scale 1.0, no warning): an fp16 run resumed so trained unscaled. It refuses, as an enabled
    torch.amp.GradScaler refuses a disabled one's; a disabled one loads an enabled one's state
    and stays disabled. A disabled scaler's GradScaler keys carry its kept scale, not 1.0."""
    off = mp.DynamicLossScaler(init_scale=512.0, enabled=False)
    on = mp.DynamicLossScaler(init_scale=1024.0)
    with pytest.raises(ValueError, match="disabled DynamicLossScaler.*enabled=False"):
        on.load_state_dict(off.state_dict())
    assert on.is_enabled() and on.get_scale() == 1024.0
    loss = torch.tensor(3.0)
    assert on.scale(loss).item() == 3072.0
    assert off.state_dict()["scale"] == 512.0
    off.load_state_dict(mp.DynamicLossScaler(init_scale=8.0).state_dict())
    assert not off.is_enabled() and off.get_scale() == 1.0
    assert off.state_dict()["state"]["scale"] == 8.0


def test_dynamic_scaler_getters_setters_and_update_new_scale_like_torch():
    scaler = mp.DynamicLossScaler(init_scale=64.0, growth_interval=1)
    assert scaler.is_enabled() and not mp.NoLossScaler().is_enabled()
    assert mp.StaticLossScaler().is_enabled()
    assert not mp.DynamicLossScaler(enabled=False).is_enabled()
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(3)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (4.0, 0.25, 3)
    with pytest.raises(ValueError, match="growth_factor must be > 1"):
        scaler.set_growth_factor(1.0)
    model, opt = make_model(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(compute_loss(model, 0)).backward()
    scaler.step(opt)
    scaler.update(new_scale=512.0)
    assert scaler.get_scale() == 512.0
    scaler.scale(compute_loss(model, 1)).backward()
    scaler.step(opt)
    scaler.update(new_scale=torch.tensor([8.0]))
    assert scaler.get_scale() == 8.0
    scaler.scale(compute_loss(model, 2)).backward()
    scaler.step(opt)
    with pytest.raises(ValueError, match=r"new_scale must lie in \[min_scale, max_scale\]"):
        scaler.update(new_scale=2.0 ** 30)


def test_update_with_new_scale_needs_no_step_as_in_torch_amp():
    """scale(), then update(new_scale) without a step (a loop that decided to skip the batch)."""
    scaler = mp.DynamicLossScaler(init_scale=64.0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(compute_loss(model, 0)).backward()
    scaler.update(new_scale=8.0)
    assert scaler.get_scale() == 8.0 and scaler.skipped_steps == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.zero_grad()
    scaler.scale(compute_loss(model, 1)).backward()  # the next iteration starts clean
    assert scaler.step(opt) is True
    scaler.update()
    with pytest.raises(RuntimeError, match=r"update\(\) called before any step\(\)"):
        scaler.update()  # without new_scale, update() still needs a step


def test_static_and_none_scalers_answer_torch_calls_and_refuse_what_they_cannot_do():
    static = mp.StaticLossScaler(128.0)
    assert repr(static) == "StaticLossScaler(scale=128.0, skip_on_overflow=True)"
    assert "scale=256.0" in repr(mp.DynamicLossScaler(init_scale=256.0))
    assert (static.get_growth_factor(), static.get_backoff_factor()) == (1.0, 1.0)
    with pytest.raises(ValueError, match="fixed scale; set_growth_factor\\(\\) needs a "
                                         "DynamicLossScaler"):
        static.set_growth_factor(2.0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static.scale(compute_loss(model, 0)).backward()
    static.step(opt)
    static.update(new_scale=64.0)
    assert static.get_scale() == 64.0
    none = mp.NoLossScaler()
    none.scale(compute_loss(model, 1)).backward()
    none.step(opt)
    with pytest.raises(ValueError, match="does not scale the loss"):
        none.update(new_scale=2.0)


# ----------------------------------------------------------------------------- edge inputs
def test_a_policy_with_a_fixed_loss_scale_makes_a_static_scaler():
    """``Policy(loss_scale=128.0)`` (the docstring's "a fixed float") made every entry point
    fail with "loss scaler spec must be 'auto', ...; got 'auto'"."""
    policy = mp.Policy(param_dtype="fp16", compute_dtype="fp16", output_dtype="fp32",
                       master_weights=True, loss_scale=128.0)
    scaler = mp.make_loss_scaler("auto", policy)
    assert isinstance(scaler, mp.StaticLossScaler) and scaler.get_scale() == 128.0
    amp = mp.MixedPrecision(policy=policy)
    amp.setup(make_model())
    assert isinstance(amp.scaler, mp.StaticLossScaler) and amp.scaler.get_scale() == 128.0


@pytest.mark.parametrize("make", [
    lambda: mp.StaticLossScaler(1e-46),  # stored as 0: the step wrote NaN weights
    lambda: mp.make_loss_scaler(1e-40),  # a float32 subnormal: its reciprocal is inf
    lambda: mp.DynamicLossScaler(init_scale=2.0 ** -129, min_scale=2.0 ** -140),
    lambda: mp.DynamicLossScaler(min_scale=1e-50),  # backed off to exactly 0 after 160 skips
    lambda: mp.StaticLossScaler(1.0).update(new_scale=1e-46),
])
def test_a_scale_float32_cannot_hold_or_invert_is_refused(make):
    with pytest.raises(ValueError, match=r"must be positive, a float32 normal number"):
        make()
    assert mp.StaticLossScaler(2.0 ** -126).get_scale() == 2.0 ** -126


def test_a_scale_above_float32s_largest_says_the_bound_exactly():
    """2^128 read as 'got 3.4028e+38' against a bound printed as 3.403e+38: the bound is shown
    whole now."""
    with pytest.raises(ValueError, match=r"3\.4028234663852886e\+38\] \(float32's largest"):
        mp.DynamicLossScaler(max_scale=2.0 ** 128)


def test_grad_norm_after_another_optimizers_step_reads_the_carried_scale():
    """Two optimizers over one model, one backward: after ``amp.step(o1)`` grew the scale,
    ``amp.grad_norm(o2)`` divided by the new scale (half the true norm)."""
    model = make_model()
    o1 = torch.optim.SGD(model[0].parameters(), lr=0.1)
    o2 = torch.optim.SGD(model[2].parameters(), lr=0.1)
    amp = mp.MixedPrecision(level="O0", loss_scale=mp.DynamicLossScaler(init_scale=1024.0,
                                                                        growth_interval=1))
    model = amp.setup(model)
    amp.backward(model(batch(0)[0]).sum())
    before = amp.grad_norm(o2)
    amp.step(o1)
    assert amp.scaler.get_scale() == 2048.0
    torch.testing.assert_close(amp.grad_norm(o2), before, rtol=0, atol=0)
    torch.testing.assert_close(amp.clip_grad_norm_(o2, 1e9), before, rtol=1e-6, atol=0)


def test_apex_facade_keeps_a_first_scale_below_its_floor_until_a_change():
    """apex starts at min(2**16, max_loss_scale) whatever min_loss_scale is, and bounds only
    the scale a change makes: a floor of 2**17 moved the scale on a clean step (to 131072)."""
    from mixprec.compat.apex_scaler import ApexLossScaler

    scaler = ApexLossScaler("dynamic", min_loss_scale=2.0 ** 17)
    clean, overflow = torch.zeros(()), torch.ones(())
    for _ in range(3):
        scaler.update(clean)
    assert scaler.loss_scale() == 2.0 ** 16 and scaler.unskipped() == 3
    scaler.update(overflow)  # apex: max(min_loss_scale, scale / 2)
    assert scaler.loss_scale() == 2.0 ** 17 and scaler.unskipped() == 0
    capped = ApexLossScaler("dynamic", max_loss_scale=2.0 ** 10)
    capped.load(2.0 ** 10, 1999)
    capped.update(clean)  # a growth: min(max_loss_scale, scale * 2)
    assert capped.loss_scale() == 2.0 ** 10 and capped.unskipped() == 0


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd["state"].update(scale=1e6), "outside"),  # above max_scale=64
    (lambda sd: sd["state"].update(growth_tracker=-5), "growth_tracker"),
    (lambda sd: sd["state"].update(growth_tracker=2.5), "growth_tracker"),
    (lambda sd: sd["state"].update(hysteresis_tracker=0), "hysteresis_tracker"),
    (lambda sd: sd["state"].update(skips_at_min=-3), "skips_at_min"),
    (lambda sd: sd["counters"].update(applied_steps="x"), "applied_steps"),
])
def test_a_scaler_state_the_config_rules_out_is_refused_and_nothing_changes(edit, match):
    """Each was accepted: a scale above max_scale (dropped to 64 on a clean step), negative or
    fractional counts (truncated), a count of the wrong type (a TypeError at the next step)."""
    scaler = mp.DynamicLossScaler(init_scale=32.0, max_scale=64.0, hysteresis=2)
    sd = copy.deepcopy(scaler.state_dict())
    edit(sd)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=match):
        scaler.load_state_dict(sd)
    assert scaler.state_dict() == before


def test_a_static_scalers_skip_flag_loads_as_a_bool_only():
    scaler = mp.StaticLossScaler(8.0)
    sd = scaler.state_dict()
    sd["config"]["skip_on_overflow"] = "False"  # bool("False") is True
    with pytest.raises(ValueError, match="skip_on_overflow.*must be a bool"):
        scaler.load_state_dict(sd)
    assert scaler.skip_on_overflow is True


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("second", ["clip", "step"])
def test_a_backward_after_unscaling_is_refused_before_the_mixed_gradients_are_used(level,
                                                                                 second):
    """backward -> clip_grad_norm_ -> backward -> clip_grad_norm_: the second clip measured
    (and the step applied) unscaled gradients plus still-scaled ones (a norm of 1501 for a
    true 2.93; Accelerate's clip on every micro-batch did this). Refused, as GradScaler
    refuses a second unscale_, with the order to follow."""
    model = make_model()
    amp = mp.MixedPrecision(level=level, dtype="fp16", loss_scale=1024.0)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch(0)
    amp.backward(F.mse_loss(model(x).float(), y))
    amp.clip_grad_norm_(opt, 1e9)
    amp.backward(F.mse_loss(model(x).float(), y))
    before = [p.detach().clone() for p in model.parameters()]
    call = (lambda: amp.clip_grad_norm_(opt, 1e9)) if second == "clip" else (lambda: amp.step(opt))
    with pytest.raises(RuntimeError, match="after a backward that followed unscale_"):
        call()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
