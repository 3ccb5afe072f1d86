"""``mixprec plan``: memory per rank and gradient traffic per step of a set-up, on paper."""

from __future__ import annotations

import dataclasses
import json

from .. import masters
from ..parallel.plan import OPTIMIZER_MOMENTS, STRATEGIES, MemoryPlan, parse_count, plan, plan_table
from ..policy import LEVELS
from .args import add_keyword_options

__all__ = ["plan_report", "register"]

_GIB = 2.0 ** 30
_FP32_NOTE = ("fp32 is not a 16-bit type: every level is plain fp32 (O1-O3 keep no 16-bit "
              "copies and no masters), as mixprec.prepare makes them")
_COLUMNS = ("strategy", "ranks", "level", "params", "masters", "grads", "optimizer", "total",
            "B/param", "traffic/step")


def _line(mark: str, cells, width: int = 5) -> str:
    strategy, ranks, level, *sizes, bpp, traffic = cells
    return (f"{mark} {strategy:<8} {ranks:>5}  {level:<{width}} "
            + " ".join(f"{c:>9}" for c in sizes) + f" {bpp:>8} {traffic:>13}")


def _gib(x: float) -> str:
    return f"{x / _GIB:.2f}"


def _count(n: int) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _level(p: MemoryPlan) -> str:
    """The level, with the master kind and moment dtype when they are not the default."""
    if p.is_default_recipe:
        return p.level
    return f"{p.level} {p.master}/{p.state_dtype}"


def _row(p: MemoryPlan, chosen: bool, width: int) -> str:
    shard = p.world if p.strategy == "fsdp" else 1
    bpp = f"{p.total * shard / p.params:g}" + (f"/{shard}" if shard > 1 else "")
    return _line("*" if chosen else " ", (
        p.strategy, p.world, _level(p), _gib(p.parameters), _gib(p.masters), _gib(p.gradients),
        _gib(p.optimizer_state), _gib(p.total), bpp, f"{p.traffic / _GIB:.2f} GiB"), width)


def plan_report(params, *, level="O2", dtype="bf16", strategy="fsdp", world=8, optimizer="adamw",
                reduce_dtype="fp32", master="fp32",
                state_dtype="fp32") -> tuple[MemoryPlan, list[MemoryPlan], str]:
    """The chosen plan, the plans of every level and strategy (and, when the chosen one is
    compact, of every O2 master and moment dtype), and the printed table."""
    chosen = plan(params, level=level, dtype=dtype, strategy=strategy, world=world,
                  optimizer=optimizer, reduce_dtype=reduce_dtype, master=master,
                  state_dtype=state_dtype)
    others_world = world if strategy != "single" else 8
    compact = not chosen.is_default_recipe
    rows = plan_table(params, dtype=dtype, world=others_world, optimizer=optimizer,
                      reduce_dtype=reduce_dtype, compact=compact)
    width = 19 if compact else 5
    lines = [
        f"mixprec plan: {_count(chosen.params)} parameters, {chosen.optimizer} "
        f"({OPTIMIZER_MOMENTS[chosen.optimizer]} moments), training dtype {chosen.dtype}, "
        f"gradients reduced in {chosen.reduce_dtype}",
        "GiB per rank; B/param: bytes per parameter (/N: over N ranks); traffic: sent per rank "
        "per step",
        *([_FP32_NOTE] if chosen.dtype == "fp32" else []),
        "",
        _line(" ", _COLUMNS, width),
    ]
    def key_of(p):
        return p.strategy, p.level, p.world, p.master, p.state_dtype

    key = key_of(chosen)
    lines += [_row(p, key_of(p) == key, width) for p in rows]
    if key not in {key_of(p) for p in rows}:
        lines.append(_row(chosen, True, width))
    lines += [
        "",
        f"* {chosen.strategy} {_level(chosen)} at {chosen.world} rank(s): "
        f"{chosen.total / _GIB:.2f} GiB per rank before activations; sends "
        f"{chosen.traffic / _GIB:.2f} GiB per step.",
        "Not counted: activations, transient fp32 copies of 16-bit gradients, FSDP's gathered "
        "units.",
    ]
    return chosen, rows, "\n".join(lines)


def _run(args) -> int:
    world = args.world if args.world is not None else 1 if args.strategy == "single" else 8
    chosen, rows, text = plan_report(parse_count(args.params), level=args.level, dtype=args.dtype,
                                     strategy=args.strategy, world=world,
                                     optimizer=args.optimizer, reduce_dtype=args.reduce_dtype,
                                     master=args.master, state_dtype=args.state_dtype)
    if args.json:
        out = {"chosen": dataclasses.asdict(chosen),
               "rows": [{**dataclasses.asdict(p), "total": p.total} for p in rows]}
        out["chosen"]["total"] = chosen.total
        print(json.dumps(out, indent=2))
    else:
        print(text)
    return 0


#: The options whose default differs from the vocabulary's, and why.
_DIFFERS = {
    "level": ("O2", "the level a memory plan is usually asked about"),
    "dtype": ("bf16", "fp32 makes every level plain fp32; auto has no device to resolve on"),
    "master": ("fp32", "what None resolves to at O2, shown by name"),
    "state_dtype": ("fp32", "what None resolves to, shown by name"),
}


def register(subparsers) -> None:
    """Add the ``plan`` subcommand."""
    p = subparsers.add_parser(
        "plan", help="bytes per rank and gradient traffic per step, on paper",
        description="Memory per rank (parameters, fp32 masters, gradients, optimizer state) and "
                    "gradient traffic per rank per step for a level, strategy and world size, "
                    "next to the other levels and strategies.")
    p.add_argument("--params", required=True, help="parameter count: 7e9, 7B, 350M, ...")
    add_keyword_options(p, "level", "dtype", differs=_DIFFERS,
                        choices={"level": LEVELS, "dtype": ("bf16", "fp16", "fp32")})
    p.add_argument("--strategy", default="fsdp", choices=STRATEGIES)
    p.add_argument("--world", type=int, default=None,
                   help="number of ranks (default 8; 1 for --strategy single)")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_MOMENTS))
    add_keyword_options(p, "reduce_dtype", "master", "state_dtype", differs=_DIFFERS,
                        choices={"master": masters.shorthands()})
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_run)
