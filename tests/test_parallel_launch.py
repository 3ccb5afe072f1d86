"""Launching: the same script under ``python`` and ``torchrun``; a rank that raises mid-step."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_cases import GLOBAL_BATCH, WORLD, Net, launch, loader

import mixprec as mp

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_distributed.py"


def _run(cmd, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)


def test_the_same_script_trains_alike_under_python_and_torchrun(tmp_path):
    one = _run([sys.executable, str(EXAMPLE), "--level", "O0", "--epochs", "2",
                "--out", "one.pt"], tmp_path)
    assert one.returncode == 0, one.stderr
    two = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", str(EXAMPLE), "--level", "O0", "--epochs", "2",
                "--out", "two.pt"], tmp_path)
    # returncode 0: gloo's workers were let finish before exit (env.settle; it may abort otherwise)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.startswith("ddp x2 O0") and two.stdout.count("\n") == 1  # rank 0 prints
    a, b = (torch.load(tmp_path / f, weights_only=True) for f in ("one.pt", "two.pt"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_script_that_ends_right_after_its_collectives_exits_0(tmp_path, strategy):
    """gloo's workers release the last collectives' tensors after the script's last line; mixprec
    lets them finish before the interpreter finalizes (without it, 9 of 20 launches aborted)."""
    script = Path(__file__).resolve().parent / "train_then_exit.py"
    for _ in range(2):
        run = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(script), "--strategy", strategy], tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]


class _RaiseAt:
    """A loss function that raises on rank 1 at its third call (mid-epoch)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, output, target):
        self.calls += 1
        if mp.parallel.rank() == 1 and self.calls == 3:
            raise ValueError("bad batch on rank 1")
        return F.cross_entropy(output, target)


def _raise_mid_step(rank, out):
    torch.manual_seed(0)
    model = Net()
    trainer = mp.Trainer(model, _RaiseAt(), torch.optim.SGD(model.parameters(), lr=0.1),
                         level="O0", progress=False)
    start = time.monotonic()
    try:
        trainer.fit(loader(GLOBAL_BATCH // WORLD), epochs=1)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    if rank == 1:  # stay alive without taking part, as a rank stuck elsewhere would
        time.sleep(5)
    return {"error": error, "seconds": time.monotonic() - start}


def test_a_rank_that_raises_does_not_leave_the_others_waiting(tmp_path):
    r0, r1 = launch(_raise_mid_step, tmp_path, pg_timeout=2.0, barrier=False, timeout=60)
    assert r1["error"] == "ValueError: bad batch on rank 1"  # reported where it happened
    assert r0["error"].startswith("RuntimeError: rank 0 of 2: a collective operation failed")
    assert r0["seconds"] < 20  # the group's timeout, not forever


@pytest.mark.cuda
@pytest.mark.parametrize("strategy,reduce_dtype", [("ddp", "bf16"), ("fsdp", "fp32")])
def test_torchrun_on_cuda_takes_the_device_from_local_rank(tmp_path, strategy, reduce_dtype):
    """NCCL for CUDA tensors (torch's own bf16 compression hook under DDP), one rank per GPU."""
    ranks = min(2, torch.cuda.device_count())
    run = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(ranks), str(EXAMPLE), "--level", "O2", "--strategy",
                strategy, "--reduce-dtype", reduce_dtype, "--epochs", "1", "--out", "w.pt"],
               tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith(f"{strategy} x{ranks} O2")
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in weights.values())
