"""Run ``mixprec bench`` for every model, several rounds, and write JSON + a Markdown table.

    .venv/bin/python bench/bench_all.py [--repeat 3] [--models nine-linear,convnet,transformer]

Results go to ``bench/results/<model>.json`` and ``bench/results/summary.md``. Timings on a shared
machine are noisy: run when it is quiet, and prefer ``--repeat`` >= 3 (the median round is kept).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from mixprec.benchmodels import MODELS
from mixprec.commands.bench import format_table, peak_share_text, run_bench
from mixprec.commands.doctor import doctor_report

OUT = Path(__file__).parent / "results"


def markdown(rep: dict) -> str:
    sizes = ", ".join(f"{k} {v}" for k, v in rep["sizes"].items())
    lines = [f"**{rep['model']}** ({sizes}; {rep['flops_per_step'] / 1e9:.1f} GFLOP/step)", "",
             ("| row | dtype | ms/step | speed-up | peak MB | final loss | GFLOP/s "
              "| % GEMM peak | update % |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rep["rows"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        lines.append(f"| {r['row']} | {r['dtype']} | {r['ms_per_step']:.1f} | {sp} | "
                     f"{r['peak_mb']:.0f} | {r['final_loss']:.6g} | {r['gflops']:.0f} | "
                     f"{peak_share_text(r)} | {100 * r['update_share']:.1f}% |")
    peaks = ", ".join(f"{d} {v:.0f}" for d, v in rep["matmul_peak_gflops"].items())
    lines += ["", f"GEMM peak at {'x'.join(map(str, rep['gemm_shape']))} (a Linear layer's "
                  f"forward, input- and weight-gradient GEMMs combined; GFLOP/s): {peaks}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    doc = doctor_report()
    parts = [f"Machine: {doc['cpu_model']} ({doc['name']}), {doc['cpu_count']} CPUs, "
             f"{doc['threads']} threads, torch {doc['torch']}, "
             f"python {platform.python_version()}; doctor matmul GFLOP/s: "
             + ", ".join(f"{k} {v.get('matmul_gflops', 0):.0f}" for k, v in doc["dtypes"].items())]
    for model in args.models.split(","):
        rep = run_bench(model, steps=args.steps, repeat=args.repeat)
        (OUT / f"{model}.json").write_text(json.dumps(rep, indent=2))
        print(format_table(rep), "\n", flush=True)
        parts.append(markdown(rep))
    (OUT / "summary.md").write_text("\n\n".join(parts) + "\n")
    print(f"wrote {OUT / 'summary.md'}")


if __name__ == "__main__":
    main()
