"""mixprec.compat.apex_amp: scale_loss, apex's dynamic-scale rules, step skipping, several
models/optimizers/losses with injected inf, add_param_group, checkpoints.

The multi-model, add_param_group and checkpoint tests port what apex's own tests/L0/run_amp
checked (test_multiple_models_optimizers_losses, test_add_param_group, test_checkpointing) to
CPU, with differential fp32 references computed in the test.
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.compat import apex_amp as amp
from mixprec.compat.apex_state import AMP

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

LEVELS = ("O0", "O1", "O2", "O3")
DYNAMIC = ("O1", "O2")
ZEROING = ("none", "model", "optimizer")


class Pair(nn.Module):
    """``sum(x * a * b)``: ``a`` is cast at O2/O3; ``b`` is a BatchNorm's affine weight, kept fp32
    at O2 (keep_batchnorm_fp32), so an O2 optimizer holds both a master and an fp32 parameter."""

    def __init__(self, unique):
        super().__init__()
        self.a = nn.Parameter(unique + torch.arange(2.0))
        self.norm = nn.BatchNorm1d(2)
        self.norm.bias.requires_grad_(False)
        with torch.no_grad():
            self.norm.weight.copy_(1.0 + unique + torch.arange(2.0))

    def forward(self, x):
        return (x * self.a * self.norm.weight).sum()

    def trained(self):
        return [self.a, self.norm.weight]


# A scenario: models (by their "unique"), optimizers as [(model index, lr), ...] groups with a
# momentum, and losses as (models summed, optimizers passed to scale_loss).
SCENARIOS = {
    "2models2losses1optimizer": dict(
        models=(1, 2), optimizers=[([(0, 0.25), (1, 0.5)], 0.125)],
        losses=[((0,), (0,)), ((1,), (0,))]),
    "2models2losses2optimizers": dict(
        models=(1, 2), optimizers=[([(0, 0.25)], 0.125), ([(1, 0.5)], 0.25)],
        losses=[((0,), (0,)), ((1,), (1,))]),
    "3models2losses2optimizers": dict(
        models=(1, 2, 3), optimizers=[([(0, 0.25), (1, 1.0)], 0.5), ([(2, 0.5)], 0.25)],
        losses=[((0, 1), (0,)), ((2, 1), (0, 1))]),
}


def _build(spec):
    models = [Pair(u) for u in spec["models"]]
    opts = [torch.optim.SGD([{"params": models[m].trained(), "lr": lr} for m, lr in groups],
                            momentum=momentum) for groups, momentum in spec["optimizers"]]
    return models, opts


def _reference(spec, iters, skipped):
    """fp32 run; ``skipped`` holds (iteration, optimizer index) pairs whose step is left out."""
    models, opts = _build(spec)
    x = torch.ones(2)
    grads = []
    for i in range(iters):
        for opt in opts:
            opt.zero_grad()
        for model_ids, _ in spec["losses"]:
            sum(models[m](x) for m in model_ids).backward()
        grads.append([[p.grad.clone() for g in opt.param_groups for p in g["params"]]
                      for opt in opts])
        for k, opt in enumerate(opts):
            if (i, k) not in skipped:
                opt.step()
    return grads, [[p.detach().clone() for p in m.trained()] for m in models]


def _zero(how, models, opts):
    if how == "none":
        for m in models:
            for p in m.parameters():
                p.grad = None
    elif how == "model":
        for m in models:
            m.zero_grad()
    else:
        for opt in opts:
            opt.zero_grad()


def _run_amp(spec, level, how, multiple_scalers, inject):
    """inject: None, or (iteration, loss index, model index in that loss, "low" | "fp32")."""
    models, opts = _build(spec)
    n_losses = len(spec["losses"])
    models, opts = amp.initialize(models, opts, opt_level=level, verbosity=0,
                                  num_losses=n_losses if multiple_scalers else 1)
    scales = [4.0, 16.0][: n_losses if multiple_scalers else 1]
    amp.load_state_dict({f"loss_scaler{i}": {"loss_scale": s, "unskipped": 0}
                         for i, s in enumerate(scales)})
    loss_ids = list(range(n_losses)) if multiple_scalers else [0] * n_losses
    skipped = set()
    if inject is not None:
        skipped = {(inject[0], k) for k in spec["losses"][inject[1]][1]}
    ref_grads, ref_final = _reference(spec, 3 if inject else 2, skipped)
    x = torch.ones(2)
    for i in range(3 if inject else 2):
        _zero(how, models, opts)
        for j, (model_ids, opt_ids) in enumerate(spec["losses"]):
            loss = sum(models[m](x) for m in model_ids)
            with amp.scale_loss(loss, [opts[k] for k in opt_ids], loss_id=loss_ids[j]) as scaled:
                scaled.backward()
                if inject is not None and inject[:2] == (i, j):
                    target = models[model_ids[inject[2]]]
                    param = target.a if inject[3] == "low" else target.norm.weight
                    param.grad[0] = float("inf")
        if inject is None or inject[0] != i:
            for opt, ref in zip(opts, ref_grads[i]):
                for master, g in zip(amp.master_params(opt), ref):
                    # measured: equal (powers-of-two scales, values exact in 16 bits)
                    torch.testing.assert_close(master.grad.float(), g, rtol=0, atol=0)
        for opt in opts:
            opt.step()
    for model, ref in zip(models, ref_final):
        for p, r in zip(model.trained(), ref):
            torch.testing.assert_close(p.float(), r, rtol=0, atol=0)  # measured: equal
    for opt in opts:
        for master in amp.master_params(opt):
            model_param = opt.inner.model_param(master) if level == "O2" else master
            assert torch.equal(model_param, master.to(model_param.dtype))
    return amp.state_dict()


def _injections(spec, level):
    if level not in DYNAMIC:
        return [None]
    return [None] + [(it, j, m, loc) for it in (0, 1) for j, (model_ids, _) in
                     enumerate(spec["losses"]) for m in range(len(model_ids))
                     for loc in ("low", "fp32")]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("level", LEVELS)
def test_multiple_models_optimizers_losses(scenario, level):
    spec = SCENARIOS[scenario]
    for how in ZEROING:
        for multiple in (True, False):
            for inject in _injections(spec, level):
                state = _run_amp(spec, level, how, multiple, inject)
                if inject is not None:
                    scaler = f"loss_scaler{inject[1] if multiple else 0}"
                    start = {"loss_scaler0": 4.0, "loss_scaler1": 16.0}[scaler]
                    assert state[scaler]["loss_scale"] == start / 2  # halved once, exactly


def test_overflow_skips_exactly_the_optimizers_passed():
    spec = SCENARIOS["3models2losses2optimizers"]
    models, opts = _build(spec)
    models, opts = amp.initialize(models, opts, opt_level="O2", num_losses=2, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 16.0, "unskipped": 0}})
    before = [[p.detach().clone() for p in m.trained()] for m in models]
    x = torch.ones(2)
    with amp.scale_loss(models[0](x) + models[1](x), opts[0], loss_id=0) as scaled:
        scaled.backward()
        models[0].a.grad[0] = float("nan")
    with amp.scale_loss(models[2](x) + models[1](x), opts, loss_id=1) as scaled:
        scaled.backward()
    for opt in opts:
        opt.step()
    assert all(torch.equal(p, b) for m, bs in zip(models[:2], before[:2])
               for p, b in zip(m.trained(), bs))                      # opt0 skipped
    assert not torch.equal(models[2].a, before[2][0])                  # opt1 stepped
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0},
                                "loss_scaler1": {"loss_scale": 16.0, "unskipped": 1}}


# -- apex's dynamic-scale rules --------------------------------------------------------------
def _linear_setup(level="O2", **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kw.setdefault("verbosity", 0)
    return amp.initialize(model, opt, opt_level=level, **kw)


def _step(model, opt, scale_input=1.0, **scale_kw):
    opt.zero_grad()
    loss = model(torch.ones(3, 4) * scale_input).float().pow(2).mean()
    with amp.scale_loss(loss, opt, **scale_kw) as scaled:
        scaled.backward()
    return opt.step(), loss


def test_initial_scale_growth_and_cap():
    model, opt = _linear_setup()
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 16, "unskipped": 0}
    _step(model, opt)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 16, "unskipped": 1}
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0 ** 16, "unskipped": 1999}})
    _step(model, opt)   # the 2000th clean exit doubles the scale
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 17, "unskipped": 0}
    model, opt = _linear_setup(max_loss_scale=2.0 ** 10)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 10  # min(2**16, max)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0 ** 10, "unskipped": 1999}})
    _step(model, opt)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 10, "unskipped": 0}


def test_overflow_halves_down_to_min_loss_scale_and_skips(capsys):
    model, opt = _linear_setup(min_loss_scale=2.0 ** 15, verbosity=1)
    capsys.readouterr()
    w = model.weight.detach().clone()
    for expected in (2.0 ** 15, 2.0 ** 15):
        _step(model, opt, scale_input=1e5)   # fp16 inputs overflow: inf loss, inf gradients
        assert amp.state_dict()["loss_scaler0"] == {"loss_scale": expected, "unskipped": 0}
    assert torch.equal(model.weight, w)
    assert capsys.readouterr().out.count("gradient overflow, skipping this step; loss scaler 0 "
                                         "reduced the loss scale to 32768.0") == 2


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_skipped_step_leaves_params_and_state_bitwise_untouched(optim):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optim == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-3))
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(6, 4)
    for _ in range(2):
        _step_data(model, opt, x)
        sched.step()
    params = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    assert _step_data(model, opt, x * 1e6) is None    # overflow: skipped
    after = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert _same(params, after)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 8 if optim == "sgd" else 1e-3 / 8)


def _step_data(model, opt, x):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    return opt.step()


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_fixed_loss_scale_never_skips():
    model, opt = _linear_setup(loss_scale=128.0)
    loss = model(torch.ones(3, 4)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss * 128)
        scaled.backward()
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 128.0, "unskipped": 1}
    w = model.weight.detach().clone()
    _step(model, opt, scale_input=1e5)  # overflow: applied anyway (apex: fixed scales never skip)
    assert not torch.equal(model.weight, w)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 128.0, "unskipped": 2}


def test_o0_and_o3_yield_the_float_loss_and_touch_nothing():
    for level in ("O0", "O3"):
        model, opt = _linear_setup(level)
        loss = model(torch.ones(3, 4)).pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            assert scaled.dtype == torch.float32 and torch.equal(scaled, loss.float())
            scaled.backward()
        assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": 0}


def test_delay_overflow_check_neither_checks_nor_updates():
    model, opt = _linear_setup()
    w = model.weight.detach().clone()
    _step(model, opt, scale_input=1e5, delay_overflow_check=True)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 16, "unskipped": 0}
    assert not torch.equal(model.weight, w)   # the step was not skipped


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_delay_unscale_accumulates_like_fp32(level):
    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    model = copy.deepcopy(ref)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0,
                                opt_level=level, dtype="bf16")
    xs = [torch.randn(3, 4) for _ in range(3)]
    for i, x in enumerate(xs):
        ref(x).float().pow(2).mean().backward()
        loss = model(x).float().pow(2).mean()
        with amp.scale_loss(loss, opt, delay_unscale=i < 2) as scaled:
            scaled.backward()
        if i < 2:
            assert amp.state_dict()["loss_scaler0"]["unskipped"] == 0
    masters = list(amp.master_params(opt))
    for m, p in zip(masters, ref.parameters()):
        torch.testing.assert_close(m.grad, p.grad, rtol=2e-2, atol=2e-2)
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1


def test_two_blocks_on_one_optimizer_add_unscaled_gradients():
    """Each block unscales its own fresh gradients with its own scale before they are summed."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    model = copy.deepcopy(ref)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0,
                                opt_level="O1", num_losses=2)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 1024.0, "unskipped": 0}})
    x = torch.randn(3, 4)
    for loss_id in (0, 1):
        with amp.scale_loss(model(x).float().pow(2).mean(), opt, loss_id=loss_id) as scaled:
            scaled.backward()
    ref(x).pow(2).mean().mul(2).backward()
    torch.testing.assert_close(model.weight.grad, ref.weight.grad, rtol=2e-3, atol=2e-3)


def test_clip_master_params_after_scale_loss():
    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    model = copy.deepcopy(ref)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0,
                                opt_level="O2", dtype="bf16")
    x = torch.randn(8, 4) * 10
    with amp.scale_loss(model(x).pow(2).mean(), opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
    ref(x).pow(2).mean().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    # the true (unscaled) norm: measured 1.3e-3 relative (bf16 gradients)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-2, atol=0)
    total = torch.cat([m.grad.flatten() for m in amp.master_params(opt)]).norm()
    assert total == pytest.approx(1.0, rel=1e-4)
    assert all(m.dtype == torch.float32 for m in amp.master_params(opt))


def test_scale_loss_errors(monkeypatch):
    monkeypatch.setattr(AMP, "session", None)
    with pytest.raises(RuntimeError, match="amp.initialize first"):
        with amp.scale_loss(torch.tensor(1.0), None):
            pass
    model, opt = _linear_setup()
    loss = model(torch.ones(1, 4)).float().sum()
    with pytest.raises(TypeError, match="returned by amp.initialize"):
        with amp.scale_loss(loss, opt.inner):
            pass
    with pytest.raises(ValueError, match="loss_id"):
        with amp.scale_loss(loss, opt, loss_id=1):
            pass
    with pytest.raises(TypeError, match="loss must be"):
        with amp.scale_loss(3.0, opt):
            pass
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: loss)


def test_state_dict_format_and_errors():
    _linear_setup(num_losses=2)
    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1"]
    assert sd["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 0}
    assert isinstance(sd["loss_scaler0"]["loss_scale"], float)
    with pytest.raises(RuntimeError, match="unexpected key"):
        amp.load_state_dict({"loss_scaler0": sd["loss_scaler0"], "optimizer": {}})
    with pytest.warns(UserWarning, match="holds 1 loss scaler"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}})
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 8.0, "unskipped": 3}
    with pytest.raises(ValueError, match="'loss_scale' and 'unskipped'"):
        amp.load_state_dict({"loss_scaler0": {"scale": 8.0}, "loss_scaler1": sd["loss_scaler1"]})


# -- add_param_group after initialize (test_add_param_group) ---------------------------------
@pytest.mark.parametrize("level", LEVELS)
def test_add_param_group_after_initialize(level):
    def train(models, opt, zero, scale_loss):
        x = torch.ones(2)
        zero(models, opt)
        scale_loss(models[0](x), opt, twice=False)
        opt.step()
        yield
        for _ in range(2):
            zero(models, opt)
            scale_loss(models[0](x) + models[1](x), opt, twice=True)
            opt.step()

    def plain_backward(loss, opt, twice):
        loss.backward(retain_graph=twice)
        if twice:
            loss.backward()

    def amp_backward(loss, opt, twice):
        for k in range(2 if twice else 1):
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward(retain_graph=twice and k == 0)

    def reference(zero_before_add):
        models = [Pair(1), Pair(2)]
        opt = torch.optim.SGD([{"params": models[0].trained(), "lr": 0.25}], momentum=0.125)
        run = train(models, opt, lambda ms, o: o.zero_grad(), plain_backward)
        next(run)
        opt.add_param_group({"params": models[1].trained(), "lr": 0.5})
        list(run)
        return [p.detach().clone() for m in models for p in m.trained()]

    for zero_before_add in (True, False):
        expected = reference(zero_before_add)
        for how in ZEROING:
            models = [Pair(1), Pair(2)]
            opt = torch.optim.SGD([{"params": models[0].trained(), "lr": 0.25}], momentum=0.125)
            models, opt = amp.initialize(models, opt, opt_level=level, verbosity=0)
            amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}})
            run = train(models, opt, lambda ms, o: _zero(how, ms, [o]), amp_backward)
            next(run)
            if zero_before_add:
                _zero(how, models, [opt])
            opt.add_param_group({"params": models[1].trained(), "lr": 0.5})
            list(run)
            got = [p for m in models for p in m.trained()]
            for g, e in zip(got, expected):
                torch.testing.assert_close(g.float(), e, rtol=0, atol=0)  # measured: equal


# -- checkpoints (test_checkpointing) ------------------------------------------------------------
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, 1, 1)
        self.bn = nn.BatchNorm2d(6)
        self.gain = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return self.bn(F.relu(self.conv(x * self.gain)))


def _train_step(model, opt, x, loss_ids):
    opt.zero_grad()
    out = model(x)
    for loss_id in loss_ids:
        with amp.scale_loss(out.float().mean(), opt, loss_id=loss_id) as scaled:
            scaled.backward(retain_graph=True)
    opt.step()
    return out


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("num_losses", [1, 2])
def test_checkpoint_recipe_resumes_bitwise(level, num_losses):
    """apex's recipe: state dicts saved after initialize, loaded after initialize."""
    torch.manual_seed(2809)
    data = [torch.randn(4, 3, 8, 8) for _ in range(8)]
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, num_losses=num_losses, verbosity=0)
    recorded = []
    for i, x in enumerate(data):
        out = _train_step(model, opt, x, range(num_losses))
        if i == 3:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "amp": amp.state_dict()}, buffer)
            checkpoint = buffer.getvalue()
        elif i > 3:
            recorded.append((out.detach().clone(), copy.deepcopy(model.state_dict()),
                             amp.state_dict()))
    ckpt = torch.load(io.BytesIO(checkpoint), weights_only=False)
    for key, value in ckpt["model"].items():
        assert value.dtype == (torch.int64 if "num_batches" in key else torch.float32), key
    restored = ConvNet()
    opt2 = torch.optim.SGD(restored.parameters(), lr=1e-3, momentum=0.9)
    restored, opt2 = amp.initialize(restored, opt2, opt_level=level, num_losses=num_losses,
                                    verbosity=0)
    restored.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    for x, (out, state, amp_state) in zip(data[4:], recorded):
        out2 = _train_step(restored, opt2, x, range(num_losses))
        assert torch.equal(out2, out)
        assert _same(restored.state_dict(), state)
        assert amp.state_dict() == amp_state


@pytest.mark.parametrize("level", DYNAMIC)
def test_loss_scale_decrease_per_loss_id(level):
    model = ConvNet()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                opt_level=level, num_losses=3, verbosity=0)
    for loss_id, overflows in enumerate((0, 1, 2)):
        for _ in range(overflows):
            opt.zero_grad()
            out = model(torch.randn(2, 3, 8, 8) * 2.0 ** 17)   # inf in fp16
            with amp.scale_loss(out.float().mean(), opt, loss_id=loss_id) as scaled:
                scaled.backward()
            opt.step()
    assert amp.state_dict() == {f"loss_scaler{i}": {"loss_scale": 2.0 ** 16 / 2 ** i,
                                                    "unskipped": 0} for i in range(3)}


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_state_dict_fp32_and_still_trains(level):
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert all(v.dtype != torch.float16 for v in model.state_dict().values())
    data, target = torch.randn(10, 3, 4, 4), torch.randn(10, 6, 4, 4)
    last = None
    for _ in range(10):
        opt.zero_grad()
        loss = F.mse_loss(model(data).float(), target)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        assert last is None or loss.item() < last
        last = loss.item()
    plain = ConvNet()
    plain.load_state_dict(model.state_dict())  # an fp32 model loads the checkpoint as it is
