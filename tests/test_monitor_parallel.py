"""PrecisionMonitor under mp.Trainer's ddp and fsdp strategies on two gloo ranks: every rank
measures (fsdp: its own shards), only rank 0 writes, and the fp32 shards (fsdp) or masters (ddp)
lose nothing."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_cases import GLOBAL_BATCH, WORLD, Net, launch, loader

import mixprec as mp
from mixprec.monitor import JSONLWriter

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]


def monitored_fit(rank, out, strategy):
    torch.manual_seed(0)
    model = Net()
    monitor = mp.PrecisionMonitor(every=2, writers=[
        JSONLWriter(os.path.join(out, f"{strategy}-rank{rank}.jsonl"))])
    trainer = mp.Trainer(model, F.cross_entropy,
                         torch.optim.AdamW(model.parameters(), lr=1e-2), level="O2",
                         dtype="bf16", strategy=strategy, progress=False, monitor=monitor)
    trainer.fit(loader(GLOBAL_BATCH // WORLD), epochs=1)
    return monitor.records


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_records_and_only_rank_zero_writes(strategy, tmp_path):
    ranks = launch(monitored_fit, tmp_path, strategy)
    steps = [[r["step"] for r in records] for records in ranks]
    assert steps == [[0, 2], [0, 2]]
    for records in ranks:
        last = records[-1]
        lost = [v for k, v in last.items() if k.endswith("weight_update_lost")]
        assert len(lost) == 5 and all(abs(v) < 1e-6 for v in lost)  # fp32 masters / shards
        assert last["mixprec/grad_norm"] > 0 and last["mixprec/loss_scale"] == 1.0
    written = (tmp_path / f"{strategy}-rank0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in written] == [0, 2]
    assert not (tmp_path / f"{strategy}-rank1.jsonl").exists()
