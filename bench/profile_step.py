"""Where the time of one training step goes, per level: phases and op categories.

    .venv/bin/python bench/profile_step.py [--model nine-linear] [--levels O0,O1,O2,O3,torch]
        [--steps 5] [--compile]

Phases come from ``Trainer.timings`` (forward incl. loss, backward, update = scaler + optimizer +
master copies + zero_grad). Op categories come from ``torch.profiler`` self-CPU times of the
timed steps: GEMM (mm/addmm/bmm/conv), casts (copy_/_to_copy: autocast and prepare's casts),
master copies (_foreach_copy_: grads -> fp32 masters, masters -> params), optimizer math
(_foreach_add_/mul_/...), reductions (sum: bias grads), other ops, and "python" (wall time not
spent in any op: hooks, autocast dispatch, the loop itself). With ``--compile`` the levels run
``Trainer(compile=True)``; the self time of compiled graphs (e.g. O2's fused master step, whose
kernel replaces the master copies and optimizer math) is "compiled kernels".
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from mixprec import benchmodels
from mixprec.training import Trainer

CATS = (("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::convolution",
                  "aten::mkldnn_convolution", "aten::_scaled_dot_product", "aten::linear")),
        ("master copies", ("aten::_foreach_copy_",)),
        ("casts", ("aten::copy_", "aten::_to_copy", "aten::to")),
        ("optimizer math", ("aten::_foreach_",)),
        ("reductions", ("aten::sum",)))


def _category(name: str) -> str:
    for cat, prefixes in CATS:
        if name.startswith(prefixes):
            return cat
    return "other ops"


def _step_fn(bm, level, inputs, target, compile=False):
    torch.manual_seed(0)
    model = bm.build()
    opt = bm.make_optimizer(model.parameters())
    if level == "torch":
        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(inputs)
            bm.loss_fn(out.float(), target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, None
    trainer = Trainer(model, bm.loss_fn, opt, level=level, dtype="bf16", progress=False,
                      compile=compile)
    return (lambda: trainer.train_step([(inputs, target)])), trainer


def profile_level(bm, level: str, steps: int, compile: bool = False) -> None:
    inputs, target = bm.batch(torch.Generator().manual_seed(0))
    step, trainer = _step_fn(bm, level, inputs, target, compile)
    for _ in range(3):
        step()
    if trainer is not None:
        trainer.timings = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) / steps * 1e3
    cats = defaultdict(float)
    for ev in prof.key_averages():
        if ev.key.startswith("aten::"):
            cats[_category(ev.key)] += ev.self_cpu_time_total / 1e3 / steps
        elif ev.key.startswith("## Call CompiledFxGraph"):
            cats["compiled kernels"] += ev.self_cpu_time_total / 1e3 / steps
        if ev.key == "aten::_foreach_copy_":  # its per-tensor copy_ children belong to it
            children = (ev.cpu_time_total - ev.self_cpu_time_total) / 1e3 / steps
            cats["master copies"] += children
            cats["casts"] -= children
    cats["python"] = wall - sum(cats.values())
    phases = "" if trainer is None else "  phases: " + ", ".join(
        f"{k} {v / steps * 1e3:.1f}" for k, v in trainer.timings.items())
    print(f"{level:<6} {wall:7.1f} ms/step (under the profiler){phases}")
    print("       " + ", ".join(f"{k} {v:.1f}"
                                for k, v in sorted(cats.items(), key=lambda kv: -kv[1])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="nine-linear")
    ap.add_argument("--levels", default="O0,O1,O2,O3,torch")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--width", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--compile", action="store_true", help="Trainer(compile=True) for the levels")
    args = ap.parse_args()
    bm = benchmodels.get_model(args.model, width=args.width, batch=args.batch)
    for level in args.levels.split(","):
        profile_level(bm, level, args.steps, args.compile)


if __name__ == "__main__":
    main()
