"""Shared pieces of the distributed tests: a 2-rank gloo launcher with a deadline, a small model
with blocks in an nn.ModuleList (FSDP units) and LayerNorms (fp32 units at O2), its data, and
training runs that return plain results for the tests to compare.

The launcher uses a file store (no TCP port to race for) and leaves each worker with
``os._exit(0)`` after its results are on disk: gloo's background threads can abort a process at
interpreter exit ("terminate called without an active exception", seen on a fresh clone), which
would fail a test for a reason that is not ours.
"""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec as mp

WORLD = 2
SAMPLES = 32
GLOBAL_BATCH = 8
FEATURES = 8


def launch(fn, out_dir, *args, world=WORLD, timeout=90.0, pg_timeout=30.0, barrier=True):
    """Run ``fn(rank, out_dir, *args)`` on ``world`` spawned gloo ranks; return each rank's result.

    Fails the test when the ranks are still running after ``timeout`` seconds (a hang), and
    re-raises a rank's exception with its traceback. ``barrier=False``: ranks leave without a
    last barrier (for cases that break the group).
    """
    out = str(out_dir)
    ctx = tmp.start_processes(_entry, args=(fn, out, world, pg_timeout, barrier, args),
                              nprocs=world,
                              join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                pytest.fail(f"{fn.__name__}: ranks still running after {timeout:.0f} s (a hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _entry(rank, fn, out, world, pg_timeout, barrier, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))
    result = fn(rank, out, *args)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if barrier:
        dist.barrier()
    os._exit(0)


class Block(nn.Module):
    def __init__(self, d, dropout):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(F.relu(self.norm(self.fc(x))))


class Net(nn.Module):
    """Two residual blocks (Linear, LayerNorm, ReLU, Dropout) in a ModuleList and a head."""

    def __init__(self, d=FEATURES, classes=3, dropout=0.0):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, dropout) for _ in range(2)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dataset(inf_at=None):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    if inf_at is not None:
        x[inf_at, 0] = float("inf")
    return TensorDataset(x, torch.randint(0, 3, (SAMPLES,), generator=g))


def loader(batch, shuffle=False, inf_at=None):
    gen = torch.Generator().manual_seed(7) if shuffle else None
    return DataLoader(dataset(inf_at), batch_size=batch, shuffle=shuffle, generator=gen)


def make_trainer(strategy, level, *, reduce="fp32", dropout=0.0, accum=1, clip=None, scaler="auto",
                 callbacks=(), adam=False, master=None, state_dtype=None, dtype="bf16"):
    torch.manual_seed(0)
    model = Net(dropout=dropout)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if adam else
           torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return mp.Trainer(model, F.cross_entropy, opt, level=level, dtype=dtype, strategy=strategy,
                      reduce_dtype=reduce, metrics="accuracy", progress=False,
                      grad_accum_steps=accum, max_grad_norm=clip, loss_scale=scaler,
                      callbacks=callbacks, master=master, state_dtype=state_dtype)


def fit(strategy, level, *, epochs=2, world=1, **options):
    """Train at a global batch of GLOBAL_BATCH; fp32 weights, history and evaluation."""
    trainer = make_trainer(strategy, level, **options)
    per_rank = GLOBAL_BATCH // world // options.get("accum", 1)
    history = trainer.fit(loader(per_rank), epochs=epochs)
    evaluation = trainer.evaluate(loader(per_rank))
    weights = mp.fp32_state_dict(trainer.model, trainer.optimizer)
    return {"weights": {k: v.cpu() for k, v in weights.items()}, "loss": history.loss,
            "epochs": history.epochs, "eval": evaluation}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# The tolerances of parity with one process at the same global batch (weights, and the per-step
# and evaluation losses): O0 reassociates fp32 sums only; 16-bit levels round differently when
# the batch is split (measured max weight differences: O1 2e-3, O2 2.4e-3, O3 7.8e-3).
TOLERANCE = {"O0": 1e-5, "O1": 1e-2, "O2": 1e-2, "O3": 2e-2}


def assert_matches_one_process(ranks: list, single: dict, level: str) -> None:
    for r in ranks:
        got, want = r[f"fit_{level}"], single[level]
        assert max_diff(got["weights"], want["weights"]) <= TOLERANCE[level]
        tol = TOLERANCE[level]
        assert got["loss"] == pytest.approx(want["loss"], abs=tol)
        assert got["eval"]["loss"] == pytest.approx(want["eval"]["loss"], abs=tol)


def assert_ranks_agree(ranks: list, level: str) -> None:
    """Every rank ends with the same weights, history and evaluation, bit for bit."""
    a, b = (r[f"fit_{level}"] for r in ranks)
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert a["loss"] == b["loss"] and a["epochs"] == b["epochs"] and a["eval"] == b["eval"]


# ----------------------------------------------------------------- pieces both suites run
class StopAt(mp.Callback):
    """Stop after global step ``step``, asked on rank 0 only (every rank must stop with it)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, logs):
        if logs["step"] == self.step and mp.parallel.is_main_process():
            trainer.stop_training = True


def resume_case(rank, out, strategy, level, name="resume.ckpt", **options):
    """Uninterrupted vs stopped at step 6 (mid-epoch 2), saved, loaded into a fresh trainer."""
    def run(callbacks=()):
        trainer = make_trainer(strategy, level, dropout=0.25, callbacks=callbacks, **options)
        torch.manual_seed(100 + rank)  # different dropout masks on each rank
        return trainer

    per_rank = GLOBAL_BATCH // WORLD
    whole = run()
    whole.fit(loader(per_rank, shuffle=True), epochs=2)
    first = run([StopAt(6)])
    first.fit(loader(per_rank, shuffle=True), epochs=2)
    stopped_at = first.global_step
    path = os.path.join(out, name)
    first.save(path)
    second = run()
    torch.manual_seed(12345)  # load() must restore every rank's own RNG
    second.load(path)
    second.fit(loader(per_rank, shuffle=True), epochs=2)
    a = mp.fp32_state_dict(whole.model, whole.optimizer)
    b = mp.fp32_state_dict(second.model, second.optimizer)
    return {"stopped_at": stopped_at, "equal": all(torch.equal(a[k], b[k]) for k in a),
            "loss_equal": whole.history.loss == second.history.loss,
            "steps": second.global_step, "is_dir": os.path.isdir(path)}


def skip_case(rank, make_model_and_opt):
    """Rank 1 alone writes an inf into one of its (already reduced) gradients at step 1."""
    model, opt = make_model_and_opt()
    scaler = mp.DynamicLossScaler(init_scale=256.0, growth_interval=1000)
    applied, scales = [], []
    for step in range(3):
        x, y = dataset()[rank * 4 + 8 * step: rank * 4 + 8 * step + 4]
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if rank == 1 and step == 1:
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("inf")
        applied.append(scaler.step(opt))
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return {"applied": applied, "scales": scales}
