"""What a PrecisionMonitor costs per step: a config-built Hugging Face GPT-2 trained at O2 bf16
(AdamW) without a monitor, with ``every=50`` and with ``every=1``, interleaved.

    .venv/bin/python bench/monitor_cost.py [--rounds 4] [--steps 50] [--warmup 5] [--size cpu]

Three copies of the same seeded model train side by side on the same batches: each round runs
``--steps`` steps of each (the monitored ones include their recorded steps, so the mean step
time carries the recording's amortised cost), in rotating order so drift and neighbours' load
fall on all three alike. Printed per run: the mean ms/step of each round and the median over
rounds of the ratio to the unmonitored run of the same round. ``--clock cpu`` times the
process's CPU time (all threads) instead of the wall clock: on a machine shared with other
work that is the steadier measure of what the step itself costs.

``--size cpu`` (default without CUDA): 4 layers, width 256, 8192 tokens, sequence 128, batch 8.
``--size gpt2`` (default on CUDA): the 124M config (12 layers, width 768, 50257 tokens),
sequence 512, batch 8; timings take ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import mixprec as mp

SIZES = {
    "cpu": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, seq=128, batch=8),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq=512, batch=8),
}
RUNS = {"no monitor": None, "every=50": 50, "every=1": 1}


def build(size: dict, device: torch.device, every: int | None):
    from transformers import GPT2Config, GPT2LMHeadModel  # the benchmark's only
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        n_layer=size["n_layer"], n_embd=size["n_embd"], n_head=size["n_head"],
        vocab_size=size["vocab_size"], n_positions=size["seq"], bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).to(device)
    monitor = None if every is None else mp.PrecisionMonitor(every=every)
    amp = mp.MixedPrecision("O2", "bf16", monitor=monitor)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return amp, model, opt


def batches(size: dict, device: torch.device, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, size["vocab_size"], (size["batch"], size["seq"]), generator=g)
            .to(device) for _ in range(count)]


def train(run, data: list[torch.Tensor], device: torch.device, clock=time.perf_counter) -> float:
    """Train on ``data``; seconds per step (of ``clock``)."""
    amp, model, opt = run
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = clock()
    for ids in data:
        amp.backward(model(input_ids=ids, labels=ids).loss)
        amp.step(opt)
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (clock() - start) / len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--size", choices=sorted(SIZES), default=None)
    parser.add_argument("--runs", default=",".join(RUNS), help="which runs, comma-separated")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    warnings.simplefilter("ignore", mp.SlowDtypeWarning)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SIZES[args.size or ("gpt2" if device.type == "cuda" else "cpu")]
    names = [n.strip() for n in args.runs.split(",")]
    runs = {name: build(size, device, RUNS[name]) for name in names}
    data = batches(size, device, args.steps)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for run in runs.values():  # warm up; the monitored ones record their step 0 here
        train(run, data[:args.warmup], device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(train(runs[name], data, device, clock))
    print(f"GPT-2 {size} at O2 bf16 (AdamW) on {device.type}, torch {torch.__version__}, "
          f"{args.rounds} rounds of {args.steps} steps, {args.clock} clock")
    base = times[names[0]]
    for name in names:
        ratios = [t / b for t, b in zip(times[name], base)]
        shown = " ".join(f"{1e3 * t:.1f}" for t in times[name])
        print(f"  {name:<11} ms/step per round: {shown}   median ratio to {names[0]}: "
              f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
