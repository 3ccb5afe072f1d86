"""A script launched by torchrun in the tests: rank 1 freezes (sleeps) while rank 0 waits on a
collective of the process group its host made (Accelerate, or Lightning's "ddp"); with
``MIXPREC_DIST_TIMEOUT`` set, rank 0 prints how long it waited and raises."""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
FROZEN_S = 300


def accelerate_run() -> None:
    from mixprec.integrations.accelerate import MixprecAccelerator

    MixprecAccelerator(level="O2", dtype="bf16", cpu=True)  # Accelerate makes the group
    if dist.get_rank() == 1:
        time.sleep(FROZEN_S)
    waited(lambda: dist.all_reduce(torch.ones(1)))


def lightning_run() -> None:
    import lightning.pytorch as L
    from parallel_cases import Net, dataset
    from torch.utils.data import DataLoader

    from mixprec.integrations.lightning import MixprecPrecision

    class Frozen(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()

        def training_step(self, batch, batch_idx):
            if self.global_rank == 1:
                time.sleep(FROZEN_S)
            x, y = batch
            return F.cross_entropy(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                        plugins=[MixprecPrecision(level="O2", dtype="bf16")],
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    waited(lambda: trainer.fit(Frozen(), DataLoader(dataset(), batch_size=8)))


def waited(collective) -> None:
    start = time.monotonic()
    try:
        collective()
    finally:
        print(f"rank 0 waited {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", choices=["accelerate", "lightning"], required=True)
    args = parser.parse_args()
    accelerate_run() if args.host == "accelerate" else lightning_run()
