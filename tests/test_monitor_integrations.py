"""PrecisionMonitor inside Lightning (through the trainer's loggers) and the Hugging Face Trainer
(through Trainer.log, so report_to reaches it): real runs on the real packages."""

import csv

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
