"""The precision advisor's evidence (docs/precision-advisor.md): planted cases, its ranking
against an exhaustive one-layer-at-a-time ablation, and what it costs.

    .venv/bin/python bench/advisor_evidence.py [--part planted|ablation|cost|all] [--full-gpt2]

* planted: a layer whose outputs pass fp16's 65504, and a layer that reads one feature ~1e5x
  larger than the rest; what the advisor flags, and what the advised policies do.
* ablation: on a small GPT-style transformer (mixprec's bench "transformer", width 64, 2 blocks,
  trained 100 fp32 steps), each layer alone in each format: the advisor's first-order loss
  change against the measured one (a forward pass per layer and format); Spearman's rank
  correlation per format.
* cost: full passes, single-layer passes and seconds on a few models (``--full-gpt2`` adds
  Hugging Face's GPT-2 124M config, about two minutes here).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec.advisor.planted import outlier_case, overflow_case
from mixprec.benchmodels import get_model


def overflow_net():
    return overflow_case()[0]


def outlier_net():
    return outlier_case()[0]


def planted() -> None:
    _, (x, y), loss_fn = overflow_case()
    advice = mp.advise(overflow_net(), (x, y), loss_fn)
    print("== a layer whose outputs pass fp16's max")
    with torch.no_grad():
        print(f"max |output| of layer 2: {overflow_net()[:3](x).abs().max():.4g}")
    print(advice.table())
    policy = advice.policy("O2", "fp16")
    plain = mp.prepare(overflow_net(), level="O2", dtype="fp16")
    advised = mp.prepare(overflow_net(), policy=policy)
    with torch.no_grad():
        print(f"advised policy: {policy}")
        print(f"plain O2 fp16: finite outputs {torch.isfinite(plain(x)).float().mean():.0%}; "
              f"advised: {torch.isfinite(advised(x)).float().mean():.0%}")
    print("\n== a layer that reads one feature ~1e5x larger than the rest")
    model, batch, loss_fn = outlier_case()
    advice = mp.advise(model, batch, loss_fn)
    print(advice.table())
    for a in advice.layers:
        m = a.measurements["fp8_e4m3"]
        print(f"  {a.name}: fp8 input flushed {m.underflow['input']:.1%}, output error "
              f"{m.out_error:.1%}")
    print(f"advised policy: {advice.policy('O2', 'bf16', fp8='tensorwise')}")


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def trained_transformer():
    bm = get_model("transformer", width=64, depth=2, seq_len=64, batch=16)
    torch.manual_seed(0)
    model = bm.build()
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(100):
        x, y = bm.batch(gen)
        opt.zero_grad()
        bm.loss_fn(model(x), y).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return bm, model, bm.batch(gen)


def ablation() -> None:
    bm, model, batch = trained_transformer()
    advice = mp.advise(model, batch, bm.loss_fn, ablation=True)
    print(f"== ablation: {bm.sizes}, fp32 loss {advice.loss:.4f}")
    print(f"{'format':9} {'layers':>6} {'spearman':>9} {'top-3 agree':>11} "
          f"{'median |est/measured|':>22}")
    for fmt in advice.formats:
        rows = [a.measurements[fmt] for a in advice.layers if fmt in a.measurements]
        est = np.array([m.loss_change for m in rows])
        got = np.array([m.measured_loss_change for m in rows])
        top = len(set(np.argsort(-est)[:3]) & set(np.argsort(-got)[:3]))
        print(f"{fmt:9} {len(rows):6} {spearman(est, got):9.3f} {top:>9}/3 "
              f"{np.median(est / got):22.2f}")
    c = advice.cost
    print(f"cost with ablation: {c['full_passes']} full pass, {c['layer_passes']} single-layer "
          f"passes, {c['ablation_forwards']} ablation forwards, {c['seconds']:.2f} s")


def cost(full_gpt2: bool) -> None:
    import transformers  # optional: this script's only
    print("== cost (1 thread)")
    cases = []
    bm, model, batch = trained_transformer()
    cases.append(("bench transformer (w64, 2 blocks, 16x64)", model, batch, bm.loss_fn))
    from mixprec.commands.demo import DigitsCNN, digits_data
    train, _ = digits_data()
    cases.append(("demo DigitsCNN (batch 128)", DigitsCNN(),
                  (train.tensors[0][:128], train.tensors[1][:128]), F.cross_entropy))
    sizes = [("GPT-2 2x256 (2x128 tokens)", dict(n_layer=2, n_embd=256, n_head=4))]
    if full_gpt2:
        sizes.append(("GPT-2 124M config (2x128 tokens)", {}))
    for label, kw in sizes:
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(**kw)
        ids = torch.randint(0, cfg.vocab_size, (2, 128))
        cases.append((label, transformers.GPT2LMHeadModel(cfg),
                      {"input_ids": ids, "labels": ids}, None))
    print(f"{'model':42} {'layers':>6} {'full':>5} {'layer passes':>12} {'s':>7} "
          f"{'1 fwd+bwd s':>11} {'unsafe bf16/fp16/fp8':>20}")
    for label, model, batch, loss_fn in cases:
        t = time.perf_counter()
        split = batch if isinstance(batch, dict) else batch
        out = model(**split) if isinstance(split, dict) else model(split[0])
        loss = out.loss if loss_fn is None else loss_fn(out, split[1])
        loss.backward()
        one = time.perf_counter() - t
        model.zero_grad(set_to_none=True)
        advice = mp.advise(model, batch, loss_fn)
        c = advice.cost
        unsafe = "/".join(str(len(advice.unsafe(f))) for f in advice.formats)
        print(f"{label:42} {len(advice.layers):6} {c['full_passes']:5} {c['layer_passes']:12} "
              f"{c['seconds']:7.2f} {one:11.2f} {unsafe:>20}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="all", choices=("planted", "ablation", "cost", "all"))
    p.add_argument("--full-gpt2", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.part in ("planted", "all"):
        planted()
    if args.part in ("ablation", "all"):
        ablation()
    if args.part in ("cost", "all"):
        cost(args.full_gpt2)


if __name__ == "__main__":
    main()
