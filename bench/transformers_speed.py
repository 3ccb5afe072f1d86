"""mixprec against torch.autocast where people train transformers: every figure of the speed
targets in one run.

1. ``mixprec bench --model hf-gpt2|hf-llama|hf-bert`` for each model (see
   ``mixprec.commands.hfbench``): fp32, autocast, O1, O2, O3, compact masters and FP8 side by
   side -- ms/step, host us/step, peak MB (live tensor bytes), final loss.
2. nine-linear (``mixprec bench``'s model): O2 over fp32, and the stochastic-rounding master step
   (O2, ``master="stochastic"``) against O3, rows interleaved and repeated, medians.

Run: ``python bench/transformers_speed.py [--json out.json]`` (about 3 minutes on a quiet
2-core machine; ``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec import benchmodels
from mixprec.commands import hfbench


def nine_linear(width: int, batch: int, rounds: int, steps: int) -> dict:
    """ms/step of fp32, O2, O3 and O2 with stochastic-rounding masters on nine-linear."""
    bm = benchmodels.get_model("nine-linear", width=width, batch=batch)
    x, target = bm.batch(torch.Generator().manual_seed(0))
    options = {"fp32": None, "O2": {"level": "O2"}, "O3": {"level": "O3"},
               "O2 stochastic": {"level": "O2", "master": "stochastic"}}
    steps_of = {}
    for row, opts in options.items():
        torch.manual_seed(0)
        model = bm.build()
        opt = bm.make_optimizer(model.parameters())
        if opts:
            model, opt = mp.prepare(model, opt, dtype="bf16", **opts)

        def step(model=model, opt=opt):
            loss = F.mse_loss(model(x).float(), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        steps_of[row] = step
    ms, _ = hfbench._interleaved(steps_of, rounds, steps, warmup=1)
    return {"width": width, "batch": batch, "ms_per_step": {k: round(v * 1e3, 1)
                                                            for k, v in ms.items()},
            "o2_speedup_over_fp32": round(ms["fp32"] / ms["O2"], 2),
            "stochastic_over_o3": round(ms["O2 stochastic"] / ms["O3"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(hfbench.HF_MODELS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nine-width", type=int, default=2048)
    p.add_argument("--nine-batch", type=int, default=512)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke run")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    args = p.parse_args()
    hfbench.quiet_profiler()  # no kineto USDT lines at each peak-memory measurement
    start = time.perf_counter()
    rounds = 1 if args.quick else args.rounds
    sizes = {"width": 32, "seq": 16, "batch": 2, "vocab": 256} if args.quick else {}
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "models": []}
    for name in args.models.split(","):
        rep = hfbench.run_hf_bench(name, rounds=rounds, **sizes)
        report["models"].append(rep)
        print(hfbench.format_hf_table(rep), end="\n\n", flush=True)
    nine = nine_linear(128 if args.quick else args.nine_width,
                       32 if args.quick else args.nine_batch, rounds, 1 if args.quick else 2)
    report["nine_linear"] = nine
    print(f"nine-linear (width {nine['width']}, batch {nine['batch']}, SGD): ms/step "
          + ", ".join(f"{k} {v}" for k, v in nine["ms_per_step"].items())
          + f"; O2 over fp32 {nine['o2_speedup_over_fp32']}x; stochastic-rounding masters over "
            f"O3 {nine['stochastic_over_o3']}x")
    print(f"\n(took {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
