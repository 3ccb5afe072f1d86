"""Trainer: levels on real data, exact resume, skipped steps, accumulation, clipping, bad input."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import mixprec as mp
from mixprec.training import Callback, History, LossMonitor, ModelCheckpoint, ProgressBar, Trainer

slow_fp16 = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])


def mlp(dropout=0.0):
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 10))


def loader(ds, batch=64, seed=0, shuffle=True):
    return DataLoader(ds, batch_size=batch, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(seed))


def make_trainer(level="O0", dtype="bf16", seed=0, dropout=0.0, lr=0.2, sched=False, **kw):
    torch.manual_seed(seed)
    model = mlp(dropout)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7) if sched else None
    kw.setdefault("progress", False)
    return Trainer(model, F.cross_entropy, opt, level=level, dtype=dtype, metrics="accuracy",
                   scheduler=scheduler, **kw)


def params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


# ----------------------------------------------------------------- accuracy per level
@pytest.fixture(scope="module")
def fp32_accuracy(digits):
    train, test = digits
    trainer = make_trainer("O0")
    trainer.fit(loader(train, 128), epochs=3)
    return trainer.evaluate(DataLoader(test, batch_size=400))["accuracy"]


@slow_fp16
@pytest.mark.parametrize("level,dtype",
                         [("O1", "bf16"), ("O2", "bf16"), ("O3", "bf16"), ("O2", "fp16")])
def test_each_level_reaches_fp32_accuracy_on_digits(digits, fp32_accuracy, level, dtype):
    train, test = digits
    trainer = make_trainer(level, dtype)
    history = trainer.fit(loader(train, 128), epochs=3, eval_data=DataLoader(test, batch_size=400))
    acc = history.epochs[-1]["val_accuracy"]
    assert fp32_accuracy > 0.9  # the control itself learned
    assert acc >= fp32_accuracy - 0.01, (level, dtype, acc, fp32_accuracy)
    assert history.steps == 3 * math.ceil(1400 / 128)
    assert history.metric("val_accuracy")[-1] == acc


def test_prepared_attributes_follow_the_level():
    t2 = make_trainer("O2", "bf16")
    assert isinstance(t2.optimizer, mp.MasterWeightOptimizer)
    assert t2.model[0].weight.dtype == torch.bfloat16
    assert mp.policy_of(t2.model).level == "O2"
    assert isinstance(t2.scaler, mp.NoLossScaler)  # bf16 needs no loss scaling


@slow_fp16
def test_fp16_o2_scaler_is_dynamic():
    assert isinstance(make_trainer("O2", "fp16").scaler, mp.DynamicLossScaler)


# ----------------------------------------------------------------- exact resume
class StopAt(Callback):
    def __init__(self, step, path):
        self.step, self.path = step, path

    def on_step_end(self, trainer, logs):
        if logs["step"] == self.step:
            trainer.save(self.path)
            trainer.stop_training = True


@slow_fp16
@pytest.mark.parametrize("level,dtype,accum,stop", [
    ("O0", "fp32", 1, 7),      # mid-epoch 1
    ("O2", "bf16", 1, 12),     # mid-epoch 2
    ("O2", "fp16", 2, 5),      # the last step of epoch 1, with accumulation and a dynamic scaler
    ("O2", "fp16", 2, 6),      # the first step of epoch 2
    ("O1", "bf16", 2, 4),
])
def test_resume_is_bitwise_identical(digits, tmp_path, level, dtype, accum, stop):
    train = torch.utils.data.Subset(digits[0], range(320))  # 10 batches of 32 per epoch
    ref = make_trainer(level, dtype, dropout=0.2, sched=True, grad_accum_steps=accum)
    ref.fit(loader(train, 32), epochs=3)

    first = make_trainer(level, dtype, dropout=0.2, sched=True, grad_accum_steps=accum,
                         callbacks=[StopAt(stop, tmp_path / "ck.pt")])
    first.fit(loader(train, 32), epochs=3)
    assert first.global_step == stop
    torch.manual_seed(123)  # a different global RNG state: load() must restore it
    resumed = make_trainer(level, dtype, seed=99, dropout=0.2, sched=True, grad_accum_steps=accum)
    resumed.load(tmp_path / "ck.pt")
    resumed.fit(loader(train, 32), epochs=3)

    assert resumed.global_step == ref.global_step == 3 * 10 // accum
    for a, b in zip(params(resumed), params(ref)):
        assert torch.equal(a, b)
    assert resumed.history.loss == ref.history.loss
    # the epoch's metrics count the batches before the save too (they were reset on resume:
    # accuracy of the batches after it only, NaN when the save was at an epoch's last step)
    assert resumed.history.epochs == ref.history.epochs
    assert resumed.history.loss_scale == ref.history.loss_scale
    assert resumed.scheduler.state_dict() == ref.scheduler.state_dict()
    assert resumed.scaler.get_scale() == ref.scaler.get_scale()


@slow_fp16
def test_resume_from_an_epoch_end_checkpoint(digits, tmp_path):
    train = torch.utils.data.Subset(digits[0], range(320))
    ref = make_trainer("O2", "fp16", dropout=0.2, sched=True)
    ref.fit(loader(train, 32), epochs=3)
    ck = ModelCheckpoint(tmp_path, every_epoch=True)
    first = make_trainer("O2", "fp16", dropout=0.2, sched=True, callbacks=[ck])
    first.fit(loader(train, 32), epochs=1)
    assert ck.last_path.name == "ckpt-step10.pt"
    resumed = make_trainer("O2", "fp16", seed=5, dropout=0.2, sched=True)
    resumed.load(ck.last_path)
    assert resumed.epoch == 1 and resumed.history.steps == 10
    resumed.fit(loader(train, 32), epochs=3)
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(ref)))
    assert resumed.history.epochs == ref.history.epochs


def test_load_rejects_a_checkpoint_of_another_model(tmp_path):
    t = make_trainer("O0")
    t.save(tmp_path / "a.pt")
    torch.manual_seed(1)
    other_model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.0), nn.Linear(32, 10))
    other = Trainer(other_model, F.cross_entropy, torch.optim.SGD(other_model.parameters(), lr=0.1),
                    level="O0", progress=False)
    before = params(other)
    with pytest.raises(ValueError, match="different model.*0.weight"):
        other.load(tmp_path / "a.pt")
    assert all(torch.equal(a, b) for a, b in zip(before, params(other)))
    assert other.global_step == 0


def test_load_rejects_another_policy_and_bad_files(tmp_path):
    make_trainer("O2", "bf16").save(tmp_path / "o2.pt")
    t = make_trainer("O0")
    with pytest.raises(ValueError, match="policy O2"):
        t.load(tmp_path / "o2.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable"):
        t.load(tmp_path / "junk.pt")
    with pytest.raises(FileNotFoundError):
        t.load(tmp_path / "missing.pt")


def test_load_refuses_a_checkpoint_of_another_optimizer_class(tmp_path):
    """torch loads SGD's groups into an Adam (a KeyError 'betas' at the first step): refused at
    load, naming both, the trainer unchanged."""
    make_trainer("O2", "bf16").save(tmp_path / "sgd.pt")
    torch.manual_seed(0)
    model = mlp(0.0)
    t = Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=1e-3),
                level="O2", dtype="bf16", progress=False)
    before = params(t)
    with pytest.raises(ValueError, match=r"state of a torch.optim.sgd.SGD and this trainer steps "
                                         r"a torch.optim.adam.Adam"):
        t.load(tmp_path / "sgd.pt")
    assert all(torch.equal(a, b) for a, b in zip(before, params(t)))
    assert "betas" in t.optimizer.param_groups[0]


def test_namedtuple_batches_train_as_tuples(digits):
    """``default_collate`` keeps a dataset's namedtuples: they were rebuilt from a generator (a
    TypeError at the first batch)."""
    import collections
    Sample = collections.namedtuple("Sample", ["x", "y"])
    train = [Sample(x, y) for x, y in loader(torch.utils.data.Subset(digits[0], range(64)), 16)]
    plain = [tuple(b) for b in train]
    losses = [make_trainer("O2").fit(batches).loss for batches in (train, plain)]
    assert losses[0] == losses[1]


def test_save_failure_keeps_the_old_file(tmp_path):
    t = make_trainer("O0")
    t.save(tmp_path / "c.pt")
    old = (tmp_path / "c.pt").read_bytes()
    with pytest.raises(ValueError, match="is a directory"):
        t.save(tmp_path)
    assert (tmp_path / "c.pt").read_bytes() == old


# ----------------------------------------------------------------- skipped steps and scheduler
class InfAt:
    """A loss that returns +inf at the given (1-based) calls."""

    def __init__(self, steps):
        self.steps, self.calls = set(steps), 0

    def __call__(self, out, target):
        self.calls += 1
        loss = F.cross_entropy(out, target)
        return loss * math.inf if self.calls in self.steps else loss


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_scheduler_does_not_step_on_skipped_steps(digits, level):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = Trainer(model, InfAt({3, 4}), opt, level=level, dtype="bf16", scheduler=sched,
                      loss_scale=mp.DynamicLossScaler(init_scale=1024.0), progress=False)
    data = loader(torch.utils.data.Subset(digits[0], range(6 * 32)), 32, shuffle=False)
    history = trainer.fit(data, epochs=1)
    assert history.skipped == [False, False, True, True, False, False]
    assert history.loss_scale == [1024.0, 1024.0, 1024.0, 512.0, 256.0, 256.0]
    assert sched.last_epoch == 4  # 4 applied updates
    assert history.lr == [0.1, 0.05, 0.025, 0.025, 0.025, 0.0125]
    assert trainer.scaler.skipped_steps == 2


def test_skipped_step_leaves_parameters_unchanged(digits):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, InfAt({1}), opt, level="O0", loss_scale=8.0, progress=False)
    before = params(trainer)
    x, y = digits[0][:32]
    log = trainer.train_step([(x, y)])
    assert log["skipped"] and math.isinf(log["loss"])
    assert all(torch.equal(a, b) for a, b in zip(before, params(trainer)))


class _Reads(torch.utils._python_dispatch.TorchDispatchMode):
    """The order of the optimizer kernels and the host reads inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("aten._fused_") or name == "aten._local_scalar_dense":
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@slow_fp16
def test_an_fp16_step_reads_nothing_before_its_update(digits):
    """The scale a step logs is read after the step is queued (it was a read before it): O2 fp16
    on torch's fused kernel reads the host only after the kernel, as ``amp.step`` does."""
    torch.manual_seed(0)
    model = mlp()
    trainer = Trainer(model, F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=1e-3),
                      level="O2", dtype="fp16", progress=False)
    x, y = digits[0][:32]
    scales = [trainer.train_step([(x, y)])["loss_scale"] for _ in range(2)]
    with _Reads() as reads:
        log = trainer.train_step([(x, y)])
    assert reads.ops[0] == "aten._fused_adamw_" and "aten._local_scalar_dense" in reads.ops
    assert scales == [65536.0, 65536.0] and log["loss_scale"] == 65536.0


# ----------------------------------------------------------------- accumulation and clipping
class _Stream(IterableDataset):
    """A dataset without ``len()`` (streamed)."""

    def __init__(self, ds):
        self.ds = ds

    def __iter__(self):
        return iter(self.ds)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n,batch,accum", [(64, 16, 4), (80, 16, 2), (48, 8, 3), (48, 8, 4)])
def test_accumulation_equals_the_large_batch_step(n, batch, accum, stream):
    """Windows of ``accum`` micro-batches step as one batch of their size, a shorter last window
    too, also where the data has no ``len()`` (there its gradient was divided by ``accum``)."""
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))

    def run(b, k, stream=False):
        torch.manual_seed(0)
        model = mlp()
        t = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.5), level="O0",
                    grad_accum_steps=k, progress=False)
        t.fit(DataLoader(_Stream(ds) if stream else ds, batch_size=b), epochs=1)
        return t

    small, large = run(batch, accum, stream), run(batch * accum, 1)
    assert small.global_step == large.global_step == math.ceil(n / (batch * accum))
    for a, b in zip(params(small), params(large)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert small.history.loss == pytest.approx(large.history.loss, abs=1e-6)


def test_clipping_acts_on_unscaled_gradients(digits):
    torch.manual_seed(0)
    model = mlp()
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=1.0),
                      level="O0", loss_scale=1024.0, max_grad_norm=0.01, progress=False)
    before = params(trainer)
    trainer.train_step([digits[0][:64]])
    delta = torch.cat([(a - b).flatten() for a, b in zip(params(trainer), before)])
    assert delta.norm().item() == pytest.approx(0.01, rel=1e-3)


def test_a_plateau_scheduler_is_refused_with_the_callback_that_steps_it(digits):
    """ReduceLROnPlateau steps on a metric: taken, it failed after the first update (weights
    changed, the step count not). The refusal's callback steps it."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"sched\.step\(logs\['val_loss'\]\)"):
        Trainer(model, F.cross_entropy, opt, scheduler=sched, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))

    class Plateau(Callback):
        def on_epoch_end(self, trainer, epoch, logs):
            sched.step(1.0)  # a flat metric: the LR halves from the second epoch on

    trainer = Trainer(model, F.cross_entropy, opt, callbacks=[Plateau()], progress=False)
    trainer.fit([digits[0][:64]], epochs=3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)


# ----------------------------------------------------------------- bad input
def test_bad_arguments_raise_clear_errors(digits):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="grad_accum_steps must be an integer >= 1"):
            Trainer(model, F.cross_entropy, opt, grad_accum_steps=bad)
    with pytest.raises(ValueError, match="max_grad_norm"):
        Trainer(model, F.cross_entropy, opt, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="level must be one of"):
        Trainer(model, F.cross_entropy, opt, level="O4")
    with pytest.raises(ValueError, match="unknown metric"):
        Trainer(model, F.cross_entropy, opt, metrics="f1")
    with pytest.raises(TypeError, match="Trainer's model must be an nn.Module; got NoneType"):
        Trainer(None, F.cross_entropy, opt)
    for bad in (3, "LossMonitor"):
        with pytest.raises(TypeError, match="callbacks must be a list of mixprec.Callback"):
            Trainer(model, F.cross_entropy, opt, callbacks=bad)


def test_empty_data_and_non_scalar_loss(digits):
    t = make_trainer("O0")
    with pytest.raises(ValueError, match="train_data is empty"):
        empty = TensorDataset(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long))
        t.fit(DataLoader(empty, batch_size=4))
    with pytest.raises(ValueError, match="epochs must be"):
        t.fit(loader(digits[0]), epochs=0)
    model = mlp()
    bad = Trainer(model, nn.CrossEntropyLoss(reduction="none"),
                  torch.optim.SGD(model.parameters(), lr=0.1), level="O0", progress=False)
    before = params(bad)
    with pytest.raises(ValueError, match=r"scalar \(0-d\) tensor; got shape \(64,\): reduce"):
        bad.fit(loader(digits[0]))
    assert all(torch.equal(a, b) for a, b in zip(before, params(bad)))
    model = mlp()
    counted = Trainer(model, lambda out, y: (out.argmax(-1) == y).sum(),
                      torch.optim.SGD(model.parameters(), lr=0.1), level="O0", progress=False)
    with pytest.raises(ValueError, match="got a torch.int64 one: compute it in floating point"):
        counted.fit(loader(digits[0]))
    model = mlp()
    pair = Trainer(model, lambda out, y: (F.cross_entropy(out, y), 0),
                   torch.optim.SGD(model.parameters(), lr=0.1), level="O0", progress=False)
    with pytest.raises(ValueError, match="got a tuple: return the loss tensor itself"):
        pair.fit(loader(digits[0]))
    with pytest.raises(TypeError, match="each batch must be a tuple"):
        make_trainer("O0").fit([torch.zeros(4, 64)])


# ----------------------------------------------------------------- callbacks, history, progress
def test_loss_monitor_prints_like_mindspore(digits, capsys):
    t = make_trainer("O0", callbacks=[LossMonitor(per_print_times=2)])
    t.fit(loader(torch.utils.data.Subset(digits[0], range(128)), 32), epochs=2)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    assert re.fullmatch(r"epoch: 1 step: 2, loss is \d+\.\d+", lines[0])
    assert lines[-1].startswith("epoch: 2 step: 4, loss is ")


def test_checkpoint_callback_keeps_the_last_files(digits, tmp_path):
    ck = ModelCheckpoint(tmp_path, every_n_steps=2, every_epoch=True, keep_last=2)
    subset = torch.utils.data.Subset(digits[0], range(160))
    make_trainer("O0", callbacks=[ck]).fit(loader(subset, 32), epochs=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-step4.pt", "ckpt-step5.pt"]
    assert ck.last_path.name == "ckpt-step5.pt"


def test_progress_bar_only_on_a_terminal(digits, capsys):
    make_trainer("O0", progress=True).fit(loader(torch.utils.data.Subset(digits[0], range(64)), 32))
    assert capsys.readouterr().out == ""  # pytest's stdout is not a TTY
    import io

    buf = io.StringIO()
    bar = ProgressBar(total=2, file=buf)
    subset = torch.utils.data.Subset(digits[0], range(64))
    make_trainer("O0", callbacks=[bar]).fit(loader(subset, 32))
    assert "2/2" in buf.getvalue() and "scale=1" in buf.getvalue()


def test_history_round_trips():
    h = History(loss=[1.0, 0.5], loss_scale=[2.0, 2.0], skipped=[False, True], lr=[0.1, 0.1],
                epochs=[{"epoch": 1, "loss": 0.75}])
    h2 = History()
    h2.load_state_dict(h.state_dict())
    assert h2 == h and h2.steps == 2 and h2.metric("loss") == [0.75]


def test_diagnose_overflow_reports_and_changes_nothing(digits):
    x, y = digits[0][:32]
    batches = [(x, y), (torch.full_like(x, 3e38), y), (x, y)]  # step 2 overflows in layer "0"

    def run(diagnose):
        torch.manual_seed(0)
        model = mlp(dropout=0.3)  # dropout: the re-run must not shift the RNG stream
        t = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), level="O0",
                    loss_scale=4.0, diagnose_overflow=diagnose, progress=False)
        for b in batches:
            t.train_step([b])
        return t

    plain, diagnosed = run(False), run(True)
    assert diagnosed.history.skipped == [False, True, False]
    (found,) = diagnosed.history.overflows
    assert found["step"] == 2 and found["scale"] == 4.0
    assert found["report"].startswith("first non-finite in forward: 0 (aten.addmm")
    assert plain.history.overflows == []
    assert all(torch.equal(a, b) for a, b in zip(params(plain), params(diagnosed)))


def test_persistent_overflow_is_reported_once_then_counted(digits, caplog):
    """0.1 logged one six-line report per overflowing step (19 under persistent overflow)."""
    x, y = digits[0][:32]
    bad, other = (torch.full_like(x, 3e38), y), (x, torch.full_like(y, 0))
    torch.manual_seed(0)
    model = mlp()
    t = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), level="O0",
                loss_scale=4.0, diagnose_overflow=True, progress=False)
    with caplog.at_level("INFO", logger="mixprec"):
        for _ in range(5):
            t.train_step([bad])
    assert t.history.skipped == [True] * 5
    (entry,) = t.history.overflows
    assert entry["step"] == 1 and entry["repeats"] == 4 and "addmm" in entry["cause"]
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "first non-finite in forward" in warnings[0].getMessage()
    repeats = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(repeats) == 4 and "same first cause as step 1" in repeats[-1]
    assert all(len(m.splitlines()) == 1 for m in repeats)
    t.train_step([other])  # a clean step; the history keeps counting across checkpoints
    assert History().load_state_dict(t.history.state_dict()) is None


# ----------------------------------------------------------------- Hugging Face batches
class DictModel(nn.Module):
    """A Hugging Face-style model: keyword inputs, a ModelOutput-like dict with loss and logits."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, pixels, labels=None, scale=1.0):
        logits = self.body(pixels) * scale
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float(), labels)
        return out


def dict_batches(ds, batch=64):
    x, y = ds[:]
    return [{"pixels": x[i:i + batch], "labels": y[i:i + batch]} for i in range(0, len(x), batch)]


@pytest.mark.parametrize("loss_fn", [None, F.cross_entropy], ids=["output.loss", "loss_fn"])
def test_dict_batches_and_model_outputs(digits, loss_fn):
    """0.1 rejected dict batches (`each batch must be a tuple`) and broke on ModelOutput."""
    train, test = digits
    torch.manual_seed(0)
    model = DictModel()
    trainer = Trainer(model, loss_fn, torch.optim.Adam(model.parameters(), lr=3e-3), level="O2",
                      dtype="bf16", metrics="accuracy", progress=False)
    history = trainer.fit(dict_batches(train), epochs=5, eval_data=dict_batches(test, 200))
    assert history.epochs[-1]["val_accuracy"] > 0.9
    assert history.loss[-1] < 0.5 * history.loss[0]
    evaluated = trainer.evaluate(dict_batches(test, 200))
    assert evaluated["accuracy"] == history.epochs[-1]["val_accuracy"]


def test_hugging_face_model_output_with_loss_fn_none():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32, num_labels=2,
                                  max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (32, 8), generator=g)
    labels = (ids[:, 0] > 32).long()  # learnable from the first token
    batches = [{"input_ids": ids[i:i + 8], "attention_mask": torch.ones(8, 8, dtype=torch.long),
                "labels": labels[i:i + 8]} for i in range(0, 32, 8)]
    trainer = Trainer(model, None, torch.optim.AdamW(model.parameters(), lr=3e-3), level="O2",
                      dtype="bf16", metrics="accuracy", progress=False)
    history = trainer.fit(batches, epochs=6)
    assert history.epochs[-1]["accuracy"] > 0.8 and history.loss[-1] < history.loss[0]


def test_batches_without_what_the_trainer_needs_get_clear_errors(digits):
    x, y = digits[0][:8]
    model = DictModel()
    trainer = Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.1), level="O0",
                      metrics="accuracy", progress=False)
    with pytest.raises(ValueError,
                       match=r"model's output \(\.loss.*has none: give the batch labels"):
        trainer.train_step([{"pixels": x}])
    plain = mlp()
    with pytest.raises(TypeError, match=r"tuple \(inputs..., target\) or a dict"):
        Trainer(plain, F.cross_entropy, torch.optim.SGD(plain.parameters(), lr=0.1),
                progress=False).train_step([x])


def test_cuda_device_without_cuda_and_one_shot_iterators_are_refused(digits):
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            make_trainer("O0", device="cuda")
    trainer = make_trainer("O0")
    x, y = digits[0][:64]
    gen = ((x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16))
    with pytest.raises(TypeError, match="one-shot iterator.*exhausted after the first of 2"):
        trainer.fit(gen, epochs=2)
    trainer.fit(gen, epochs=1)  # one epoch of a generator is fine
    assert trainer.history.steps == 4


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own imports under compile
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_compile_matches_eager(digits):
    data = torch.utils.data.Subset(digits[0], range(256))
    eager = make_trainer("O1", "bf16")
    eager.fit(loader(data, 64), epochs=1)
    compiled = make_trainer("O1", "bf16", compile=True)
    compiled.fit(loader(data, 64), epochs=1)
    assert compiled.history.loss == pytest.approx(eager.history.loss, rel=2e-2)


def test_accuracy_reads_the_class_dimension_from_the_shapes():
    """Scores (N, C, ...) as torch's F.cross_entropy takes them, or (N, T, C) token logits as
    Hugging Face models return them, against (N, ...) targets; where both fit it refuses to
    guess (it took argmax over dim 1 of token logits: a wrong number, or a size error)."""
    torch.manual_seed(0)
    target = torch.randint(0, 5, (4, 3))
    torch_layout, tokens = torch.randn(4, 5, 3), torch.randn(4, 3, 5)
    for scores, dim in ((torch_layout, 1), (tokens, -1)):
        acc = mp.Accuracy()
        acc.update(scores, target)
        assert acc.compute() == (scores.argmax(dim) == target).sum().item() / target.numel()
    flat = mp.Accuracy()
    flat.update(torch.randn(6, 5), torch.arange(6) % 5)
    assert flat.total == 6
    square = torch.randn(4, 3, 3)
    with pytest.raises(ValueError, match=r"class_dim=-1\) \(token logits\)"):
        mp.Accuracy().update(square, target % 3)
    chosen = mp.Accuracy(class_dim=-1)
    chosen.update(square, target % 3)
    assert chosen.compute() == (square.argmax(-1) == target % 3).sum().item() / target.numel()
    with pytest.raises(ValueError, match="the scores' shape without its class dimension"):
        mp.Accuracy().update(torch.randn(4, 6, 7), target)
    with pytest.raises(ValueError, match="class_dim must be None, 1 or -1; got 2"):
        mp.Accuracy(class_dim=2)


def test_a_policy_naming_a_class_defined_in_a_function_resumes(tmp_path):
    """keep_fp32=[a class defined in a function]: the checkpoint's policy names a type that
    can't be imported back; it is compared as saved (save worked, load refused its own file)."""
    class Head(torch.nn.Linear):
        pass

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), Head(16, 3))
        return Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                       level="O2", dtype="bf16", keep_fp32=[Head], progress=False)

    data = [(torch.randn(4, 8), torch.randint(0, 3, (4,)))] * 2
    first = make()
    first.fit(data)
    first.save(tmp_path / "run.pt")
    again = make()
    again.load(tmp_path / "run.pt")
    assert again.global_step == first.global_step
    assert all(torch.equal(a, b) for a, b in zip(params(again), params(first)))


def test_accuracy_leaves_out_ignored_labels_and_mae_refuses_a_broadcast():
    """Token labels of -100 (padding, which cross-entropy ignores) were counted as wrong
    predictions (0.5 for 2 of 2 right); MAE of (N, 1) outputs against (N,) targets summed
    all N x N differences (105 for a true 1.9)."""
    from mixprec.training.metrics import Accuracy, MeanAbsoluteError

    logits = torch.tensor([[[5.0, 0.0], [0.0, 5.0], [5.0, 0.0]]])  # (N=1, T=3, C=2)
    acc = Accuracy()
    acc.update(logits, torch.tensor([[0, 1, -100]]))
    assert acc.compute() == 1.0
    counted_all = Accuracy(ignore_index=None)  # every target counts: -100 is a wrong one
    counted_all.update(logits, torch.tensor([[0, 1, -100]]))
    assert counted_all.compute() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="ignore_index must be an integer"):
        Accuracy(ignore_index=1.5)
    mae = MeanAbsoluteError()
    out, target = torch.tensor([[1.0], [2.0]]), torch.tensor([0.0, 4.0])
    mae.update(out, target)
    assert mae.compute() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="element by element"):
        mae.update(torch.ones(2, 3), torch.ones(2))


@pytest.mark.parametrize("value", [True, -1, 1.5])
def test_loss_monitor_takes_a_step_count_only(value):
    """``LossMonitor(True)`` was taken as "print every step" (a bool is an int to Python)."""
    with pytest.raises(ValueError, match="per_print_times must be an integer >= 0"):
        mp.LossMonitor(value)


def test_an_fp32_output_policy_at_o3_computes_the_loss_in_fp32_as_mindspores_model():
    """MindSpore's Model computes the loss in fp32 at O3; mixprec's O3 returns 16-bit outputs
    (apex's O3), and the documented policy gives the loss fp32 outputs of 16-bit compute."""
    seen = []

    def loss_fn(out, y):
        seen.append(out.dtype)
        return F.cross_entropy(out, y)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 5, (32,)))
    policy = mp.Policy.from_level("O3", "fp16").replace(output_dtype="fp32")
    trainer = Trainer(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.01),
                      policy=policy, progress=False)
    trainer.fit(DataLoader(data, batch_size=8))
    assert set(seen) == {torch.float32}
    assert trainer.model[0].weight.dtype == torch.float16


def test_a_scheduler_of_another_optimizer_and_loose_flags_are_refused():
    """A scheduler made over another optimizer was taken (the LR never changed), optimizer=None
    failed inside prepare with an AttributeError, scheduler=3 failed after the first update,
    compile="no" compiled, and ModelCheckpoint took every_n_steps=True."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler was made for another optimizer"):
        Trainer(model, F.cross_entropy, opt,
                scheduler=torch.optim.lr_scheduler.StepLR(other, 1, 0.5))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer.*NoneType"):
        Trainer(model, F.cross_entropy, None)
    with pytest.raises(TypeError, match="scheduler must be an LR scheduler .* got 3"):
        Trainer(model, F.cross_entropy, opt, scheduler=3)
    for name in ("compile", "diagnose_overflow", "progress"):
        with pytest.raises(TypeError, match=f"{name} must be True or False; got 'no'"):
            Trainer(model, F.cross_entropy, opt, **{name: "no"})
    with pytest.raises(ValueError, match="every_n_steps must be None or an integer >= 1"):
        ModelCheckpoint("ckpt", every_n_steps=True)
    with pytest.raises(TypeError, match="Trainer steps without a closure, and LBFGS"):
        Trainer(model, F.cross_entropy, torch.optim.LBFGS(model.parameters()))


def test_callbacks_refuse_what_they_would_misread():
    """``every_epoch="no"`` saved every epoch (a non-empty string is true), ``every_epoch=False``
    with no ``every_n_steps`` never saved, ``prefix=""`` named files ``-stepN.pt``,
    ``print_fn=5`` failed at the first print, ``FP8Monitor(every_n_steps=True)`` checked every
    step."""
    with pytest.raises(TypeError, match="every_epoch must be True or False; got 'no'"):
        ModelCheckpoint("ckpt", every_epoch="no")
    with pytest.raises(ValueError, match="would never save"):
        ModelCheckpoint("ckpt", every_epoch=False)
    with pytest.raises(ValueError, match="prefix must be a non-empty string"):
        ModelCheckpoint("ckpt", prefix="")
    with pytest.raises(TypeError, match="print_fn must be callable.*int 5"):
        LossMonitor(print_fn=5)
    with pytest.raises(ValueError, match="every_n_steps must be an integer >= 1; got True"):
        mp.training.FP8Monitor(every_n_steps=True)


def _interrupting(after: int):
    calls = [0]

    def loss_fn(output, target):
        calls[0] += 1
        if calls[0] == after:
            raise KeyboardInterrupt
        return F.cross_entropy(output, target)
    return loss_fn, calls


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_a_fit_interrupted_inside_an_accumulation_window_goes_on_exactly(digits, level,
                                                                          tmp_path):
    """KeyboardInterrupt on a window's second micro-batch: fit() again started a new window at
    that batch with the first micro-batch's gradients still held (9.4e-3 off), and save() wrote
    a checkpoint without them (1.8e-2 off once resumed). fit() again finishes the window, bit for
    bit the uninterrupted run; save() inside the window is refused."""
    batches = [digits[0][i:i + 16] for i in range(0, 96, 16)]  # 6 micro-batches, 2 steps
    runs = []
    for stop in (None, 2, 3, 5):
        loss_fn, calls = _interrupting(stop or 0)
        torch.manual_seed(0)
        model = mlp()
        trainer = Trainer(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                          level=level, dtype="bf16", grad_accum_steps=3, progress=False)
        if stop is not None:
            with pytest.raises(KeyboardInterrupt):
                trainer.fit(batches, epochs=2)
            with pytest.raises(RuntimeError, match="save\\(\\) inside an accumulation window"):
                trainer.save(tmp_path / "mid.pt")
            calls[0] = -100
        trainer.fit(batches, epochs=2)
        runs.append((params(trainer), trainer.history.loss))
    for weights, losses in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(weights, runs[0][0]))
        assert losses == runs[0][1]


def test_accuracy_of_a_hugging_face_causal_lm_says_how_scores_align():
    """metrics="accuracy" with loss_fn=None on a causal language model compared the logits at
    t (most often the next token's scores) with the label at t: 0.0 for a model 100% right. Not
    every such model shifts (XLNet does not): the Trainer asks, and Accuracy(next_token=True)
    compares with the next token."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=16, n_layer=1,
                                     n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel is a causal language model.*"
                                         r"mp\.Accuracy\(next_token=True\)"):
        Trainer(model, None, opt, level="O0", metrics="accuracy", progress=False)
    ids = torch.arange(8).repeat(4, 1) % 16
    data = [{"input_ids": ids, "labels": ids}]
    trainer = Trainer(model, None, opt, level="O0", metrics=[mp.Accuracy(next_token=True)],
                      progress=False)
    trainer.fit(data, epochs=30)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    want = (logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean().item()
    assert want == 1.0
    assert trainer.evaluate(data)["accuracy"] == want


class _RaisingHook:
    """A gradient hook on one parameter that raises once, in the backward of call ``at``."""

    def __init__(self, param, at):
        self.calls, self.at = 0, at
        param.register_hook(self)

    def __call__(self, grad):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return grad


@pytest.mark.parametrize("sized", [True, False])
def test_a_window_cut_inside_a_backward_or_of_unsized_data_starts_again(digits, sized):
    """An exception inside a backward leaves partial gradients (the later layers' added): fit()
    again took them twice (1.4e-2 off); data without len() started a new window on top of the
    interrupted one's gradients (1.8e-2). The window starts again: bit for bit without dropout.
    load() after an interrupted window drops its gradients (8.7e-3 off before)."""
    batches = [digits[0][i:i + 16] for i in range(0, 112, 16)]  # 7 micro-batches
    data = batches if sized else _Unsized(batches)
    runs = []
    for stop in (None, 2, 3):
        torch.manual_seed(0)
        model = mlp()
        trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                          grad_accum_steps=4, progress=False)
        if stop is not None:
            hook = _RaisingHook(model[0].weight, stop)  # the first layer: after the last's
            with pytest.raises(KeyboardInterrupt):
                trainer.fit(data, epochs=2)
            assert model[-1].weight.grad is not None  # (partial: the last layer's added)
            hook.at = -1
        trainer.fit(data, epochs=2)
        runs.append(params(trainer))
    for weights in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(weights, runs[0]))


class _Unsized:
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_an_exception_in_train_step_s_backward_leaves_save_to_the_loop(digits, tmp_path):
    """An exception inside the backward of train_step (a custom loop) left fit()'s window flag
    set: save() then refused, saying to call fit() again."""
    torch.manual_seed(0)
    model = mlp()
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                      progress=False)
    hook = _RaisingHook(model[0].weight, 1)
    with pytest.raises(KeyboardInterrupt):
        trainer.train_step([digits[0][:16]])
    hook.at = -1
    trainer.optimizer.zero_grad()
    trainer.save(tmp_path / "ok.pt")
    trainer.train_step([digits[0][:16]])
