"""FP8 training tracks bf16: a config-built GPT-2 and a small Llama, O2 bf16 vs O2 + FP8 layers.

    .venv/bin/python bench/fp8_training.py [--model gpt2|llama|both] [--steps 300]
        [--recipes tensorwise,rowwise] [--json out.json]

Both models are scaled down to train in a few minutes on a CPU (4 layers, width 256, byte-level
vocabulary of 256, sequence 128, batch 8) on real text: the bytes of the Python sources of
``torch.nn`` (what the local torch install holds), 90% for training, read in order. Each run
starts from the same weights and sees the same batches; only the precision differs. The FP8
runs use mixprec's default layer choice (every Linear/Conv1D except the first and the last).
Printed: the loss every 50 steps, the final smoothed loss (mean of the last 20 steps' training
losses) and the held-out loss, and each FP8 run's relative difference from bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import torch

import mixprec as mp

SEQ, BATCH, WIDTH, LAYERS, HEADS = 128, 8, 256, 4, 4


def corpus() -> torch.Tensor:
    root = pathlib.Path(torch.nn.__file__).parent
    text = b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batches(data: torch.Tensor, steps: int):
    """``steps`` consecutive batches of ``BATCH`` windows of ``SEQ + 1`` bytes."""
    span = SEQ + 1
    for i in range(steps):
        start = (i * BATCH * span) % (len(data) - BATCH * span)
        chunk = data[start:start + BATCH * span].view(BATCH, span)
        yield chunk


def build(name: str):
    import transformers  # optional: this benchmark's only
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=256,
                                      n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=WIDTH, intermediate_size=704,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=HEADS, vocab_size=256,
                                   max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def train(name: str, fp8: str | None, train_data, held_out, steps: int) -> dict:
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    amp = mp.MixedPrecision("O2", "bf16", fp8=fp8)
    model, opt = amp.setup(model, opt)
    losses, started = [], time.perf_counter()
    for step, chunk in enumerate(batches(train_data, steps)):
        loss = model(input_ids=chunk[:, :-1], labels=chunk[:, :-1]).loss
        amp.backward(loss)
        amp.step(opt, max_grad_norm=1.0)
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0:
            print(f"  {name} {fp8 or 'bf16'} step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        evals = [model(input_ids=c[:, :-1], labels=c[:, :-1]).loss.item()
                 for c in batches(held_out, 8)]
    return {"model": name, "fp8": fp8, "fp8_layers": len(mp.fp8_modules(model)),
            "smoothed": sum(losses[-20:]) / len(losses[-20:]), "held_out": sum(evals) / len(evals),
            "first": losses[0], "seconds": time.perf_counter() - started, "losses": losses}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="both", choices=("gpt2", "llama", "both"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--recipes", default="tensorwise")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    data = corpus()
    cut = int(len(data) * 0.9)
    train_data, held_out = data[:cut], data[cut:]
    print(f"corpus: {len(data):,} bytes of torch.nn sources; {args.steps} steps of "
          f"{BATCH}x{SEQ} tokens; torch {torch.__version__}")
    rows = []
    for name in (("gpt2", "llama") if args.model == "both" else (args.model,)):
        base = train(name, None, train_data, held_out, args.steps)
        rows.append(base)
        for recipe in args.recipes.split(","):
            run = train(name, recipe, train_data, held_out, args.steps)
            run["vs_bf16"] = run["smoothed"] / base["smoothed"] - 1
            rows.append(run)
    print(f"{'model':6} {'run':11} {'fp8 layers':>10} {'first':>7} {'smoothed':>9} "
          f"{'held-out':>9} {'vs bf16':>8} {'seconds':>8}")
    for r in rows:
        delta = f"{100 * r['vs_bf16']:+.2f}%" if "vs_bf16" in r else "-"
        print(f"{r['model']:6} {r['fp8'] or 'bf16':11} {r['fp8_layers']:>10} {r['first']:7.3f} "
              f"{r['smoothed']:9.4f} {r['held_out']:9.4f} {delta:>8} {r['seconds']:8.0f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows))
    assert all(math.isfinite(r["smoothed"]) for r in rows)


if __name__ == "__main__":
    main()
