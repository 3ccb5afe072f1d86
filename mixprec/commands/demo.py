"""``mixprec demo``: train a CNN on scikit-learn's handwritten digits in fp32 and mixed precision.

Five runs of the same seeded model on the same seeded data order: O0 (fp32), O1, O2 and O3 with
the auto dtype (``--dtype bf16`` to see bf16 where ``auto`` is fp32), and O2 in fp16 with
dynamic loss scaling. Prints one comparison table and writes
a PNG with the loss curves and the loss-scale history, and beside it the fp16 run's precision
record (a :class:`mixprec.PrecisionMonitor` JSONL) and its ``mixprec report`` page. A bar on
stderr counts the optimizer steps of all five runs (on a terminal; ``--no-progress`` turns it
off).
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..dtypes import dtype_name
from ..hardware import SlowDtypeWarning, device_capabilities
from ..monitor import JSONLWriter, PrecisionMonitor
from ..monitor.report import write_report
from ..policy import resolve_dtype
from ..scaling import DynamicLossScaler
from ..training import Callback, Trainer
from . import progress
from .memory import peak_mb, reset_peak

__all__ = ["digits_data", "DigitsCNN", "run_demo", "register"]


def digits_data(seed: int = 0, test_fraction: float = 0.2):
    """scikit-learn's 8x8 digits as ``(train, test)`` TensorDatasets: images ``(N, 1, 8, 8)`` in
    [0, 1], labels 0-9; a seeded random split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # the demo extra
        raise RuntimeError("the demo needs scikit-learn: pip install 'mixprec[demo]'") from exc
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class DigitsCNN(nn.Module):
    """Three 3x3 conv layers with BatchNorm (kept fp32 at O1/O2), a max-pool and a linear head."""

    def __init__(self, width: int = 64, num_classes: int = 10):
        super().__init__()

        def block(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        self.features = nn.Sequential(*block(1, width), *block(width, 2 * width), nn.MaxPool2d(2),
                                      *block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class _StepTimer(Callback):
    def __init__(self):
        self.times: list[float] = []
        self._t = None

    def on_epoch_begin(self, trainer, epoch):
        self._t = time.perf_counter()

    def on_step_end(self, trainer, logs):
        now = time.perf_counter()
        self.times.append(now - self._t)
        self._t = now


class _Ticks(Callback):
    """Advance a progress bar by one per optimizer step."""

    def __init__(self, bar):
        self.bar = bar

    def on_step_end(self, trainer, logs):
        self.bar.update(1)


RUNS = (("O0", "auto"), ("O1", "auto"), ("O2", "auto"), ("O3", "auto"), ("O2", "fp16"))


def _train_one(level: str, dtype: str, data, args, monitor=None, bar=None) -> dict:
    train, test = data
    torch.manual_seed(args.seed)
    model = DigitsCNN(args.width)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    steps_per_epoch = -(-len(train) // args.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr,
                                                total_steps=args.epochs * steps_per_epoch)
    timer = _StepTimer()
    callbacks = [timer] if bar is None else [timer, _Ticks(bar)]
    base = reset_peak(torch.device("cpu"))
    # fp16: a dynamic scaler that starts too high and grows often, so the plot shows it at work
    scaler = (DynamicLossScaler(init_scale=2.0 ** 24, growth_interval=50) if dtype == "fp16"
              else "auto")
    trainer = Trainer(model, F.cross_entropy, opt, level=level, dtype=dtype, loss_scale=scaler,
                      metrics="accuracy", scheduler=sched, callbacks=callbacks, progress=False,
                      monitor=monitor)
    loader = DataLoader(train, batch_size=args.batch, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    start = time.perf_counter()
    history = trainer.fit(loader, epochs=args.epochs)
    wall = time.perf_counter() - start
    result = trainer.evaluate(DataLoader(test, batch_size=512))
    return {"level": level, "dtype": dtype_name(trainer.policy.compute_dtype),
            "ms_per_step": 1e3 * statistics.median(timer.times), "seconds": wall,
            "peak_mb": peak_mb(torch.device("cpu"), base), "final_loss": history.epochs[-1]["loss"],
            "test_loss": result["loss"], "test_accuracy": result["accuracy"],
            "skipped_steps": sum(history.skipped), "loss": history.loss,
            "loss_scale": history.loss_scale}


def _warm_up() -> None:
    """Load what the first run would otherwise load lazily (and count in its time and memory)."""
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)  # imports torch._dynamo


def run_demo(args, record: Path | None = None, show_progress: bool = False) -> list[dict]:
    """Train every run of :data:`RUNS`; returns one dict per run. With ``record``, the fp16 run
    is recorded there by a :class:`mixprec.PrecisionMonitor` (every 10 steps, as JSONL). With
    ``show_progress``, a bar on stderr counts the optimizer steps of all the runs."""
    data = digits_data(args.seed)
    _warm_up()
    rows = []
    steps = len(RUNS) * args.epochs * -(-len(data[0]) // args.batch)
    with progress.bar(steps, "mixprec demo", show_progress, unit="step") as bar:
        for level, spec in RUNS:
            dtype = getattr(args, "dtype", "auto") if spec == "auto" else spec
            bar.set_postfix_str(f"{level} {dtype}")
            monitor = None
            if record is not None and spec == "fp16":  # the fp16 run's record
                record.unlink(missing_ok=True)
                monitor = PrecisionMonitor(every=10, writers=[JSONLWriter(record)])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SlowDtypeWarning)  # fp16 on a CPU: in the table
                row = _train_one(level, dtype, data, args, monitor, bar)
            if monitor is not None:
                monitor.close()  # the record's closing count: every step, not only the recorded
            if not args.json:
                progress.say(f"  trained {row['level']} {row['dtype']:<4} in "
                             f"{row['seconds']:5.1f} s", show_progress)
            rows.append(row)
    for row in rows:
        row["speedup"] = rows[0]["ms_per_step"] / row["ms_per_step"]
    return rows


def format_table(rows: list[dict]) -> str:
    """The comparison table."""
    lines = [f"{'level':<6}{'dtype':<6}{'ms/step':>9}{'speed-up':>10}{'peak MB':>9}"
             f"{'final loss':>12}{'test acc':>10}{'skipped':>9}"]
    for r in rows:
        mem = f"{r['peak_mb']:.1f}" if r["peak_mb"] is not None else "n/a"
        lines.append(f"{r['level']:<6}{r['dtype']:<6}{r['ms_per_step']:>9.2f}{r['speedup']:>9.2f}x"
                     f"{mem:>9}{r['final_loss']:>12.4f}{100 * r['test_accuracy']:>9.1f}%"
                     f"{r['skipped_steps']:>9}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    """Loss curves (left) and loss-scale histories (right) of every run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        label = f"{r['level']} {r['dtype']}"
        ax1.plot(r["loss"], label=label, linewidth=1)
        ax2.step(range(len(r["loss_scale"])), r["loss_scale"], where="post", label=label)
    ax1.set(title="training loss per step", xlabel="optimizer step", ylabel="loss", yscale="log")
    ax2.set(title="loss scale (1 = no loss scaling)", xlabel="optimizer step", ylabel="scale",
            yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _check_writable(out: Path) -> None:
    """Refuse an ``--out`` folder that can't be made or written (the runs take minutes)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".mixprec-write-check"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r} is not a folder the demo can write its plot and "
                         f"report to ({exc.strerror or exc}); pass another, or --no-plot") from None


def _run(args) -> int:
    for name in ("epochs", "batch", "width"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be a positive integer; got {getattr(args, name)}")
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise ValueError(f"--lr must be a positive finite number; got {args.lr}")
    if not args.no_plot:  # before training, not after it
        _check_writable(Path(args.out))
    low = dtype_name(resolve_dtype(args.dtype, "cpu", warn=False))
    if not args.json:
        print(f"mixprec demo: DigitsCNN(width={args.width}) on scikit-learn digits, {args.epochs} "
              f"epochs, batch {args.batch}; dtype {args.dtype!r} -> {low}", flush=True)
        if args.dtype == "auto" and low == "fp32":
            print(f"  (dtype 'auto' is fp32 here: {device_capabilities('cpu')['auto_reason']}; "
                  f"--dtype bf16 trains O1-O3 in bf16 anyway)", flush=True)
    out = Path(args.out)
    record = None if args.no_plot else out / "demo-precision.jsonl"
    rows = run_demo(args, record, progress.wanted(args))
    png = None if args.no_plot else plot(rows, out / "demo.png")
    report = None if args.no_plot else write_report(record, out / "demo-report.html",
                                                    "mixprec demo: the O2 fp16 run")
    if args.json:
        print(json.dumps({"runs": rows, "plot": str(png) if png else None,
                          "report": str(report) if report else None}))
        return 0
    print()
    print(format_table(rows))
    print("\nms/step: median optimizer step; peak MB: rise of the process's peak resident memory "
          "during the run;\nfp16 on a CPU without AMX-FP16 runs fp16-rounded math on fp32 kernels "
          "(numerics of fp16, speed of fp32);\nfp16's dynamic loss scale starts at 2^24 and "
          "grows every 50 clean steps: 'skipped' counts the overflowing steps it skipped.")
    if png:
        print(f"loss curves and loss-scale history: {png.resolve()}")
        print(f"the fp16 run's precision report: {report.resolve()}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("demo",
                              help="train a CNN on digits in fp32 and mixed precision side by side",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=64, help="channels of the first conv layer")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16"),
                   help="the 16-bit type of the O1-O3 runs (default: auto, the fast one here, "
                   "fp32 where none is)")
    p.add_argument("--out", default="mixprec-out",
                   help="directory for the PNG and the report (default %(default)s)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG and no report")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output (includes the curves)")
    progress.add_option(p)
    p.set_defaults(func=_run)
