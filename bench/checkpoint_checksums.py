"""What the checkpoint checksums cost (docs/distributed.md, "Checkpoints whole or refused").

    .venv/bin/python bench/checkpoint_checksums.py [--mb 256] [--rounds 5]

A Trainer-shaped state of ``--mb`` MB of fp32 tensors (model, two Adam moments) is written and
read back in interleaved rounds, each way side by side:

* file: ``torch.save`` into a temporary and rename (what a save did without a checksum) against
  ``write_checkpoint`` (the content's SHA-256 sealed in, then the same atomic write); ``torch.load``
  against ``read_checkpoint`` (load, then the digest checked) and ``read_checkpoint(verify=False)``;
* directory: the same state as three files, then ``write_manifest`` (hash every file, written
  last) and ``verify_directory``, against writing the files alone.

Prints the median seconds of each, its spread (min-max) and the ratio to the plain one. The page
cache holds what was just written, so reads measure hashing and unpickling, not the disk.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mixprec import integrity
from mixprec.training import state as ts


def make_state(mb: int) -> dict:
    n = mb * 2**20 // 4 // 3 // 8
    layers = {f"layer{i}.weight": torch.randn(n) for i in range(8)}
    moments = {i: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n),
                   "step": torch.tensor(9.0)} for i in range(8)}
    groups = [{"lr": 1e-3, "params": list(range(8))}]
    return {"format": ts.CHECKPOINT_FORMAT, "model": layers,
            "optimizer": {"state": moments, "param_groups": groups}}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    state = make_state(args.mb)
    plain = {k: v for k, v in state.items() if k != "format"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = {
            "file: write, plain": lambda: integrity.atomic_save(state, root / "plain.pt"),
            "file: write, sealed": lambda: ts.write_checkpoint(state, root / "sealed.pt"),
            "file: read, torch.load": lambda: torch.load(root / "plain.pt", weights_only=True),
            "file: read, checked": lambda: ts.read_checkpoint(root / "sealed.pt"),
            "file: read, verify=False": lambda: ts.read_checkpoint(root / "sealed.pt",
                                                                   verify=False),
            "dir: write files": lambda: write_files(plain, root / "d"),
            "dir: write files + manifest": lambda: (write_files(plain, root / "m"),
                                                    integrity.write_manifest(root / "m")),
            "dir: verify_directory": lambda: integrity.verify_directory(root / "m"),
        }
        for fn in rows.values():  # warm-up, and the files the reads read
            fn()
        times: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.rounds):  # interleaved: every row once per round
            for name, fn in rows.items():
                times[name].append(timed(fn))
    base = {"file: write": "file: write, plain", "file: read": "file: read, torch.load",
            "dir:": "dir: write files"}
    print(f"{args.mb} MB of fp32 tensors, {args.rounds} interleaved rounds, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'':30s} {'median s':>9s} {'min-max s':>13s} {'x plain':>8s}")
    for name, ts_ in times.items():
        ref = next(v for k, v in base.items() if name.startswith(k))
        med = statistics.median(ts_)
        print(f"{name:30s} {med:9.3f} {min(ts_):6.3f}-{max(ts_):.3f} "
              f"{med / statistics.median(times[ref]):8.2f}")
    return 0


def write_files(state: dict, directory: Path) -> None:
    directory.mkdir(exist_ok=True)
    for key, value in state.items():
        torch.save(value, directory / f"{key}.pt")


if __name__ == "__main__":
    raise SystemExit(main())
