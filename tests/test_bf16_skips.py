"""bf16 (no loss scale) skips a step whose gradients hold inf/NaN, as fp16's scaler does: the
weights, the masters, the moments, the step count and the schedule stay as they were, the first
skip warns, and a run of skips raises an error naming the parameters."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_skip_on_device import OpOrder
from testmodels import norm_mlp
from testmodels import regression_batch as batch
from torch import nn

import mixprec as mp

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

CASES = [("O1", None), ("O3", None), *[("O2", m) for m in ("fp32", "split", "kahan", "stochastic")]]


def net():
    return norm_mlp(nn.BatchNorm1d)


def snapshot(model, opt) -> dict:
    """Every tensor a step could change: weights, buffers, masters, moments, step counts."""
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    out.update({f"fp32.{k}": v.clone() for k, v in mp.fp32_state_dict(model).items()})
    state = copy.deepcopy(opt.state_dict()["state"])
    for i, entry in state.items():
        out.update({f"opt.{i}.{k}": torch.as_tensor(v) for k, v in entry.items()})
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def finite(d: dict) -> bool:
    return all(torch.isfinite(v).all() for v in d.values() if v.is_floating_point())


def engine_and_model(level, master, **kwargs):
    amp = mp.MixedPrecision(level=level, dtype="bf16", master=master, **kwargs)
    model = net()
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return amp, model, opt


def backward(amp, model, i, poison=False):
    x, y = batch(i)
    amp.backward(F.mse_loss(model(x).float(), y))
    if poison:  # one gradient value NaN: the forward (and the BatchNorm statistics) stay clean
        with torch.no_grad():
            model[3].weight.grad[0, 0] = float("nan")


def skip(amp, model, opt, steps: int) -> None:
    """``steps`` steps in a row with a NaN gradient: each is skipped."""
    for i in range(steps):
        backward(amp, model, i, poison=True)
        assert not amp.step(opt)
        opt.zero_grad()


@pytest.mark.parametrize("level,master", CASES)
def test_a_nonfinite_step_is_skipped_and_leaves_everything_untouched(level, master):
    amp, model, opt = engine_and_model(level, master)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    backward(amp, model, 0)
    assert amp.step(opt)
    sched.step()
    opt.zero_grad()
    before, lr = snapshot(model, opt), sched.get_last_lr()
    backward(amp, model, 1, poison=True)
    before = {**before, **{k: v for k, v in snapshot(model, opt).items()
                           if "running" in k or "num_batches" in k}}  # this forward's statistics
    with pytest.warns(RuntimeWarning, match=r"skipped a step: gradients hold inf/NaN \(3\.weight"):
        applied = amp.step(opt)
    assert applied is False
    if applied:
        sched.step()
    opt.zero_grad()
    assert same(snapshot(model, opt), before)
    assert sched.get_last_lr() == lr
    assert (amp.scaler.skipped_steps, amp.scaler.applied_steps) == (1, 1)
    backward(amp, model, 2)
    assert amp.step(opt)  # the run goes on, finite; the second skip would not warn again
    model(batch(3)[0])
    assert finite(snapshot(model, opt))


@pytest.mark.parametrize("level,master", [("O1", None), ("O2", "fp32"), ("O2", "split")])
def test_consecutive_skips_beyond_the_bound_raise_naming_the_first_parameter(level, master):
    amp, model, opt = engine_and_model(level, master, max_consecutive_skips=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        skip(amp, model, opt, 2)
        backward(amp, model, 5)  # a clean step resets the count
        assert amp.step(opt)
        opt.zero_grad()
        skip(amp, model, opt, 2)
        backward(amp, model, 2, poison=True)
        with pytest.raises(mp.NonFiniteGradientsError,
                           match=r"inf/NaN for 3 steps in a row \(max_consecutive_skips=3\).*"
                                 r"first parameter with a non-finite gradient: 3\.weight") as err:
            amp.step(opt)
    assert err.value.parameters[0].startswith("3.weight")


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True])
def test_a_bad_bound_is_refused(bad):
    with pytest.raises(ValueError, match="max_consecutive_skips must be an integer >= 1"):
        mp.MixedPrecision(level="O2", dtype="bf16", max_consecutive_skips=bad)


def test_no_bound_never_raises_and_the_bound_travels_in_the_state_dict():
    amp, model, opt = engine_and_model("O2", "fp32", max_consecutive_skips=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        skip(amp, model, opt, 10)
    assert amp.scaler.skipped_steps == 10
    other = mp.MixedPrecision(level="O2", dtype="bf16")
    other.setup(net())
    other.load_state_dict(amp.state_dict())
    assert other.scaler.max_consecutive_skips is None and other.scaler.skipped_steps == 10


def test_fp16_keeps_its_dynamic_scaler_and_the_bound_is_its_limit_at_the_minimum_scale():
    amp = mp.MixedPrecision(level="O2", dtype="fp16", max_consecutive_skips=5)
    amp.setup(net())
    assert isinstance(amp.scaler, mp.DynamicLossScaler)
    assert amp.scaler.config.max_skips_at_min == 5
    with pytest.raises(ValueError, match="set it on the scaler"):
        mp.make_loss_scaler(mp.NoLossScaler(), "bf16", max_consecutive_skips=3)
    assert not mp.make_loss_scaler("none").skip_nonfinite  # no dtype: a plain no-op
    assert not mp.make_loss_scaler("auto", "fp32").skip_nonfinite  # O0 is torch's own step


def test_the_trainer_skips_and_leaves_the_scheduler_alone():
    calls = []

    def loss_fn(out, y):
        calls.append(1)
        loss = F.mse_loss(out.float(), y)
        return loss * float("nan") if len(calls) == 2 else loss

    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = mp.Trainer(model, loss_fn, opt, level="O2", dtype="bf16", scheduler=sched,
                         progress=False)
    with pytest.warns(RuntimeWarning, match="skipped a step"):
        history = trainer.fit([batch(i) for i in range(4)])
    assert history.skipped == [False, True, False, False]
    assert sched.last_epoch == 3
    assert finite({k: v for k, v in trainer.model.state_dict().items()})


# ----------------------------------------------------------------------- the integrations
SKIP_WARNING = "ignore:skipped a step:RuntimeWarning"


@pytest.mark.filterwarnings(SKIP_WARNING)
def test_the_accelerator_skips_and_leaves_the_scheduler_alone():
    pytest.importorskip("accelerate")
    from mixprec.integrations.accelerate import MixprecAccelerator

    acc = MixprecAccelerator(level="O2", dtype="bf16", cpu=True)
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    model, opt, sched = acc.prepare(model, opt, sched)
    skipped = []
    for i in range(3):
        before = snapshot(model, opt.optimizer)
        x, y = batch(i)
        loss = F.mse_loss(model(x).float(), y)
        acc.backward(loss * float("nan") if i == 1 else loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
        after = snapshot(model, opt.optimizer)
        if skipped[-1]:
            assert same({k: v for k, v in after.items() if "running" not in k
                         and "num_batches" not in k},
                        {k: v for k, v in before.items() if "running" not in k
                         and "num_batches" not in k})
    assert skipped == [False, True, False]
    assert sched.scheduler.last_epoch == 2  # stepped after the applied updates only
    assert finite(snapshot(model, opt.optimizer))


class _NanAt(nn.Module):
    """A Hugging Face-style model: returns ``{"loss": ...}``, NaN at the ``at``-th call."""

    def __init__(self, at: int):
        super().__init__()
        self.net, self.at, self.calls = net(), at, 0

    def forward(self, x, y):
        self.calls += 1
        loss = F.mse_loss(self.net(x).float(), y)
        return {"loss": loss * float("nan") if self.calls == self.at else loss}


@pytest.mark.filterwarnings(SKIP_WARNING)
def test_the_hugging_face_trainer_skips_and_leaves_the_scheduler_alone(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mixprec.integrations.transformers import MixprecTrainer

    transformers.logging.set_verbosity_error()
    rows = [dict(zip(("x", "y"), batch(i))) for i in range(4)]
    data = [{"x": r["x"][j], "y": r["y"][j]} for r in rows for j in range(8)]
    model = _NanAt(at=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    args = transformers.TrainingArguments(
        str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=8,
        num_train_epochs=1, save_strategy="no", disable_tqdm=True, seed=0,
        train_sampling_strategy="sequential")
    trainer = MixprecTrainer(model, args, train_dataset=data, optimizers=(opt, sched),
                             level="O2", dtype="bf16")
    trainer.train()
    assert trainer.state.global_step == 4
    assert trainer.mixed_precision.scaler.skipped_steps == 1
    assert sched.last_epoch == 3  # 3 applied updates
    assert finite(dict(model.state_dict()))


@pytest.mark.filterwarnings(SKIP_WARNING)
def test_the_lightning_plugin_skips_and_leaves_the_scheduler_alone():
    L = pytest.importorskip("lightning.pytorch")
    from mixprec.integrations.lightning import MixprecPrecision

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.weights = net(), []

        def training_step(self, b, i):
            loss = F.mse_loss(self.net(b[0]).float(), b[1])
            return loss * float("nan") if i == 1 else loss

        def on_train_batch_start(self, b, i):
            self.weights.append(mp.fp32_state_dict(self.net))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module = Module()
    plugin = MixprecPrecision(level="O2", dtype="bf16")
    trainer = L.Trainer(plugins=[plugin], accelerator="cpu", max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader([batch(i) for i in range(4)],
                                                    batch_size=None))
    w = module.weights
    weights = {k: v for k, v in w[2].items() if "running" not in k and "num_batches" not in k}
    assert same(weights, {k: w[1][k] for k in weights})  # step 1 skipped
    assert not same(w[3], w[2])
    assert plugin.scaler.skipped_steps == 1
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3  # 3 applied updates
    assert finite(mp.fp32_state_dict(module.net))


def test_the_flag_goes_to_torchs_fused_kernel_and_is_read_once_after_the_step():
    amp, model, opt = engine_and_model("O2", "fp32")
    for i in range(2):
        backward(amp, model, i)
        assert amp.step(opt)
        opt.zero_grad()
    assert opt.skips_on_device()
    before = snapshot(model, opt)
    backward(amp, model, 2, poison=True)
    before = {**before, **{k: v for k, v in snapshot(model, opt).items()
                           if "running" in k or "num_batches" in k}}
    with OpOrder() as order, pytest.warns(RuntimeWarning, match="skipped a step"):
        assert amp.step(opt) is False
    assert same(snapshot(model, opt), before)  # the kernel skipped, step counts included
    reads = [i for i, op in enumerate(order.ops) if op == "aten._local_scalar_dense"]
    assert reads and reads[0] > order.ops.index("aten._fused_adamw_")  # no read before it
    opt.zero_grad()
    backward(amp, model, 3)
    with OpOrder() as order:
        assert amp.step(opt)
    reads = [i for i, op in enumerate(order.ops) if op == "aten._local_scalar_dense"]
    assert len(reads) == 1 and reads[0] > order.ops.index("aten._fused_adamw_")


@pytest.mark.parametrize("dtype,scale", [("bf16", 1.0), ("fp16", 128.0)])
def test_a_fixed_loss_scale_takes_the_bound_too(dtype, scale):
    """A fixed scale can fix no overflow: every skip counts toward ``max_consecutive_skips``
    (it was accepted and dropped); a StaticLossScaler made by hand keeps MindSpore's rule."""
    amp = mp.MixedPrecision(level="O2", dtype=dtype, loss_scale=scale, max_consecutive_skips=2)
    second_skip_raises(amp, r"2 steps in a row \(max_consecutive_skips=2\) at the fixed loss "
                            r"scale .*first parameter with a non-finite gradient: 3\.weight")
    assert isinstance(amp.scaler, mp.StaticLossScaler)
    assert mp.StaticLossScaler(8.0).max_consecutive_skips is None
    restored = mp.StaticLossScaler(8.0)
    restored.load_state_dict(amp.scaler.state_dict())
    assert restored.max_consecutive_skips == 2


def test_a_static_scaler_s_bound_survives_an_earlier_version_s_state_dict():
    """A state dict of a version without the bound (a resumed run) keeps the scaler's own (it
    was read as "no bound": the resumed run skipped forever again)."""
    scaler = mp.StaticLossScaler(16.0, max_consecutive_skips=4)
    old = scaler.state_dict()
    old["config"] = {"skip_on_overflow": True}
    scaler.load_state_dict(old)
    assert scaler.max_consecutive_skips == 4
    with pytest.raises(ValueError, match="skip_on_overflow=False skips none"):
        mp.StaticLossScaler(16.0, skip_on_overflow=False, max_consecutive_skips=4)


def test_the_fp16_bound_error_names_its_keyword_and_the_first_parameter():
    amp = mp.MixedPrecision(level="O2", dtype="fp16",
                            loss_scale=mp.DynamicLossScaler(init_scale=1.0, max_skips_at_min=2))
    second_skip_raises(amp, r"max_skips_at_min=2; the precision keyword max_consecutive_skips= "
                            r"sets it.*first parameter with a non-finite gradient: 3\.weight")


def second_skip_raises(amp, match: str) -> None:
    """A model set up on ``amp``: one skipped step, then a second that raises ``match``."""
    model = net()
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    skip(amp, model, opt, 1)
    backward(amp, model, 1, poison=True)
    with pytest.raises(mp.NonFiniteGradientsError, match=match):
        amp.step(opt)


@pytest.mark.parametrize("level,master", [("O1", None), ("O2", "fp32"), ("O2", "split")])
@pytest.mark.parametrize("clip", ["norm", "value", "unscale"])
def test_a_micro_batch_after_a_clip_is_checked_too(level, master, clip):
    """Clipping (or unscale_) after each micro-batch: the inf/NaN check was made at the first
    clip, and a NaN gradient of a later micro-batch was stepped into every weight."""
    amp, model, opt = engine_and_model(level, master)
    before = snapshot(model, opt)
    for i in range(2):
        backward(amp, model, i, poison=i == 1)
        if clip == "norm":
            amp.clip_grad_norm_(opt, 0.5)
        elif clip == "value":
            amp.clip_grad_value_(opt, 0.01)
        elif i == 0:
            amp.unscale_(opt)
    with pytest.warns(RuntimeWarning, match="skipped a step"):
        assert amp.step(opt) is False
    opt.zero_grad()
    after = snapshot(model, opt)
    assert same({k: v for k, v in after.items() if "running" not in k and "num_b" not in k},
                {k: v for k, v in before.items() if "running" not in k and "num_b" not in k})


def test_split_clipped_after_each_micro_batch_steps_as_fp32_masters():
    """bf16 split clipped the sum of a later micro-batch in bf16 (its fp32 copies were of the
    first): its update differed from fp32 masters' by 2.3e-4; now their masters agree bit for
    bit, as for one clip per step."""
    runs = {}
    for master in ("fp32", "split"):
        amp, model, opt = engine_and_model("O2", master)
        for i in range(2):
            backward(amp, model, i)
            amp.clip_grad_norm_(opt, 0.05)
        assert amp.step(opt)
        runs[master] = mp.fp32_state_dict(model)
    assert same(runs["fp32"], runs["split"])


def test_a_backward_after_a_clip_folded_into_the_step_is_refused_in_bf16_too():
    """The scaler's own clip_grad_norm_ folds the clip into the step (applied when it runs): a
    backward after it would be clipped with the earlier gradients' factor."""
    model = net()
    opt = mp.MasterWeightOptimizer(torch.optim.SGD(model.to(torch.bfloat16).parameters(),
                                                   lr=0.1))
    scaler = mp.make_loss_scaler(None, dtype="bf16")
    for i in range(2):
        x, y = batch(i)
        scaler.scale(F.mse_loss(model(x.bfloat16()).float(), y)).backward()
        if i == 0:
            scaler.clip_grad_norm_(opt, 0.5)
    with pytest.raises(RuntimeError, match="step\\(\\) after a backward that followed unscale_"
                                           "\\(\\) or clip_grad_norm_\\(\\).*folded into the step"):
        scaler.step(opt)


@pytest.mark.parametrize("master", ["fp32", "split"])
def test_a_loss_scaled_without_a_backward_after_a_clip_changes_nothing(master):
    """A logged ``amp.scale(loss)`` (no backward) between a clip and the step: counted as a
    backward, it made the fp32 gradients again from the model's bf16 ones (7.6e-7 off) or, after
    the scaler's own folded clip, refused the step."""
    runs = []
    for extra in (False, True):
        amp, model, opt = engine_and_model("O2", master)
        backward(amp, model, 0)
        amp.clip_grad_norm_(opt, 1e-3)
        if extra:
            amp.scale(torch.tensor(0.5))  # a logged value
        assert amp.step(opt)
        runs.append(mp.fp32_state_dict(model))
    assert same(*runs)
    model = net()
    opt = mp.MasterWeightOptimizer(torch.optim.SGD(model.to(torch.bfloat16).parameters(),
                                                   lr=0.1))
    scaler = mp.make_loss_scaler(None, dtype="bf16")
    x, y = batch(0)
    loss = F.mse_loss(model(x.bfloat16()).float(), y)
    scaler.scale(loss).backward()
    scaler.clip_grad_norm_(opt, 0.5)
    scaler.scale(loss.detach())
    assert scaler.step(opt)


def test_the_first_skip_warning_points_at_the_users_line():
    """It pointed at ``torch/_dynamo/eval_frame.py`` (the step runs eagerly under dynamo's
    wrapper): the warning names the line of this file that called ``amp.step`` or
    ``scaler.step``."""
    model = net()
    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, _ = batch(0)
    amp.backward(model(x).float().sum() * float("inf"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp.step(opt)
    skips = [w for w in caught if "skipped a step" in str(w.message)]
    assert len(skips) == 1 and skips[0].filename == __file__
