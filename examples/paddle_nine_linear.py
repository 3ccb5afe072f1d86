"""PaddlePaddle's AMP guide benchmark (nine Linear layers), in mixprec form.

The guide trains ``SimpleNet`` (nine ``Linear(input_size, output_size)`` layers) with MSE and
SGD(lr=1e-4) on random data (10 batches of 2048, 8192 wide, 2 epochs) three ways and prints the
last loss and the mean time per step of each: float32, AMP-O1 (``auto_cast`` with
``custom_white_list={'elementwise_add'}`` and ``GradScaler(init_loss_scaling=1024)``) and AMP-O2
(``decorate(models=model, level='O2')`` plus the same scaler). On a V100 it measured
0.529 s / 0.118 s / 0.102 s per step. It also shows gradient accumulation under O1.

* ``with auto_cast(custom_white_list={'elementwise_add'}, custom_black_list={'reduce_mean'},
  level='O1')``: ``with mp.autocast(dtype, low_precision_ops=["add"], fp32_ops=["mean"])``
* ``paddle.amp.decorate(models=model, level='O2')`` and ``with auto_cast(level='O2')``:
  ``mp.prepare(model, optimizer, level="O2", dtype=dtype)`` (fp32 master weights; the prepared
  model's forward runs under ``mp.autocast`` itself)
* ``GradScaler(init_loss_scaling=1024)`` with the guide's defaults (incr_ratio 2, decr_ratio
  0.5, incr_every_n_steps 1000, decr_every_n_nan_or_inf 2):
  ``mp.DynamicLossScaler(init_scale=1024, growth_factor=2, backoff_factor=0.5,
  growth_interval=1000, hysteresis=2)``
* ``scaled = scaler.scale(loss); scaled.backward(); scaler.step(optimizer); scaler.update()``:
  the same calls
* ``optimizer.clear_grad(set_to_zero=False)``: ``optimizer.zero_grad(set_to_none=True)``

Run: ``python examples/paddle_nine_linear.py [--tiny] [--width N] [--batch N] [--dtype D]``
(``--tiny``, or ``MIXPREC_EXAMPLE_TINY=1``: width 64, batch 32, for the test suite; the default
width 1024, batch 256 suits a CPU; ``--width 8192 --batch 2048`` is the guide's GPU size).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import mixprec as mp

EPOCHS, NUMS_BATCH = 2, 10


class SimpleNet(nn.Module):
    """Nine Linear layers (each a matmul and an add), nothing else."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(input_size, output_size) for _ in range(9))

    def forward(self, x):
        for layer in self.linears:
            x = layer(x)
        return x


class RandomDataset(Dataset):
    """Uniform random inputs and labels in [0, 1), drawn per item as the guide's dataset does."""

    def __init__(self, num_samples: int, input_size: int, output_size: int):
        self.num_samples, self.input_size, self.output_size = num_samples, input_size, output_size

    def __getitem__(self, idx):
        data = np.random.random([self.input_size]).astype("float32")
        label = np.random.random([self.output_size]).astype("float32")
        return data, label

    def __len__(self):
        return self.num_samples


def make_scaler():
    """``paddle.amp.GradScaler(init_loss_scaling=1024)`` with the guide's other defaults."""
    return mp.DynamicLossScaler(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5,
                                growth_interval=1000, hysteresis=2)


def run(mode: str, loader, width: int, dtype, accumulate: int = 1):
    """Train as the guide's section for ``mode`` does; returns (last loss, seconds per step)."""
    torch.manual_seed(100)
    np.random.seed(100)
    mse = nn.MSELoss()
    model = SimpleNet(width, width)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = make_scaler() if mode != "fp32" else mp.NoLossScaler()
    if mode == "O2":
        model, optimizer = mp.prepare(model, optimizer, level="O2", dtype=dtype)
    context = {
        "fp32": contextlib.nullcontext,
        # custom_white_list={'elementwise_add'}, custom_black_list={'reduce_mean'}
        "O1": lambda: mp.autocast(dtype, low_precision_ops=["add"], fp32_ops=["mean"]),
        "O2": contextlib.nullcontext,   # the prepared model's forward runs under mp.autocast
    }[mode]
    train_time, steps = 0.0, 0
    for _epoch in range(EPOCHS):
        for i, (data, label) in enumerate(loader):
            start = time.perf_counter()
            with context():
                output = model(data)
                loss = mse(output.float(), label)
            scaler.scale(loss).backward()
            if (i + 1) % accumulate == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            train_loss = loss.detach().numpy()
            train_time += time.perf_counter() - start
            steps += 1
    return float(train_loss), train_time / steps



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
    parser.add_argument("--width", type=_positive, default=None, help="input_size = output_size")
    parser.add_argument("--batch", type=_positive, default=None)
    parser.add_argument("--dtype", default="auto", choices=("bf16", "fp16", "auto"),
                        help="bf16, fp16 or auto (the fast one here)")
    args = parser.parse_args(argv)
    width = args.width or (64 if args.tiny else 1024)
    batch = args.batch or (32 if args.tiny else 256)
    dtype = mp.device_capabilities()["auto_dtype"] if args.dtype == "auto" else args.dtype
    loader = DataLoader(RandomDataset(NUMS_BATCH * batch, width, width), batch_size=batch,
                        shuffle=False, drop_last=True, num_workers=0)
    print(f"nine Linear layers {width} wide, batch {batch}, {EPOCHS} epochs x {NUMS_BATCH} "
          f"batches, low precision {dtype}")
    results = {}
    for mode, label in (("fp32", "float32"), ("O1", "AMP-O1"), ("O2", "AMP-O2")):
        loss, seconds = run(mode, loader, width, dtype)
        results[label] = (loss, seconds)
        print(f"loss: [{loss:.7g}]")
        print(f"{label} mode: {seconds:.3f} sec per step")
    loss, seconds = run("O1", loader, width, dtype, accumulate=NUMS_BATCH)
    results["AMP-O1, gradients accumulated over 10 batches"] = (loss, seconds)
    print(f"loss: [{loss:.7g}]")
    print(f"AMP-O1 with gradient accumulation: {seconds:.3f} sec per step")
    base = results["float32"][1]
    print(f"\n| - | {' | '.join(results)} |")
    print(f"|---|{'---|' * len(results)}")
    times = " | ".join(f"{s:.3f}s ({base / s:.2f}x)" for _, s in results.values())
    print(f"| time per step | {times} |")
    print(f"| loss | {' | '.join(f'{v:.7g}' for v, _ in results.values())} |")
    return results


if __name__ == "__main__":
    main()
