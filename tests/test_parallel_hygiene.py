"""What a distributed trial found that one process shows: temporaries of interrupted saves are
removed by the next save or resume, and ``strategy="single"`` in a run of several processes warns.
"""

import os
import tempfile
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.integrity import STALE_AFTER_S, remove_stale_temporaries
from mixprec.monitor.ranks import RankReduction


def _trainer(**kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return mp.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                      level="O0", progress=False, **kwargs)


def _orphans(directory):
    """What interrupted saves leave (as atomic_save names its temporaries, and as earlier
    versions did), written long enough ago to be stale, and a fresh one being written now."""
    old = time.time() - 10 * STALE_AFTER_S
    fd, partial = tempfile.mkstemp(prefix=".ckpt-step4.pt.", suffix=".partial", dir=directory)
    os.close(fd)
    earlier = directory / ".ckpt-step8.pt.k3j_x9a2"   # before the ".partial" suffix
    saving = directory / ".ckpt-step12.saving"        # an FSDP directory being written
    saving.mkdir()
    (saving / "__0_0.distcp").write_bytes(b"x" * 64)
    earlier.write_bytes(b"x" * 64)
    for p in (partial, earlier, saving / "__0_0.distcp", saving):
        os.utime(p, (old, old))
    fresh = directory / ".ckpt-step16.pt.abcd1234.partial"
    fresh.write_bytes(b"being written")
    return [directory / os.path.basename(partial), earlier, saving], fresh


def _unrelated(directory):
    old = time.time() - 10 * STALE_AFTER_S
    names = [".bashrc.abcdefgh", "notes.txt", ".hidden", "run.pt.abcdefgh", ".x.saving.txt"]
    for name in names:
        (directory / name).write_text("not a temporary of a checkpoint")
        os.utime(directory / name, (old, old))
    return [directory / n for n in names]


def test_the_next_save_removes_stale_temporaries_of_interrupted_saves(tmp_path):
    stale, fresh = _orphans(tmp_path)
    others = _unrelated(tmp_path)
    _trainer().save(tmp_path / "ckpt-step20.pt")
    assert not any(p.exists() for p in stale)
    assert fresh.exists() and all(p.exists() for p in others)  # being written / not ours
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert leftovers == [fresh.name]  # the save itself left no temporary


def test_resuming_removes_them_too(tmp_path):
    trainer = _trainer()
    trainer.save(tmp_path / "ckpt.pt")
    stale, fresh = _orphans(tmp_path)
    _trainer().load(tmp_path / "ckpt.pt")
    assert not any(p.exists() for p in stale) and fresh.exists()


def test_remove_stale_temporaries_reports_what_it_removed(tmp_path):
    stale, fresh = _orphans(tmp_path)
    assert sorted(remove_stale_temporaries(tmp_path)) == sorted(stale)
    assert remove_stale_temporaries(tmp_path / "missing") == []
    assert remove_stale_temporaries(tmp_path, stale_after_s=0.0) == [fresh]


# -- strategy="single" in a run of several processes -------------------------------------------
def test_single_in_a_run_of_several_processes_warns(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(UserWarning, match=r"strategy='single' in a run of 2 processes "
                                         r"\(WORLD_SIZE; this is rank 1\).*strategy='ddp'") as got:
        trainer = _trainer(strategy="single")
    assert trainer.strategy.name == "single"
    assert got[0].filename == __file__  # points at the line that built the Trainer


@pytest.mark.parametrize("world", [None, "1"])
def test_single_in_one_process_does_not_warn(monkeypatch, world):
    if world is not None:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", world)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _trainer(strategy="single").strategy.name == "single"
        assert _trainer(strategy="auto").strategy.name == "single"


# -- the monitor's combination across ranks, in one process -------------------------------------
def test_an_inactive_reduction_keeps_every_value_and_refuses_unknown_kinds():
    reduction = RankReduction(active=False)
    value = torch.tensor([1.0, 2.0])
    item = reduction.add(value, "sum")
    reduction.run()
    assert item.value is value
    with pytest.raises(ValueError, match="kind must be one of"):
        reduction.add(value, "median")
