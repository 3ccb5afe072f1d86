"""``make gpu-check``'s benchmark: every GPU row on GPT-2 124M, the Llama (d=1024, 8 layers, 32k
vocabulary) and the 4096-wide Llama, eager and compiled, in one markdown table.

    python3 bench/gpu_check.py [--budget 420] [--steps 6] [--rounds 3] [--out table.md]
    python3 bench/gpu_check.py --device cpu --tiny     # a smoke run of the same code (~2 min)

On CUDA with the machine's own torch (nothing installed; torchao only when it is importable --
``make gpu-check`` takes it from a wheel in ``.whl/`` -- else the FP8 rows are skipped with a
note). Batch 8 x 1024 tokens, AdamW. Each group of rows (one model, eager or compiled) is
built side by side and timed in interleaved rounds: ms/step is the median over ``--rounds``
rounds of ``--steps`` steps each, after warm-up steps (compiled rows: the first step's time
minus a steady step is the compile time). The 4096-wide Llama's rows (1.1B parameters each) do
not fit side by side: each is built, timed in consecutive rounds and freed. Peak memory is
``torch.cuda.max_memory_allocated`` during a row's build and warm-up, less what was allocated
before it. A row that fails (out of memory, say) prints its error in the table; rows that
would start after ``--budget`` seconds are listed as not run.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_rows  # noqa: E402  (bench/ is not a package)

import mixprec as mp  # noqa: E402
from mixprec.commands.memory import peak_mb, reset_peak  # noqa: E402

EAGER = ("fp32", "autocast", "O1", "O2", "O3", "split", "kahan", "autocast-fp16", "O2-fp16",
         "O2-fp8")
# (model, compiled, rows, side by side)
PLAN = (("gpt2", False, EAGER, True), ("llama", False, EAGER, True),
        ("gpt2", True, ("autocast", "O2", "O2-fp8"), True),
        ("llama4096", True, ("autocast", "O2", "O2-fp8", "torchao-fp8"), False))
REFERENCE = {"O2-fp16": "autocast-fp16"}  # each row's ratio is to autocast (bf16) unless here
NO_CUDA = ("make gpu-check needs a CUDA GPU: this torch ({version}) sees none "
           "(torch.cuda.is_available() is False). For a smoke run of the same code on a CPU: "
           "python3 bench/gpu_check.py --device cpu --tiny")


def commit() -> str:
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_line(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    else:
        name = "CPU"
    return f"device: {name}; torch {torch.__version__}; mixprec commit {commit()}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Row:
    """One row being timed: its step function, and what it measured."""

    def __init__(self, model: str, row: str, compiled: bool):
        self.model, self.row, self.compiled = model, row, compiled
        self.step = None
        self.times: list[float] = []
        self.peak = self.compile_s = self.loss = None
        self.fp8_layers = 0
        self.note = ""

    def result(self) -> dict:
        ms = statistics.median(self.times) * 1e3 if self.times else None
        return {"model": self.model, "row": self.row, "compiled": self.compiled, "ms": ms,
                "peak_mb": self.peak, "compile_s": self.compile_s, "loss": self.loss,
                "fp8_layers": self.fp8_layers, "note": self.note}


def _start(r: Row, size: dict, device: torch.device, ids, warmup: int) -> None:
    """Build the row and run its warm-up steps, measuring its peak memory and compile time."""
    _free(device)
    base = reset_peak(device)
    step, model = gpu_rows.make_row(r.row, size, device, r.compiled)
    r.fp8_layers = len(mp.fp8_modules(model)) or sum(  # torchao's own: its Float8Linear
        type(m).__name__ == "Float8Linear" for m in model.modules())
    del model
    times = []
    for _ in range(warmup):
        _sync(device)
        t = time.perf_counter()
        step(ids)
        _sync(device)
        times.append(time.perf_counter() - t)
    r.peak = peak_mb(device, base)
    if r.compiled and len(times) > 1:
        r.compile_s = times[0] - statistics.median(times[1:])
    r.step = step


def _round(r: Row, ids, steps: int, device: torch.device) -> None:
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        loss = r.step(ids)
    _sync(device)
    r.times.append((time.perf_counter() - t) / steps)
    r.loss = float(loss)


def _guarded(r: Row, device: torch.device, fn, *args) -> None:
    try:
        fn(r, *args)
    except Exception as exc:  # a failed row is reported, and the others still run
        r.step, r.times = None, []
        r.note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        _free(device)


def run_group(name: str, compiled: bool, rows, side_by_side: bool, size: dict,
              device: torch.device, steps: int, rounds: int, warmup: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen)
    ids = ids.to(device)
    fp8_why = gpu_rows.fp8_problem(device)
    live = []
    out = []
    for row in rows:
        r = Row(name, row, compiled)
        if row in gpu_rows.FP8_ROWS and fp8_why:
            r.note = f"skipped: {fp8_why}"
        else:
            live.append(r)
        out.append(r)
    if side_by_side:
        for r in live:
            _guarded(r, device, _start, size, device, ids, warmup)
        for _ in range(rounds):
            for r in live:
                if r.step is not None:
                    _guarded(r, device, _round, ids, steps, device)
    else:
        for r in live:
            _guarded(r, device, _start, size, device, ids, warmup)
            for _ in range(rounds):
                if r.step is not None:
                    _guarded(r, device, _round, ids, steps, device)
            r.step = None
            _free(device)
    for r in live:
        r.step = None
    _free(device)
    return [r.result() for r in out]


def _cell(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(results: list[dict], header: str, sizes: dict) -> str:
    """The markdown table of ``results`` (each model's ratios to its autocast row)."""
    lines = [header, "", "| model | row | mode | ms/step | x ref | peak MiB | loss | notes |",
             "|---|---|---|---|---|---|---|---|"]
    index = {(r["model"], r["compiled"], r["row"]): r for r in results}
    for r in results:
        ref_row = REFERENCE.get(r["row"], "autocast")
        ref = index.get((r["model"], r["compiled"], ref_row))
        ratio = (f"{r['ms'] / ref['ms']:.2f} ({ref_row})" if ref and ref["ms"] and r["ms"]
                 else "-")
        notes = [r["note"]] if r["note"] else []
        if r["compile_s"] is not None:
            notes.insert(0, f"compile {r['compile_s']:.1f} s")
        if r["fp8_layers"]:
            notes.append(f"{r['fp8_layers']} FP8 layers")
        lines.append(f"| {sizes[r['model']]} | {r['row']} | "
                     f"{'compiled' if r['compiled'] else 'eager'} | {_cell(r['ms'], '.1f')} | "
                     f"{ratio} | {_cell(r['peak_mb'], '.0f')} | {_cell(r['loss'], '.4f')} | "
                     f"{'; '.join(notes)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true",
                   help="tiny models: a smoke run (about two minutes on a 2-core CPU)")
    p.add_argument("--models", default=None, help="comma-separated: gpt2,llama,llama4096")
    p.add_argument("--rows", default=None, help="only these rows (comma-separated)")
    p.add_argument("--eager-only", action="store_true", help="skip the compiled groups")
    p.add_argument("--steps", type=int, default=None, help="steps per round (6; tiny 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds: groups that would start later are not run")
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.add_argument("--check-cuda", action="store_true",
                   help="only check that a CUDA GPU is there (exit status 2 when not)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA.format(version=torch.__version__), file=sys.stderr)
        return 2
    if args.check_cuda:
        print(device_line(device=torch.device(args.device)))
        return 0
    try:
        import transformers  # noqa: F401  (optional: the benchmark's models)
    except ImportError:
        print("gpu-check builds Hugging Face models: transformers is not importable here "
              "(bring its wheel in .whl/)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    steps = args.steps or (1 if args.tiny else 6)
    warmup = 2 if args.tiny else 3
    models = args.models.split(",") if args.models else list(gpu_rows.MODELS)
    only = set(args.rows.split(",")) if args.rows else None
    unknown = [m for m in models if m not in gpu_rows.MODELS] + \
        [r for r in (only or ()) if r not in gpu_rows.ROWS]
    if unknown:
        print(f"unknown models/rows {unknown}; models: {', '.join(gpu_rows.MODELS)}; rows: "
              f"{', '.join(gpu_rows.ROWS)}", file=sys.stderr)
        return 2
    sizes = {m: gpu_rows.size_of(m, args.tiny) for m in gpu_rows.MODELS}
    start = time.perf_counter()
    results = []
    for name, compiled, rows, side in PLAN:
        rows = [r for r in rows if only is None or r in only]
        if name not in models or not rows or (compiled and args.eager_only):
            continue
        if time.perf_counter() - start > args.budget:
            results += [{"model": name, "row": r, "compiled": compiled, "ms": None,
                         "peak_mb": None, "compile_s": None, "loss": None, "fp8_layers": 0,
                         "note": f"not run: past the {args.budget:.0f} s budget"} for r in rows]
            continue
        results += run_group(name, compiled, rows, side, sizes[name], device, steps,
                             args.rounds, warmup)
        if args.out:  # the table so far: a run stopped from outside still leaves its rows
            partial = table(results, f"{device_line(device)}; partial, "
                            f"{time.perf_counter() - start:.0f} s so far",
                            {m: s["label"] for m, s in sizes.items()})
            pathlib.Path(args.out).write_text(partial + "\n")
        print(f"[gpu-check] {name} {'compiled' if compiled else 'eager'} done at "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    header = (f"{device_line(device)}; batch {sizes['gpt2']['batch']} x {sizes['gpt2']['seq']}; "
              f"ms/step = median of {args.rounds} rounds of {steps} steps; "
              f"{time.perf_counter() - start:.0f} s in all")
    text = table(results, header, {m: s["label"] for m, s in sizes.items()})
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
