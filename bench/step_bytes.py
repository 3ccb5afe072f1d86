"""Memory traffic of one optimizer step: bytes read + written per parameter, and launches.

    python bench/step_bytes.py [--layers 16] [--width 256] [--backward] [--ops]
        [--inner default|fused|foreach] [--state-dtype fp32|bf16] [--compiled]
        [--paths cpu|cuda] [--json FILE]

A ``TorchDispatchMode`` (``bench/_bytes.py``) counts every aten op inside one optimizer step
(the third, so the state exists): an op reads each tensor argument and writes each output and
each argument its schema marks as mutated; the destination of a copy is written, not read; views
and allocations are left out; every other op is a launch. The model is ``--layers``
``Linear(width, width)`` layers, AdamW; everything runs eagerly (``TORCHDYNAMO_DISABLE=1``,
so no compiled kernel hides an op). Rows:

* ``torch.autocast`` bf16 with torch's fused AdamW on the fp32 parameters: the step, and what
  autocast adds each step outside it (the weight cast in the forward, 6 B/param; the fp32
  gradient cast in the backward, 6 more, shown apart);
* mixprec O2 bf16 with fp32 masters, ``master="split"``, ``"kahan"`` and ``"stochastic"``
  (``amp.step(opt)``: everything mixprec runs for the step, over a ``torch.optim.AdamW`` made
  with ``--inner``'s flags; its moments in ``--state-dtype``: bf16 moments are rounded
  stochastically every step);
* O2 written with torch's fused kernel and nothing more, in plain torch: the bf16 gradients
  widened into fp32 buffers (one ``_foreach_copy_``), torch's fused AdamW on fp32 masters, the
  masters cast back into the bf16 weights (one ``_foreach_copy_``), run and counted like the rest;
* the ideal fused O2 step, computed: one pass reading the bf16 gradient and the fp32 master and
  moments, writing the master, the moments and the bf16 weight (2+4+4+4 + 4+4+4+2 = 28);
* with ``--compiled``, O2 with fp32 masters and the compiled master step
  (``fused="compile"``: torch's single-tensor AdamW between the widening of the gradient and the
  cast, compiled by inductor into one C++ kernel per parameter). The counter does not see into a
  compiled kernel (under a dispatch mode dynamo runs the function eagerly), so each kernel call
  (``mixprec.optim.compiled._run``) runs outside it and is counted by hand from its arguments
  (:class:`KernelCount`): every tensor argument read once except the 16-bit weight (only the
  destination of the cast), and every argument whose version counter the call moved written
  once; what the step runs around the kernels is counted as usual. (This matches the kernel
  inductor generates: its C++ signature takes the bf16 gradient, master and moments as inputs
  and the master, moments and bf16 weight as outputs.)

"transient peak" is the most memory the step's ops allocated that was alive at once. Buffers
an optimizer keeps as tensors and whose storage it fills when a step starts and empties when it
ends are no aten op's allocation and show in their own column, "step scratch" (held while the
step runs, nothing between steps): a compact optimizer's piece (fp32 values, gradients, widened
moments: at most 2^20 elements each), an fp32-master optimizer's bucket of fp32 gradients (4 MiB
at least). The plain-torch O2 row keeps its fp32 gradient buffers, 4 B/param, between steps.
``--backward`` adds what
each row runs in its forward and its backward beyond a plain bf16 model's (same layers, same
batch; work a method moves into backward hooks shows here), counted the same way, and the step
plus both. ``--ops`` prints each measured row's traffic by op. ``--paths cuda`` counts with the
kernel choices mixprec makes on CUDA imposed on the CPU (``mixprec.kernel_table``): there the
bf16 inf/NaN check of a step is a read-only inf-norm (2 B/param), where on the CPU torch's
check-and-unscale kernel (read and write, 4 B/param) is chosen because it runs about 10x faster
there.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # before torch is imported: eager, nothing compiled

import argparse  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bytes import ByteCounter, Traffic  # noqa: E402
from _plain_o2 import PlainO2  # noqa: E402
from _report import write_json  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402

import mixprec as mp  # noqa: E402
from mixprec import kernel_table  # noqa: E402

BF16 = torch.bfloat16
#: The ideal fused O2 AdamW step, bytes per parameter: read bf16 grad, fp32 master, m, v;
#: write master, m, v and the bf16 weight.
IDEAL_O2 = (2 + 4 + 4 + 4) + (4 + 4 + 4 + 2)
#: autocast's weight cast (fp32 read, bf16 written), per parameter, each forward.
AUTOCAST_CAST = 4 + 2
MASTERS = {"O2 bf16, fp32 masters": None, 'O2 `master="split"`': "split",
           'O2 `master="kahan"`': "kahan", 'O2 `master="stochastic"`': "stochastic"}
FUSED_ONLY = "O2 with torch's fused kernel, nothing more (widen + kernel + cast)"
COMPILED_ROW = 'O2 bf16, fp32 masters, `fused="compile"` (compiled kernels counted by hand)'


def build(layers: int, width: int, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(dtype)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


class Row:
    """One way to train the model: ``forward()`` -> loss, ``backward(loss)``, ``step()``,
    ``zero_grad()``; ``params`` the trained parameters (counted per parameter)."""

    def __init__(self, forward, backward, step, zero_grad, params, kept=lambda: 0):
        self.forward, self.backward, self.step, self.zero_grad = forward, backward, step, zero_grad
        self.params = list(params)
        self.kept = kept  # bytes of scratch the optimizer's step fills and empties


def _plain(model: nn.Module, opt, x: torch.Tensor, autocast: bool = False) -> Row:
    dtype = next(model.parameters()).dtype

    def forward():
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            return _loss(model(x.to(dtype)))
    return Row(forward, lambda loss: loss.backward(), opt.step,
               lambda: opt.zero_grad(set_to_none=True), model.parameters())


def autocast_row(layers: int, width: int, x: torch.Tensor) -> Row:
    model = build(layers, width)
    return _plain(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), x, True)


def bf16_row(layers: int, width: int, x: torch.Tensor) -> Row:
    """A plain bf16 model with torch's AdamW: the forward and backward the others are read
    against."""
    model = build(layers, width, BF16)
    return _plain(model, torch.optim.AdamW(model.parameters(), lr=1e-3), x)


#: ``--inner``: the keyword arguments of the ``torch.optim.AdamW`` mixprec's rows wrap.
INNER = {"default": {}, "fused": {"fused": True}, "foreach": {"foreach": True}}


def mixprec_row(layers: int, width: int, x: torch.Tensor, master, inner: str = "default",
                state_dtype: str = "fp32", fused=None) -> Row:
    model = build(layers, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **INNER[inner])
    amp = mp.MixedPrecision(level="O2", dtype="bf16", master=master, state_dtype=state_dtype)
    model, opt = amp.setup(model, opt)
    if fused is not None:
        opt.fused = fused
    def kept() -> int:  # the scratch an optimizer's step fills and empties
        scratch = getattr(opt, "scratch", None)
        return sum(t.numel() * t.element_size() for t in scratch.tensors()) if scratch else 0

    return Row(lambda: _loss(model(x)), amp.backward, lambda: amp.step(opt),
               lambda: opt.zero_grad(set_to_none=True), model.parameters(), kept)


def fused_only_row(layers: int, width: int, x: torch.Tensor) -> Row:
    """O2 in plain torch: bf16 weights, fp32 masters stepped by torch's fused AdamW."""
    model = build(layers, width)
    masters = [p.detach().clone() for p in model.parameters()]
    model.to(BF16)
    o2 = PlainO2(model.parameters(), masters, lr=1e-3)
    return Row(lambda: _loss(model(x.to(BF16))), lambda loss: loss.backward(), o2.step,
               o2.zero_grad, o2.params)


class KernelCount:
    """Stands in for ``mixprec.optim.compiled._run`` (every call of a compiled master kernel):
    runs the kernel outside the byte counter (so it runs compiled) and, while ``counting``,
    counts its traffic by hand (see the module docstring) into ``traffic`` (one launch per
    call)."""

    def __init__(self, run):
        self.run, self.counting, self.traffic = run, False, Traffic()

    def __call__(self, kernel, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        versions = [t._version for t in tensors]
        with _disable_current_modes():
            out = self.run(kernel, *args)
        if self.counting:
            t = self.traffic
            for i, (arg, version) in enumerate(zip(tensors, versions)):
                size = arg.numel() * arg.element_size()
                t.read += size if i != 1 else 0  # argument 1: the 16-bit weight, written only
                t.written += size if arg._version != version else 0
            t.launches += 1
            t.by_op[COMPILED] = t.read + t.written
            t.launches_by_op[COMPILED] = t.launches
        return out


COMPILED = "compiled master kernel"


def measure_compiled(layers: int, width: int, x: torch.Tensor) -> dict[str, Traffic]:
    """O2 with fp32 masters and ``fused="compile"`` (dynamo switched on for it): two steps
    (they compile), then one counted, its kernels' traffic (:class:`KernelCount`) added to the
    step's."""
    from mixprec.optim import compiled
    count = compiled._run = KernelCount(compiled._run)
    try:
        with torch._dynamo.config.patch(disable=False):
            row = mixprec_row(layers, width, x, None, fused="compile")
            measure(row, steps=2)
            count.counting = True
            got = measure(row, steps=1)
    finally:
        compiled._run = count.run
    step, kernel = got["step"], count.traffic
    step.read, step.written = step.read + kernel.read, step.written + kernel.written
    step.launches += kernel.launches
    step.by_op.update(kernel.by_op)
    step.launches_by_op.update(kernel.launches_by_op)
    return got


def measure(row: Row, steps: int = 3) -> dict[str, Traffic]:
    """Runs ``steps`` training steps and counts the last one's forward, backward and step."""
    counted = {}
    for i in range(steps):
        last = i == steps - 1
        with ByteCounter() as fwd:
            loss = row.forward()
        with ByteCounter() as bwd:
            row.backward(loss)
        with ByteCounter() as stp:
            row.step()
        row.zero_grad()
        if last:
            counted = {"forward": fwd.traffic, "backward": bwd.traffic, "step": stp.traffic}
    return counted


def numel(row: Row) -> int:
    return sum(p.numel() for p in row.params)


def run(layers: int = 16, width: int = 256, batch: int = 8, inner: str = "default",
        state_dtype: str = "fp32", compiled: bool = False) -> list[dict]:
    """Every row's counts: step, forward and backward bytes per parameter beyond the bf16
    model's, launches, the step's transient peak per parameter. Returns a list of dicts
    (``name``, ``step``, ``launches``, ``transient``, ``forward``, ``backward``, ``measured``)."""
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0))
    ref_row = bf16_row(layers, width, x)
    ref = measure(ref_row)
    n = numel(ref_row)
    makers = [("torch fused AdamW, fp32 params, `torch.autocast` bf16",
               lambda: autocast_row(layers, width, x))]
    makers += [(name, lambda m=m: mixprec_row(layers, width, x, m, inner, state_dtype))
               for name, m in MASTERS.items()]
    makers += [(FUSED_ONLY, lambda: fused_only_row(layers, width, x))]
    counted = []
    for name, make in makers:
        row = make()
        if numel(row) != n:
            raise RuntimeError(f"{name}: {numel(row)} parameters, expected {n}")
        counted.append((name, measure(row), row.kept()))
    if compiled:  # last: it replaces the compiled kernels for the process while it runs
        counted.append((COMPILED_ROW, measure_compiled(layers, width, x), 0))
    rows = [{"name": name, "measured": True, "step": got["step"].total / n,
             "launches": got["step"].launches, "transient": got["step"].peak_live / n,
             "transient_bytes": got["step"].peak_live, "kept_bytes": kept,
             "forward": (got["forward"].total - ref["forward"].total) / n,
             "backward": (got["backward"].total - ref["backward"].total) / n,
             "step_ops": {k: v / n for k, v in got["step"].by_op.most_common()},
             "step_launches": dict(got["step"].launches_by_op.most_common())}
            for name, got, kept in counted]
    rows.append({"name": "ideal fused O2 step (computed)", "measured": False,
                 "step": float(IDEAL_O2), "launches": None, "transient": 0.0,
                 "transient_bytes": 0, "kept_bytes": 0, "forward": 0.0, "backward": 0.0})
    return rows


def table(rows: list[dict], backward: bool) -> str:
    head = "| row | step B/param | launches | transient peak MiB (B/param) | step scratch MiB |"
    rule = "|---|---:|---:|---:|---:|"
    if backward:
        head += " forward + | backward + | step + forward + backward |"
        rule += "---:|---:|---:|"
    lines = [head, rule]
    for r in rows:
        launches = "-" if r["launches"] is None else str(r["launches"])
        line = (f"| {r['name']} | {r['step']:.1f} | {launches} | "
                f"{r['transient_bytes'] / 2**20:.1f} ({r['transient']:.1f}) | "
                f"{r['kept_bytes'] / 2**20:.1f} |")
        if backward:
            total = r["step"] + r["forward"] + r["backward"]
            line += f" {r['forward']:+.1f} | {r['backward']:+.1f} | {total:.1f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--backward", action="store_true",
                        help="also count the forward and backward beyond a plain bf16 model's")
    parser.add_argument("--ops", action="store_true", help="print each row's step by op")
    parser.add_argument("--inner", default="default", choices=tuple(INNER),
                        help="the AdamW mixprec's rows wrap: torch's default, fused=True or "
                             "foreach=True")
    parser.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16"),
                        help="the moments' dtype in mixprec's rows")
    parser.add_argument("--compiled", action="store_true",
                        help="add O2 with the compiled master step (compiles: seconds)")
    parser.add_argument("--paths", default="cpu", choices=("cpu", "cuda"),
                        help="the device whose kernel choices mixprec's rows make (cuda: "
                             "imposed on the CPU)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE")
    args = parser.parse_args(argv)
    for key in ("layers", "width", "batch"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be a positive integer; got {getattr(args, key)}")
    torch.set_num_threads(1)
    table_now = kernel_table.TABLE
    if args.paths == "cuda":
        kernel_table.TABLE = table_now.imposing("cuda")
    try:
        with torch._dynamo.config.patch(disable=True):  # eager (also when imported, not run)
            rows = run(args.layers, args.width, args.batch, args.inner, args.state_dtype,
                       args.compiled)
    finally:
        kernel_table.TABLE = table_now
    n = args.layers * (args.width + 1) * args.width
    print(f"One AdamW step, {args.layers} x Linear({args.width}, {args.width}) ({n:,} parameters),"
          f" batch {args.batch}, eager, torch {torch.__version__}, mixprec {mp.__version__}, "
          f"mixprec's rows over AdamW({INNER[args.inner]}), {args.state_dtype} moments, "
          f"{args.paths.upper()}'s kernel choices; "
          f"bytes read + written per parameter, launches = aten ops that are not views.")
    print(f"autocast adds {AUTOCAST_CAST} B/param each forward outside the step (its weight cast):"
          f" step + cast = {rows[0]['step'] + AUTOCAST_CAST:.1f}.\n")
    print(table(rows, args.backward))
    if args.ops:
        for r in rows:
            if r["measured"]:
                ops = ", ".join(f"{k} {v:.1f} ({r['step_launches'][k]})"
                                for k, v in r["step_ops"].items())
                print(f"\n{r['name']}: {ops}")
    write_json(args.json, {"layers": args.layers, "width": args.width, "batch": args.batch,
                           "inner": args.inner, "state_dtype": args.state_dtype,
                           "paths": args.paths,
                           "torch": torch.__version__, "mixprec": mp.__version__, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
