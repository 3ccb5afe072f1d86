"""Precision recipes on GPT-2: bytes per parameter and loss of every master method x optimizer
state, and the loss of bf16, FP8 and MXFP8 GEMMs.

    PYTHONPATH=. python bench/precision_recipes.py [--steps 60] [--json out.json] [--quick]

**Model and data.** transformers' ``GPT2LMHeadModel`` built from a config (nothing is
downloaded; :data:`CONFIG`, ``--quick``: :data:`QUICK`), dropout off, every Linear/Conv1D
dimension a multiple of 32 (so FP8 and MXFP8 may take every eligible layer). Every run starts
from the same initial weights (seeded before the model is built) and sees the same batches:
arithmetic sequences modulo the vocabulary with a random start and stride (1..7), so the next
token is learnable from the context; loss from the model itself (``labels=``).

**Table 1, masters x states.** Each master method ("fp32", "split", "kahan", "stochastic"; see
``mp.prepare``'s ``master=``) with each optimizer state: fp32 and bf16 moments (``state_dtype=``)
and 8-bit ones (torchao's ``AdamW8bit``, blockwise-quantized moments; tensors under 4096
values keep fp32 ones), all trained with AdamW at O2 bf16 through ``mp.prepare``, plus an
fp32 (O0) row. A combination the installed mixprec refuses (``ValueError``/``TypeError``; an
``ImportError`` when torchao is missing) is printed as ``refused: <message>`` and the run goes
on. Columns: bytes per parameter from
``mp.bytes_per_parameter`` after the last step's ``zero_grad(set_to_none=True)`` (what a run
holds between steps, so no gradients), the final loss (mean of the losses of the last tenth
of the steps) and its gap to fp32 masters with fp32 states.

**Table 2, GEMM formats.** O2 bf16 (fp32 masters and moments: the same run as table 1's
``fp32/fp32`` row, reused) against FP8 (``mp.lowbit.Float8()``, torchao's tensorwise recipe) and
MXFP8 (``mp.lowbit.MXFP8()``, torchao's emulated kernels off sm100 GPUs): final loss, its ratio
to bf16's, and how many layers ran their GEMMs in the low-bit format (by default the first and
the last Linear-like layer stay in bf16). ms/step is the median wall time of the second half
of the steps, the runs one after another (not interleaved): on a CPU the FP8 and MXFP8 GEMMs
are emulated, so it says what the emulation costs, not what the hardware would gain.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings

import torch

import mixprec as mp
from mixprec.commands.doctor import doctor_report
from mixprec.hardware import SlowDtypeWarning
from mixprec.lowbit.backend import quiet_import

MASTERS = ("fp32", "split", "kahan", "stochastic")
STATES = ("fp32", "bf16", "8-bit")
BYTES = ("weights", "masters", "compensation", "optimizer_state", "total")

#: GPT2Config fields of the benchmark model; --quick uses QUICK.
CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 64}
QUICK = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}
BATCH, QUICK_BATCH = 8, 2
OPTIMIZER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training run: a level, a master method, a state format and a GEMM format."""

    name: str
    level: str = "O2"
    master: str | None = None
    state: str = "fp32"
    fp8: object = None

    def prepare_options(self) -> dict:
        if self.level == "O0":
            return {"level": "O0"}
        options = {"level": self.level, "dtype": "bf16", "master": self.master}
        if self.state in ("fp32", "bf16"):
            options["state_dtype"] = self.state
        if self.fp8 is not None:
            options["fp8"] = self.fp8
        return options


def master_recipes() -> list[Recipe]:
    """Table 1's rows: fp32 (O0), then every master x state at O2 bf16."""
    return [Recipe("fp32 (O0)", level="O0")] + [
        Recipe(f"{m} / {s}", master=m, state=s) for m in MASTERS for s in STATES]


def format_recipes() -> list[Recipe]:
    """Table 2's rows: bf16, FP8 (tensorwise), MXFP8, all at O2 with fp32 masters and moments."""
    return [Recipe("bf16", master="fp32"),
            Recipe("fp8", master="fp32", fp8=mp.lowbit.Float8("tensorwise")),
            Recipe("mxfp8", master="fp32", fp8=mp.lowbit.MXFP8())]


def build_model(config: dict):
    """GPT2LMHeadModel from ``config``, dropout off (seed torch before calling)."""
    with quiet_import():  # transformers' modeling modules import torchao when it is installed
        import transformers
        cfg = transformers.GPT2Config(**config, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)


def make_batches(config: dict, batch: int, steps: int, seed: int = 1) -> list[dict]:
    """``steps`` batches of arithmetic sequences modulo the vocabulary (the same every call)."""
    g = torch.Generator().manual_seed(seed)
    vocab, seq = config["vocab_size"], config["n_positions"]
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 8, (batch, 1), generator=g)
        ids = (start + stride * torch.arange(seq)) % vocab
        out.append({"input_ids": ids, "labels": ids})
    return out


def make_optimizer(params, state: str) -> torch.optim.Optimizer:
    """AdamW with :data:`OPTIMIZER`'s settings; torchao's 8-bit AdamW for the "8-bit" state."""
    if state == "8-bit":
        with quiet_import():  # ImportError without torchao: the row says so
            from torchao.optim import AdamW8bit
        return AdamW8bit(params, **OPTIMIZER)
    return torch.optim.AdamW(params, **OPTIMIZER)


def train(recipe: Recipe, config: dict, batches: list[dict], last: int) -> dict:
    """Train ``recipe`` from the seed-0 initial weights over ``batches``; its figures, or
    ``{"refused": message}`` when mixprec refuses the combination."""
    began = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(config)
    model.train()
    gemm_layers = sum(1 for m in model.modules() if type(m).__name__ in ("Linear", "Conv1D"))
    try:
        opt = make_optimizer(model.parameters(), recipe.state)
        model, opt = mp.prepare(model, opt, **recipe.prepare_options())
        losses, times = [], []
        for batch in batches:
            start = time.perf_counter()
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            times.append(time.perf_counter() - start)
    except (ValueError, TypeError, ImportError) as err:
        return {"refused": f"{type(err).__name__}: {err}"}
    tail = losses[-last:]
    return {"loss": sum(tail) / len(tail), "first_loss": losses[0],
            "finite": all(math.isfinite(x) for x in losses),
            "ms_per_step": 1e3 * statistics.median(times[len(times) // 2:]),
            "bytes": mp.bytes_per_parameter(model, opt),
            "lowbit_layers": len(mp.fp8_modules(model)), "gemm_layers": gemm_layers,
            "first_step_s": times[0], "wall_s": time.perf_counter() - began}


def _mixprec_version() -> str:
    """mixprec's version, and the git commit of its checkout when it runs from one."""
    where = os.path.dirname(os.path.dirname(os.path.abspath(mp.__file__)))
    try:
        commit = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{mp.__version__} (git {commit})" if commit else mp.__version__


def _header(args_line: str) -> dict:
    info = doctor_report(measure=False)
    torchao = importlib.util.find_spec("torchao")
    ao_version = "absent"
    if torchao is not None:
        with quiet_import():
            import torchao as ao
        ao_version = ao.__version__
    return {"command": args_line, "cpu_model": info["cpu_model"], "device": info["name"],
            "flags": info["flags"], "cpu_count": info["cpu_count"], "threads": info["threads"],
            "torch": info["torch"], "python": info["python"], "torchao": ao_version,
            "auto_dtype": info["auto_dtype"], "mixprec": _mixprec_version(),
            "load_start": [round(x, 1) for x in os.getloadavg()]}


def run(steps: int = 60, quick: bool = False, log=print) -> dict:
    """Both tables' figures (see the module docstring)."""
    config, batch = (QUICK, QUICK_BATCH) if quick else (CONFIG, BATCH)
    last = max(1, steps // 10)
    batches = make_batches(config, batch, steps)
    n_params = sum(p.numel() for p in build_model(config).parameters())
    masters = {}
    for recipe in master_recipes():
        masters[recipe.name] = train(recipe, config, batches, last)
        log(f"{recipe.name}: {_summary(masters[recipe.name])}")
    formats = {"bf16": masters["fp32 / fp32"]}
    for recipe in format_recipes()[1:]:
        formats[recipe.name] = train(recipe, config, batches, last)
        log(f"{recipe.name}: {_summary(formats[recipe.name])}")
    return {"config": {**config, "batch": batch, "parameters": n_params, "steps": steps,
                       "last": last, "optimizer": {"name": "AdamW", **OPTIMIZER}},
            "masters": masters, "formats": formats}


def _summary(row: dict) -> str:
    if "refused" in row:
        return f"refused: {row['refused']}"
    return (f"loss {row['loss']:.4f}, {row['bytes']['total']:.2f} B/param, "
            f"{row['ms_per_step']:.0f} ms/step, first step {row['first_step_s']:.1f} s, "
            f"{row['wall_s']:.0f} s in all")


def masters_table(result: dict) -> str:
    """Table 1 in markdown."""
    rows = result["masters"]
    base = rows["fp32 / fp32"].get("loss")
    lines = ["| master / state | weights | masters | compensation | optimizer state | total "
             "B/param | final loss | gap vs fp32 / fp32 |", "|---|" + "---:|" * 7]
    for name, row in rows.items():
        if "refused" in row:
            lines.append(f"| {name} | refused: {row['refused']} |||||||")
            continue
        b = row["bytes"]
        gap = "-" if base is None else f"{row['loss'] - base:+.4f} ({row['loss'] / base - 1:+.2%})"
        lines.append(f"| {name} | " + " | ".join(f"{b[k]:.2f}" for k in BYTES)
                     + f" | {row['loss']:.4f} | {gap} |")
    return "\n".join(lines)


def formats_table(result: dict) -> str:
    """Table 2 in markdown."""
    rows = result["formats"]
    base = rows["bf16"].get("loss")
    lines = ["| GEMMs | low-bit layers | final loss | vs bf16 | ms/step |",
             "|---|---:|---:|---:|---:|"]
    for name, row in rows.items():
        if "refused" in row:
            lines.append(f"| {name} | refused: {row['refused']} ||||")
            continue
        ratio = "-" if base is None else f"{row['loss'] / base:.4f}x"
        lines.append(f"| {name} | {row['lowbit_layers']} of {row['gemm_layers']} | "
                     f"{row['loss']:.4f} | {ratio} | {row['ms_per_step']:.0f} |")
    return "\n".join(lines)


def header_text(result: dict) -> str:
    h, c = result["header"], result["config"]
    model = ", ".join(f"{k}={c[k]}" for k in ("n_layer", "n_embd", "n_head", "vocab_size",
                                               "n_positions"))
    return "\n".join([
        f"command: {h['command']}",
        f"machine: {h['cpu_model']}, {h['device']}, flags {', '.join(h['flags']) or 'none'}, "
        f"{h['cpu_count']} CPUs, {h['threads']} torch threads; torch {h['torch']}, torchao "
        f"{h['torchao']}, mixprec {h['mixprec']}, Python {h['python']}",
        f"load average (1, 5, 15 min): {h['load_start']} at the start, {h['load_end']} at the "
        f"end; {h['wall_s']:.0f} s in all",
        f"model: GPT2LMHeadModel({model}), {c['parameters']} parameters (tied embedding/head); "
        f"batch {c['batch']} x {c['n_positions']} tokens; AdamW lr {OPTIMIZER['lr']}, "
        f"weight decay {OPTIMIZER['weight_decay']}; {c['steps']} steps, final loss = mean of "
        f"the last {c['last']}"])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--quick", action="store_true", help="a tiny model (for a test)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be a positive integer; got {args.steps}")
    line = " ".join(shlex.quote(a) for a in ["python", "bench/precision_recipes.py",
                                             *(sys.argv[1:] if argv is None else argv)])
    with warnings.catch_warnings():
        # torchao's 8-bit state tensors are compiled without a stable hash for the AOT cache
        warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
        warnings.filterwarnings("ignore", category=SlowDtypeWarning)
        header = _header(line)
        print(f"command: {line}", flush=True)
        start = time.perf_counter()
        result = {"header": header, **run(args.steps, args.quick,
                                          log=lambda s: print(s, flush=True))}
    header.update(wall_s=round(time.perf_counter() - start, 1),
                  load_end=[round(x, 1) for x in os.getloadavg()])
    print()
    print(header_text(result))
    print()
    print(masters_table(result))
    print()
    print(formats_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
