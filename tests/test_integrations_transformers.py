"""The Hugging Face Trainer on the engine: a GPT-2 tracks fp32, the same numbers as mp.Trainer,
exact resume, fp32 weights on disk, and what it refuses."""

import json

import pytest
import torch

import mixprec as mp

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from mixprec.integrations.transformers import EngineGradScaler, MixprecTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

VOCAB, SEQ, BATCH = 64, 16, 8
# loss of each logged step against the fp32 transformers.Trainer, relative (measured at O2 over
# 16 steps: bf16 6.1e-4, fp16 7.7e-5; see docs/integrations.md)
FP32_TOL = {"bf16": 2e-3, "fp16": 5e-4}
ADAM_TOL = 5e-3  # master weights against mp.Trainer on the same batches (see its use)


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    yield


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def rows(n=64):
    """Counting sequences from random starts: a GPT-2 learns them within a few steps."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    ids = (starts + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def arguments(out, **kwargs):
    options = dict(use_cpu=True, report_to=[], per_device_train_batch_size=BATCH,
                   num_train_epochs=2, learning_rate=3e-3, logging_steps=1, save_strategy="no",
                   disable_tqdm=True, seed=0, train_sampling_strategy="sequential")
    return transformers.TrainingArguments(str(out), **{**options, **kwargs})


def optimizers(model, steps=16):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / steps)
    return opt, sched


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def masters(model) -> dict:
    return mp.fp32_state_dict(model)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_gpt2_at_o2_tracks_the_fp32_trainer(dtype, tmp_path):
    data = rows()
    fp32 = transformers.Trainer(gpt2(), arguments(tmp_path / "fp32"), train_dataset=data)
    fp32.train()
    amp = mp.MixedPrecision(level="O2", dtype=dtype)
    mixed = MixprecTrainer(gpt2(), arguments(tmp_path / "mixed"), train_dataset=data,
                           mixed_precision=amp)
    mixed.train()
    ours, theirs = losses(mixed), losses(fp32)
    assert len(ours) == len(theirs) == 16
    assert max(abs(a - b) / b for a, b in zip(ours, theirs)) < FP32_TOL[dtype]
    assert isinstance(mixed.optimizer.optimizer, mp.MasterWeightOptimizer)
    assert mixed.model.transformer.h[0].mlp.c_fc.weight.dtype == amp.policy.param_dtype
    norms = [h["grad_norm"] for h in mixed.state.log_history if "grad_norm" in h]
    reference = [h["grad_norm"] for h in fp32.state.log_history if "grad_norm" in h]
    assert norms[0] == pytest.approx(reference[0], rel=1e-2)  # the true norm, not a scaled one


@pytest.mark.parametrize("accumulate", [1, 2])
def test_skipped_steps_match_mp_trainer_and_leave_the_scheduler_alone(accumulate, tmp_path):
    data = rows(48)
    steps = len(data) // BATCH // accumulate
    scaler = dict(init_scale=2.0 ** 19, growth_interval=3)  # the first steps overflow in fp16
    model = gpt2()
    opt, sched = optimizers(model, steps=steps)
    amp = mp.MixedPrecision(level="O2", dtype="fp16", loss_scale=mp.DynamicLossScaler(**scaler))
    args = arguments(tmp_path, num_train_epochs=1, gradient_accumulation_steps=accumulate)
    mixed = MixprecTrainer(model, args, train_dataset=data, optimizers=(opt, sched),
                           mixed_precision=amp)
    # the model's own mean loss, as mp.Trainer takes it (not a sum over a token count)
    mixed.model_accepts_loss_kwargs = False
    mixed.train()

    ref_model = gpt2()
    ref_opt, ref_sched = optimizers(ref_model, steps=steps)
    collate = transformers.default_data_collator
    batches = [collate(data[i:i + BATCH]) for i in range(0, len(data), BATCH)]
    ref = mp.Trainer(ref_model, None, ref_opt, level="O2", dtype="fp16", scheduler=ref_sched,
                     loss_scale=mp.DynamicLossScaler(**scaler), max_grad_norm=1.0,
                     grad_accum_steps=accumulate, progress=False)
    history = ref.fit(batches)

    assert 0 < amp.scaler.skipped_steps == sum(history.skipped) < steps
    assert mixed.state.global_step == steps
    assert sched.get_last_lr() == ref_sched.get_last_lr()  # stepped on applied steps only
    assert amp.scaler.get_scale() == ref.scaler.get_scale()
    a, b = masters(mixed.model), masters(ref.model)
    # mp.Trainer folds its clip into the fused kernel's grad_scale (g / (scale / coef)); the
    # Trainer here unscales, then clips (g * (1 / scale) * coef): fp32 ulps apart (3.7e-9 after
    # the first update), which AdamW turns into up to a step's size where a gradient is ~0
    # (its update is m / sqrt(v)): measured 1.5e-3 after 3 updates at lr <= 3e-3
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= ADAM_TOL


class _GradNorms(transformers.TrainerCallback):
    def __init__(self):
        self.norms = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
        self.norms.append(torch.stack(grads).norm().item())


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_callbacks_before_the_step_see_the_true_gradients(max_grad_norm, tmp_path):
    seen = {}
    for scale in (1.0, 2.0 ** 12):
        record = _GradNorms()
        amp = mp.MixedPrecision(level="O2", dtype="fp16", loss_scale=scale)
        trainer = MixprecTrainer(gpt2(), arguments(tmp_path, max_steps=3,
                                                   max_grad_norm=max_grad_norm),
                                 train_dataset=rows(24), callbacks=[record], mixed_precision=amp)
        trainer.train()
        seen[scale] = record.norms
    assert len(seen[1.0]) == 3 and seen[2.0 ** 12] == pytest.approx(seen[1.0], rel=1e-2)


def test_resume_from_a_checkpoint_is_exact_and_carries_the_scaler(tmp_path):
    data = rows(48)

    def run(out, **kwargs):
        amp = mp.MixedPrecision(level="O2", dtype="fp16",
                                loss_scale=mp.DynamicLossScaler(init_scale=2.0 ** 18,
                                                                       growth_interval=2))
        trainer = MixprecTrainer(gpt2(), arguments(out, num_train_epochs=1, save_strategy="steps",
                                                   save_steps=2), train_dataset=data,
                                 mixed_precision=amp)
        trainer.train(**kwargs)
        return trainer, amp

    whole, whole_amp = run(tmp_path / "whole")
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    state = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert state["policy"] == whole_amp.policy.state_dict()
    assert "master_weights" in torch.load(checkpoint / "optimizer.pt", weights_only=True)
    resumed, resumed_amp = run(tmp_path / "resumed", resume_from_checkpoint=str(checkpoint))
    a, b = masters(whole.model), masters(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed_amp.scaler.state_dict() == whole_amp.scaler.state_dict()
    assert whole_amp.scaler.skipped_steps > 0


def test_a_checkpoint_of_another_policy_is_refused(tmp_path):
    data = rows(16)
    trainer = MixprecTrainer(gpt2(), arguments(tmp_path, num_train_epochs=1,
                                               save_strategy="steps", save_steps=2),
                             train_dataset=data, mixed_precision=mp.MixedPrecision("O2", "bf16"))
    trainer.train()
    other = MixprecTrainer(gpt2(), arguments(tmp_path / "o1", num_train_epochs=1),
                           train_dataset=data, mixed_precision=mp.MixedPrecision("O1", "bf16"))
    with pytest.raises(ValueError, match=r"made under the policy O2\(.*this run uses O1\("):
        other.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_save_model_writes_the_fp32_masters_and_a_float32_config(tmp_path):
    trainer = MixprecTrainer(gpt2(), arguments(tmp_path, max_steps=2), train_dataset=rows(16),
                             mixed_precision=mp.MixedPrecision("O2", "bf16"))
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    with open(tmp_path / "saved" / "config.json") as f:
        assert json.load(f)["dtype"] == "float32"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    assert loaded.dtype == torch.float32
    ours = masters(trainer.model)
    assert all(torch.equal(v, ours[k]) for k, v in loaded.state_dict().items())
    assert trainer.evaluate(rows(8))["eval_loss"] > 0  # evaluation runs the prepared model


@pytest.mark.parametrize("flag", ["fp16", "bf16"])
def test_the_trainers_own_mixed_precision_is_refused_saying_why(flag, tmp_path):
    args = arguments(tmp_path, **{flag: True})
    with pytest.raises(ValueError, match=rf"{flag}=True\) turns on accelerate's own mixed "
                                         r"precision.*cast and scale twice"):
        MixprecTrainer(gpt2(), args, mixed_precision=mp.MixedPrecision("O2", "bf16"))


def test_bad_arguments_are_refused(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="mixed_precision must be a mixprec.MixedPrecision"):
        MixprecTrainer(gpt2(), arguments(tmp_path), mixed_precision="O2")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(ValueError, match="accelerator was configured for mixed precision"):
        MixprecTrainer(gpt2(), arguments(tmp_path), mixed_precision=mp.MixedPrecision("O2"))


def test_the_engine_scaler_speaks_grad_scaler():
    amp = mp.MixedPrecision(level="O2", dtype="fp16", loss_scale=1024.0)
    model = torch.nn.Linear(4, 2)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = EngineGradScaler(amp)
    assert scaler.is_enabled() and scaler.get_scale() == 1024.0
    scaler.scale(model(torch.ones(3, 4)).float().sum()).backward()
    assert scaler.step(opt) is True
    scaler.update()
    with pytest.raises(TypeError, match="closure"):
        scaler.step(opt, closure=lambda: 0.0)
    with pytest.raises(ValueError, match="updates its scale in step"):
        scaler.update(2.0)
    assert scaler.state_dict() == amp.state_dict()


def test_preparing_a_model_of_another_library_imports_nothing_of_transformers():
    """With transformers' lazy top level imported (Lightning imports it), preparing a plain
    model at O2 loads neither transformers' model classes nor, through them, torchao (it did:
    about 1 s and torchao's load messages in every prepare)."""
    import subprocess
    import sys
    code = ("import sys, torch, transformers, mixprec as mp; "
            "model = torch.nn.Linear(4, 4); "
            "mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level='O2', "
            "dtype='bf16'); "
            "print('transformers.modeling_utils' in sys.modules, 'torchao' in sys.modules)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
