"""Lightning's own precision-plugin and trainer tests, ported to ``MixprecPrecision``.

The cases follow Lightning's tests/tests_pytorch/plugins/precision/ (test_half, test_all,
test_amp, test_amp_integration, test_double) and tests/tests_pytorch/trainer/ (test_trainer's
gradient clipping and predictions, optimization/test_manual_optimization, test_backward_calls,
test_optimizers), written anew against the plugin. O3 (16-bit storage and compute) plays the
part of Lightning's ``bf16-true``/``16-true`` plugins, O1/O2 (autocast) that of its ``-mixed``
ones. The deliberate differences, each named at its test (and listed in docs/integrations.md):

* **the model is prepared in ``connect``** (after ``configure_optimizers``), not in
  ``convert_module``: the fp32 masters need the optimizers; ``convert_module`` returns the module
  as it is.
* **``module_init_context``/``tensor_init_context`` keep fp32**: the masters start from the fp32
  initialisation, not from weights made in 16 bits.
* **the model's gradients are 16-bit at O2/O3**: after clipping they read as the fp32 gradients
  the step uses, rounded to 16 bits (an fp16 value below 2**-24 reads as 0); the exact ones are
  the fp32 masters' in ``optimizer.param_groups``.
* **fp64 tensors of a batch stay fp64 at O3** (Lightning's ``-true`` plugins convert every
  floating tensor): mixprec casts fp32/fp16/bf16 only, as the model's entry does.
"""

import collections
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset  # noqa: E402
from lightning.pytorch.strategies import Strategy  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning"),
              pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings."
                                         "PossibleUserWarning"),
              pytest.mark.filterwarnings("ignore:`training_step` returned `None`:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*configure_optimizers` returned `None`")]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def trainer(plugin, **kwargs):
    options = dict(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False,
                   enable_progress_bar=False, enable_checkpointing=False,
                   enable_model_summary=False)
    return L.Trainer(plugins=[plugin], **{**options, **kwargs})


def boring(cls=BoringModel):
    torch.manual_seed(0)
    return cls()


def connected(level, dtype, model=None):
    """A plugin set up on ``model`` (a BoringModel) as Lightning's connect() would."""
    plugin = MixprecPrecision(level=level, dtype=dtype)
    plugin.connect(model if model is not None else boring(), [], [])
    return plugin


# -- plugins/precision/test_half.py, test_all.py --------------------------------------------------
@pytest.mark.parametrize("level, dtype, expected", [
    ("O3", "bf16", "bf16-true"), ("O3", "fp16", "16-true"), ("O2", "bf16", "bf16-true"),
    ("O1", "bf16", "32-true"), ("O0", "bf16", "32-true")])
def test_selected_dtype(level, dtype, expected):
    assert connected(level, dtype).precision == expected


@pytest.mark.parametrize("level, dtype, expected", [
    ("O3", "bf16", torch.bfloat16), ("O3", "fp16", torch.float16),
    ("O2", "bf16", torch.float32), ("O1", "fp16", torch.float32)])
def test_forward_context(level, dtype, expected):
    """At O3 the forward context makes the compute dtype torch's default, as Lightning's
    ``-true`` plugins; the autocast levels keep fp32, as its ``-mixed`` ones."""
    plugin = connected(level, dtype)
    assert torch.get_default_dtype() == torch.float32
    with plugin.forward_context():
        assert torch.get_default_dtype() == expected
        assert torch.tensor([0.0]).dtype == expected
        assert torch.tensor([0.0], dtype=torch.float16).dtype == torch.float16
    assert torch.get_default_dtype() == torch.float32


def test_default_dtype_is_restored():
    plugin = connected("O3", "bf16")
    with pytest.raises(RuntimeError, match="foo"), plugin.forward_context():
        assert torch.get_default_dtype() is torch.bfloat16
        raise RuntimeError("foo")
    assert torch.get_default_dtype() is torch.float32


def test_convert_module_leaves_the_model_to_connect():
    """Deliberate difference: Lightning's ``-true`` plugins cast in ``convert_module``; the
    masters need the optimizers, so the model is prepared in ``connect``."""
    plugin = MixprecPrecision(level="O3", dtype="bf16")
    module = nn.Linear(2, 2)
    assert plugin.convert_module(module) is module
    assert module.weight.dtype == torch.float32
    model = boring()
    plugin.connect(model, [], [])
    assert model.layer.weight.dtype == model.layer.bias.dtype == torch.bfloat16


def test_module_init_context_keeps_fp32():
    """Deliberate difference: Lightning's ``-true`` plugins build modules in 16 bits; mixprec's
    masters start from the fp32 initialisation."""
    plugin = MixprecPrecision(level="O3", dtype="bf16")
    with plugin.module_init_context(), plugin.tensor_init_context():
        layer = nn.Linear(2, 2)
        assert torch.get_default_dtype() == torch.float32
    assert layer.weight.dtype == torch.float32


@pytest.mark.parametrize("level, dtype", [("O3", "bf16"), ("O2", "fp16")])
def test_configure_model(level, dtype):
    class MyModel(L.LightningModule):
        def configure_model(self):
            self.layer = nn.Linear(1, 3)
            assert self.layer.weight.dtype == torch.float32  # (see the test above)

        def test_step(self, batch, batch_idx):
            return self.layer(batch).float().sum()

    model = MyModel()
    trainer(MixprecPrecision(level=level, dtype=dtype)).test(
        model, torch.utils.data.DataLoader(torch.ones(2, 1)), verbose=False)
    assert model.layer.weight.dtype == DTYPES[dtype]


# -- plugins/precision/test_double.py: the batch, sub-modules and tensors made in a step ----------
class FloatIntDataset(torch.utils.data.Dataset):
    def __init__(self, size=32, length=8):
        self.floats, self.ints = torch.randn(length, size), torch.randint(10, (length, 1))

    def __getitem__(self, index):
        return self.floats[index], self.ints[index]

    def __len__(self):
        return len(self.floats)


class NoForward(BoringModel):
    """Every step feeds the batch to a sub-module, bypassing the model's entry (Lightning's
    DoublePrecisionBoringModelNoForward)."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype_seen, self.expected = collections.Counter(), dtype

    def _check(self, batch, what):
        assert batch.dtype == self.expected, what
        out = self.layer(batch)
        assert out.dtype == self.expected, what
        self.dtype_seen[what] += 1
        return out

    def training_step(self, batch, batch_idx):
        return {"loss": self.loss(self._check(batch, "train"))}

    def validation_step(self, batch, batch_idx):
        return {"x": self.loss(self._check(batch, "val"))}

    def test_step(self, batch, batch_idx):
        return {"y": self.loss(self._check(batch, "test"))}

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self._check(batch, "predict")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_o3_steps_that_call_a_sub_module_get_the_batch_in_the_compute_dtype(dtype):
    """``self.loss(self.layer(batch))`` at O3 raised 'mat1 and mat2 must have the same dtype';
    Lightning's ``-true`` plugins convert the batch (``convert_input``), and so does O3."""
    model = boring(lambda: NoForward(DTYPES[dtype]))
    loader = torch.utils.data.DataLoader(RandomDataset(32, 8), batch_size=4)
    fit = trainer(MixprecPrecision(level="O3", dtype=dtype), limit_val_batches=1)
    fit.fit(model, loader, loader)
    fit.test(model, loader, verbose=False)
    preds = fit.predict(model, loader)
    assert preds[0].dtype == DTYPES[dtype]
    assert set(model.dtype_seen) == {"train", "val", "test", "predict"}


def test_o2_steps_that_call_a_sub_module_compute_under_autocast():
    """At O2 the batch stays fp32 (autocast casts for each op, the targets keep fp32)."""
    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            assert batch.dtype == torch.float32
            out = self.layer(batch)
            assert out.dtype == torch.bfloat16  # autocast in the forward context
            return self.loss(out)

    model = boring(Model)
    trainer(MixprecPrecision(level="O2", dtype="bf16")).fit(model)
    assert model.layer.weight.dtype == torch.bfloat16


def test_o3_casts_the_floating_tensors_of_a_batch_only():
    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            floats, ints = batch
            assert floats.dtype == torch.bfloat16 and ints.dtype == torch.int64
            assert torch.tensor([0.0]).dtype == torch.bfloat16  # made inside the step
            return super().training_step(floats, batch_idx)

        def on_train_epoch_end(self):
            assert torch.tensor([0.0]).dtype == torch.float32  # not inside a step

        def train_dataloader(self):
            return torch.utils.data.DataLoader(FloatIntDataset(), batch_size=4)

    plugin = MixprecPrecision(level="O3", dtype="bf16")
    trainer(plugin, max_epochs=1, max_steps=-1).fit(boring(Model))
    nested = plugin.convert_input({"a": [torch.ones(1), torch.ones(1, dtype=torch.float64)],
                                   "b": (torch.ones(1, dtype=torch.float16), 3)})
    assert nested["a"][0].dtype == torch.bfloat16 and nested["b"][0].dtype == torch.bfloat16
    assert nested["a"][1].dtype == torch.float64  # deliberate difference: fp64 stays
    assert nested["b"][1] == 3


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_autocast_levels_leave_the_batch_as_it_is(level):
    plugin = connected(level, "bf16")
    batch = {"x": torch.ones(2), "y": torch.ones(2, dtype=torch.float64)}
    assert plugin.convert_input(batch) is batch


# -- plugins/precision/test_amp.py ----------------------------------------------------------------
def test_clip_gradients_dispatch_and_no_op():
    """``clip_gradients`` is a no-op without a clip value, by value or by norm otherwise."""
    plugin = connected("O2", "bf16")
    optimizer = mock.Mock()
    with mock.patch.object(plugin.engine, "clip_grad_value_") as by_value, \
            mock.patch.object(plugin.engine, "clip_grad_norm_") as by_norm, \
            mock.patch.object(plugin.engine, "unscale_"), \
            mock.patch.object(plugin.engine, "is_unscaled", return_value=True):
        plugin.clip_gradients(optimizer)
        by_value.assert_not_called()
        by_norm.assert_not_called()
        plugin.clip_gradients(optimizer, clip_val=1.0,
                              gradient_clip_algorithm=GradClipAlgorithmType.VALUE)
        by_value.assert_called_once()
        by_norm.assert_not_called()
        plugin.clip_gradients(optimizer, clip_val=1.0,
                              gradient_clip_algorithm=GradClipAlgorithmType.NORM)
        by_norm.assert_called_once()


@pytest.mark.parametrize("inner", [torch.no_grad, torch.inference_mode])
def test_forward_context_with_no_grad_inside(inner):
    """A ``no_grad``/``inference_mode`` forward inside the forward context leaves a later
    forward differentiable (the autocast weight cache must not keep a graph-less cast)."""
    model = boring()
    plugin = connected("O1", "bf16", model)
    x = torch.randn(1, 32)
    with plugin.forward_context():
        with inner():
            model.layer(x)
        loss = model.layer(x).float().mean()
    assert loss.grad_fn is not None
    loss.backward()
    assert model.layer.weight.grad is not None


# -- plugins/precision/test_amp_integration.py ----------------------------------------------------
def test_fused_optimizer_parity():
    def run(fused):
        class Model(BoringModel):
            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-2, fused=fused)

        model = boring(Model)
        trainer(MixprecPrecision(level="O2", dtype="fp16"), max_steps=5).fit(model)
        return mp.fp32_state_dict(model)

    plain, fused = run(False), run(True)
    for name in plain:  # fp32 arithmetic on the masters, up to the kernels' reassociation
        torch.testing.assert_close(plain[name], fused[name], rtol=1e-5, atol=1e-6)


def test_skip_training_step_with_the_loss_scale():
    """A ``training_step`` that returns None has no backward: the engine neither unscales nor
    steps for it (Lightning's own AMP skips its GradScaler the same way)."""
    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            if batch_idx % 2:
                return None
            return super().training_step(batch, batch_idx)

    plugin = MixprecPrecision(level="O2", dtype="fp16")
    fit = trainer(plugin, max_steps=5, gradient_clip_val=0.5)
    with mock.patch.object(MixprecPrecision, "_after_closure",
                           autospec=True, side_effect=MixprecPrecision._after_closure) as hooks:
        fit.fit(boring(Model))
    assert hooks.call_count == 3
    assert plugin.scaler.applied_steps + plugin.scaler.skipped_steps == 3


# -- trainer/test_trainer.py: gradient clipping ---------------------------------------------------
def _norm(tensors):
    return torch.stack([t.detach().float().norm() for t in tensors]).norm()


class ClipRecorder(BoringModel):
    """Records, in ``configure_gradient_clipping`` after Lightning's clipping, the gradients
    of the model's parameters and of the optimizer's (the fp32 masters at O2)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.model_grads = [p.grad.detach().clone() for p in self.parameters()]
        self.step_grads = [p.grad.detach().clone() for g in optimizer.param_groups
                           for p in g["params"]]
        self.before = [p.detach().float().clone() for g in optimizer.param_groups
                       for p in g["params"]]
        self.lr = optimizer.param_groups[0]["lr"]
        self.after = optimizer.param_groups[0]["params"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("level, dtype", [("O1", "bf16"), ("O2", "bf16"), ("O2", "fp16"),
                                          ("O3", "bf16")])
def test_gradient_clipping_by_norm(level, dtype):
    """After ``gradient_clip_val`` the gradients read are the clipped, true ones, and the update
    is made of them. At O2 the model's read 10.8 (fp16: scaled) before."""
    model = boring(ClipRecorder)
    plugin = MixprecPrecision(level=level, dtype=dtype, loss_scale=2.0 ** 8 if dtype == "fp16"
                              else "auto")
    trainer(plugin, max_steps=1, gradient_clip_val=0.05,
            gradient_clip_algorithm="norm").fit(model)
    assert plugin.scaler.applied_steps == 1
    exact = 1e-5 if level in ("O1", "O2") else 2e-2  # O3 steps the 16-bit gradients
    torch.testing.assert_close(_norm(model.step_grads), torch.tensor(0.05), rtol=exact, atol=0)
    # 16-bit model gradients: the fp32 ones rounded (deliberate difference)
    torch.testing.assert_close(_norm(model.model_grads), torch.tensor(0.05), rtol=2e-2, atol=0)
    for before, grad, after in zip(model.before, model.step_grads, model.after):  # SGD
        expected = before - model.lr * grad.float()
        torch.testing.assert_close(after.detach().float(), expected, rtol=0,
                                   atol=1e-7 if after.dtype == torch.float32 else 2e-2)


def test_visible_clipping_changes_no_number_of_the_update():
    """Making the clipped gradients readable applies the clip with the step's own arithmetic:
    the run is bitwise the engine's loop that clips inside the step (``max_grad_norm``)."""
    class Model(BoringModel):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    batches = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    module = boring(Model)
    trainer(MixprecPrecision(level="O2", dtype="bf16"), max_steps=5,
            gradient_clip_val=0.05).fit(module, torch.utils.data.DataLoader(batches,
                                                                             batch_size=None))
    model = boring(Model)
    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x in batches:
        amp.backward(model.loss(model(x)))
        amp.step(opt, max_grad_norm=0.05)
        opt.zero_grad()
    ours, theirs = mp.fp32_state_dict(module), mp.fp32_state_dict(model)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gradient_clipping_by_value(dtype):
    model = boring(ClipRecorder)
    plugin = MixprecPrecision(level="O2", dtype=dtype, loss_scale=2.0 ** 8 if dtype == "fp16"
                              else "auto")
    trainer(plugin, max_steps=1, gradient_clip_val=1e-10,
            gradient_clip_algorithm="value").fit(model)
    step_max = max(g.abs().max() for g in model.step_grads)
    assert step_max.item() == pytest.approx(1e-10, rel=1e-6)
    model_max = max(g.float().abs().max() for g in model.model_grads).item()
    if dtype == "bf16":
        assert model_max == pytest.approx(1e-10, rel=2 ** -8)
    else:  # deliberate difference: below fp16's smallest subnormal the model's read 0
        assert model_max == 0.0


def test_clip_gradients_in_manual_optimization_reads_clipped():
    class Manual(BoringModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.norms = []

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            self.manual_backward(self.step(batch))
            self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
            self.norms.append(_norm([p.grad for p in self.parameters()]).item())
            opt.step()
            opt.zero_grad()

    model = boring(Manual)
    trainer(MixprecPrecision(level="O2", dtype="bf16"), max_steps=3).fit(model)
    assert model.norms == pytest.approx([0.01] * 3, rel=2e-2)


def test_on_before_optimizer_step_reads_unscaled_gradients():
    """Lightning's sister test of AMP's unscaling: the gradients seen after backward, divided
    by the scale, are what ``on_before_optimizer_step`` reads."""
    scale = 2.0 ** 10

    class Model(BoringModel):
        def on_after_backward(self):
            self.expected = [p.grad.float() / scale for p in self.parameters()]

        def on_before_optimizer_step(self, optimizer):
            for p, expected in zip(self.parameters(), self.expected):
                torch.testing.assert_close(p.grad.float(), expected, rtol=1e-3, atol=0)
            self.checked = True

    model = boring(Model)
    plugin = MixprecPrecision(level="O2", dtype="fp16", loss_scale=scale)
    trainer(plugin, max_steps=1).fit(model)
    assert model.checked and plugin.scaler.applied_steps == 1


# -- trainer/optimization/test_manual_optimization.py ---------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_step_with_optimizer_closure(level):
    """A closure running two backward passes (MC-dropout style) steps once per batch."""
    class Model(BoringModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.losses = []

        def training_step(self, batch, batch_idx):
            assert self.layer.weight.grad is None
            opt = self.optimizers()

            def closure():
                losses = []
                for i in range(2):
                    loss = self.loss(F.dropout(self(F.dropout(batch, 0.1)), 0.1))
                    losses.append(loss)
                    self.manual_backward(loss, retain_graph=i == 0)
                assert losses[0] != losses[1]
                self.losses.append(torch.stack(losses).mean())

            before = self.layer.weight.detach().clone()
            opt.step(closure=closure)
            opt.zero_grad()
            assert not torch.equal(before, self.layer.weight.detach())

    model = boring(Model)
    fit = trainer(MixprecPrecision(level=level, dtype="bf16"))
    with mock.patch.object(Strategy, "backward", wraps=fit.strategy.backward) as backward:
        fit.fit(model)
    assert backward.call_count == 2 * 2
    assert len(model.losses) == fit.global_step == 2


class RecordingSGD(torch.optim.SGD):
    def step(self, closure=None, optim=None):
        self.seen = getattr(self, "seen", []) + [optim]
        return super().step(closure)


class TwoOptimizers(BoringModel):
    """Lightning's GAN-style case: two optimizers, one stepped every other batch with a
    custom keyword, the other every batch."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.head = nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        gen, dis = self.optimizers()

        def gen_closure():
            self.manual_backward(self.loss(self(batch)))

        def dis_closure():
            self.manual_backward(self.loss(self.head(self(batch).detach())))

        gen_closure()
        if batch_idx % 2 == 0:
            gen.step(closure=gen_closure, optim="sgd")
            gen.zero_grad()
        dis.step(closure=dis_closure)
        dis.zero_grad()

    def configure_optimizers(self):
        return (RecordingSGD(self.layer.parameters(), lr=0.1),
                torch.optim.Adam(self.head.parameters(), lr=0.1))


@pytest.mark.parametrize("level,master", [("O1", None), ("O2", None), ("O2", "kahan")])
def test_step_keywords_reach_the_optimizer(level, master):
    """``opt.step(closure, optim="sgd")`` was refused; the keywords go to ``optimizer.step``
    (at O2 through the fp32-master or compact wrapper to the user's optimizer)."""
    model = boring(TwoOptimizers)
    fit = trainer(MixprecPrecision(level=level, dtype="bf16", master=master), max_steps=8)
    fit.fit(model)
    gen = fit.optimizers[0]
    gen = getattr(gen, "inner", gen)
    assert gen.seen == ["sgd"] * 3  # batches 0, 2 and 4 (global_step counts both optimizers)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_multiple_optimizers_manual_call_counts(level):
    """Two optimizers over the same parameters, three backward passes per batch."""
    class Model(BoringModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt_a, opt_b = self.optimizers()
            assert self.layer.weight.grad is None
            self.manual_backward(self.step(batch))
            opt_a.step()
            opt_a.zero_grad()
            assert self.layer.weight.grad is None
            loss = self.step(batch)
            self.manual_backward(loss, retain_graph=True)
            self.manual_backward(loss)
            assert self.layer.weight.grad is not None
            opt_b.step()
            opt_b.zero_grad()

        def configure_optimizers(self):
            return (torch.optim.SGD(self.layer.parameters(), lr=0.1),
                    torch.optim.SGD(self.layer.parameters(), lr=0.1))

    model = boring(Model)
    fit = trainer(MixprecPrecision(level=level, dtype="bf16"), max_steps=-1, max_epochs=1,
                  limit_train_batches=2)
    with mock.patch.object(Strategy, "backward", wraps=fit.strategy.backward) as backward:
        fit.fit(model)
    assert backward.call_count == 2 * 3
    assert fit.global_step == 2 * 2


# -- trainer/optimization/test_backward_calls.py --------------------------------------------------
@pytest.mark.parametrize("accumulate", [1, 2])
def test_backward_count(accumulate):
    model = boring()
    fit = trainer(MixprecPrecision(level="O2", dtype="fp16"), max_steps=-1, max_epochs=1,
                  limit_train_batches=6, accumulate_grad_batches=accumulate)
    with mock.patch("torch.Tensor.backward") as backward:
        fit.fit(model)
    assert backward.call_count == 6
    assert fit.global_step == 6 // accumulate


# -- trainer/optimization/test_optimizers.py ------------------------------------------------------
def test_none_optimizer():
    """``configure_optimizers`` returning None: Lightning trains with its stand-in optimizer
    (nothing steps); the plugin prepared it as an optimizer and raised."""
    class Model(BoringModel):
        def configure_optimizers(self):
            return None

    model = boring(Model)
    fit = trainer(MixprecPrecision(level="O2", dtype="bf16"))
    fit.fit(model)
    assert model.layer.weight.dtype == torch.bfloat16
    assert fit.global_step == 2


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_init_optimizers_during_evaluation_and_prediction(fn):
    """Evaluation without fitting prepares the model with no optimizer and builds none."""
    model = boring()
    fit = trainer(MixprecPrecision(level="O2", dtype="bf16"), limit_val_batches=1,
                  limit_test_batches=1, limit_predict_batches=1)
    getattr(fit, fn)(model, getattr(model, f"{'val' if fn == 'validate' else fn}_dataloader")())
    assert fit.optimizers == [] and fit.lr_scheduler_configs == []
    assert mp.policy_of(model).level == "O2"


def test_optimizer_with_scheduling_steps_the_scheduler_per_epoch():
    class Model(BoringModel):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)]

    model = boring(Model)
    fit = trainer(MixprecPrecision(level="O2", dtype="bf16"), max_steps=-1, max_epochs=2,
                  limit_train_batches=2)
    fit.fit(model)
    assert fit.lr_scheduler_configs[0].scheduler.get_last_lr() == pytest.approx([0.1 * 0.1 ** 2])
    assert fit.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.1 ** 2)


# -- trainer/test_trainer.py: predictions ---------------------------------------------------------
@pytest.mark.parametrize("level, expected", [("O3", torch.bfloat16), ("O2", torch.float32),
                                             ("O1", torch.float32)])
def test_predict_return_predictions(level, expected):
    """Predictions come in the policy's output dtype (O3: as computed, the 16-bit dtype)."""
    model = boring()
    preds = trainer(MixprecPrecision(level=level, dtype="bf16")).predict(
        model, torch.utils.data.DataLoader(RandomDataset(32, 4), batch_size=2))
    assert len(preds) == 2 and preds[0].shape == (2, 2) and preds[0].dtype == expected


# -- a metric held by the model (Lightning moves the model to the CPU at teardown) ----------------
def test_fit_at_o2_with_a_torchmetrics_metric():
    torchmetrics = pytest.importorskip("torchmetrics")

    class Model(BoringModel):
        def __init__(self):
            super().__init__()
            self.mean_loss = torchmetrics.MeanMetric()

        def training_step(self, batch, batch_idx):
            loss = self.step(batch)
            self.mean_loss.update(loss.detach().float())
            return loss

    model = boring(Model)
    trainer(MixprecPrecision(level="O2", dtype="bf16"), max_steps=3).fit(model)
    assert torch.isfinite(model.mean_loss.compute())
    model.cpu()
    assert model.layer.weight.dtype == torch.bfloat16


def test_a_subclass_whose_step_calls_super_takes_keywords_at_o2_whatever_was_built_before():
    """torch hooks a class's ``step`` once an instance of it exists: with a plain SGD built
    first, ``super().step()`` inside the user's subclass passes torch's hook wrapper of SGD,
    which must not take the wrapper's own call for a direct step of the inner optimizer."""
    torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1).step()  # hooks SGD.step
    model = boring(TwoOptimizers)
    fit = trainer(MixprecPrecision(level="O2", dtype="bf16"), max_steps=8)
    fit.fit(model)
    assert fit.optimizers[0].inner.seen == ["sgd"] * 3
