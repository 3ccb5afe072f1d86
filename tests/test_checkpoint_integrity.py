"""Checkpoints whole or refused in every host: a save that dies half-way leaves nothing under the
checkpoint's name, and a damaged file is refused naming it (``verify=False`` loads one edited on
purpose): mp.Trainer, MixprecAccelerator.save_state, MixprecTrainer's checkpoints."""

import json
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from parallel_cases import launch
from torch import nn

import mixprec as mp
from mixprec import integrity

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")


class Killed(Exception):
    """Stands for the process dying in the middle of a write."""


def dying_save(when):
    """A ``torch.save`` that, for the paths ``when`` picks, writes half of the file and then
    raises (as a killed process would stop); the others are saved as usual."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        name = str(getattr(f, "name", f))
        real(obj, f, *args, **kwargs)
        if not when(name):
            return
        if os.path.isfile(name):
            with open(name, "r+b") as out:
                out.truncate(os.path.getsize(name) // 2)
        raise Killed(f"killed while writing {name}")
    return save


def half_then_die(monkeypatch, when=lambda path: True):
    monkeypatch.setattr(torch, "save", dying_save(when))


def flip(path, needle: bytes | None = None, n: int = 64) -> None:
    """Invert ``n`` bytes of ``path``: where ``needle`` starts (a tensor's bytes), else at
    the middle."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    at = data.find(needle) if needle is not None else len(data) // 2
    assert at >= 0, "the bytes to damage are not in the file"
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    with open(path, "wb") as f:
        f.write(bytes(data))


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def batches(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


# ----------------------------------------------------------------- the helpers themselves
def test_the_digest_is_the_same_after_a_round_trip_and_sees_one_bit(tmp_path):
    state = {"w": torch.randn(5, 3).to(torch.bfloat16), "step": 3, "rng": (1, (2, 3), None),
             "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "flag": torch.tensor([True])}
    torch.save(integrity.seal(state), tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    integrity.check_seal(loaded, tmp_path / "s.pt")
    loaded["w"].view(torch.int16)[2, 1] ^= 1  # one bit of one bf16 weight
    with pytest.raises(ValueError, match=r"'.*s\.pt' is damaged"):
        integrity.check_seal(loaded, tmp_path / "s.pt")
    integrity.check_seal(loaded, tmp_path / "s.pt", verify=False)
    del loaded["sha256"]
    with pytest.raises(ValueError, match="carries no checksum"):
        integrity.check_seal(loaded, tmp_path / "s.pt")
    integrity.check_seal(loaded, tmp_path / "s.pt", required=False)


def test_a_directory_save_that_dies_leaves_the_old_one_whole(tmp_path):
    path = tmp_path / "ckpt"

    def write(text):
        def go(tmp):
            (tmp / "sub").mkdir(parents=True)
            (tmp / "a.txt").write_text(text)
            (tmp / "sub" / "b.bin").write_bytes(text.encode() * 3)
        return go

    integrity.save_directory(path, write("one"))
    assert sorted(p.name for p in path.rglob("*")) == ["a.txt", "b.bin",
                                                       integrity.MANIFEST, "sub"]
    assert integrity.verify_directory(path)

    def dies(tmp):
        tmp.mkdir()
        (tmp / "a.txt").write_text("two, half")
        raise Killed("mid-save")
    with pytest.raises(Killed):
        integrity.save_directory(path, dies)
    assert (path / "a.txt").read_text() == "one" and integrity.verify_directory(path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the temporary is gone too

    integrity.save_directory(path, write("two"))
    assert (path / "a.txt").read_text() == "two" and integrity.verify_directory(path)
    (path / "sub" / "b.bin").write_bytes(b"twx" * 3)  # same size, other bytes
    with pytest.raises(ValueError, match=r"'.*sub/b\.bin' is damaged"):
        integrity.verify_directory(path)
    assert not integrity.verify_directory(path, verify=False)
    (path / "sub" / "b.bin").unlink()
    with pytest.raises(ValueError, match=r"'.*sub/b\.bin' is missing"):
        integrity.verify_directory(path)
    (path / integrity.MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match="manifest .* is damaged"):
        integrity.verify_directory(path)
    (path / integrity.MANIFEST).unlink()
    assert not integrity.verify_directory(path)  # no manifest: another tool's, unchecked


def test_the_checksum_benchmark_times_every_row(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "checkpoint_checksums.py"
    spec = importlib.util.spec_from_file_location("checkpoint_checksums", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--mb", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for row in ("write, sealed", "read, checked", "verify=False", "verify_directory"):
        assert row in out


# ----------------------------------------------------------------- mp.Trainer
def trainer():
    model = tiny()
    return mp.Trainer(model, F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=1e-2),
                      level="O2", dtype="bf16", progress=False)


def test_a_trainer_checkpoint_with_flipped_bytes_is_refused_naming_it(tmp_path):
    t = trainer()
    t.fit(batches(), epochs=1)
    t.save(tmp_path / "ck.pt")
    master = t.model.state_dict()["0.weight"]  # fp32, as the file holds it
    flip(tmp_path / "ck.pt", master.numpy().tobytes()[:64])
    fresh = trainer()
    with pytest.raises(ValueError, match=r"'.*ck\.pt' is damaged"):
        fresh.load(tmp_path / "ck.pt")
    assert fresh.global_step == 0  # refused before anything was loaded
    fresh.load(tmp_path / "ck.pt", verify=False)
    assert fresh.global_step == 4


def test_a_trainer_checkpoint_edited_on_purpose_loads_with_verify_false(tmp_path):
    t = trainer()
    t.fit(batches(), epochs=1)
    t.save(tmp_path / "ck.pt")
    ckpt = torch.load(tmp_path / "ck.pt", weights_only=True)
    ckpt["optimizer"]["param_groups"][0]["lr"] = 5e-3  # a deliberate edit, not re-sealed
    torch.save(ckpt, tmp_path / "ck.pt")
    with pytest.raises(ValueError, match=r"'.*ck\.pt' is damaged.*verify=False"):
        trainer().load(tmp_path / "ck.pt")
    edited = trainer()
    edited.load(tmp_path / "ck.pt", verify=False)
    assert edited.optimizer.param_groups[0]["lr"] == 5e-3


def test_a_trainer_checkpoint_of_the_earlier_format_loads_unchecked(tmp_path):
    t = trainer()
    t.fit(batches(), epochs=1)
    t.save(tmp_path / "ck.pt")
    ckpt = torch.load(tmp_path / "ck.pt", weights_only=True)
    del ckpt["sha256"]
    torch.save({**ckpt, "format": "mixprec.trainer/2"}, tmp_path / "old.pt")
    old = trainer()
    old.load(tmp_path / "old.pt")
    assert old.global_step == 4
    torch.save(ckpt, tmp_path / "unsealed.pt")  # the current format carries its checksum
    with pytest.raises(ValueError, match=r"'.*unsealed\.pt' carries no checksum"):
        trainer().load(tmp_path / "unsealed.pt")


def test_a_trainer_save_killed_mid_write_keeps_the_previous_file(tmp_path, monkeypatch):
    t = trainer()
    t.fit(batches(), epochs=1)
    t.save(tmp_path / "ck.pt")
    before = (tmp_path / "ck.pt").read_bytes()
    t.fit(batches(), epochs=2)
    half_then_die(monkeypatch)
    with pytest.raises(Killed):
        t.save(tmp_path / "ck.pt")
    monkeypatch.undo()
    assert (tmp_path / "ck.pt").read_bytes() == before
    assert os.listdir(tmp_path) == ["ck.pt"]
    resumed = trainer()
    resumed.load(tmp_path / "ck.pt")
    assert resumed.global_step == 4


# ----------------------------------------------------------------- MixprecAccelerator
def accelerated(**kwargs):
    pytest.importorskip("accelerate")
    import hf_cases as hc

    acc = hc.accelerator("O2", **kwargs)
    model = tiny()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return acc, model, opt


def steps(acc, model, opt, data):
    for x, y in data:
        acc.backward(F.cross_entropy(model(x).float(), y))
        opt.step()
        opt.zero_grad()


def test_a_save_state_killed_mid_write_leaves_no_state_under_its_name(tmp_path, monkeypatch):
    acc, model, opt = accelerated()
    steps(acc, model, opt, batches(2))
    acc.save_state(str(tmp_path / "step2"))
    assert integrity.verify_directory(tmp_path / "step2")
    saved = (tmp_path / "step2" / "optimizer.bin").read_bytes()
    steps(acc, model, opt, batches(2))
    half_then_die(monkeypatch, when=lambda name: name.endswith("optimizer.bin"))
    with pytest.raises(Killed):
        acc.save_state(str(tmp_path / "step4"))
    with pytest.raises(Killed):
        acc.save_state(str(tmp_path / "step2"))  # over an existing state
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["step2"]
    assert (tmp_path / "step2" / "optimizer.bin").read_bytes() == saved
    other, model2, opt2 = accelerated()
    other.load_state(str(tmp_path / "step2"))
    a, b = mp.fp32_state_dict(model2, opt2.optimizer), mp.fp32_state_dict(model, opt.optimizer)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the state of step 2, not step 4


def test_automatic_naming_saves_whole_checkpoints_and_loads_the_latest(tmp_path, monkeypatch):
    from accelerate.utils import ProjectConfiguration

    config = dict(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc, model, opt = accelerated(project_config=ProjectConfiguration(**config))
    for _ in range(3):
        steps(acc, model, opt, batches(1))
        acc.save_state()
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["checkpoint_1", "checkpoint_2"]  # total_limit
    half_then_die(monkeypatch, when=lambda name: name.endswith("optimizer.bin"))
    with pytest.raises(Killed):
        acc.save_state()
    monkeypatch.undo()
    assert sorted(os.listdir(root)) == ["checkpoint_1", "checkpoint_2"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]
    assert acc.save_iteration == 3  # the failed save did not count
    acc.save_state()
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]
    flip(root / "checkpoint_3" / "optimizer.bin")
    fresh = accelerated(project_config=ProjectConfiguration(**config))[0]
    with pytest.raises(ValueError, match=r"'.*checkpoint_3/optimizer\.bin' is damaged"):
        fresh.load_state()


def test_load_state_refuses_a_flipped_byte_and_loads_an_edit_with_verify_false(tmp_path):
    acc, model, opt = accelerated()
    steps(acc, model, opt, batches(2))
    acc.save_state(str(tmp_path / "state"))
    path = tmp_path / "state" / "optimizer.bin"
    state = torch.load(path, weights_only=True)
    state["param_groups"][0]["lr"] = 5e-3  # a deliberate edit
    torch.save(state, path)
    other, _, opt2 = accelerated()
    with pytest.raises(ValueError, match=r"'.*state/optimizer\.bin' is damaged.*verify=False"):
        other.load_state(str(tmp_path / "state"))
    other.load_state(str(tmp_path / "state"), verify=False)
    assert opt2.param_groups[0]["lr"] == 5e-3


# ----------------------------------------------------------------- MixprecTrainer
def hf_trainer(out, eval_rows=None, **kwargs):
    transformers = pytest.importorskip("transformers")
    from mixprec.integrations.transformers import MixprecTrainer

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8))
    rows = [{"input_ids": (torch.arange(8) + i) % 32, "labels": (torch.arange(8) + i) % 32}
            for i in range(8)]
    args = transformers.TrainingArguments(
        str(out), use_cpu=True, report_to=[], per_device_train_batch_size=4, num_train_epochs=1,
        save_strategy="steps", save_steps=1, disable_tqdm=True, seed=0,
        train_sampling_strategy="sequential", **kwargs)
    transformers.logging.set_verbosity_error()
    return MixprecTrainer(model, args, train_dataset=rows, eval_dataset=eval_rows, level="O2",
                          dtype="bf16")


def test_a_trainer_checkpoint_killed_mid_write_is_not_picked_for_resume(tmp_path, monkeypatch):
    half_then_die(monkeypatch, when=lambda name: "checkpoint-2" in name
                  and name.endswith("rng_state.pth"))
    with pytest.raises(Killed):
        hf_trainer(tmp_path).train()
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]
    assert integrity.verify_directory(tmp_path / "checkpoint-1")
    resumed = hf_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2"]


def test_resume_refuses_a_damaged_checkpoint_and_verify_false_loads_an_edit(tmp_path):
    hf_trainer(tmp_path, save_total_limit=1).train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]  # rotated after the rename
    checkpoint = tmp_path / "checkpoint-2"
    whole = (checkpoint / "optimizer.pt").read_bytes()
    flip(checkpoint / "optimizer.pt")
    with pytest.raises(ValueError, match=r"'.*checkpoint-2/optimizer\.pt' is damaged"):
        hf_trainer(tmp_path).train(resume_from_checkpoint=True)
    (checkpoint / "optimizer.pt").write_bytes(whole)

    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["logging_steps"] = 7  # a deliberate edit
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"trainer_state\.json' is damaged"):
        hf_trainer(tmp_path).train(resume_from_checkpoint=str(checkpoint))
    resumed = hf_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=str(checkpoint), verify=False)
    assert resumed.state.global_step == 2 and resumed.state.logging_steps == 7


def test_the_best_checkpoint_is_recorded_under_its_final_name(tmp_path):
    """load_best_model_at_end: the best checkpoint is found while the current one is still
    being written aside; the state (and its trainer_state.json) names the renamed one."""
    rows = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32}] * 4
    trainer = hf_trainer(tmp_path, rows, eval_strategy="steps", eval_steps=1,
                         load_best_model_at_end=True, metric_for_best_model="loss")
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert os.path.dirname(best) == str(tmp_path) and os.path.isdir(best)
    recorded = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert recorded["best_model_checkpoint"] in (str(tmp_path / "checkpoint-1"),
                                                 str(tmp_path / "checkpoint-2"))
    assert integrity.verify_directory(tmp_path / "checkpoint-2")


# ----------------------------------------------------------------- a rank dies, 2 gloo ranks
def killed_on_rank_1(rank, out):
    """Rank 1 dies writing its RNG file: Accelerate's save_state (over an existing state and to a
    new name), then MixprecTrainer's checkpoint-4; what each rank raised, what is left, and a
    resume with resume_from_checkpoint=True."""
    import torch.distributed as dist

    pytest.importorskip("transformers")
    import hf_cases as hc

    hc.launcher_env(2)
    got = {}
    acc = hc.accelerator("O2")
    model, opt, data = hc.build(acc, 2)
    hc.train(acc, model, opt, data, stop_at=2)
    state = os.path.join(out, "state")
    acc.save_state(state)
    with mock.patch.object(torch, "save", dying_save(
            lambda name: rank == 1 and "random_states_1" in name)):
        for target in (state, os.path.join(out, "state-new")):
            try:
                acc.save_state(target)
            except Exception as exc:
                got.setdefault("accelerate", []).append(f"{type(exc).__name__}: {exc}")
    dist.barrier()
    got["accelerate files"] = sorted(n for n in os.listdir(out) if n.startswith(("state", ".")))
    got["state whole"] = integrity.verify_directory(state)

    runs = os.path.join(out, "hf")
    trainer = hc.hf_trainer(runs, "O2", 2, save_strategy="steps", save_steps=2)
    with mock.patch.object(torch, "save", dying_save(
            lambda name: rank == 1 and "checkpoint-4" in name and "rng_state_1" in name)):
        try:
            trainer.train()
        except Exception as exc:
            got["hf"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    got["hf files"] = sorted(os.listdir(runs))
    resumed = hc.hf_trainer(runs, "O2", 2, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    got["hf resumed to"] = resumed.state.global_step
    got["hf files after"] = sorted(os.listdir(runs))
    return got


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_no_checkpoint_under_its_name(tmp_path):
    """2 gloo ranks: every rank raises (rank 1 its own error, rank 0 naming rank 1's), nothing
    half-written is left under a final name, and resume_from_checkpoint=True takes the last
    whole checkpoint."""
    pytest.importorskip("accelerate")
    r0, r1 = launch(killed_on_rank_1, tmp_path, timeout=600)
    assert all(m.startswith("Killed") for m in r1["accelerate"]) and "Killed" in r1["hf"]
    assert all(m.startswith("RuntimeError") and "failed on another rank: rank 1: Killed" in m
               for m in r0["accelerate"])
    assert r0["hf"].startswith("RuntimeError") and "rank 1: Killed" in r0["hf"]
    for r in (r0, r1):
        assert r["accelerate files"] == ["state"] and r["state whole"]
        assert r["hf files"] == ["checkpoint-2"]
        assert r["hf resumed to"] == 8
        assert r["hf files after"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6",
                                       "checkpoint-8"]
