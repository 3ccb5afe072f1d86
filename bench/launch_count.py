"""Count what one training step runs: aten ops per step for ``torch.autocast`` + ``GradScaler``
against mixprec O2 (fp16 with its loss scaler, and bf16).

    .venv/bin/python bench/launch_count.py [--width 64] [--layers 2] [--ops] [--phases]

A ``TorchDispatchMode`` counts every aten op a whole step dispatches on a CPU: the forward, the
backward, the loss scaling, the unscale and overflow check, the optimizer step, the fp32 master
update and the copy back into the 16-bit weights, and ``zero_grad``. On a GPU each of these ops
is a kernel launch (or a host-side view), so the count is the launch-bound part of a step; the
same code runs on CUDA (``--device cuda``) but there the backward runs on autograd's device
threads, outside the mode, so the CPU count is the one to read. Each row counts the third step
(the first steps create optimizer state). ``--ops`` prints the ops each mixprec row runs more
or fewer times than its reference.

Rows: fp32 (AdamW), ``torch.autocast`` fp16 + ``torch.amp.GradScaler`` (fused AdamW: the
scaler hands its scale and inf flag to the fused kernel), mixprec O2 fp16 (``MixedPrecision``:
the fp32 masters stepped by torch's fused AdamW, its dynamic loss scaler), ``torch.autocast``
bf16 and mixprec O2 bf16. fp16 matmuls on a CPU are emulated by mixprec (fp32 arithmetic on
fp16-rounded values) unless ``emulate_fp16=False``, which this count sets: the ops counted are
the ones a GPU would run.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec as mp
from mixprec.benchmodels import TinyGPT

ROWS = ("fp32", "autocast-fp16", "O2-fp16", "autocast-bf16", "O2-bf16")
#: Ops that make a view or alias (host-side metadata: no kernel on any device).
VIEWS = frozenset(f"aten.{op}" for op in (
    "as_strided", "view", "_unsafe_view", "_reshape_alias", "alias", "detach", "slice", "select",
    "t", "transpose", "permute", "unsqueeze", "squeeze", "expand", "split", "unbind"))


PHASES = ("forward", "backward", "check", "update", "scale update", "read", "step", "zero_grad")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by name and by the phase set in ``phase``."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.phases: collections.Counter = collections.Counter()
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        self.phases[self.phase] += 1
        return func(*args, **(kwargs or {}))


class _Phases:
    """Sets the phase of the active counter (none: no-op); ``within`` wraps an object's method
    (an instance attribute, so only that object) to count under a phase while it runs."""

    def __init__(self):
        self.counter: OpCounter | None = None

    def __call__(self, phase: str) -> None:
        if self.counter is not None:
            self.counter.phase = phase

    def within(self, obj, name: str, phase: str) -> None:
        method = getattr(obj, name, None)
        if method is None:  # an older mixprec without this method
            return

        def wrapped(*args, **kwargs):
            before = self.counter.phase if self.counter is not None else None
            self(phase)
            try:
                return method(*args, **kwargs)
            finally:
                self(before)
        setattr(obj, name, wrapped)


def _model(width: int, layers: int, device: str):
    torch.manual_seed(0)
    return TinyGPT(vocab=128, dim=width, depth=layers, heads=2, seq_len=32).to(device)


def _loss(out, x):
    return torch.nn.functional.cross_entropy(out.float().flatten(0, 1), x.flatten())


def make_step(row: str, width: int = 64, layers: int = 2, device: str = "cpu",
              mark: _Phases | None = None):
    """A function running one whole training step of ``row`` on a fixed batch (``mark``: sets
    the phase the counted ops belong to)."""
    mark = _Phases() if mark is None else mark
    model = _model(width, layers, device)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    fused = {"fused": True}
    if row == "fp32":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **fused)

        def step():
            mark("forward")
            loss = _loss(model(x), x)
            mark("backward")
            loss.backward()
            mark("update")
            opt.step()
            mark("zero_grad")
            opt.zero_grad()
        return step
    if row.startswith("autocast"):
        dtype = torch.float16 if row.endswith("fp16") else torch.bfloat16
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **fused)
        scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
        mark.within(scaler, "unscale_", "check")  # step() calls it first

        def step():
            mark("forward")
            with torch.autocast(device, dtype=dtype):
                loss = _loss(model(x), x)
            mark("backward")
            scaler.scale(loss).backward()
            mark("update")
            scaler.step(opt)
            mark("scale update")
            scaler.update()
            mark("zero_grad")
            opt.zero_grad()
        return step
    dtype = row.rpartition("-")[2]
    amp = mp.MixedPrecision(level="O2", dtype=dtype, emulate_fp16=False)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    scaler = amp.scaler
    mark.within(scaler, "_prepare_step", "check")
    mark.within(opt, "step", "update")
    mark.within(scaler, "update", "scale update")
    mark.within(scaler, "read_step", "read")

    def step():
        mark("forward")
        loss = _loss(model(x), x)
        mark("backward")
        amp.backward(loss)
        mark("step")
        amp.step(opt)
        mark("zero_grad")
        opt.zero_grad()
    return step


def count(row: str, width: int = 64, layers: int = 2, device: str = "cpu",
          steps: int = 3, by_phase: bool = False) -> collections.Counter:
    """The aten ops of the last of ``steps`` training steps of ``row``, by name (``by_phase``:
    by phase)."""
    mark = _Phases()
    step = make_step(row, width, layers, device, mark)
    for _ in range(steps - 1):
        step()
    with OpCounter() as counter:
        mark.counter = counter
        step()
    mark.counter = None
    return counter.phases if by_phase else counter.ops


def diff(ops: collections.Counter, ref: collections.Counter) -> dict[str, int]:
    """Ops ``ops`` runs more (positive) or fewer (negative) times than ``ref``."""
    return {k: ops[k] - ref[k] for k in sorted(set(ops) | set(ref)) if ops[k] != ref[k]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--ops", action="store_true", help="print the ops that differ")
    p.add_argument("--phases", action="store_true", help="print the count of each phase")
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    if args.phases:
        print(f"TinyGPT width {args.width}, {args.layers} layers, {args.device}, torch "
              f"{torch.__version__}: aten ops per training step, by phase")
        print("| row | " + " | ".join(PHASES) + " | total |")
        print("|---" * (len(PHASES) + 2) + "|")
        for r in rows:
            phases = count(r, args.width, args.layers, args.device, by_phase=True)
            print(f"| {r} | " + " | ".join(str(phases[k]) for k in PHASES)
                  + f" | {sum(phases.values())} |")
        return 0
    counts = {r: count(r, args.width, args.layers, args.device) for r in rows}
    refs = {"O2-fp16": "autocast-fp16", "O2-bf16": "autocast-bf16"}
    print(f"TinyGPT width {args.width}, {args.layers} layers, {args.device}, torch "
          f"{torch.__version__}: aten ops per training step")
    print("| row | ops/step | of them not views | vs reference |")
    print("|---|---|---|---|")
    for r in rows:
        ref = refs.get(r)
        extra = (f"{sum(counts[r].values()) - sum(counts[ref].values()):+d} vs {ref}"
                 if ref in counts else "")
        kernels = sum(n for op, n in counts[r].items() if op not in VIEWS)
        print(f"| {r} | {sum(counts[r].values())} | {kernels} | {extra} |")
    if args.ops:
        for r, ref in refs.items():
            if r in counts and ref in counts:
                print(f"\n{r} - {ref}: {diff(counts[r], counts[ref])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
