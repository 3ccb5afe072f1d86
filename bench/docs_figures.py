"""Run every command behind the measured figures of README.md and docs/, and collect their output.

    .venv/bin/python bench/docs_figures.py [--list] [--only NAME,NAME] [--out PATH]

Each figure in the documentation names its machine, torch version and command; this script
runs those commands again on the machine at hand (CUDA-only ones where CUDA is present) and
writes ``bench/results/docs-figures.md``: the machine (``mixprec doctor``), then each command,
the page it feeds, its wall time and its output. The tables in the documentation are then
updated from that file by hand, with this machine's name. Run it on a quiet machine: the timings
are medians of interleaved rounds, but load from other processes still shows.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from mixprec.commands.doctor import doctor_report

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "docs-figures.md"
PY = [sys.executable]
MP = [*PY, "-m", "mixprec"]

#: (name, the page the figures go to, command, needs CUDA)
FIGURES = [
    ("bench-nine-linear", "README.md (Measured speed on a CPU)",
     [*MP, "bench", "--repeat", "3"], False),
    ("bench-nine-linear-compile", "README.md (Measured speed on a CPU)",
     [*MP, "bench", "--compile", "--levels", "O0,O2,O3", "--repeat", "2"], False),
    ("bench-transformer", "docs/benchmarks.md",
     [*MP, "bench", "--model", "transformer", "--repeat", "2"], False),
    ("bench-convnet", "docs/benchmarks.md", [*MP, "bench", "--model", "convnet", "--repeat", "2"],
     False),
    ("profile-step", "docs/benchmarks.md", [*PY, "bench/profile_step.py"], False),
    ("gemm-bound", "docs/benchmarks.md", [*PY, "bench/gemm_bound.py"], False),
    ("channels-last-60", "docs/benchmarks.md",
     [*PY, "bench/resnet_channels_last.py", "--steps", "60"], False),
    ("channels-last-150", "docs/benchmarks.md",
     [*PY, "bench/resnet_channels_last.py", "--steps", "150"], False),
    ("demo", "docs/benchmarks.md", [*MP, "demo", "--no-plot"], False),
    ("transformers-speed", "docs/benchmarks.md", [*PY, "bench/transformers_speed.py"], False),
    ("emulation", "docs/numerics.md", [*PY, "bench/bench_emulation.py"], False),
    ("accumulation-error", "docs/numerics.md", [*PY, "bench/accumulation_error.py"], False),
    ("compact-states", "docs/low-bit.md", [*PY, "bench/compact_states.py"], False),
    ("precision-recipes", "docs/benchmarks.md",
     [*PY, "bench/precision_recipes.py", "--steps", "150"], False),
    ("step-bytes", "docs/benchmarks.md", [*PY, "bench/step_bytes.py", "--backward", "--ops"],
     False),
    ("step-speed", "docs/benchmarks.md", [*PY, "bench/step_speed.py"], False),
    ("peer-memory", "docs/benchmarks.md", [*PY, "bench/peer_memory.py"], False),
    ("plan-8", "docs/distributed.md",
     [*MP, "plan", "--params", "7e9", "--level", "O2", "--dtype", "bf16", "--strategy", "fsdp",
      "--world", "8", "--optimizer", "adamw"], False),
    ("plan-64", "docs/distributed.md",
     [*MP, "plan", "--params", "7e9", "--level", "O2", "--dtype", "bf16", "--strategy", "fsdp",
      "--world", "64", "--optimizer", "adamw"], False),
    ("plan-check", "docs/distributed.md", [*PY, "bench/plan_check.py"], False),
    ("monitor-cost", "docs/monitoring.md", [*PY, "bench/monitor_cost.py"], False),
    ("advisor-evidence", "docs/precision-advisor.md", [*PY, "bench/advisor_evidence.py"], False),
    ("gpu-gpt2-cpu", "docs/precision-advisor.md", [*PY, "bench/gpu_gpt2.py"], False),
    ("bench-cuda-nine-linear", "docs/benchmarks.md", [*MP, "bench", "--device", "cuda"], True),
    ("bench-cuda-transformer", "docs/benchmarks.md",
     [*MP, "bench", "--device", "cuda", "--model", "transformer", "--batch", "64"], True),
    ("gpu-gpt2", "docs/precision-advisor.md", [*PY, "bench/gpu_gpt2.py"], True),
]


def machine() -> str:
    doc = doctor_report()
    rates = ", ".join(f"{k} {v.get('matmul_gflops', 0):.0f}" for k, v in doc["dtypes"].items())
    return (f"{doc['cpu_model']} ({doc['name']}), {doc['cpu_count']} CPUs, {doc['threads']} "
            f"threads, torch {doc['torch']}, Python {platform.python_version()}; "
            f"doctor's matmul GFLOP/s: {rates}")


def shown(command: list[str]) -> str:
    """The command as a user types it (``python`` for this interpreter)."""
    return " ".join(["python" if c == sys.executable else shlex.quote(c) for c in command])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the commands and exit")
    ap.add_argument("--only", default=None, help="comma-separated names to run")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    names = [n for n, *_ in FIGURES]
    chosen = names if args.only is None else args.only.split(",")
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        ap.error(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    if args.list:
        for name, page, command, cuda in FIGURES:
            print(f"{name:<26} {page:<28} {shown(command)}{'  (CUDA)' if cuda else ''}")
        return
    parts = [f"# Figures of the documentation\n\nMachine: {machine()}"]
    for name, page, command, cuda in FIGURES:
        if name not in chosen:
            continue
        if cuda and not torch.cuda.is_available():
            parts.append(f"## {name} (for {page})\n\n`{shown(command)}`: skipped, no CUDA")
            continue
        print(f"== {name}: {shown(command)}", flush=True)
        start = time.perf_counter()
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        took = time.perf_counter() - start
        output = run.stdout + (f"\n[exit code {run.returncode}]\n{run.stderr[-2000:]}"
                               if run.returncode else "")
        print(output, flush=True)
        parts.append(f"## {name} (for {page})\n\n`{shown(command)}`, {took:.0f} s\n\n"
                     f"```\n{output.rstrip()}\n```")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(parts) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
