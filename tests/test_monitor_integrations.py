"""PrecisionMonitor inside Lightning (through the trainer's loggers) and the Hugging Face Trainer
(through Trainer.log, so report_to reaches it): real runs on the real packages."""

import copy
import csv
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.monitor import JSONLWriter, read_run

pytestmark = [pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")]


def test_lightning_logs_the_monitor_through_the_trainers_loggers(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from mixprec.integrations.lightning import MixprecPrecision

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]
    monitor = mp.PrecisionMonitor(every=2, writers=[JSONLWriter(tmp_path / "p.jsonl")])
    plugin = MixprecPrecision(level="O2", dtype="fp16", monitor=monitor)
    trainer = L.Trainer(plugins=[plugin], accelerator="cpu", max_epochs=1,
                        logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1,
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=None))
    assert [r["step"] for r in monitor.records] == [0, 2, 4]
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("mixprec/loss_scale")]
    assert [int(r["step"]) for r in rows] == [0, 2, 4]
    assert float(rows[1]["mixprec/net.0/act_amax"]) == pytest.approx(
        monitor.records[1]["mixprec/net.0/act_amax"], rel=1e-6)
    assert float(rows[2]["mixprec/net.2/weight_update_lost"]) == pytest.approx(0.0, abs=1e-6)
    assert read_run(tmp_path / "p.jsonl")["mixprec/loss_scale"][0] == (0, 65536.0)


def test_mixprec_trainer_logs_the_monitor_through_trainer_log_to_tensorboard(tmp_path,
                                                                           monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mixprec.integrations.transformers import MixprecTrainer
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # report_to's folder
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    g = torch.Generator().manual_seed(0)
    ids = (torch.randint(0, 64, (32, 1), generator=g) + torch.arange(16)) % 64
    rows = [{"input_ids": r, "labels": r.clone()} for r in ids]
    monitor = mp.PrecisionMonitor(every=2, layers=["transformer.h.*.mlp.c_proj", "lm_head"])
    args = transformers.TrainingArguments(
        str(tmp_path / "out"), use_cpu=True, report_to=["tensorboard"],
        per_device_train_batch_size=8, num_train_epochs=1,
        learning_rate=3e-3, logging_steps=100, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = MixprecTrainer(model, args, train_dataset=rows,
                             mixed_precision=mp.MixedPrecision("O2", "bf16", monitor=monitor))
    trainer.train()
    assert [r["step"] for r in monitor.records] == [0, 2]
    logged = [h for h in trainer.state.log_history if "mixprec/loss_scale" in h]
    assert len(logged) == 2
    assert logged[0]["mixprec/transformer.h.1.mlp.c_proj/weight_update_lost"] == pytest.approx(
        0.0, abs=1e-6)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    names = {t.removeprefix("train/") for t in tags}
    assert {"mixprec/grad_norm", "mixprec/lm_head/act_headroom",
            "mixprec/transformer.h.0.mlp.c_proj/grad_underflow"} <= names


def test_a_resumed_trainer_records_at_the_steps_the_uninterrupted_run_would(tmp_path):
    """After ``Trainer.load`` the monitor counted from 0 again: a resumed run appending to its
    record wrote steps 0, 2, 4 after 0..5 (``read_run`` saw two runs in one file). The engine's
    state carries the monitor's step now."""
    def make(path, mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        return mp.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                          level="O2", dtype="bf16", progress=False,
                          monitor=mp.PrecisionMonitor(every=2,
                                                      writers=[JSONLWriter(path, mode=mode)]))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(6)]
    path = tmp_path / "precision.jsonl"
    first = make(path, "w")
    first.fit(data, epochs=1)
    first.save(tmp_path / "ck.pt")
    first.engine.monitor.close()
    resumed = make(path, "a")
    resumed.load(tmp_path / "ck.pt")
    assert resumed.engine.monitor.step == resumed.global_step == 6
    resumed.fit(data, epochs=2)
    resumed.engine.monitor.close()
    assert [r["step"] for r in resumed.engine.monitor.records] == [6, 8, 10]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "holds more than one run"
        series = read_run(path)
    assert [s for s, _ in series["mixprec/loss_scale"]] == [0, 2, 4, 6, 8, 10]


def _linear_run(every: int):
    """An engine with a monitor recording every ``every`` steps, a Linear and its SGD."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    amp = mp.MixedPrecision("O2", "bf16", monitor=mp.PrecisionMonitor(every=every))
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return amp, model, opt


def test_the_engine_state_carries_the_monitors_step():
    """What Lightning's and Accelerate's checkpoints hold of mixprec (the engine's state):
    a resumed run's monitor continues from the saved step (Lightning's restarted at 0)."""
    def run():
        return _linear_run(2)
    amp, model, opt = run()
    for _ in range(3):
        amp.backward(model(torch.randn(2, 4)).float().sum())
        amp.step(opt)
        opt.zero_grad()
    state = amp.state_dict()
    assert state["monitor"] == {"step": 3, "loss_steps": 0, "loss_sum": None}  # (2 recorded)
    amp2, model2, opt2 = run()
    amp2.load_state_dict(state)
    assert amp2.monitor.step == 3 and not amp2.monitor.recording
    plain = mp.MixedPrecision("O2", "bf16")
    plain.setup(nn.Linear(4, 2))
    plain.load_state_dict(state)  # a run without a monitor loads it, ignoring the count
    amp2.load_state_dict({**state, "monitor": {"step": 3}})  # (written before the loss window)
    assert amp2.monitor.step == 3
    with pytest.raises(ValueError, match="step must be an integer"):
        amp2.monitor.resume_at(-1)


def test_a_resumed_runs_first_loss_record_averages_the_uninterrupted_runs_steps():
    """A checkpoint between two records: the resumed run's first ``mixprec/loss`` averaged
    only the steps after the resume (1.35 where the uninterrupted run recorded 1.21, the mean
    of steps 4-6); the checkpoint keeps the loss summed since the last record."""
    def run():
        return _linear_run(3)

    def steps(amp, model, opt, which):
        for i in which:
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
            amp.backward(model(x).float().square().mean())
            amp.step(opt)
            opt.zero_grad()
    amp, model, opt = run()
    steps(amp, model, opt, range(7))
    whole = [r["mixprec/loss"] for r in amp.monitor.records]
    amp, model, opt = run()
    steps(amp, model, opt, range(5))
    saved = (copy.deepcopy(amp.state_dict()), copy.deepcopy(model.state_dict()),
             copy.deepcopy(opt.state_dict()))
    amp2, model2, opt2 = run()
    amp2.load_state_dict(saved[0])
    model2.load_state_dict(saved[1])
    opt2.load_state_dict(saved[2])
    steps(amp2, model2, opt2, range(5, 7))
    assert [r["mixprec/loss"] for r in amp2.monitor.records] == [whole[-1]]


def test_mixprec_trainer_logs_the_monitor_at_the_step_of_its_own_log(tmp_path):
    """The monitor's record of an optimizer step went through ``Trainer.log`` inside the step,
    before ``global_step`` moved on: one step before the Trainer's own loss and grad norm of
    that step. It is held until the Trainer counted the step (and its own log still runs)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mixprec.integrations.transformers import MixprecTrainer
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    rows = (torch.randint(0, 64, (32, 1), generator=torch.Generator().manual_seed(0))
            + torch.arange(16)) % 64
    args = transformers.TrainingArguments(
        str(tmp_path), use_cpu=True, per_device_train_batch_size=8, num_train_epochs=1,
        report_to=[], disable_tqdm=True, logging_steps=1, save_strategy="no",
        max_grad_norm=0.0, seed=0)
    trainer = MixprecTrainer(model, args, train_dataset=[{"input_ids": r, "labels": r}
                                                         for r in rows],
                             mixed_precision=mp.MixedPrecision(
                                 "O2", "bf16", monitor=mp.PrecisionMonitor(every=1)))
    trainer.train()
    own = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    monitored = {h["step"]: h["mixprec/loss"] for h in trainer.state.log_history
                 if "mixprec/loss" in h}
    assert sorted(own) == sorted(monitored) == [1, 2, 3, 4]
    for step, loss in own.items():
        assert monitored[step] == pytest.approx(loss, rel=1e-4)
