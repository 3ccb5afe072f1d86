"""The Lightning precision plugin: the same numbers as mp.Trainer, exact resume, fp32 weights."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import mixprec as mp

L = pytest.importorskip("lightning.pytorch")
from mixprec.averaging import fp32_parameters  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning"),
              pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings."
                                         "PossibleUserWarning")]

OVERFLOW_AT = 2
TOL = 1e-5  # master weights against mp.Trainer (measured: <= 6e-8; see docs/integrations.md)
LOSS_SCALES = {"bf16": 1.0, "fp16": "dynamic"}  # bf16: a unit scale that still skips on inf/NaN


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def data(n=6, overflow_at=OVERFLOW_AT):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]
    if overflow_at is not None:
        x, y = batches[overflow_at]
        batches[overflow_at] = (x, torch.full_like(y, float("nan")))  # NaN gradients: a skip
    return batches


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = net()
        self.seen = []  # true gradient norms seen by on_before_optimizer_step

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
        self.seen.append(torch.stack([g.float().norm() for g in grads]).norm().item())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(plugin, **kwargs):
    options = dict(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                   enable_checkpointing=False, enable_model_summary=False)
    return L.Trainer(plugins=[plugin], **{**options, **kwargs})


def loader(batches):
    return torch.utils.data.DataLoader(batches, batch_size=None)


def reference(batches, level, dtype, **kwargs):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    ref = mp.Trainer(model, F.mse_loss, opt, level=level, dtype=dtype, scheduler=sched,
                     loss_scale=LOSS_SCALES[dtype], progress=False, **kwargs)
    return ref, ref.fit(batches)


def weights(model: nn.Module) -> dict:
    """The fp32 weights (the masters at O2) by the plain network's names."""
    return {k.removeprefix("net."): v for k, v in mp.fp32_state_dict(model).items()}


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = weights(a), weights(b)
    assert sa.keys() == sb.keys()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_training_matches_mp_trainer_with_an_overflow(level, dtype):
    batches = data()
    module = Regressor()
    plugin = MixprecPrecision(level=level, dtype=dtype, loss_scale=LOSS_SCALES[dtype])
    fit = trainer(plugin, gradient_clip_val=0.5)
    fit.fit(module, loader(batches))
    ref, history = reference(batches, level, dtype, max_grad_norm=0.5)

    assert max_diff(module, ref.model) <= TOL
    assert plugin.scaler.skipped_steps == sum(history.skipped) == 1
    assert fit.global_step == len(batches)  # a skipped step is no error and still counts
    assert plugin.scaler.get_scale() == ref.scaler.get_scale()
    scheduler = fit.lr_scheduler_configs[0].scheduler
    assert scheduler.get_last_lr() == ref.scheduler.get_last_lr()  # stepped on applied steps only
    if level == "O2":
        assert isinstance(fit.optimizers[0], mp.MasterWeightOptimizer)
        assert module.net[0].weight.dtype == mp.Policy.from_level("O2", dtype).param_dtype
    assert plugin.engine.policy == plugin.policy == mp.policy_of(module)


def test_accumulation_and_value_clipping_match_the_engine_loop():
    batches = data(8, overflow_at=5)
    module = Regressor()
    plugin = MixprecPrecision(level="O2", dtype="fp16")
    trainer(plugin, accumulate_grad_batches=2, gradient_clip_val=0.05,
            gradient_clip_algorithm="value").fit(module, loader(batches))

    model = net()
    amp = mp.MixedPrecision(level="O2", dtype="fp16")
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    for i in range(0, len(batches), 2):
        for x, y in batches[i:i + 2]:
            amp.backward(F.mse_loss(model(x), y) / 2)
        amp.clip_grad_value_(opt, 0.05)
        if amp.step(opt):
            sched.step()
        opt.zero_grad()
    assert max_diff(module, model) <= TOL
    assert plugin.scaler.skipped_steps == amp.scaler.skipped_steps == 1


def test_hooks_see_the_true_gradients_under_a_loss_scale():
    batches = data(3, overflow_at=None)
    seen = {}
    for scale in (1.0, 2.0 ** 12):
        module = Regressor()
        trainer(MixprecPrecision(level="O2", dtype="fp16", loss_scale=scale)).fit(
            module, loader(batches))
        seen[scale] = module.seen
    assert seen[2.0 ** 12] == pytest.approx(seen[1.0], rel=1e-3)


def test_fit_from_a_checkpoint_resumes_exactly_and_saves_fp32_weights(tmp_path):
    batches = data(4, overflow_at=1)
    whole, uninterrupted = Regressor(), MixprecPrecision(level="O2", dtype="fp16")
    trainer(uninterrupted, max_epochs=2).fit(whole, loader(batches))

    first = Regressor()
    plugin = MixprecPrecision(level="O2", dtype="fp16")
    fit = trainer(plugin)
    fit.fit(first, loader(batches))
    fit.save_checkpoint(tmp_path / "one.ckpt")
    ckpt = torch.load(tmp_path / "one.ckpt", weights_only=True)
    masters = mp.fp32_state_dict(first)
    assert all(v.dtype == torch.float32 for v in ckpt["state_dict"].values())
    assert all(torch.equal(ckpt["state_dict"][k], masters[k]) for k in masters)
    assert ckpt["MixprecPrecision"]["policy"] == plugin.policy.state_dict()
    assert ckpt["MixprecPrecision"]["scaler"]["scale"] == plugin.scaler.get_scale() < 2.0 ** 16

    resumed = Regressor()
    again = MixprecPrecision(level="O2", dtype="fp16")
    trainer(again, max_epochs=2).fit(resumed, loader(batches), ckpt_path=tmp_path / "one.ckpt")
    assert max_diff(resumed, whole) == 0.0
    assert again.scaler.state_dict() == uninterrupted.scaler.state_dict()


class Dropping(Regressor):
    """A Regressor with dropout: each step draws from the global torch RNG."""

    def __init__(self):
        super().__init__()
        self.net.insert(3, nn.Dropout(0.5))


def test_a_model_with_dropout_resumes_bitwise_from_an_epoch_end(tmp_path):
    """Lightning saves no RNG state: the plugin's state carries it (a resumed run otherwise
    draws other dropout masks than the uninterrupted one)."""
    batches = data(4, overflow_at=None)
    whole = Dropping()
    trainer(MixprecPrecision(level="O2", dtype="bf16"), max_epochs=3).fit(whole, loader(batches))

    fit = trainer(MixprecPrecision(level="O2", dtype="bf16"))
    fit.fit(Dropping(), loader(batches))
    fit.save_checkpoint(tmp_path / "epoch0.ckpt")
    saved = torch.load(tmp_path / "epoch0.ckpt", weights_only=True)["MixprecPrecision"]
    assert torch.equal(saved["rng_states"][0]["torch"], torch.get_rng_state())

    resumed = Dropping()
    torch.manual_seed(1234)  # another global RNG state: the checkpoint's must replace it
    trainer(MixprecPrecision(level="O2", dtype="bf16"), max_epochs=3).fit(
        resumed, loader(batches), ckpt_path=tmp_path / "epoch0.ckpt")
    assert max_diff(resumed, whole) == 0.0


def test_a_checkpoint_of_another_policy_is_refused_showing_both(tmp_path):
    batches = data(2, overflow_at=None)
    fit = trainer(MixprecPrecision(level="O2", dtype="bf16"))
    fit.fit(Regressor(), loader(batches))
    fit.save_checkpoint(tmp_path / "o2.ckpt")
    with pytest.raises(ValueError, match=r"made under the policy O2\(.*but this run uses O1\("):
        trainer(MixprecPrecision(level="O1", dtype="bf16"), max_epochs=2).fit(
            Regressor(), loader(batches), ckpt_path=tmp_path / "o2.ckpt")


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightning_amp_as_well_is_a_clear_error(precision):
    with pytest.raises(ValueError, match=r"Received both `precision=.*` and "
                                         r"`plugins=MixprecPrecision\(MixedPrecision\(O2"):
        trainer(MixprecPrecision(level="O2", dtype="bf16"), precision=precision)


def test_a_strategy_that_wraps_the_model_is_refused():
    plugin = MixprecPrecision(level="O2", dtype="bf16")
    with pytest.raises(RuntimeError, match="hand it the LightningModule.*passed Sequential"):
        plugin.connect(net(), [], [])


def test_manual_optimization_steps_through_the_engine():
    class Manual(Regressor):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            self.manual_backward(F.mse_loss(self(x), y))
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    batches = data()
    module = Manual()
    plugin = MixprecPrecision(level="O2", dtype="fp16")
    trainer(plugin).fit(module, loader(batches))

    model = net()
    amp = mp.MixedPrecision(level="O2", dtype="fp16")
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in batches:
        amp.backward(F.mse_loss(model(x), y))
        amp.clip_grad_norm_(opt, 0.5)
        amp.step(opt)
        opt.zero_grad()
    assert max_diff(module, model) <= TOL
    assert plugin.scaler.skipped_steps == 1


def test_manual_optimization_clipping_two_optimizers_before_stepping_them():
    """``clip_gradients(o1); clip_gradients(o2); o1.step(); o2.step()`` at fp16: each step
    updates the scale, and o2's clip (folded into its step) outlives o1's update: the same
    bits as the engine's ``amp.step(o1, o2)`` (the update dropped it: o2 stepped unclipped)."""
    class Two(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()
            self.automatic_optimization = False

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            o1, o2 = self.optimizers()
            x, y = batch
            self.manual_backward(F.mse_loss(self(x), y))
            for opt in (o1, o2):
                self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            o1.step()
            o2.step()
            o1.zero_grad()
            o2.zero_grad()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                    torch.optim.SGD([*self.net[1].parameters(), *self.net[3].parameters()],
                                    lr=0.1)]

    batches = data(n=3, overflow_at=None)
    module = Two()
    trainer(MixprecPrecision(level="O2", dtype="fp16")).fit(module, loader(batches))
    model = net()
    amp = mp.MixedPrecision(level="O2", dtype="fp16")
    model, o1, o2 = amp.setup(model, torch.optim.SGD(model[0].parameters(), lr=0.1),
                              torch.optim.SGD([*model[1].parameters(), *model[3].parameters()],
                                              lr=0.1))
    for x, y in batches:
        amp.backward(F.mse_loss(model(x), y))
        amp.clip_grad_norm_(o1, 0.05)
        amp.clip_grad_norm_(o2, 0.05)
        amp.step(o1, o2)
        o1.zero_grad()
        o2.zero_grad()
    ours, engine = weights(module), weights(model)
    assert all(torch.equal(ours[k], engine[k]) for k in engine)


@pytest.mark.parametrize("evaluate", ["validate", "predict"])
def test_a_baseline_evaluation_before_fit_keeps_the_fp32_weights(evaluate):
    """``trainer.validate(module)`` (or predict) before any fit at O2: the weights are stored in
    bf16 for it, the fp32 values stay with the model (``state_dict()`` gives them), and the
    fit after it trains bitwise as a fit alone (it was refused: the weights rounded for good)."""
    class Evaluated(Regressor):
        def validation_step(self, batch, batch_idx):
            return F.mse_loss(self(batch[0]), batch[1])

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

    batches = data(n=3, overflow_at=None)
    first, alone = Evaluated(), Evaluated()
    initial = copy.deepcopy(first.state_dict())
    run = getattr(trainer(MixprecPrecision(level="O2", dtype="bf16")), evaluate)
    run(first, loader(batches))
    assert first.net[0].weight.dtype == torch.bfloat16
    assert all(torch.equal(first.state_dict()[k], v) for k, v in initial.items())
    widened = copy.deepcopy(first).float()  # (.float() takes the kept values, as after a fit)
    assert all(torch.equal(widened.state_dict()[k], v) for k, v in initial.items())
    trainer(MixprecPrecision(level="O2", dtype="bf16")).fit(first, loader(batches))
    trainer(MixprecPrecision(level="O2", dtype="bf16")).fit(alone, loader(batches))
    ours, plain = weights(first), weights(alone)
    assert all(torch.equal(ours[k], plain[k]) for k in plain)


class _Starts(L.Callback):
    def on_train_start(self, trainer, module):
        self.values = copy.deepcopy(mp.fp32_state_dict(module))


def test_validation_after_fit_reuses_the_prepared_model_and_a_second_fit_goes_on():
    """A second fit (Lightning's Tuner.lr_find and then fit do this) was refused: its new
    optimizer's masters start from the fp32 values the model keeps, exactly."""
    batches = data(2, overflow_at=None)
    module = Regressor()
    plugin = MixprecPrecision(level="O2", dtype="bf16")
    fit = trainer(plugin)
    fit.fit(module, loader(batches))
    before = copy.deepcopy(mp.fp32_state_dict(module))
    module.validation_step = module.training_step
    fit.validate(module, loader(batches), verbose=False)
    assert all(torch.equal(v, before[k]) for k, v in mp.fp32_state_dict(module).items())
    starts = _Starts()
    again = trainer(MixprecPrecision(level="O2", dtype="bf16"), callbacks=[starts])
    again.fit(module, loader(batches))
    assert all(torch.equal(v, before[k]) for k, v in starts.values.items())
    assert not all(torch.equal(v, before[k]) for k, v in mp.fp32_state_dict(module).items())


def test_lr_find_then_fit_trains_as_fit_alone(tmp_path):
    """Lightning's tuner workflow at O2: lr_find restores the weights exactly, and the fit
    after it was refused ("prepared by an earlier run")."""
    from lightning.pytorch.tuner import Tuner
    batches = data(4, overflow_at=None)
    runs = []
    for tune in (False, True):
        module = Regressor()
        fit = trainer(MixprecPrecision(level="O2", dtype="bf16"), default_root_dir=tmp_path)
        if tune:
            Tuner(fit).lr_find(module, loader(batches), num_training=3, update_attr=False)
        fit.fit(module, loader(batches))
        runs.append(mp.fp32_state_dict(module))
    assert all(torch.equal(v, runs[0][k]) for k, v in runs[1].items())


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_compact_masters_train_as_in_mp_trainer(master):
    """master=/state_dtype= reach the engine and the run follows mp.Trainer's, the NaN batch
    skipped in both. Lightning clips the optimizer's parameters' gradients, which are the bf16
    model gradients here (mp.Trainer folds the clip factor into the step): each clipped gradient
    rounds to bf16, lr * 4 * eps(bf16) per step (Kahan: 6 steps of that); a stochastic run that
    once rounds differently drifts by a few bf16 ulps of its weights (|w| < 1: 2**-6)."""
    batches = data()
    module = Regressor()
    plugin = MixprecPrecision(level="O2", dtype="bf16", loss_scale=LOSS_SCALES["bf16"],
                              master=master, state_dtype="bf16")
    trainer(plugin, gradient_clip_val=0.5).fit(module, loader(batches))
    ref, history = reference(batches, "O2", "bf16", max_grad_norm=0.5, master=master,
                             state_dtype="bf16")
    assert mp.policy_of(module).master == master
    assert plugin.scaler.skipped_steps == sum(history.skipped) == 1
    tol = 6 * 1e-2 * 4 * 2.0 ** -8 if master == "kahan" else 2.0 ** -6
    assert max_diff(module, ref.model) <= tol


def test_toggle_optimizer_freezes_the_other_optimizers_model_parameters_at_o2():
    """Lightning's ``toggle_optimizer`` sets ``requires_grad`` on what ``param_groups`` hold: at
    O2 the fp32 masters, which now pass it to their model parameters (the discriminator of a
    GAN kept receiving the generator loss's gradients: weights 0.2 off fp32's in six steps)."""
    seen = {}

    class Gan(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.gen, self.dis = nn.Linear(8, 8), nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            opt_g, opt_d = self.optimizers()
            self.toggle_optimizer(opt_g)
            self.manual_backward(self.dis(self.gen(batch[0])).float().mean())
            seen["frozen"] = [p.requires_grad for p in self.dis.parameters()]
            seen["dis grads"] = [p.grad is not None for p in self.dis.parameters()]
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)
            seen["restored"] = [p.requires_grad for p in self.dis.parameters()]

        def configure_optimizers(self):
            return (torch.optim.SGD(self.gen.parameters(), lr=0.1),
                    torch.optim.SGD(self.dis.parameters(), lr=0.1))

    trainer(MixprecPrecision(level="O2", dtype="bf16"), max_steps=1).fit(
        Gan(), loader(data(2, overflow_at=None)))
    assert seen == {"frozen": [False, False], "dis grads": [False, False],
                    "restored": [True, True]}


@pytest.mark.parametrize("master", ["fp32", "split"])
def test_a_finetuning_callback_trains_with_split_and_is_refused_beside_fp32_masters(master):
    """Lightning's BaseFinetuning looks the optimizer's parameters up among the module's: fp32
    masters are not there (a KeyError at the first epoch); split holds the module's own."""
    class Tuned(Regressor):
        def configure_optimizers(self):
            return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()),
                                     lr=1e-2)

    module = Tuned()
    callback = L.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    module.backbone = module.net[0]
    fit = trainer(MixprecPrecision(level="O2", dtype="bf16", master=master), max_epochs=2,
                  callbacks=[callback]).fit
    if master == "fp32":
        with pytest.raises(RuntimeError, match="BackboneFinetuning maps the optimizer's "
                                               "parameters.*Use master='split'"):
            fit(module, loader(data(2, overflow_at=None)))
    else:
        fit(module, loader(data(2, overflow_at=None)))
        assert module.trainer.current_epoch == 2


class _HeadOnly(Regressor):
    only_head = False

    def configure_optimizers(self):
        params = self.net[-1].parameters() if self.only_head else self.parameters()
        return torch.optim.AdamW(params, lr=1e-2)


def test_a_second_fit_of_part_of_the_module_keeps_the_rest_s_fp32_values():
    """A second fit training the head alone (the body frozen): the body's fp32 values of the
    first fit were dropped, its state_dict() the bf16 weights upcast (9.7e-4 off)."""
    batches = data(2, overflow_at=None)
    module = _HeadOnly()
    trainer(MixprecPrecision(level="O2", dtype="bf16")).fit(module, loader(batches))
    before = copy.deepcopy(module.state_dict())
    module.only_head = True
    module.net[0].requires_grad_(False)
    trainer(MixprecPrecision(level="O2", dtype="bf16")).fit(module, loader(batches))
    after = module.state_dict()
    assert torch.equal(after["net.0.weight"], before["net.0.weight"])
    assert not torch.equal(after["net.3.weight"], before["net.3.weight"])  # (trained)


class _Reference(L.Callback):
    """torch's AveragedModel over a plain fp32 network set to the module's fp32 values after
    each batch (run after WeightAveraging's own update)."""

    def __init__(self, **averaging):
        self.plain = net()
        self.average = AveragedModel(self.plain, **averaging)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with torch.no_grad():  # (by parameter: a module's state_dict may leave keys out)
            for mine, value in zip(self.plain.parameters(), fp32_parameters(module.net)):
                mine.copy_(value)
        self.average.update_parameters(self.plain)


class _Validated(Regressor):
    def __init__(self, read_state=False):
        super().__init__()
        self.validated = []  # each validation batch's loss
        self.read_state = read_state  # validation reads the module's state_dict()
        self.register_buffer("tally", torch.zeros(4), persistent=False)

    def training_step(self, batch, batch_idx):
        self.tally += batch[1].mean(0)  # a non-persistent buffer training changes
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.read_state:
            self.state_dict()
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.validated.append(loss.item())
        return loss


class _SwapProbe(L.Callback):
    """What the averaging callback's swap holds during validation: in host memory, the module's
    tensors in their own dtypes and its state_dict (the first version held an fp32 copy of the
    average and the module on the module's device: 3x its size)."""

    def __init__(self, averaging):
        self.averaging, self.held = averaging, []

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        own, held = self.averaging._swap_models.kept
        size = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
        self.held.append((sum(t.numel() * t.element_size() for t in own), size,
                          {t.device.type for t in (*own, *(kept for _, kept in held))}))


def _averaged_fit(master, epochs, tmp_path, ckpt_path=None, from_step=0, read_state=False,
                  kind=None):
    from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging

    class Averaging(WeightAveraging):
        def should_update(self, step_idx=None, epoch_idx=None):
            return step_idx is not None and step_idx >= from_step

    averaging = {"multi_avg_fn": get_ema_multi_avg_fn(0.9)}
    callback, ref = Averaging(**averaging), _Reference(use_buffers=True, **averaging)
    saved, probe = ModelCheckpoint(dirpath=tmp_path, save_last=True), _SwapProbe(callback)
    module, batches = (kind or _Validated)(read_state), loader(data(4, overflow_at=None))
    fit = trainer(MixprecPrecision(level="O2", dtype="bf16", master=master), max_epochs=epochs,
                  callbacks=[callback, ref, saved, probe], enable_checkpointing=True,
                  num_sanity_val_steps=0)
    fit.fit(module, batches, batches, ckpt_path=ckpt_path)
    ref.probe = probe
    return module, callback._average_model, ref


@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_weight_averaging_keeps_its_average_in_fp32_from_the_masters(master, tmp_path):
    """Lightning's WeightAveraging built torch's AveragedModel before the plugin cast the module:
    the first EMA update raised a dtype error (an fp32 average, 16-bit parameters). Its average
    is now mixprec's: fp32, bit for bit torch's over the masters after two epochs with a
    validation each (whose swap rounded the average to bf16); saved exactly in the checkpoint's
    state_dict; and, when the fit ends, the module's fp32 values (its 16-bit weights took the
    average's rounding through .data, and the masters followed them: up to 1.3e-3 off)."""
    module, average, ref = _averaged_fit(master, 2, tmp_path)
    assert isinstance(average, mp.AveragedModel)
    assert ref.probe.held and all(held == size and devices == {"cpu"}
                                  for held, size, devices in ref.probe.held)
    assert module.net[0].weight.dtype == torch.bfloat16
    ours = {k.removeprefix("module.net."): v for k, v in average.state_dict().items()}
    theirs = {k.removeprefix("module."): v for k, v in ref.average.state_dict().items()}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], v) and v.dtype == ours[k].dtype for k, v in theirs.items())
    stored = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(stored["net." + k], v) for k, v in theirs.items()
               if k != "n_averaged")
    final = weights(module)  # a Kahan pair holds about 16 significant bits of a value
    tol = 0 if master == "fp32" else 2.0 ** -16
    for k, v in theirs.items():
        if k != "n_averaged":
            torch.testing.assert_close(final[k], v, rtol=tol, atol=0)
    assert torch.equal(module.net[0].weight, theirs["0.weight"].bfloat16())
    assert torch.equal(module.tally, average.module.tally)  # (non-persistent: Lightning's copy)


class _Partial(_Validated):
    """A module that leaves keys out of its state_dict (Lightning's partial checkpoints, with
    ``strict_loading = False``) and keeps extra state."""

    def __init__(self, read_state=False):
        super().__init__(read_state)
        self.forwards = 0  # extra state: the swap must not roll it back
        self.strict_loading = False

    def forward(self, x):
        self.forwards += 1
        return super().forward(x)

    def get_extra_state(self):
        return {"forwards": self.forwards}

    def set_extra_state(self, state):
        self.forwards = state["forwards"]

    def state_dict(self, *args, **kwargs):
        return {k: v for k, v in super().state_dict(*args, **kwargs).items()
                if not k.startswith("net.0.")}


@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_a_state_dict_read_during_validation_leaves_the_training_values(master, tmp_path):
    """While validation runs the module's 16-bit weights hold the average's rounding: a
    state_dict() read then gave the masters those values (and zeroed Kahan compensations), and
    the swap back restored the 16-bit weights only (the fit ended 0.013 off one without the
    read). The module leaves keys out of its state_dict and keeps extra state (a first mend
    reloaded its state_dict: missing keys raised, the extra state went back)."""
    plain, average, _ = _averaged_fit(master, 2, tmp_path / "a", kind=_Partial)
    read, again, _ = _averaged_fit(master, 2, tmp_path / "b", read_state=True, kind=_Partial)
    assert all(torch.equal(a, b) for a, b in zip(fp32_parameters(read), fp32_parameters(plain)))
    assert all(torch.equal(a, b) for a, b in zip(average.parameters(), again.parameters()))
    assert read.forwards == plain.forwards == 2 * (4 + 4)


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.parametrize("from_step", [0, 8], ids=["averaging from the start", "from step 8"])
def test_a_fit_resumed_with_weight_averaging_continues_its_average(from_step, tmp_path):
    """The checkpoint's average, loaded into the callback before the plugin rebuilt it, was
    dropped: the resumed fit averaged from scratch (0.035 off the straight fit's). One saved
    before the average's first update (an EMA started late) was dropped by the first mend: the
    validation before that update showed the module's weights, not the average's."""
    straight, average, _ = _averaged_fit("fp32", 3, tmp_path / "a", from_step=from_step)
    _averaged_fit("fp32", 1, tmp_path / "b", from_step=from_step)
    resumed, again, _ = _averaged_fit("fp32", 3, tmp_path / "b", tmp_path / "b" / "last.ckpt",
                                      from_step=from_step)
    assert int(again.n_averaged) == int(average.n_averaged) == 12 - from_step
    assert all(torch.equal(a, b) for a, b in zip(average.parameters(), again.parameters()))
    assert all(torch.equal(v, weights(resumed)[k]) for k, v in weights(straight).items())
    assert resumed.validated == straight.validated[-len(resumed.validated):]
