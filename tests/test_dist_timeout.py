"""``MIXPREC_DIST_TIMEOUT`` where a host made the process group: Lightning's strategies (DDP and
FSDP2 over one gloo rank, the group and the mesh's groups made by Lightning), Accelerate and the
Hugging Face ``Trainer`` (over a group made before them, as ``accelerate launch`` leaves it) take
it; unset, the host's own timeout stands; where it cannot be applied, a warning says so at
start, naming the host's own setting."""

import datetime
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from mixprec import distenv as env

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
import hf_cases as hc  # noqa: E402
import lightning_cases as lc  # noqa: E402

from mixprec.integrations.accelerate import MixprecAccelerator  # noqa: E402
from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning"),
              pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings."
                                         "PossibleUserWarning"),
              pytest.mark.filterwarnings("ignore:.*ModelParallelStrategy.*:UserWarning"),
              pytest.mark.filterwarnings(
                  r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")]

HOSTS_DEFAULT_S = 1800.0  # torch's gloo default, which Lightning, Accelerate and HF pass on


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo group made by someone else (30-minute timeout), torn down after."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=HOSTS_DEFAULT_S))
    yield
    dist.destroy_process_group()


def accelerator():
    hc.reset_accelerate()
    return MixprecAccelerator(level="O2", dtype="bf16", cpu=True)


def hf_trainer(tmp_path):
    model = torch.nn.Linear(4, 2)
    args = transformers.TrainingArguments(str(tmp_path / "hf"), use_cpu=True, report_to=[],
                                          disable_tqdm=True)
    return MixprecTrainer(model, args, level="O2", dtype="bf16",
                          optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))


@pytest.mark.parametrize("host", ["accelerate", "transformers"])
def test_the_hugging_face_hosts_give_their_group_the_timeout(host, group, tmp_path, monkeypatch):
    monkeypatch.setenv(env.TIMEOUT_ENV, "15")
    sub = dist.new_group([0])  # a group made after the default one (a device mesh's)
    accelerator() if host == "accelerate" else hf_trainer(tmp_path)
    assert lc.group_timeouts() == [15.0, 15.0]
    monkeypatch.delenv(env.TIMEOUT_ENV)  # unset: the host's own timeout stands
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=HOSTS_DEFAULT_S), sub)
    accelerator() if host == "accelerate" else hf_trainer(tmp_path)
    assert lc.group_timeouts() == [15.0, HOSTS_DEFAULT_S]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lightnings_strategies_give_their_groups_the_timeout(strategy, monkeypatch):
    """Lightning makes the group (and under ModelParallelStrategy the mesh's groups) with its
    own 30 minutes; the plugin gives every one of them the variable's timeout before its first
    collective."""
    monkeypatch.setenv(env.TIMEOUT_ENV, "15")
    got = lc.fit_alone(strategy, ("O2", "bf16", None), epochs=1)
    assert got["backend"] == "gloo" and got["timeouts"] and set(got["timeouts"]) == {15.0}


def test_where_it_cannot_be_applied_a_warning_names_the_hosts_own_setting(group, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv(env.TIMEOUT_ENV, "15")
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")  # a torch without it
    with pytest.warns(env.TimeoutNotAppliedWarning,
                      match=r"MIXPREC_DIST_TIMEOUT=15 does not apply to the process group "
                            r"Accelerate made .*InitProcessGroupKwargs\(timeout="):
        accelerator()
    assert lc.group_timeouts() == [HOSTS_DEFAULT_S]
    dist.destroy_process_group()
    assert env.apply_timeout("a host", "its setting") is False  # no group: nothing to apply
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'again'}", rank=0,
                            world_size=1)  # for the fixture to tear down



FROZEN_PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "frozen_peer.py")


@pytest.mark.slow
@pytest.mark.parametrize("host", ["accelerate", "lightning"])
def test_a_frozen_peer_stops_the_survivor_after_the_timeout(host, tmp_path):
    """Two torchrun ranks, the host makes the group, rank 1 sleeps 300 s: with the variable at
    5, rank 0's collective raises after about 5 s and the launch ends (before: the host's 30
    minutes)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MIXPREC_DIST_TIMEOUT="5")
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", FROZEN_PEER, "--host", host], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=240)
    took = time.monotonic() - start
    waited = re.search(r"rank 0 waited ([0-9.]+) s", run.stdout)
    assert run.returncode != 0 and waited, run.stdout[-2000:] + run.stderr[-3000:]
    print(f"FIGURE frozen peer {host}: rank 0 raised after {float(waited[1]):.1f} s "
          f"(launch {took:.0f} s)")
    assert 4.0 <= float(waited[1]) <= 30.0 and took < 200
