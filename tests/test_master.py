"""Tests for mixprec.optim: fp32 master weights around a torch optimizer."""

import copy
import io

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import fp32_state_dict
from mixprec.optim import MasterWeightOptimizer, is_master_optimizer
from mixprec.optim.params import valid_grad


def written(master, dtype):
    """A master as the optimizer writes it into a ``dtype`` weight: torch's cast (round to
    nearest, ties to even)."""
    return master.detach().to(dtype)


LOW = [torch.bfloat16, torch.float16]
ULP_AT_ONE = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


class Mixed(nn.Module):
    """Linear layers in the given dtypes, then an fp32 LayerNorm (as O2 keeps norms)."""

    def __init__(self, dtypes, width=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width).to(dt) for dt in dtypes)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        return self.norm(x.float())


def loss_of(model, x):
    return (model(x) - 0.5).pow(2).mean()


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum_wd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                           weight_decay=1e-2, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}
DTYPE_MIXES = {
    "bf16": [torch.bfloat16] * 2,
    "fp16": [torch.float16] * 2,
    "bf16+fp16+fp32": [torch.bfloat16, torch.float16, torch.float32],
}


def two_groups(model):
    """Two param groups with different learning-rate scales (the second at half the lr)."""
    first = list(model.layers[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return first, rest


def make(model, name):
    first, rest = two_groups(model)
    inner = OPTIMIZERS[name](first)
    inner.add_param_group({"params": rest, "lr": inner.defaults["lr"] / 2})
    return inner


# -- construction and mappings -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_params_get_fp32_masters_and_fp32_params_stay(dtype):
    model = Mixed([dtype, dtype])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = MasterWeightOptimizer(inner)
    assert opt.param_groups is inner.param_groups and opt.inner is inner
    held = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in held)
    for p in model.parameters():
        master = opt.master_param(p)
        assert opt.model_param(master) is p
        if p.dtype == torch.float32:
            assert master is p
        else:
            assert master is not p and master.dtype == torch.float32
            assert torch.equal(master, p.float())
    assert sum(1 for p in held if not any(p is q for q in model.parameters())) == 4
    assert is_master_optimizer(opt) and not is_master_optimizer(inner)


def test_tied_parameter_has_one_master_and_gets_both_gradients():
    emb = nn.Embedding(6, 4).to(torch.bfloat16)
    head = nn.Linear(4, 6, bias=False).to(torch.bfloat16)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert len(list(model.parameters())) == 1
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    tokens = torch.tensor([0, 3])
    head(emb(tokens)).float().sum().backward()
    before = opt.master_param(emb.weight).clone()
    opt.step()
    master = opt.master_param(emb.weight)
    assert torch.equal(master, before - emb.weight.grad.float())
    assert torch.equal(head.weight, written(master, torch.bfloat16))


def test_state_made_before_wrapping_moves_to_master_in_fp32():
    model = nn.Linear(4, 4).to(torch.bfloat16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    inner.step()
    opt = MasterWeightOptimizer(inner)
    assert not any(key is model.weight for key in inner.state)  # moved to its master's key
    buf = opt.state[opt.master_param(model.weight)]["momentum_buffer"]
    assert buf.dtype == torch.float32 and torch.equal(buf, model.weight.grad.float())


# -- gradients: the protocol the loss scalers rely on --------------------------------------------
def test_unscale_grads_makes_fp32_master_grads_and_none_for_missing_ones():
    model = Mixed([torch.bfloat16, torch.bfloat16])
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model.layers[1].weight.requires_grad_(False)  # this one will have grad None
    loss_of(model, torch.randn(3, 8)).backward()
    scaled = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}
    found = opt.unscale_grads_(torch.tensor(0.25))
    assert found.item() == 0
    for p in model.parameters():
        g = opt.master_param(p).grad
        if p.grad is None:
            assert g is None
        else:
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, scaled[p].float() * 0.25, rtol=0, atol=0)
            # the model's gradients read as unscaled too (bf16: a power of two is exact)
            torch.testing.assert_close(p.grad, (scaled[p].float() * 0.25).to(p.dtype),
                                       rtol=0, atol=0)


def test_unscale_grads_flags_inf_and_nan_in_any_gradient():
    model = Mixed([torch.float16, torch.float32])
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for bad, where in ((float("inf"), 0), (float("nan"), 1)):
        opt.zero_grad()
        loss_of(model, torch.randn(3, 8)).backward()
        model.layers[where].weight.grad[0, 0] = bad
        assert opt.unscale_grads_(torch.tensor(1.0)).item() > 0
    opt.zero_grad()
    loss_of(model, torch.randn(3, 8)).backward()
    assert opt.unscale_grads_(None).item() == 0


def test_step_uses_the_unscaled_master_grads_and_frees_them():
    model = Mixed([torch.bfloat16])
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    loss_of(model, torch.randn(3, 8)).backward()
    w = model.layers[0].weight
    expected = opt.master_param(w).detach() - 0.25 * w.grad.float()
    opt.unscale_grads_(torch.tensor(0.25))
    opt.step()
    assert torch.equal(opt.master_param(w), expected)
    masters = [p for g in opt.param_groups for p in g["params"] if p is not opt.model_param(p)]
    assert masters and all(valid_grad(m) is None for m in masters)  # no fp32 gradient held
    # reading one after the step makes it again: the model's (unscaled) gradient in fp32
    assert torch.equal(opt.master_param(w).grad, w.grad.float())


@pytest.mark.parametrize("fused", ["auto", False])
def test_step_with_grad_scale_divides_the_model_grads_as_it_reads_them(fused):
    model = Mixed([torch.float16, torch.float32])
    ref_model = copy.deepcopy(model)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), fused=fused)
    ref = MasterWeightOptimizer(torch.optim.SGD(ref_model.parameters(), lr=0.5), fused=fused)
    x = torch.randn(3, 8)
    (loss_of(model, x) * 1024).backward()
    loss_of(ref_model, x).backward()
    opt.step(grad_scale=torch.tensor(1024.0))
    ref.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(opt.master_param(p), ref.master_param(q), rtol=1e-6, atol=1e-7)


def test_no_fp32_gradient_lives_between_steps_and_zero_grad_clears_both_sides():
    model = Mixed([torch.bfloat16])
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    w = model.layers[0].weight
    master = opt.master_param(w)
    for _ in range(2):
        loss_of(model, torch.randn(3, 8)).backward()
        opt.step()
        assert valid_grad(master) is None and w.grad is not None
        opt.zero_grad()
        assert w.grad is None and master.grad is None
    loss_of(model, torch.randn(3, 8)).backward()
    opt.unscale_grads_(None)
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        assert torch.count_nonzero(p.grad) == 0
    assert torch.count_nonzero(master.grad) == 0  # made again from the zeroed model gradient


def test_changing_model_grads_after_unscale_grads_is_what_the_step_uses():
    """torch.amp's line `scaler.unscale_(opt); clip_grad_norm_(model.parameters(), ...)`: the
    model's gradients are then the truth, and the masters' are made again from them."""
    model = Mixed([torch.bfloat16])
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    loss_of(model, torch.randn(3, 8)).backward()
    before = {p: opt.master_param(p).detach().clone() for p in model.parameters()}
    opt.unscale_grads_(torch.tensor(0.5))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    clipped = {p: p.grad.float() for p in model.parameters()}
    opt.step()
    for p in model.parameters():
        torch.testing.assert_close(opt.master_param(p), before[p] - clipped[p], rtol=0, atol=0)
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in clipped.values()]))
    assert total < 1.01e-3


@pytest.mark.parametrize("set_to_none", [True, False])
def test_unscale_grads_again_after_a_new_backward_replaces_stale_master_grads(set_to_none):
    """Master gradients made before a skipped step must not survive into the next one."""
    model = nn.Linear(4, 3).to(torch.bfloat16)
    opt = mp.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    model(x).float().sum().mul(float("inf")).backward()
    assert opt.unscale_grads_(None).item() > 0  # e.g. a scaler's unscale_ before a skipped step
    model.zero_grad(set_to_none=set_to_none)
    model(x).float().sum().backward()
    assert opt.unscale_grads_(None).item() == 0
    torch.testing.assert_close(opt.master_param(model.weight).grad, model.weight.grad.float(),
                               rtol=0, atol=0)
    opt.drop_master_grads()
    assert valid_grad(opt.master_param(model.weight)) is None


def test_the_wrapped_optimizer_refuses_to_step_directly():
    model = Mixed([torch.bfloat16])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = MasterWeightOptimizer(inner)
    loss_of(model, torch.randn(3, 8)).backward()
    with pytest.raises(RuntimeError, match="wrapped in a MasterWeightOptimizer.*optimizer prepare "
                                           "returned"):
        inner.step()
    opt.step()  # the wrapper steps it
    clone = copy.deepcopy(opt)
    with pytest.raises(RuntimeError, match="wrapped in a MasterWeightOptimizer"):
        clone.inner.step()


def _scaled_run(master, driver, clip):
    """6 O2 fp16 AdamW steps of a small net, the third with inf gradients, the loss scaled at
    1024 (no growth) by ``driver``: mixprec's engine or ``torch.amp.GradScaler``. Returns the
    fp32 masters and each step's outcome."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))
    net, opt = mp.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2), level="O2",
                          dtype="fp16", master=master)
    if driver == "mixprec":
        scaler = mp.DynamicLossScaler(init_scale=1024.0, growth_interval=10**6)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    stepped = []
    for i in range(6):
        g = torch.Generator().manual_seed(i)
        loss = net(torch.randn(8, 8, generator=g)).float().pow(2).mean()
        scaler.scale(loss * (float("inf") if i == 2 else 1.0)).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_([p for grp in opt.param_groups for p in grp["params"]],
                                           0.5)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        stepped.append(scaler.get_scale() == before)
        opt.zero_grad()
    return fp32_state_dict(net, opt), stepped


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_ + clip"])
@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_torch_grad_scaler_drives_a_master_optimizer_as_mixprecs_scaler_does(master, clip):
    """torch.amp.GradScaler hands the step its scale and overflow flag
    (``_step_supports_amp_scaling``): the same masters, bit for bit, as mixprec's scaler, and
    the step with inf gradients skipped by both."""
    if clip and master == "kahan":  # GradScaler's unscale_ refuses fp16 gradients itself
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            _scaled_run(master, "torch", clip)
        return
    ours, ours_stepped = _scaled_run(master, "mixprec", clip)
    theirs, theirs_stepped = _scaled_run(master, "torch", clip)
    assert ours_stepped == theirs_stepped == [True, True, False, True, True, True]
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_sparse_embedding_gradient_reaches_its_master():
    emb = nn.Embedding(10, 4, sparse=True).to(torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0))
    before = opt.master_param(emb.weight).detach().clone()
    emb(torch.tensor([1, 7])).float().sum().backward()
    opt.step()
    moved = (opt.master_param(emb.weight) != before).any(dim=1)
    assert moved.nonzero().flatten().tolist() == [1, 7]
    assert torch.equal(emb.weight, written(opt.master_param(emb.weight), torch.bfloat16))


def test_all_none_grads_and_zero_size_params_step_cleanly():
    empty = nn.Parameter(torch.empty(0, 3, dtype=torch.bfloat16))
    w = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = MasterWeightOptimizer(torch.optim.Adam([empty, w], lr=0.1))
    opt.step()  # no gradients at all: nothing moves, no state appears
    assert torch.equal(w, torch.ones(3, dtype=torch.bfloat16)) and len(opt.state) == 0
    empty.grad = torch.empty_like(empty)
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.master_param(empty).shape == (0, 3)
    assert torch.equal(w, written(opt.master_param(w), torch.bfloat16)) and (w < 1).all()

@pytest.mark.parametrize("name", ["sgd_momentum_wd_nesterov", "adam"])
def test_param_without_grad_is_skipped_and_its_state_untouched(name):
    model = Mixed([torch.bfloat16, torch.bfloat16])
    opt = MasterWeightOptimizer(OPTIMIZERS[name](model.parameters()))
    frozen = model.layers[0].weight
    loss_of(model, torch.randn(3, 8)).backward()
    opt.step()
    state = copy.deepcopy(opt.state[opt.master_param(frozen)])
    value = frozen.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        loss_of(model, torch.randn(3, 8)).backward()
        frozen.grad = None
        opt.step()
    assert torch.equal(frozen, value)
    after = opt.state[opt.master_param(frozen)]
    assert all(torch.equal(torch.as_tensor(after[k]), torch.as_tensor(v)) for k, v in state.items())


# -- numerics ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
def test_update_below_half_ulp_is_lost_without_masters_and_kept_with_them(dtype):
    """The PyTorch mixed-precision blog's rounding-error argument: lr * grad = ulp(1.0) / 8 <
    ulp / 2."""
    lr, steps = ULP_AT_ONE[dtype] / 8, 64
    pure = nn.Parameter(torch.ones(4, dtype=dtype))
    kept = nn.Parameter(torch.ones(4, dtype=dtype))
    plain = torch.optim.SGD([pure], lr=lr)
    master = MasterWeightOptimizer(torch.optim.SGD([kept], lr=lr))
    for _ in range(steps):
        for p, opt in ((pure, plain), (kept, master)):
            opt.zero_grad()
            p.grad = -torch.ones_like(p)  # descent moves the weight up by lr each step
            opt.step()
    assert torch.equal(pure, torch.ones_like(pure))  # every update rounded away
    target = 1.0 + steps * lr  # 1 + 8 ulp: exact in fp32 and in dtype
    assert torch.equal(master.master_param(kept), torch.full((4,), target))
    assert torch.equal(kept, torch.full((4,), target, dtype=dtype))


@pytest.mark.parametrize("fused", ["auto", False])
@pytest.mark.parametrize("mix", DTYPE_MIXES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_masters_track_an_fp32_model_fed_the_same_grads(name, mix, fused):
    """Bitwise: fused=False runs the optimizer's own (foreach) step, "auto" torch's fused one."""
    model = Mixed(DTYPE_MIXES[mix])
    ref_model = copy.deepcopy(model).float()  # exact upcast: the fp32 control
    opt = MasterWeightOptimizer(make(model, name), fused=fused)
    ref_opt = make(ref_model, name)
    if fused == "auto":
        for group in ref_opt.param_groups:
            group["fused"], group["foreach"] = True, False
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = loss_of(model, torch.randn(16, 8))
        loss.backward()
        losses.append(loss.item())
        for r, p in zip(ref_model.parameters(), model.parameters()):
            r.grad = None if p.grad is None else p.grad.float()
        opt.step()
        ref_opt.step()
        for r, p in zip(ref_model.parameters(), model.parameters()):
            torch.testing.assert_close(opt.master_param(p), r, rtol=0, atol=0)
            torch.testing.assert_close(p, r.to(p.dtype), rtol=0, atol=0)
    assert losses[-1] < losses[0]


def test_step_with_closure_and_lbfgs():
    target = torch.linspace(-1, 1, 6)
    w = nn.Parameter(torch.zeros(6, dtype=torch.bfloat16))
    opt = MasterWeightOptimizer(torch.optim.LBFGS([w], lr=1.0, max_iter=20))

    def closure():
        opt.zero_grad()
        loss = (w.float() - target).pow(2).sum()
        loss.backward()
        return loss

    first = opt.step(closure)
    assert first.item() == pytest.approx(target.pow(2).sum().item())
    # measured 6.1e-4 (bf16 gradients of an fp32 quadratic; AVX2 CPU, torch 2.13)
    torch.testing.assert_close(opt.master_param(w), target, rtol=0, atol=6e-3)
    assert torch.equal(w, written(opt.master_param(w), torch.bfloat16))


# -- torch.optim integration -----------------------------------------------------------------
SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=8),
}


@pytest.mark.parametrize("opt_name", ["sgd_momentum_wd_nesterov", "adam"])
@pytest.mark.parametrize("sched", SCHEDULERS)
def test_lr_schedulers_drive_the_wrapper_like_a_plain_optimizer(sched, opt_name):
    model = Mixed([torch.bfloat16])
    opt = MasterWeightOptimizer(make(model, opt_name))
    control = make(Mixed([torch.float32]), opt_name)
    schedulers = [SCHEDULERS[sched](o) for o in (opt, control)]
    seen = []
    for _ in range(6):  # warnings are errors: a misplaced optimizer.step() would fail here
        opt.zero_grad()
        loss_of(model, torch.randn(4, 8)).backward()
        opt.step()
        control.step()
        for s in schedulers:
            s.step()
        seen.append([g["lr"] for g in opt.param_groups])
        assert seen[-1] == [g["lr"] for g in control.param_groups]
        assert opt.param_groups[0].get("betas") == control.param_groups[0].get("betas")
    assert len({tuple(x) for x in seen}) > 1


def test_scheduler_built_on_the_plain_optimizer_before_wrapping_keeps_working():
    model = Mixed([torch.bfloat16])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = MasterWeightOptimizer(inner)  # what prepare() does to the user's optimizer
    for _ in range(2):
        opt.zero_grad()
        loss_of(model, torch.randn(4, 8)).backward()
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.025


def test_hooks_registered_on_the_wrapper_run():
    model = Mixed([torch.bfloat16])
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("step"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(sd.get("extra")))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    loss_of(model, torch.randn(2, 8)).backward()
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert calls == ["step", 1, "loaded"]


def test_add_param_group_creates_masters():
    model = Mixed([torch.bfloat16, torch.float16])
    first, rest = two_groups(model)
    opt = MasterWeightOptimizer(torch.optim.Adam(first, lr=1e-2))
    opt.add_param_group({"params": rest, "lr": 1e-3})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 1e-3
    w = model.layers[1].weight
    assert opt.master_param(w).dtype == torch.float32
    before = w.detach().clone()
    loss_of(model, torch.randn(4, 8)).backward()
    opt.step()
    assert not torch.equal(w, before)
    assert torch.equal(w, opt.master_param(w).to(torch.float16))


# -- checkpoints -------------------------------------------------------------------------------
def train(model, opt, batches):
    for x in batches:
        opt.zero_grad()
        loss_of(model, x).backward()
        opt.step()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name", ["sgd_momentum_wd_nesterov", "adamw"])
@pytest.mark.parametrize("dtype", LOW)
def test_resumed_training_is_bitwise_identical(dtype, name):
    batches = [torch.randn(8, 8) for _ in range(6)]
    model = Mixed([dtype, dtype])
    opt = MasterWeightOptimizer(make(model, name))
    train(model, opt, batches[:3])
    saved_model, saved_opt = roundtrip(model.state_dict()), roundtrip(opt.state_dict())
    assert set(saved_opt["master_weights"]) == {0, 1, 2, 3}
    train(model, opt, batches[3:])

    resumed = Mixed([dtype, dtype])
    resumed.load_state_dict(saved_model)
    ropt = MasterWeightOptimizer(make(resumed, name))
    ropt.load_state_dict(saved_opt)
    train(resumed, ropt, batches[3:])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.master_param(a), ropt.master_param(b))


def test_load_state_dict_resyncs_model_params_from_masters():
    model = Mixed([torch.bfloat16])
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    train(model, opt, [torch.randn(4, 8)])
    saved = copy.deepcopy(opt.state_dict())
    with torch.no_grad():
        model.layers[0].weight.zero_()
    opt.refresh_masters()
    assert torch.count_nonzero(opt.master_param(model.layers[0].weight)) == 0
    opt.load_state_dict(saved)
    w = model.layers[0].weight
    assert torch.equal(opt.master_param(w), saved["master_weights"][0])
    assert torch.equal(w, written(saved["master_weights"][0], torch.bfloat16))


def test_plain_optimizer_state_dict_loads_and_keeps_masters():
    model = Mixed([torch.bfloat16])
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(Mixed([torch.bfloat16]).parameters(), lr=0.3, momentum=0.9)
    opt = MasterWeightOptimizer(inner)
    master = opt.master_param(model.layers[0].weight).detach().clone()
    opt.load_state_dict(plain.state_dict())
    assert opt.param_groups[0]["lr"] == 0.3
    assert torch.equal(opt.master_param(model.layers[0].weight), master)


def test_fp32_state_dict_takes_masters_and_casts_buffers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=2.0 ** -12))
    model(torch.randn(8, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()  # tiny update: masters now differ from the bf16 weights
    master = opt.master_param(model[0].weight)
    assert not torch.equal(master, model[0].weight.float())
    exported = mp.fp32_state_dict(model, opt)
    assert list(exported) == list(model.state_dict())
    assert torch.equal(exported["0.weight"], master) and exported["0.weight"] is not master
    assert exported["1.running_mean"].dtype == torch.float32
    assert exported["1.num_batches_tracked"].dtype == torch.int64
    fp32_model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    fp32_model.load_state_dict(exported)
    upcast = fp32_state_dict(model)
    assert torch.equal(upcast["0.weight"], model[0].weight.float())


@pytest.mark.parametrize("master", ["fp32", "split", "copy"])
def test_fp32_state_dict_of_a_sub_module_takes_the_prepared_models_masters(master):
    """A sub-module of a prepared model (a LightningModule's ``net``, a backbone) exports the
    fp32 values its model holds for it, not its 16-bit weights upcast; a deep copy's shadows
    too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.GELU()), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=2.0 ** -12)
    model, opt = mp.prepare(model, opt, level="O2", dtype="bf16",
                            master="fp32" if master == "copy" else master)
    model(torch.randn(8, 4)).float().pow(2).mean().backward()
    opt.step()  # tiny update: the fp32 values now differ from the bf16 weights
    if master == "copy":
        model = copy.deepcopy(model)
    whole = mp.fp32_state_dict(model)
    part = mp.fp32_state_dict(model[0])
    assert list(part) == ["0.weight", "0.bias"]
    for name, value in part.items():
        assert torch.equal(value, whole["0." + name])
    assert not torch.equal(part["0.weight"], model[0][0].weight.float())
    assert torch.equal(mp.fp32_state_dict(model[0][0])["weight"], part["0.weight"])


# -- bad input ---------------------------------------------------------------------------------
def test_rejects_what_is_not_a_plain_optimizer():
    model = Mixed([torch.bfloat16])
    with pytest.raises(TypeError, match="torch.optim.Optimizer.*got list"):
        MasterWeightOptimizer(list(model.parameters()))
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already a MasterWeightOptimizer.*SGD"):
        MasterWeightOptimizer(opt)


def test_rejects_foreign_tensors_and_bad_param_groups():
    model = Mixed([torch.bfloat16, torch.bfloat16])
    first, rest = two_groups(model)
    opt = MasterWeightOptimizer(torch.optim.SGD(first, lr=0.1))
    stranger = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bfloat16 tensor of shape \(3,\) is not a parameter"):
        opt.master_param(stranger)
    with pytest.raises(ValueError, match="not a parameter"):
        opt.model_param(torch.zeros(2))
    with pytest.raises(TypeError, match="param must be a Tensor; got str"):
        opt.master_param("layers.0.weight")
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model.layers[0].weight]})
    with pytest.raises(TypeError, match="dict with a 'params' entry; got list"):
        opt.add_param_group(rest)
    with pytest.raises(ValueError, match=r"needs a 'params' entry; got keys \['lr'\]"):
        opt.add_param_group({"lr": 0.1})
    with pytest.raises(ValueError, match="non-leaf"):
        opt.add_param_group({"params": [model.layers[1].weight * 2]})
    assert len(opt.param_groups) == 1 and len(opt._master_of) == 2  # failed adds left no trace


def test_rejects_mismatched_state_dicts():
    opt = MasterWeightOptimizer(torch.optim.SGD(Mixed([torch.bfloat16]).parameters(), lr=0.1))
    fp32_opt = MasterWeightOptimizer(torch.optim.SGD(Mixed([torch.float32]).parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"masters for parameter indices \[0, 1\].* at \[\]"):
        fp32_opt.load_state_dict(opt.state_dict())
    wide = nn.Linear(8, 3).to(torch.bfloat16)
    other = MasterWeightOptimizer(torch.optim.SGD(
        [wide.weight, wide.bias, *Mixed([torch.bfloat16]).norm.parameters()], lr=0.1))
    with pytest.raises(ValueError, match=r"saved master 0 has shape \(8, 8\).*\(3, 8\)"):
        other.load_state_dict(opt.state_dict())
    with pytest.raises(TypeError, match="state_dict must be a dict; got list"):
        opt.load_state_dict([])


def test_fp32_state_dict_rejects_bad_arguments():
    model = Mixed([torch.bfloat16])
    foreign = MasterWeightOptimizer(torch.optim.SGD(Mixed([torch.bfloat16]).parameters(), lr=0.1))
    with pytest.raises(TypeError, match="nn.Module; got OrderedDict"):
        fp32_state_dict(model.state_dict())
    with pytest.raises(TypeError, match="Optimizer; got str"):
        fp32_state_dict(model, "sgd")
    with pytest.raises(ValueError, match="none of this model's parameters"):
        fp32_state_dict(model, foreign)


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
def test_hot_path_forces_no_host_sync_on_cuda():
    model = Mixed([torch.bfloat16, torch.bfloat16]).cuda()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loss_of(model, torch.randn(4, 8, device="cuda")).backward()
    half, two = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    x = torch.randn(4, 8, device="cuda")
    try:
        torch.cuda.set_sync_debug_mode("error")
        opt.unscale_grads_(half)
        opt.step()
        loss_of(model, x).backward()
        opt.step(grad_scale=two)
        opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
