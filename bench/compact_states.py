"""Compact masters and low-precision moments on real clients: loss, bytes per parameter, speed.

Three parts, each printed as a markdown table (``--json`` writes everything to a file too):

1. **Clients**: a config-built Hugging Face GPT-2 (the docs' config, AdamW), the demo's CNN on
   scikit-learn's digits (SGD + Nesterov momentum) and a small regression MLP (AdamW, lr 1e-4),
   trained as fp32 (O0), O2 with every master kind and moment dtype, and plain O3. Per row: the
   final smoothed loss (mean of the last 10% of the per-step losses, averaged over the seeds),
   bytes per parameter (``mp.bytes_per_parameter`` after ``zero_grad``: what persists between
   steps) and the median ms per step.
2. **The bf16 moment stall**: Adam's ``exp_avg_sq`` update (beta2 = 0.999) run for a few thousand
   steps from a state of 1.0 towards gradients whose square is 4.0 (growth) or 0.25 (decay), in
   fp32, in bf16 rounded to nearest, and in bf16 rounded stochastically.
3. **Speed on nine-linear** (``mixprec bench``'s model): eager O3 and eager O2 with each master
   kind, interleaved and repeated in one process; median ms per step and median update ms.

Run: ``OMP_NUM_THREADS=1 python bench/compact_states.py`` (a few minutes on two cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.benchmodels import get_model
from mixprec.commands.demo import DigitsCNN, digits_data
from mixprec.masters.rounding import RoundingGenerator, stochastic_round

ROWS = [("fp32", "O0", None, None)] + [
    (f"O2 {m}/{s}", "O2", m, s) for m in ("fp32", "kahan", "stochastic") for s in ("fp32", "bf16")
] + [("O3", "O3", None, None)]


# -- clients --------------------------------------------------------------------------------------
def gpt2_client(seed: int, steps: int):
    from transformers import GPT2Config, GPT2LMHeadModel  # optional: the bench needs it

    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, 128, (256, 1), generator=g) + torch.arange(32)) % 128
    batches = [{"input_ids": ids[i:i + 16], "labels": ids[i:i + 16]} for i in range(0, 256, 16)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, None, [batches[i % len(batches)] for i in range(steps)]


def cnn_client(seed: int, steps: int):
    train, _ = digits_data(seed)
    torch.manual_seed(seed)
    model = DigitsCNN(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(seed)
    x, y = train.tensors
    batches = []
    for _ in range(steps):
        idx = torch.randint(0, len(x), (64,), generator=g)
        batches.append((x[idx], y[idx]))
    return model, opt, F.cross_entropy, batches


def mlp_client(seed: int, steps: int):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1000 + seed)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(2048, 32, generator=g)
    with torch.no_grad():
        y = teacher(x) + 0.05 * torch.randn(2048, 1, generator=g)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [(x[i % 16 * 128:(i % 16 + 1) * 128], y[i % 16 * 128:(i % 16 + 1) * 128])
               for i in range(steps)]
    return model, opt, F.mse_loss, batches


CLIENTS = {"gpt2": gpt2_client, "cnn": cnn_client, "mlp": mlp_client}


def train_row(client: str, level: str, master, state_dtype, seed: int, steps: int) -> dict:
    model, opt, loss_fn, batches = CLIENTS[client](seed, steps)
    trainer = mp.Trainer(model, loss_fn, opt, level=level, dtype="bf16", progress=False,
                         master=master, state_dtype=state_dtype, max_grad_norm=1.0)
    losses, times = [], []
    for batch in batches:
        t = time.perf_counter()
        logs = trainer.train_step([batch])
        times.append(time.perf_counter() - t)
        losses.append(logs["loss"])
    trainer.optimizer.zero_grad(set_to_none=True)
    tail = losses[-max(1, len(losses) // 10):]
    return {"loss": sum(tail) / len(tail), "ms": 1e3 * statistics.median(times[2:]),
            "bytes": mp.bytes_per_parameter(trainer.model, trainer.optimizer)["total"]}


def clients_table(steps: dict, seeds: int) -> dict:
    out: dict = {}
    for client in CLIENTS:
        for name, level, master, state_dtype in ROWS:
            runs = [train_row(client, level, master, state_dtype, s, steps[client])
                    for s in range(seeds)]
            out[(client, name)] = {"loss": statistics.mean(r["loss"] for r in runs),
                                   "ms": statistics.median(r["ms"] for r in runs),
                                   "bytes": runs[0]["bytes"]}
            print(client, name, out[(client, name)], flush=True)
    return out


# -- the bf16 moment stall ------------------------------------------------------------------------
def stall(target: float, steps: int = 3000, beta2: float = 0.999) -> dict:
    g2 = torch.full((4096,), target)
    fp32 = torch.ones(4096)
    nearest = torch.ones(4096, dtype=torch.bfloat16)
    stochastic = torch.ones(4096, dtype=torch.bfloat16)
    rounding = RoundingGenerator()
    for _ in range(steps):
        fp32 = fp32 * beta2 + (1 - beta2) * g2
        nearest = (nearest.float() * beta2 + (1 - beta2) * g2).to(torch.bfloat16)
        stochastic = stochastic_round(stochastic.float() * beta2 + (1 - beta2) * g2,
                                      rounding.keys(1)[0])
    return {"target": target, "steps": steps, "fp32": fp32.mean().item(),
            "bf16 nearest": nearest.float().mean().item(),
            "bf16 stochastic": stochastic.float().mean().item()}


# -- speed on nine-linear -------------------------------------------------------------------------
SPEED_ROWS = [("O3", "O3", None), ("O2 fp32", "O2", "fp32"), ("O2 kahan", "O2", "kahan"),
              ("O2 stochastic", "O2", "stochastic")]


def speed(rounds: int, steps: int, warmup: int) -> dict:
    bm = get_model("nine-linear")
    inputs, target = bm.batch(torch.Generator().manual_seed(0))
    trainers = {}
    for name, level, master in SPEED_ROWS:
        torch.manual_seed(0)
        model = bm.build()
        trainers[name] = mp.Trainer(model, bm.loss_fn, bm.make_optimizer(model.parameters()),
                                    level=level, dtype="bf16", progress=False, master=master)
    times: dict = {n: [] for n in trainers}
    updates: dict = {n: [] for n in trainers}
    for r in range(rounds):
        for name, trainer in trainers.items():
            for i in range(warmup + steps):
                trainer.timings = {}
                t = time.perf_counter()
                trainer.train_step([(inputs, target)])
                if r or i >= warmup:
                    times[name].append(time.perf_counter() - t)
                    updates[name].append(trainer.timings["update"])
    out = {}
    for name in trainers:
        ms, upd = 1e3 * statistics.median(times[name]), 1e3 * statistics.median(updates[name])
        out[name] = {"ms": ms, "update_ms": upd, "update_share": upd / ms,
                     "samples": len(times[name])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--gpt2-steps", type=int, default=120)
    parser.add_argument("--cnn-steps", type=int, default=150)
    parser.add_argument("--mlp-steps", type=int, default=400)
    parser.add_argument("--speed-rounds", type=int, default=3)
    parser.add_argument("--speed-steps", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: "
                                                   "clients,stall,speed")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    result: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    if "stall" not in skip:
        result["stall"] = [stall(4.0), stall(0.25)]
        print("| target g^2 | steps | fp32 | bf16 nearest | bf16 stochastic |")
        print("|---:|---:|---:|---:|---:|")
        for s in result["stall"]:
            print(f"| {s['target']} | {s['steps']} | {s['fp32']:.4f} | {s['bf16 nearest']:.4f} "
                  f"| {s['bf16 stochastic']:.4f} |")
    if "clients" not in skip:
        steps = {"gpt2": args.gpt2_steps, "cnn": args.cnn_steps, "mlp": args.mlp_steps}
        table = clients_table(steps, args.seeds)
        result["clients"] = {f"{c}|{n}": v for (c, n), v in table.items()}
        print("| run | " + " | ".join(f"{c} loss | {c} B/param | {c} ms/step" for c in CLIENTS)
              + " |")
        print("|---|" + "---:|" * (3 * len(CLIENTS)))
        for name, *_ in ROWS:
            cells = []
            for c in CLIENTS:
                v = table[(c, name)]
                cells += [f"{v['loss']:.4f}", f"{v['bytes']:g}", f"{v['ms']:.1f}"]
            print(f"| {name} | " + " | ".join(cells) + " |")
    if "speed" not in skip:
        result["speed"] = speed(args.speed_rounds, args.speed_steps, warmup=2)
        print("| nine-linear | ms/step | update ms | update share |")
        print("|---|---:|---:|---:|")
        for name, v in result["speed"].items():
            print(f"| {name} | {v['ms']:.0f} | {v['update_ms']:.1f} | "
                  f"{100 * v['update_share']:.1f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
