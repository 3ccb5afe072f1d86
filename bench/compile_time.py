"""Time ``torch.compile`` of a prepared model against ``torch.autocast`` on the same model, and
count what dynamo built (graphs, frames, graph breaks) over three training steps.

    .venv/bin/python bench/compile_time.py [--rows autocast,O1,O2,O3,split,kahan,fp8]
        [--device cpu|cuda] [--width 64] [--layers 2]

Each row runs in a fresh Python process (nothing cached between rows: inductor's caches are
turned off) on a config-built Hugging Face Llama (RMSNorm, SwiGLU, rotary attention; tiny by
default), bf16, AdamW. The compile time is the wall time of the first training step (forward,
backward, optimizer step) minus the median of the two steps after it; mixprec's rows compile the
prepared model, the autocast row the fp32 model called under ``torch.autocast``. Compact
masters compile their own update kernel at the first step too: their rows report it within
the step and run the model's counters alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROWS = ("autocast", "O1", "O2", "O3", "split", "kahan", "fp8")
KWARGS = {"O1": {"level": "O1"}, "O2": {"level": "O2"}, "O3": {"level": "O3"},
          "split": {"level": "O2", "master": "split"}, "kahan": {"level": "O2", "master": "kahan"},
          "fp8": {"level": "O2", "fp8": "tensorwise"}}


def one_row(row: str, device: str, width: int, layers: int) -> dict:
    import warnings

    import torch
    import transformers  # optional: this benchmark's only
    from torch._dynamo.utils import counters

    import mixprec as mp
    warnings.filterwarnings("ignore")
    torch._inductor.config.fx_graph_cache = False
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=2 * width,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (4, 64), device=device)
    if row == "autocast":
        compiled = torch.compile(model)

        def forward():
            with torch.autocast(device, dtype=torch.bfloat16):
                return compiled(input_ids=ids, labels=ids)
    else:
        model, opt = mp.prepare(model, opt, dtype="bf16", **KWARGS[row])
        compiled = torch.compile(model)

        def forward():
            return compiled(input_ids=ids, labels=ids)
    times, seen = [], {"graphs": 0, "frames": 0, "breaks": 0}
    for _ in range(3):
        counters.clear()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        forward().loss.backward()
        seen["graphs"] += counters["stats"]["unique_graphs"]
        seen["frames"] += counters["frames"]["total"]
        seen["breaks"] += sum(counters["graph_break"].values())
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    steady = statistics.median(times[1:])
    return {"row": row, "compile_s": round(times[0] - steady, 2), "step_ms": round(steady * 1e3, 1),
            **seen}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_row(args.one, args.device, args.width, args.layers)))
        return 0
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    results = []
    for row in args.rows.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", row, "--device", args.device,
                              "--width", str(args.width), "--layers", str(args.layers)],
                             capture_output=True, text=True, env=env, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    base = next((r for r in results if r["row"] == "autocast"), None)
    print("| row | compile s | x autocast | step ms | graphs | frames | breaks |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['compile_s'] / base['compile_s']:.2f}" if base else "-"
        print(f"| {r['row']} | {r['compile_s']} | {ratio} | {r['step_ms']} | {r['graphs']} | "
              f"{r['frames']} | {r['breaks']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
