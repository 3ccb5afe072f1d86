"""The Hugging Face Trainer's own mixed-precision tests, ported to ``MixprecTrainer``.

The cases follow tests/trainer/test_trainer.py of transformers (the regression model and data,
test_mixed_bf16/fp16, gradient accumulation, the number of steps, the NaN/inf loss filter,
evaluate and predict, Adafactor, the optimizer choices, gradient clipping and the logged norm),
test_trainer_optimizer_skip.py (updates skipped by the loss scale) and
test_trainer_autocast.py (train and eval dtypes agree), written anew against MixprecTrainer
with a tiny regression model. Deliberate differences, named at their tests (and listed in
docs/integrations.md):

* ``TrainingArguments(fp16=True)``/``bf16=True``/``*_full_eval`` are refused: the engine decides
  the precision (accelerate's autocast and GradScaler on top of it would cast and scale twice).
* the model's gradients at O2 are 16-bit: after clipping they read as the fp32 gradients the
  step uses, rounded; ``grad_norm`` is logged before clipping, as the Trainer does.
* with this transformers version a skipped update still counts as a step (``global_step``), as
  with the Trainer's own fp16; the scheduler and the optimizer's state advance on applied
  updates only.
"""

import math

import pytest
import torch
from torch import nn

import mixprec as mp

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

A, B = 2.0, 3.0


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    yield


class RegressionModel(nn.Module):
    """y = a * x + b, an MSE loss when labels are given (the Trainer tests' model), with a
    linear layer so that O2 has a 16-bit GEMM weight; ``poison`` makes a gradient inf."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.zeros(1))
        self.b = nn.Parameter(torch.zeros(1))
        self.mix = nn.Linear(4, 4)
        self.poison_at = set()
        self.calls = 0
        self.a.register_hook(self._poison)

    def _poison(self, grad):
        return torch.full_like(grad, math.inf) if self.calls - 1 in self.poison_at else grad

    def forward(self, input_x, labels=None, **kwargs):
        self.calls += 1
        y = input_x * self.a + self.b + 0.0 * self.mix(torch.ones(4, device=input_x.device,
                                                                  dtype=input_x.dtype)).sum()
        if labels is None:
            return (y,)
        return (nn.functional.mse_loss(y.float(), labels.float()), y)


def regression_data(n=64, seed=42):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    y = A * x + B + 0.1 * torch.randn(n, generator=g)
    return [{"input_x": x[i], "labels": y[i]} for i in range(n)]


def arguments(out, **kwargs):
    options = dict(use_cpu=True, report_to=[], per_device_train_batch_size=8,
                   num_train_epochs=3, learning_rate=0.1, logging_steps=1, save_strategy="no",
                   disable_tqdm=True, seed=0, train_sampling_strategy="sequential")
    return transformers.TrainingArguments(str(out), **{**options, **kwargs})


def mixed(tmp_path, level="O2", dtype="bf16", data=None, model=None, **kwargs):
    engine = kwargs.pop("mixed_precision", None) or mp.MixedPrecision(level=level, dtype=dtype)
    callbacks = kwargs.pop("callbacks", None)
    return MixprecTrainer(model or RegressionModel(), arguments(tmp_path, **kwargs),
                          train_dataset=data if data is not None else regression_data(),
                          callbacks=callbacks, mixed_precision=engine)


def ab(trainer):
    weights = mp.fp32_state_dict(trainer.model)
    return weights["a"].item(), weights["b"].item()


@pytest.fixture(scope="module")
def fp32_ab(tmp_path_factory):
    """The plain fp32 Trainer's result (the tests' "default trained model")."""
    trainer = transformers.Trainer(RegressionModel(), arguments(tmp_path_factory.mktemp("fp32")),
                                   train_dataset=regression_data())
    trainer.train()
    return trainer.model.a.item(), trainer.model.b.item()


# -- test_mixed_bf16 / test_mixed_fp16 ----------------------------------------------------------
@pytest.mark.parametrize("level, dtype", [("O1", "bf16"), ("O2", "bf16"), ("O2", "fp16"),
                                          ("O3", "bf16")])
def test_mixed_precision_trains_the_regression_as_fp32(level, dtype, fp32_ab, tmp_path):
    # fp16: a fixed scale (the dynamic one's first overflows would skip updates fp32 makes)
    engine = mp.MixedPrecision(level=level, dtype=dtype,
                               loss_scale=2.0 ** 8 if dtype == "fp16" else "auto")
    trainer = mixed(tmp_path, mixed_precision=engine)
    trainer.train()
    assert engine.scaler.skipped_steps == 0
    got = ab(trainer)
    # O3 steps 16-bit weights (no masters): updates under half a bf16 ulp (2**-8 near 1) are
    # lost as the learning rate decays
    tol = 0.1 if level == "O3" else 1e-2
    assert got == pytest.approx(fp32_ab, abs=tol)
    assert got[0] > 0.5 and got[1] > 0.5  # it learned (from 0)


def test_trainer_works_with_dict_outputs(tmp_path):
    class DictModel(RegressionModel):
        def forward(self, input_x, labels=None, **kwargs):
            out = super().forward(input_x, labels)
            return {"loss": out[0], "logits": out[1]} if labels is not None else {"logits": out[0]}

    trainer = mixed(tmp_path, model=DictModel())
    before = trainer.evaluate(regression_data(16))["eval_loss"]
    trainer.train()
    assert trainer.evaluate(regression_data(16))["eval_loss"] < before / 2


# -- gradient accumulation, the number of steps ----------------------------------------------
def test_gradient_accumulation_matches_the_larger_batch(tmp_path):
    whole = mixed(tmp_path / "whole")
    whole.train()
    accumulated = mixed(tmp_path / "accumulated", per_device_train_batch_size=4,
                        gradient_accumulation_steps=2)
    accumulated.train()
    assert accumulated.state.global_step == whole.state.global_step == 24
    assert ab(accumulated) == pytest.approx(ab(whole), abs=1e-3)


@pytest.mark.parametrize("options, steps", [
    ({"max_steps": 10}, 10), ({}, 24), ({"gradient_accumulation_steps": 2}, 12),
    ({"num_train_epochs": 1.5}, 12)])
def test_number_of_steps_in_training(options, steps, tmp_path):
    trainer = mixed(tmp_path, **options)
    trainer.train()
    assert trainer.state.global_step == steps


def test_training_loss_is_the_mean_of_the_logged_losses(tmp_path):
    trainer = mixed(tmp_path, logging_steps=24)
    result = trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 1 and result.training_loss == pytest.approx(logged[0], rel=1e-4)


# -- the NaN/inf loss filter, skipped updates -----------------------------------------------
class _Counts(transformers.TrainerCallback):
    def __init__(self):
        self.attempts = self.steps = 0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.attempts += 1

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.steps += 1


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_update_skipped_by_the_loss_scale_leaves_scheduler_and_optimizer_alone(accumulate,
                                                                                   tmp_path):
    """(test_trainer_optimizer_skip.py) An inf gradient skips the update: the optimizer's step
    count and the LR scheduler advance on applied updates only."""
    model = RegressionModel()
    model.poison_at = {2 * accumulate}  # the third update
    counts = _Counts()
    engine = mp.MixedPrecision(level="O2", dtype="fp16", loss_scale=16.0)
    trainer = mixed(tmp_path, model=model, mixed_precision=engine, max_steps=6,
                    per_device_train_batch_size=8 // accumulate,
                    gradient_accumulation_steps=accumulate, callbacks=[counts])
    trainer.train()
    inner = trainer.optimizer.optimizer.inner  # accelerate's wrapper, then the masters'
    applied = max(int(s["step"]) for s in inner.state.values())
    assert engine.scaler.skipped_steps == 1 and applied == 5
    assert trainer.lr_scheduler.last_epoch == 5
    assert trainer.state.global_step == counts.attempts == counts.steps == 6  # (see docstring)


@pytest.mark.parametrize("nan_filter", [True, False])
def test_logging_nan_inf_filter(nan_filter, tmp_path):
    class NanLoss(RegressionModel):
        def forward(self, input_x, labels=None, **kwargs):
            loss, y = super().forward(input_x, labels)
            return (loss * math.inf if self.calls == 3 else loss), y

    trainer = mixed(tmp_path, model=NanLoss(), max_steps=6, logging_steps=6,
                    logging_nan_inf_filter=nan_filter,
                    mixed_precision=mp.MixedPrecision(level="O2", dtype="fp16", loss_scale=16.0))
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert math.isfinite(logged[-1]) is nan_filter
    assert trainer.mixed_precision.scaler.skipped_steps == 1
    assert all(math.isfinite(v) for v in mp.fp32_state_dict(trainer.model)["a"].tolist())


# -- evaluate, predict, train/eval dtypes ---------------------------------------------------
@pytest.mark.parametrize("level, dtype", [("O2", torch.float32), ("O3", torch.bfloat16)])
def test_train_and_eval_dtype_match(level, dtype, tmp_path):
    """(test_trainer_autocast.py) The training loss and the evaluation logits come out in one
    dtype: the policy's output dtype (O3: the 16-bit compute dtype)."""
    trainer = mixed(tmp_path, level=level, max_steps=1)
    trainer.train()
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model
    with torch.no_grad():
        loss, logits, _ = trainer.prediction_step(model, batch, prediction_loss_only=False)
    assert logits.dtype == dtype
    preds = trainer.predict(regression_data(16))
    assert preds.predictions.shape == (16,)
    assert math.isfinite(trainer.evaluate(regression_data(16))["eval_loss"])


def test_evaluate_before_train_runs_the_fp32_model(tmp_path):
    trainer = mixed(tmp_path)
    assert math.isfinite(trainer.evaluate(regression_data(16))["eval_loss"])
    assert trainer.model.a.dtype == torch.float32  # prepared when training starts
    trainer.train()
    assert trainer.model.mix.weight.dtype == torch.bfloat16


# -- optimizers ------------------------------------------------------------------------------
@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "sgd", "adafactor"])
def test_optimizer_choices(optim, tmp_path):
    """``TrainingArguments(optim=...)``: the Trainer's optimizer, with fp32 masters, follows the
    fp32 Trainer's run with the same optimizer."""
    trainer = mixed(tmp_path / "mixed", optim=optim, max_steps=8)
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, mp.MasterWeightOptimizer)
    fp32 = transformers.Trainer(RegressionModel(), arguments(tmp_path / "fp32", optim=optim,
                                                             max_steps=8),
                                train_dataset=regression_data())
    fp32.train()
    assert ab(trainer) == pytest.approx((fp32.model.a.item(), fp32.model.b.item()), abs=1e-2)
    assert ab(trainer) != (0.0, 0.0)


def test_adafactor_with_its_own_schedule(tmp_path):
    from transformers.optimization import Adafactor, AdafactorSchedule

    model = RegressionModel()
    opt = Adafactor(model.parameters(), scale_parameter=True, relative_step=True,
                    warmup_init=True, lr=None)
    trainer = MixprecTrainer(model, arguments(tmp_path), train_dataset=regression_data(),
                             optimizers=(opt, AdafactorSchedule(opt)),
                             mixed_precision=mp.MixedPrecision(level="O2", dtype="bf16"))
    trainer.train()
    assert ab(trainer) != (0.0, 0.0)
    assert trainer.optimizer.state_dict()["param_groups"][0]["lr"] > 0


# -- gradient clipping and the logged norm -----------------------------------------------------
class _AfterClipping(transformers.TrainerCallback):
    """Reads the gradients where user code does, after the Trainer clipped them."""

    def __init__(self):
        self.model_norms, self.step_norms = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        def norm(ts):
            return torch.stack([t.grad.float().norm() for t in ts if t.grad is not None]).norm()
        self.model_norms.append(norm(model.parameters()).item())
        self.step_norms.append(norm([p for g in optimizer.param_groups
                                     for p in g["params"]]).item())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_callbacks_read_the_clipped_gradients(dtype, tmp_path):
    """``max_grad_norm``: ``on_pre_optimizer_step`` reads the clipped, true gradients (at O2 the
    model's read the unclipped ones before); ``grad_norm`` is logged before clipping."""
    seen = _AfterClipping()
    engine = mp.MixedPrecision(level="O2", dtype=dtype,
                               loss_scale=2.0 ** 8 if dtype == "fp16" else "auto")
    trainer = mixed(tmp_path, mixed_precision=engine, max_steps=4, max_grad_norm=0.01,
                    callbacks=[seen])
    trainer.train()
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(seen.step_norms) == 4 and min(logged) > 0.1  # every step clipped
    assert seen.step_norms == pytest.approx([0.01] * 4, rel=1e-5)
    assert seen.model_norms == pytest.approx([0.01] * 4, rel=2e-2)  # 16-bit, rounded


def test_without_clipping_the_logged_norm_is_what_callbacks_read(tmp_path):
    seen = _AfterClipping()
    trainer = mixed(tmp_path, max_steps=3, max_grad_norm=0.0, callbacks=[seen])
    trainer.train()
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert logged == pytest.approx(seen.model_norms, rel=1e-3)


# -- arguments the engine refuses --------------------------------------------------------------
@pytest.mark.parametrize("flag", ["fp16_full_eval", "bf16_full_eval"])
def test_full_eval_in_16_bits_is_refused(flag, tmp_path):
    """Deliberate difference: the engine decides the evaluation precision too."""
    with pytest.raises(ValueError, match=rf"{flag}=True"):
        mixed(tmp_path, **{flag: True})
