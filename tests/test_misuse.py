"""Mistakes of a loop on mp.MixedPrecision that trained on silently, with wrong numbers: each is
refused with what to write instead (docs/mistakes.md quotes these messages); and what a loop
moving from autocast + GradScaler to O2 keeps (a leftover autocast, a GradScaler checkpoint)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from testmodels import norm_mlp as net
from testmodels import regression_batch as batch

import mixprec as mp

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

ORDER = r"per iteration: amp\.backward\(loss\), then amp\.step\(optimizer\)"


def loss_of(model, i=0):
    x, y = batch(i)
    return F.mse_loss(model(x).float(), y)


def setup(dtype="fp16", level="O2", **kwargs):
    amp = mp.MixedPrecision(level=level, dtype=dtype, **kwargs)
    model = net()
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return amp, model, opt


def weights(model, opt) -> dict:
    return {k: v.clone() for k, v in mp.fp32_state_dict(model, opt).items()}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- loss.backward() under a loss scale -----------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp16_without_amp_backward_is_refused_every_time(level):
    amp, model, opt = setup("fp16", level)
    before = weights(model, opt)
    for _ in range(2):  # the first step, and every later one (GradScaler: the first only)
        loss_of(model).backward()
        with pytest.raises(RuntimeError, match=r"with no amp\.backward\(loss\) since its last "
                                               r"step: this run scales the loss \(fp16, scale "
                                               r"65536\.0\).*Write amp\.backward\(loss\)"):
            amp.step(opt)
        opt.zero_grad()
    assert same(weights(model, opt), before)
    amp.backward(loss_of(model))  # then the loop as written runs
    amp.step(opt)
    amp.backward(loss_of(model, 1))
    amp.step(opt)  # amp.backward before each step: no complaint
    assert amp.scaler.applied_steps + amp.scaler.skipped_steps == 2
    loss_of(model).backward()  # a later step back on loss.backward(): refused as well
    with pytest.raises(RuntimeError, match="this run scales the loss"):
        amp.step(opt)


def test_bf16_takes_loss_backward():
    amp, model, opt = setup("bf16")
    for i in range(3):
        loss_of(model, i).backward()
        assert amp.step(opt)  # no loss scale: the gradients are the true ones
        opt.zero_grad()


# -- a second step on the same gradients --------------------------------------------------------
@pytest.mark.parametrize("dtype,backward", [("fp16", "amp"), ("bf16", "amp"), ("bf16", "torch")])
def test_a_second_step_on_the_same_gradients_is_refused(dtype, backward):
    amp, model, opt = setup(dtype)
    if backward == "amp":
        amp.backward(loss_of(model))
    else:
        loss_of(model).backward()
    amp.step(opt)
    after_one = weights(model, opt)
    with pytest.raises(RuntimeError, match=r"amp\.step\(optimizer\) again with no "
                                           r"amp\.backward\(loss\) since this optimizer's last "
                                           r"step: on the same gradients its update would be "
                                           r"applied twice.*" + ORDER):
        amp.step(opt)
    assert same(weights(model, opt), after_one)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_direct_step_on_scaled_gradients_is_refused(level):
    """``amp.backward(loss); opt.step()`` (``amp.step`` left out) applied an update 65536 times
    too large at fp16 (``torch.amp.GradScaler`` lets it through too): refused, the weights
    untouched, saying to step through the engine or unscale first; a clip folded into the step
    is refused alike; after ``amp.unscale_`` (or the engine's clip) the step is taken, as torch
    takes it; bf16 carries no scale."""
    amp, model, opt = setup("fp16", level)
    amp.backward(loss_of(model))
    amp.step(opt)
    opt.zero_grad()
    before = weights(model, opt)
    amp.backward(loss_of(model, 1))
    with pytest.raises(RuntimeError, match=r"a loss was scaled \(x65536\).*amp\.step"):
        opt.step()
    if level == "O2":  # the scaler's own clip folds into the step (the engine's settles it)
        amp.scaler.clip_grad_norm_(opt, 1.0)
        with pytest.raises(RuntimeError, match="a loss was scaled"):
            opt.step()
    assert same(before, weights(model, opt))
    amp.step(opt)  # (then the iteration goes on as usual)
    opt.zero_grad()
    amp.backward(loss_of(model, 2))
    amp.unscale_(opt)
    opt.step()
    bf16, model, opt = setup("bf16", level)
    bf16.backward(loss_of(model))
    opt.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_direct_step_of_another_optimizer_or_after_a_new_backward_is_refused(level):
    """Review holes of the refusal above, each a 65536x update: the second of two optimizers
    stepped directly after ``amp.step`` of the first (the scale update hid it), and after
    ``unscale_`` a backward then a direct step (O1). An optimizer whose gradients are all None
    (a frozen part) steps directly as before (it does nothing)."""
    amp = mp.MixedPrecision(level=level, dtype="fp16")
    model = net()
    head, body = list(model[-1].parameters()), list(model[0].parameters())
    model, o1, o2 = amp.setup(model, torch.optim.SGD(head, lr=0.1),
                              torch.optim.SGD(body, lr=0.1))
    amp.backward(loss_of(model))
    amp.step(o1)
    with pytest.raises(RuntimeError, match="a loss was scaled"):
        o2.step()
    amp.step(o2)
    o1.zero_grad()
    o2.zero_grad()
    amp.backward(loss_of(model, 1))
    amp.unscale_(o1)
    amp.backward(loss_of(model, 2))
    with pytest.raises(RuntimeError, match="a loss was scaled"):
        o1.step()
    o1.zero_grad()
    o2.zero_grad()
    model.requires_grad_(False)
    for p in head:
        p.requires_grad_(True)
    amp.backward(loss_of(model, 3))
    before = weights(model, o2) if level == "O2" else None
    o2.step()  # no gradient: nothing to refuse
    assert level == "O1" or same(before, weights(model, o2))


@pytest.mark.filterwarnings("ignore:skipped a step:RuntimeWarning")
@pytest.mark.parametrize("dtype,level,master", [("fp16", "O2", "fp32"), ("bf16", "O2", "fp32"),
                                                ("bf16", "O2", "kahan"), ("bf16", "O1", None)])
def test_a_direct_step_after_amp_step_on_the_same_gradients_is_refused(dtype, level, master):
    """``amp.backward(loss); amp.step(opt); opt.step()`` (a loop moved to the engine that kept
    its own step) applied the update twice in bf16 (at fp16 from gradients that still carry the
    loss scale: 65,536x too large); ``torch.amp.GradScaler``'s ``scaler.step(opt); opt.step()`` does
    the same. Refused, the weights untouched; after a skipped step too. A new backward, or
    ``zero_grad``, and the direct step is taken as before."""
    amp, model, opt = setup(dtype, level, master=master)
    amp.backward(loss_of(model))
    amp.step(opt)
    after_one = weights(model, opt)
    with pytest.raises(RuntimeError, match=r"step\(\) called directly after "
                                           r"amp\.step\(optimizer\), on the same gradients.*"
                                           r"leave out optimizer\.step\(\)"):
        opt.step()
    assert same(weights(model, opt), after_one)
    opt.zero_grad()
    opt.step()  # no gradient: nothing to apply twice
    amp.backward(loss_of(model, 1) * float("nan"))
    assert not amp.step(opt)  # skipped
    with pytest.raises(RuntimeError, match="called directly after amp.step"):
        opt.step()
    opt.zero_grad()
    if dtype == "bf16":  # a backward of its own since: a step of its own
        loss_of(model, 2).backward()
        opt.step()
        assert not same(weights(model, opt), after_one)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_closure_that_scales_a_loss_is_refused_before_the_step(level):
    """``opt.step(closure)`` whose closure calls ``amp.backward``: every step trained on
    gradients carrying the loss scale (weights NaN in three steps); refused as the closure
    returns, before the optimizer reads them, the weights untouched. A closure with a plain
    ``loss.backward()`` steps."""
    amp, model, opt = setup("fp16", level)
    before = weights(model, opt)

    def scaled():
        opt.zero_grad()
        loss = loss_of(model)
        amp.backward(loss)
        return loss
    with pytest.raises(RuntimeError, match=r"closure scaled a loss \(amp\.backward\)"):
        opt.step(scaled)
    assert same(before, weights(model, opt))

    def plain():
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        return loss
    opt.step(plain)
    assert not same(before, weights(model, opt))


def test_two_optimizers_stepped_apart_after_one_backward_are_fine():
    amp = mp.MixedPrecision(level="O2", dtype="fp16")
    model = net()
    first, second = list(model[:2].parameters()), list(model[2:].parameters())
    model, opt_a, opt_b = amp.setup(model, torch.optim.SGD(first, lr=0.1),
                                    torch.optim.SGD(second, lr=0.1))
    for i in range(2):
        amp.backward(loss_of(model, i))
        amp.step(opt_a)
        amp.step(opt_b)  # each optimizer's first step after this backward
        opt_a.zero_grad()
        opt_b.zero_grad()


# -- an optimizer made after setup ------------------------------------------------------------
@pytest.mark.parametrize("master", ["fp32", "split"])
def test_an_optimizer_made_after_setup_is_refused_at_o2(master):
    amp = mp.MixedPrecision(level="O2", dtype="bf16", master=master)
    model = amp.setup(net())
    late = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp.backward(loss_of(model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"this AdamW steps 4 of the model's 16-bit parameters "
                                           r"themselves \(0\.weight, \.\.\.\): at O2 an optimizer "
                                           r"steps fp32 masters.*amp\.setup\(model, opt\).*"
                                           r"opt = mp\.MasterWeightOptimizer\(opt\)"):
        amp.step(late)
    assert same(model.state_dict(), before)
    wrapped = mp.MasterWeightOptimizer(late)  # what the message says to write
    assert amp.step(wrapped)
    assert wrapped.state[wrapped.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_an_optimizer_made_after_prepare_and_stepped_itself_is_refused(master):
    """No engine in the loop: torch's own ``opt.step()`` on the 16-bit weights of a model
    prepared with master weights raises before anything changes; wrapped, it steps masters."""
    model = mp.prepare(net(), level="O2", dtype="bf16", master=master)
    late = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model).backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"this AdamW steps the 16-bit weights of a model "
                                           r"prepared with master weights .*itself.*"
                                           r"mp\.prepare\(model, opt, level=\.\.\.\).*"
                                           r"opt = mp\.MasterWeightOptimizer\(opt\)"):
        late.step()
    assert same(model.state_dict(), before) and not late.state
    wrapped = mp.MasterWeightOptimizer(late)  # what the message says to write
    wrapped.step()
    assert wrapped.state[wrapped.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.float32
    fp32 = torch.nn.Linear(4, 4)  # an optimizer over nothing prepared is left alone
    plain = torch.optim.SGD(fp32.parameters(), lr=0.1)
    fp32(torch.randn(2, 4)).sum().backward()
    plain.step()


def test_at_o3_a_plain_optimizer_is_what_the_policy_means():
    amp = mp.MixedPrecision(level="O3", dtype="bf16")
    model = amp.setup(net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.backward(loss_of(model))
    assert amp.step(opt)


# -- deep copies ------------------------------------------------------------------------------
@pytest.mark.parametrize("master", ["fp32", "split", "kahan"])
def test_a_deep_copy_of_model_and_optimizer_together_trains_as_the_original(master):
    amp, model, opt = setup("bf16", master=master)
    amp.backward(loss_of(model))
    amp.step(opt)
    opt.zero_grad()
    model2, opt2 = copy.deepcopy((model, opt))
    amp2 = mp.MixedPrecision(level="O2", dtype="bf16", master=master)
    amp2.adopt(model2)
    for i in (1, 2):
        amp.backward(loss_of(model, i))
        amp.step(opt)
        opt.zero_grad()
        amp2.backward(loss_of(model2, i))
        amp2.step(opt2)
        opt2.zero_grad()
    assert same(weights(model, opt), weights(model2, opt2))
    assert not any(a.data_ptr() == b.data_ptr()
                   for a, b in zip(model.parameters(), model2.parameters()))


def test_separate_deep_copies_are_refused_saying_to_copy_them_together():
    amp, model, opt = setup("bf16")
    model2, opt2 = copy.deepcopy(model), copy.deepcopy(opt)
    amp2 = mp.MixedPrecision(level="O2", dtype="bf16")
    amp2.adopt(model2)
    amp2.backward(loss_of(model2))
    with pytest.raises(RuntimeError, match=r"copied apart from its model.*"
                                           r"copy\.deepcopy\(\(model, opt\)\)"):
        amp2.step(opt2)


# -- from autocast + GradScaler ---------------------------------------------------------------
def test_a_leftover_autocast_changes_nothing_at_o2():
    def run(leftover: bool) -> dict:
        amp, model, opt = setup("bf16")
        for i in range(3):
            if leftover:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_of(model, i)
            else:
                loss = loss_of(model, i)
            amp.backward(loss)
            amp.step(opt, max_grad_norm=1.0)
            opt.zero_grad()
        return weights(model, opt)

    assert same(run(True), run(False))


def test_amp_load_state_dict_takes_a_grad_scalers_state_dict():
    amp, _, _ = setup("fp16")
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    amp.load_state_dict(theirs.state_dict())
    assert amp.scaler.get_scale() == 1024.0 and amp.scaler.get_growth_interval() == 100
    bf16, _, _ = setup("bf16")
    bf16.load_state_dict(torch.amp.GradScaler("cpu", enabled=False).state_dict())  # {}: nothing
    with pytest.raises(ValueError, match="NoLossScaler scales nothing: load it into a "
                                         "DynamicLossScaler"):
        bf16.load_state_dict(theirs.state_dict())
    with pytest.raises(ValueError, match=r"or a torch\.amp\.GradScaler's"):
        amp.load_state_dict({"scale": 1.0})


def test_an_optimizer_cleared_before_a_later_prepare_is_checked_again():
    """The refusal caches a plain optimizer's clean verdict; preparing a model whose weights it
    holds at a master-weight level makes it check again."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of(model).backward()
    opt.step()  # fp32, nothing prepared with masters over it: cleared
    other = mp.prepare(net(), level="O2", dtype="bf16")  # watches another model: still clear
    loss_of(other).backward()
    opt.step()
    mp.prepare(model, level="O2", dtype="bf16")  # now its own weights are 16-bit, unwrapped
    with pytest.raises(RuntimeError, match="steps the 16-bit weights of a model prepared"):
        opt.step()
