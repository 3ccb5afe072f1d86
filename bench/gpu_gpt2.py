"""Train a config-built GPT-2 for a few dozen steps at fp32, torch.autocast, mixprec O1/O2/O3 and
O2 with FP8 Linear layers; print tokens/s and peak memory per row.

    .venv/bin/python bench/gpu_gpt2.py [--steps 30] [--warmup 5] [--batch B] [--rows ...]
        [--compile | --no-compile] [--small]

On CUDA: Hugging Face's GPT-2 124M config (12 layers, width 768, 50257 tokens, sequence 1024),
bf16, every row compiled (``torch.compile`` of the model; mixprec's rows prepare the model
first), AdamW (torch's fused kernels; mixprec's O2 steps its fp32 masters with them). FP8 needs
compute capability 8.9+ (Ada, Hopper): the fp8 row is skipped with a note elsewhere. Timings
take ``torch.cuda.synchronize()`` around the timed steps; peak memory is
``torch.cuda.max_memory_allocated()`` of the row (its stats reset before it).

On a CPU the same rows run a scaled-down config (2 layers, width 256, 8192 tokens, sequence
128, batch 4), eager (about a minute in all; ``--compile`` compiles every row, which takes
minutes here); peak memory is the process's peak resident set (``VmHWM``) above where the row
started. FP8 on a CPU runs through ``torch._scaled_mm``'s CPU kernels: numbers, never speed.

The figures to read: fp8 faster than bf16 at this size on an H100 (the field's claim), and
mixprec O2 no slower than torch.autocast.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import mixprec as mp
from mixprec.commands.memory import peak_mb, reset_peak

ROWS = ("fp32", "autocast", "O1", "O2", "O3", "O2+fp8")
GPU = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, seq=1024,
           batch=8)
CPU = dict(n_layer=2, n_embd=256, n_head=4, vocab_size=8192, n_positions=128, seq=128, batch=4)


def build(size: dict):
    from transformers import GPT2Config, GPT2LMHeadModel  # optional: the benchmark's only
    cfg = GPT2Config(n_layer=size["n_layer"], n_embd=size["n_embd"], n_head=size["n_head"],
                     vocab_size=size["vocab_size"], n_positions=size["n_positions"],
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def fp8_ok(device: torch.device) -> str | None:
    """Why FP8 can't run here, or None."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return f"FP8 GEMMs need compute capability 8.9+; {torch.cuda.get_device_name()}"
    try:
        mp.fp8.require()
    except ImportError as exc:
        return str(exc)
    return None


def make_row(row: str, size: dict, device: torch.device, compile: bool):
    """(step function, model) of one row: each step is forward, loss, backward, update."""
    torch.manual_seed(0)
    model = build(size).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    amp = None
    if row == "autocast":
        forward = model
    elif row != "fp32":
        level, fp8 = (row.split("+") + [None])[:2]
        amp = mp.MixedPrecision(level, "bf16", fp8="tensorwise" if fp8 else None)
        model, opt = amp.setup(model, opt)
    forward = torch.compile(model) if compile else model

    def step(ids):
        if row == "autocast":
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = forward(input_ids=ids, labels=ids).loss
        else:
            loss = forward(input_ids=ids, labels=ids).loss
        if amp is None:
            loss.backward()
            opt.step()
        else:
            amp.backward(loss)
            amp.step(opt)
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_row(row: str, size: dict, device: torch.device, steps: int, warmup: int,
            compile: bool) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = reset_peak(device)
    step, model = make_row(row, size, device, compile)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, size["vocab_size"], (size["batch"], size["seq"]), generator=gen)
    ids = ids.to(device)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step(ids)
    sync(device)
    t1 = time.perf_counter()
    for _ in range(steps):
        loss = step(ids)
    sync(device)
    t2 = time.perf_counter()
    tokens = size["batch"] * size["seq"] * steps
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 20
    else:
        peak = peak_mb(device, base)
    fp8 = len(mp.fp8_modules(model))
    del step, model
    return {"row": row, "tokens_per_s": tokens / (t2 - t1), "ms_per_step": 1e3 * (t2 - t1) / steps,
            "warmup_s": t1 - t0, "peak_mb": peak, "loss": float(loss), "fp8_layers": fp8}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps (CUDA 30, CPU 8)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (5; CPU 2)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {ROWS}")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="compile every row (default on CUDA)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--small", action="store_true", help="the CPU's scaled-down config on CUDA")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    size = dict(GPU if on_gpu and not args.small else CPU)
    if args.batch:
        size["batch"] = args.batch
    steps = args.steps or (30 if on_gpu else 8)
    warmup = args.warmup or (5 if on_gpu else 2)
    compile_all = on_gpu if args.compile is None else args.compile
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {ROWS}")
    where = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"GPT-2 {size} on {where}, {steps} timed steps after {warmup}, torch {torch.__version__}")
    print(f"{'row':10} {'tokens/s':>10} {'ms/step':>9} {'peak MiB':>9} {'loss':>8} "
          f"{'fp8 layers':>10}  compiled")
    for row in rows:
        why = fp8_ok(device) if "fp8" in row else None
        if why:
            print(f"{row:10} skipped: {why}")
            continue
        r = run_row(row, size, device, steps, warmup, compile_all)
        peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        print(f"{row:10} {r['tokens_per_s']:10.0f} {r['ms_per_step']:9.1f} {peak:>9} "
              f"{r['loss']:8.4f} {r['fp8_layers']:>10}  {compile_all} "
              f"(warm-up {r['warmup_s']:.1f} s)")


if __name__ == "__main__":
    main()
