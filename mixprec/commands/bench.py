"""``mixprec bench``: time a model at each level against fp32 and plain ``torch.autocast``.

Every row trains the same seeded model on the same fixed synthetic batch: ``warmup`` steps, then
``steps`` timed steps; a row reports the median time per step. The level rows run
:meth:`mixprec.Trainer.train_step` (prepare + scaler + master weights, what a user gets); the
reference row is the plain PyTorch loop (``torch.autocast``, plus ``torch.amp.GradScaler`` for
fp16). By default each row runs in a fresh subprocess, so its peak memory is its own:
peak MB = the process's peak resident set (``VmHWM``) minus its resident set just before the
model was built (the batch already exists) -- weights, gradients, optimizer state and masters,
activations and kernel workspaces, as the OS sees them (CPU PyTorch keeps no allocator
statistics; on CUDA the allocator's peak is used instead).

"% peak" compares a row's GFLOP/s (the model's forward+backward FLOPs per median step) with the
GEMM peak of its dtype: the rate of the three GEMMs a Linear layer's training step runs at the
model's representative shape, in the layouts autograd runs them (:mod:`.peaks`). One
product in one layout is not that rate: kernels differ by layout (torch's CPU fp16 GEMM runs
``x @ W.t()`` ~8x faster than ``x @ W``), and the weight gradient has another shape.

A row whose optimizer state would be fp16 (O3 in fp16: no fp32 master weights) runs its
Adam-style optimizer with ``eps`` = :data:`FP16_STATE_EPS` where the model's eps is below fp16's
smallest normal number (AdamW's 1e-8 rounds to 0 in fp16, and an update then divides 0 by 0);
the row says so in a note. A row whose final loss is inf/NaN gets a note with the warnings it
raised.

Timings on a shared machine are noisy: by default every row runs three interleaved rounds, and a
row whose rounds' speed-ups over O0 spread wider than the row differs from O0 (``|speed-up - 1|``)
is marked noisy (``~`` in the table, the rounds in a note): its speed-up says nothing. A bar on
stderr shows the rounds as they run (on a terminal; ``--no-progress`` turns it off).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

from .. import benchmodels
from ..dtypes import dtype_name
from ..formats import get as float_format
from ..hardware import SlowDtypeWarning, device_capabilities
from ..policy import LEVELS, Policy, resolve_dtype
from ..training import Trainer  # imported here, so it is in the memory baseline of a row
from . import hfbench, progress
from .args import add_model_size_options, comma_list
from .bench_table import format_table, peak_share_text
from .memory import peak_mb, reset_peak, synchronize
from .peaks import TRAINING_GEMMS, faster, is_emulated, matmul_peaks

__all__ = ["run_row", "run_bench", "format_table", "matmul_peaks", "peak_share_text", "register",
           "TRAINING_GEMMS", "FP16_STATE_EPS", "mark_noise"]

REFERENCE = "torch.autocast"
#: Adam-style eps of a row whose optimizer state is fp16: a normal fp16 number (the smallest
#: is 2^-14 = 6.1e-05), so ``sqrt(v) + eps`` never rounds to 0 or to a subnormal.
FP16_STATE_EPS = 1e-4
_FP16 = float_format("fp16")


# ----------------------------------------------------------------- one row
def _preload(bm, dtype: torch.dtype, device: torch.device) -> None:
    """Run a miniature of the row once, so that lazily loaded kernels and thread pools are in
    the baseline and not in the row's peak."""
    tiny = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 16)).to(device)
    bm.make_optimizer(tiny.parameters())  # the first optimizer imports torch._dynamo (~70 MB)
    for dt in {torch.float32, dtype}:
        with torch.autocast(device.type, dtype=dt, enabled=dt != torch.float32):
            tiny(torch.randn(4, 16, device=device)).float().square().mean().backward()
        tiny.to(dt)(torch.randn(4, 16, device=device, dtype=dt)).float().sum().backward()
        tiny.float()


def _reference_step(model, opt, loss_fn, inputs, target, dtype, device):
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = model(inputs)
        loss = loss_fn(out.float(), target)
        scaler.scale(loss).backward()
        t = time.perf_counter()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return (loss.item(), scaler.get_scale() if scaler.is_enabled() else 1.0,
                time.perf_counter() - t)
    return step


def _trainer_step(model, opt, loss_fn, inputs, target, level, dtype, device, compile=False):
    trainer = Trainer(model, loss_fn, opt, level=level, dtype=dtype, device=device, progress=False,
                      compile=compile)

    def step():
        trainer.timings = {}
        logs = trainer.train_step([(inputs, target)])
        return logs["loss"], logs["loss_scale"], trainer.timings["update"]
    return step


def _fp16_state_eps(opt, level: str, dtype: torch.dtype) -> str:
    """Give a row whose optimizer state is fp16 (no master weights) an eps fp16 can hold.

    Sets every ``param_groups`` eps below fp16's smallest normal number to
    :data:`FP16_STATE_EPS`; returns the row's note ("" when nothing changed)."""
    if level == REFERENCE or dtype != torch.float16:
        return ""
    policy = Policy.from_level(level, dtype, warn=False)
    if policy.master_weights or policy.param_dtype != torch.float16:
        return ""
    small = sorted({g["eps"] for g in opt.param_groups
                    if isinstance(g.get("eps"), float) and g["eps"] < _FP16.min_normal})
    if not small:
        return ""
    for group in opt.param_groups:
        if group.get("eps") in small:
            group["eps"] = FP16_STATE_EPS
    eps = small[0]
    fate = "rounds to 0" if eps <= _FP16.min_subnormal / 2 else "is an fp16 subnormal"  # ties: 0
    return (f"pure fp16 without master weights keeps the optimizer state in fp16, where "
            f"{type(opt).__name__}'s eps={eps:g} {fate} (smallest normal 2^"
            f"{_FP16.emin} = {_FP16.min_normal:.2g}): an "
            f"update divides by ~0 where a gradient is 0 (0/0 = NaN, or overflow to inf). This "
            f"row ran with eps={FP16_STATE_EPS:g}; the other rows keep eps={eps:g}")


def _loss_note(loss: float, caught) -> str:
    """Why a row's final loss is inf/NaN: the warnings the row raised (speed warnings aside)."""
    if math.isfinite(loss):
        return ""
    why = list(dict.fromkeys(str(w.message) for w in caught
                             if not issubclass(w.category, SlowDtypeWarning)))
    return (f"the loss became {loss:g}: " + (" | ".join(why) if why else
            "no warning was raised; find the first inf/NaN op with Trainer(diagnose_overflow="
            "True) or mixprec.debug.trace_nonfinite"))


def run_row(model_name: str, sizes: dict, level: str, dtype: str, steps: int, warmup: int,
            device: str = "cpu", compile: bool = False) -> dict:
    """Time one row in this process; ``level`` is "O0".."O3" or ``"torch.autocast"``.

    ``compile=True`` builds level rows with ``Trainer(compile=True)`` (compiled forward and loss;
    at O2 the fused master step); the first step compiles, so keep ``warmup >= 1``. The row's
    warnings are recorded, not shown: ``notes`` lists what the bench changed for the row (see
    :func:`_fp16_state_eps`) and, when the final loss is inf/NaN, the warnings that explain it.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        row = _timed_row(model_name, sizes, level, dtype, steps, warmup, device, compile)
    row["notes"] = [n for n in (row.pop("eps_note"), _loss_note(row["final_loss"], caught)) if n]
    return row


def _timed_row(model_name, sizes, level, dtype, steps, warmup, device, compile) -> dict:
    dev = torch.device(device)
    bm = benchmodels.get_model(model_name, **sizes)
    torch.manual_seed(0)
    inputs, target = (t.to(dev) for t in bm.batch(torch.Generator().manual_seed(0)))
    dt = torch.float32 if level == "O0" else resolve_dtype(dtype, dev, warn=False)
    _preload(bm, dt, dev)
    base = reset_peak(dev)
    model = bm.build().to(dev)
    opt = bm.make_optimizer(model.parameters())
    eps_note = _fp16_state_eps(opt, level, dt)
    if level == REFERENCE:
        step = _reference_step(model, opt, bm.loss_fn, inputs, target, dt, dev)
    else:
        step = _trainer_step(model, opt, bm.loss_fn, inputs, target, level, dt, dev, compile)
    times, updates, loss, scale = [], [], float("nan"), 1.0
    for i in range(warmup + steps):
        t = time.perf_counter()
        loss, scale, upd = step()
        synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t)
            updates.append(upd)
    return {"row": level, "dtype": dtype_name(dt), "ms_per_step": 1e3 * statistics.median(times),
            "update_ms": 1e3 * statistics.median(updates), "peak_mb": peak_mb(dev, base),
            "update_times_ms": [round(1e3 * u, 2) for u in updates],
            "final_loss": loss, "loss_scale": scale,
            "times_ms": [round(1e3 * t, 2) for t in times], "eps_note": eps_note}


def _run_isolated(spec: dict) -> dict:
    """``run_row`` in a fresh interpreter (own memory peak, no allocator state from other rows)."""
    code = "import json,sys; from mixprec.commands.bench import run_row; " \
           "print(json.dumps(run_row(**json.loads(sys.argv[1]))))"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise RuntimeError(f"bench row {spec['level']} failed: "
                           f"{proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _pool(rounds: list[dict]) -> dict:
    """One row from its rounds: medians over the timed steps of all rounds pooled."""
    row = dict(rounds[0])
    row["times_ms"] = [t for r in rounds for t in r["times_ms"]]
    row["update_times_ms"] = [t for r in rounds for t in r["update_times_ms"]]
    row["ms_per_step"] = statistics.median(row["times_ms"])
    row["update_ms"] = statistics.median(row["update_times_ms"])
    peaks = [r["peak_mb"] for r in rounds if r["peak_mb"] is not None]
    row["peak_mb"] = max(peaks) if peaks else None
    row["notes"] = list(dict.fromkeys(n for r in rounds for n in r.get("notes", [])))
    return row


def _parse_levels(text: str) -> list[str]:
    levels = list(dict.fromkeys(x.strip().upper() for x in text.split(",") if x.strip()))
    bad = [x for x in levels if x not in LEVELS]
    if not levels or bad:
        raise ValueError(f"unknown level(s) {bad or text!r}; choose from {', '.join(LEVELS)} "
                         f"(comma-separated)")
    return levels


def run_bench(model: str = "nine-linear", levels=("O0", "O1", "O2", "O3"), dtype: str = "auto",
              steps: int = 5, warmup: int = 3, repeat: int = 3, reference: bool = True,
              isolate: bool = True, device: str = "cpu", compile: bool = False,
              show_progress: bool = False, **sizes) -> dict:
    """Run the benchmark and return the report ``--json`` prints.

    Rows run in the order given, ``repeat`` rounds (interleaved, so a burst of load elsewhere
    does not hit one row only); a row's time is the median over the timed steps of all its
    rounds, its peak memory the largest of its rounds. Speed-ups are over the O0 row of the same
    run; each row also gets its rounds' own speed-ups (``round_speedups``: a round's median
    over O0's in the same round) and ``noisy``, true when they spread wider than the row's
    speed-up differs from 1 (see :func:`mark_noise`). Achieved GFLOP/s counts the model's
    matmul/conv/attention FLOPs (``benchmodels.count_flops``) per median step; the GEMM peak of
    each dtype (the GEMMs of a Linear layer's training step at the model's representative shape)
    is measured in this run
    by :func:`matmul_peaks`. ``peak_share`` is None where a GEMM was too slow to probe at its
    full shape within the budget (a figure at a smaller shape is no peak for the row). A row
    faster than its peak means the probe ran slower than the row's GEMMs: that dtype is probed
    once more (each GEMM's faster figure is kept), and a row still above it gets
    ``peak_exceeded`` (and the report ``peak_disturbed``), which :func:`format_table` flags.
    ``compile=True``: level rows (not the torch.autocast row) use ``Trainer(compile=True)``; the
    compile time falls in the warm-up steps and is not in the medians. ``show_progress``: a bar
    on stderr, one unit per row and round, and one for the GEMM peaks.
    """
    for name, value in (("steps", steps), ("repeat", repeat)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0; got {warmup!r}")
    bm = benchmodels.get_model(model, **sizes)
    low = dtype_name(resolve_dtype(dtype, device))
    rows = list(levels) + ([REFERENCE] if reference else [])
    rounds: dict[str, list[dict]] = {r: [] for r in rows}
    with progress.bar(repeat * len(rows) + 1, f"mixprec bench {model}", show_progress,
                      unit="row") as shown:
        for i in range(repeat):
            for row in rows:
                shown.set_postfix_str(f"round {i + 1}/{repeat}: {row} {low}")
                spec = {"model_name": model, "sizes": sizes, "level": row, "dtype": low,
                        "steps": steps, "warmup": warmup, "device": device, "compile": compile}
                rounds[row].append(_run_isolated(spec) if isolate else run_row(**spec))
                shown.update(1)
        shown.set_postfix_str("GEMM peaks")
        results = _results(bm, rows, rounds, device)
        shown.update(1)
    auto = isinstance(dtype, str) and dtype.strip().lower() == "auto"
    return {"model": model, "sizes": bm.sizes, "flops_per_step": benchmodels.count_flops(bm),
            "auto_reason": device_capabilities(device)["auto_reason"] if auto else None,
            "steps": steps, "warmup": warmup, "repeat": repeat, "device": device,
            "compile": compile, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "isolated": isolate, "gemm_shape": list(bm.gemm_shape),
            **results}


def mark_noise(results: list[dict], rounds: dict[str, list[dict]]) -> None:
    """Give each row its rounds' speed-ups over O0 (``round_speedups``, a round's median step
    over O0's median in the same round), their ``spread`` (largest minus smallest) and
    ``noisy``: more than one round, and a spread wider than the row differs from O0
    (``|speedup - 1|``). Without an O0 row: None, None, False."""
    base = rounds.get("O0")
    for r in results:
        own = rounds[r["row"]]
        if not base or r.get("speedup") is None:
            r["round_speedups"], r["spread"], r["noisy"] = None, None, False
            continue
        ups = [statistics.median(b["times_ms"]) / statistics.median(o["times_ms"])
               for b, o in zip(base, own)]
        r["round_speedups"] = [round(u, 3) for u in ups]
        r["spread"] = max(ups) - min(ups)
        r["noisy"] = len(ups) > 1 and r["spread"] > abs(r["speedup"] - 1)


def _results(bm, rows: list[str], rounds: dict[str, list[dict]], device) -> dict:
    """The pooled rows, their speed-ups, GFLOP/s and GEMM-peak shares, and the peaks."""
    flops = benchmodels.count_flops(bm)
    results = [_pool(rounds[r]) for r in rows]
    base = next((r["ms_per_step"] for r in results if r["row"] == "O0"), None)
    for r in results:
        r["speedup"] = base / r["ms_per_step"] if base else None
        r["gflops"] = flops / (r["ms_per_step"] / 1e3) / 1e9
        r["update_share"] = r["update_ms"] / r["ms_per_step"]
    mark_noise(results, rounds)
    for r in results:
        r["peak_of"] = _peak_key(r["row"], r["dtype"], device)
    probes = matmul_peaks(sorted({r["peak_of"] for r in results}), bm.gemm_shape, device)
    above = sorted({r["peak_of"] for r in results if probes[r["peak_of"]]["full_size"]
                    and r["gflops"] > probes[r["peak_of"]]["gflops"]})
    for key, again in matmul_peaks(above, bm.gemm_shape, device).items():  # once more
        probes[key] = faster(probes[key], again)
    for r in results:
        probe = probes[r["peak_of"]]
        r["peak_share"] = r["gflops"] / probe["gflops"] if probe["full_size"] else None
        r["peak_exceeded"] = r["peak_share"] is not None and r["peak_share"] > 1
    return {"matmul_peak_gflops": {d: round(p["gflops"], 1) for d, p in probes.items()},
            "matmul_peak": probes, "peak_reprobed": above,
            "peak_disturbed": any(r["peak_exceeded"] for r in results), "rows": results}


def _peak_key(row: str, dtype_name_: str, device) -> str:
    """Which peak a row is compared with: its dtype's, or the native kernel's for the plain
    ``torch.autocast`` row where mixprec's rows run emulated fp16."""
    native = row == REFERENCE and is_emulated(dtype_name_, device)
    return f"{dtype_name_} native" if native else dtype_name_


def _run(args) -> int:
    if args.model in hfbench.HF_MODELS:
        return hfbench.run_from_args(args)
    sizes = {k: getattr(args, k) for k in ("width", "batch", "depth", "seq_len", "image_size")
             if getattr(args, k) is not None}
    if args.model not in benchmodels.MODELS:
        raise ValueError(f"unknown model {args.model!r}; choose one of "
                         f"{', '.join([*benchmodels.MODELS, *hfbench.HF_MODELS])}")
    levels = _parse_levels(",".join(args.levels or LEVELS))
    rep = run_bench(args.model, levels, args.dtype, 5 if args.steps is None else args.steps,
                    3 if args.warmup is None else args.warmup, args.repeat,
                    not args.no_reference, not args.in_process, args.device,
                    compile=args.compile, show_progress=progress.wanted(args), **sizes)
    print(json.dumps(rep, indent=2) if args.json else format_table(rep))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time a model at each level vs fp32 and torch.autocast",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nine-linear",
                   help=f"one of {', '.join([*benchmodels.MODELS, *hfbench.HF_MODELS])} (the hf- "
                        f"models: fp32, autocast, O1-O3, compact masters and FP8 side by side, "
                        f"see mixprec.commands.hfbench)")
    p.add_argument("--levels", action="extend", type=comma_list, default=None,
                   help=f"levels, comma-separated or repeated (default {','.join(LEVELS)})")
    p.add_argument("--dtype", default="auto", help="low-precision dtype (default: auto)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per row and round (default 5; hf- models: 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 3; hf- models: 2)")
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds over all rows, interleaved (default 3; hf- models: at least 5); "
                        "a row's median pools the timed steps of all its rounds (--repeat 3 "
                        "--steps 5: 15 steps); a row whose rounds spread wider than it differs "
                        "from O0 is marked noisy")
    add_model_size_options(p)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--no-reference", action="store_true", help="skip the plain torch.autocast row")
    p.add_argument("--in-process", action="store_true",
                   help="run rows in this process (faster; memory peaks less meaningful; the "
                        "hf- models always do)")
    p.add_argument("--compile", action="store_true",
                   help="level rows use Trainer(compile=True): compiled forward+loss and, at O2, "
                        "the fused master step (compile time falls in the warm-up)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    progress.add_option(p)
    p.set_defaults(func=_run)
