"""The MindSpore mixed-precision guide's LeNet-5 program, in mixprec form.

The guide trains LeNet-5 on a random dataset (1024 images of 1x32x32, ten classes, one-hot
labels, batch 32) with ``Model(network, loss, Momentum(lr=0.01, momentum=0.9),
amp_level=..., loss_scale_manager=...)`` and prints ``epoch: 1 step: 32, loss is 2.3018966``
once per epoch through ``LossMonitor``. Here the same network and data run through
``mp.Trainer`` with the guide's settings:

* ``amp_level="O2"``, ``FixedLossScaleManager(1024.0, False)`` (apply the update even on
  overflow): ``level="O2"``, ``loss_scale=mp.StaticLossScaler(1024.0, skip_on_overflow=False)``
* ``amp_level="O2"``, ``DynamicLossScaleManager()`` (2**24, factor 2, window 2000, floor 1, no
  ceiling below fp32's range): ``level="O2"``, ``loss_scale=mp.DynamicLossScaler(
  init_scale=2**24, growth_factor=2, backoff_factor=0.5, growth_interval=2000,
  max_scale=2**127)`` (the largest power of two in fp32; the default ``max_scale`` of ``2**24``
  would keep the scale from ever growing)
* ``amp_level="O3"``, ``loss_scale_manager=None``: ``level="O3"``, ``loss_scale=None``
* ``network.conv1.to_float(mstype.float16)``: ``mp.to_float(network.conv1, "fp16")``,
  ``level="O0"``

The labels are random, so the loss stays near ln(10) = 2.30 as in the guide's printout.

Run: ``python examples/mindspore_lenet.py [--tiny] [--epochs N] [--dtype fp16|bf16]``
(``--tiny``, or ``MIXPREC_EXAMPLE_TINY=1``: 64 images, 2 epochs, for the test suite).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec as mp


class LeNet5(nn.Module):
    """The guide's LeNet-5: two valid 5x5 convolutions, three dense layers (N(0, 0.02) init)."""

    def __init__(self, num_class: int = 10, num_channel: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(num_channel, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_class)
        for fc in (self.fc1, self.fc2, self.fc3):
            nn.init.normal_(fc.weight, std=0.02)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class LeNet5Manual(LeNet5):
    """The guide's manual-precision variant: casts conv1's output back to fp32 (``ops.Cast``)."""

    def forward(self, x):
        x = self.conv1(x).float()
        x = self.pool(F.relu(x))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def create_dataset(num_data: int = 1024, batch_size: int = 32, num_classes: int = 10, seed=0):
    """Random images and one-hot labels, batched with the remainder dropped (the guide's)."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((num_data, 1, 32, 32)).astype(np.float32)
    labels = np.eye(num_classes, dtype=np.float32)[rng.integers(0, num_classes, num_data)]
    data = TensorDataset(torch.from_numpy(images), torch.from_numpy(labels))
    return DataLoader(data, batch_size=batch_size, drop_last=True)


def softmax_cross_entropy_with_logits(logits, onehot):
    """MindSpore's ``SoftmaxCrossEntropyWithLogits(reduction="mean")`` on one-hot labels."""
    return F.cross_entropy(logits, onehot)


RUNS = {
    "O2 + FixedLossScaleManager(1024.0, drop_overflow_update=False)":
        dict(level="O2", loss_scale=lambda: mp.StaticLossScaler(1024.0, skip_on_overflow=False)),
    "O2 + DynamicLossScaleManager()":
        dict(level="O2", loss_scale=lambda: mp.DynamicLossScaler(
            init_scale=2.0 ** 24, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
            max_scale=2.0 ** 127)),
    "O3, loss_scale_manager=None":
        dict(level="O3", loss_scale=lambda: None),
    "manual: conv1.to_float(float16), the rest fp32":
        dict(level="O0", loss_scale=lambda: None, conv1_fp16=True),
}


def train(name: str, run: dict, data, epochs: int, dtype: str) -> dict:
    torch.manual_seed(0)
    network = LeNet5Manual(10) if run.get("conv1_fp16") else LeNet5(10)
    if run.get("conv1_fp16"):
        mp.to_float(network.conv1, dtype)
    net_opt = torch.optim.SGD(network.parameters(), lr=0.01, momentum=0.9)
    trainer = mp.Trainer(network, softmax_cross_entropy_with_logits, net_opt, level=run["level"],
                         dtype=dtype, loss_scale=run["loss_scale"](), metrics="accuracy",
                         callbacks=[mp.LossMonitor(per_print_times=len(data))], progress=False)
    print(f"== {name} ({trainer.policy})")
    start = time.perf_counter()
    history = trainer.fit(data, epochs=epochs)
    seconds = time.perf_counter() - start
    result = {"loss": history.loss[-1], "seconds": seconds,
              "skipped": sum(history.skipped), "scale": trainer.scaler.get_scale(),
              "accuracy": history.epochs[-1]["accuracy"]}
    ms_per_step = 1e3 * seconds / len(history.loss)
    print(f"   {epochs} epochs in {seconds:.2f} s ({ms_per_step:.1f} ms/step), "
          f"loss scale {result['scale']:g}, {result['skipped']} skipped steps, "
          f"train accuracy {result['accuracy']:.3f}")
    return result



def _positive(text: str) -> int:
    """An argparse type: an integer >= 1 (0 used to mean "the default" silently)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value

def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        default=os.environ.get("MIXPREC_EXAMPLE_TINY") == "1")
    parser.add_argument("--epochs", type=_positive, default=None)
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"),
                        help="fp16 (MindSpore's float16) or bf16")
    args = parser.parse_args(argv)
    epochs = args.epochs or (2 if args.tiny else 10)
    data = create_dataset(num_data=64 if args.tiny else 1024)
    return {name: train(name, run, data, epochs, args.dtype) for name, run in RUNS.items()}


if __name__ == "__main__":
    main()
