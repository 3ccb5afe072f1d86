"""``mixprec doctor``: what this device supports, what is fast, and measured matmul throughput.

The throughput probe is bounded in time: each dtype is timed at a small shape first
(:data:`SMALL_SHAPE`), then at shapes that double towards the full one while the next shape's
predicted cost fits the time budget (:func:`probe_matmul`). A slow kernel stops early and is
reported at the largest shape it reached, marked slow: torch's native fp16 GEMM on a CPU without
fp16 hardware runs at well under 1 GFLOP/s (16 s per 512x2048x2048 product), and ``doctor``
still takes seconds.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time

import torch

from ..dtypes import to_dtype
from ..hardware import cpu_model, device_capabilities
from .memory import synchronize

__all__ = ["matmul_gflops", "probe_matmul", "probe_shapes", "doctor_report", "register",
           "DEFAULT_SHAPE", "SMALL_SHAPE", "DEFAULT_BUDGET_S", "SLOW_RATIO", "LAYOUTS"]

DEFAULT_SHAPE = (512, 2048, 2048)  # nine-linear's GEMM: batch 512 x width 2048 x width 2048
SMALL_SHAPE = (128, 128, 128)      # the first, cheap probe (4.2 MFLOP)
DEFAULT_BUDGET_S = 1.0             # time budget of one dtype's probe, in seconds
SLOW_RATIO = 0.1                   # below this share of fp32's rate: "slow"
_STEP_PRODUCTS = 3                 # products timed at an intermediate shape (1 warm-up + 2)
_FULL_PRODUCTS = 5                 # at least this many at the full shape (2 warm-up + 3)
#: Operand layouts of a product ``(m, k) @ (k, n)``: "n" a row-major operand, "t" the transpose
#: of a row-major one (``W.t()``). A Linear layer's forward is "nt", its input gradient "nn",
#: its weight gradient "tn"; some kernels' speed depends on it (torch's CPU fp16 GEMM: ~8x).
LAYOUTS = ("nn", "nt", "tn", "tt")


def matmul_gflops(dtype: torch.dtype, shape=DEFAULT_SHAPE, device="cpu", budget_s: float = 0.4,
                  min_reps: int = 3, warmup: int = 2, layout: str = "nn") -> float:
    """Measured GEMM throughput: the median GFLOP/s of ``(m, k) @ (k, n)`` in ``dtype``.

    Runs ``warmup`` products, then repeats for about ``budget_s`` seconds (at least
    ``min_reps`` times) and returns ``2*m*k*n / median_time``. The median, not the best, so a
    busy machine gives the throughput it actually delivers. Unbounded in the size of one
    product: :func:`probe_matmul` first checks that the product is affordable.

    Args:
        dtype: the operand dtype.
        shape: ``(m, k, n)``.
        device: where to run.
        budget_s: rough time budget for the timed repetitions.
        min_reps: minimum number of timed repetitions.
        warmup: untimed products first.
        layout: the operands' layout, one of :data:`LAYOUTS`.

    Returns:
        GFLOP/s (1e9 floating-point operations per second, a multiply-add counting as 2).
    """
    m, k, n = shape
    times = _product_times(dtype, shape, device, budget_s, min_reps, warmup, layout)
    return 2.0 * m * k * n / statistics.median(times) / 1e9


def _operand(rows: int, cols: int, transposed: bool, dtype, device, gen) -> torch.Tensor:
    """A ``rows x cols`` operand: row-major, or the transpose of a row-major ``cols x rows``."""
    if transposed:
        return torch.randn(cols, rows, device=device, generator=gen).to(dtype).t()
    return torch.randn(rows, cols, device=device, generator=gen).to(dtype)


def _product_times(dtype, shape, device, budget_s: float, min_reps: int, warmup: int,
                   layout: str = "nn") -> list:
    """Seconds per ``(m, k) @ (k, n)`` product in ``layout``, after ``warmup`` untimed ones."""
    device = torch.device(device)
    m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(0)
    a = _operand(m, k, layout[0] == "t", dtype, device, gen)
    b = _operand(k, n, layout[1] == "t", dtype, device, gen)
    for _ in range(warmup):
        a @ b
    synchronize(device)
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def probe_shapes(shape, small=SMALL_SHAPE) -> list[tuple[int, int, int]]:
    """The shapes a probe climbs: ``shape``'s sizes capped by ``small``'s, then doubled (capped
    by ``shape``) until ``shape`` itself, which is last. Each step is at most 8x the FLOPs."""
    shape = tuple(int(d) for d in shape)
    step = tuple(min(a, b) for a, b in zip(shape, small))
    steps = [step]
    while step != shape:
        step = tuple(min(2 * a, b) for a, b in zip(step, shape))
        steps.append(step)
    return steps


def _shape_text(shape) -> str:
    m, k, n = shape
    return f"{m}x{k}x{n}"


def probe_matmul(dtype: torch.dtype, shape=DEFAULT_SHAPE, device="cpu", *,
                 budget_s: float = DEFAULT_BUDGET_S, reference_gflops: float | None = None,
                 slow_ratio: float = SLOW_RATIO, small=SMALL_SHAPE, layout: str = "nn") -> dict:
    """GEMM throughput in bounded time: climb from a small shape to ``shape`` while affordable.

    At each shape of :func:`probe_shapes` the rate measured so far predicts the cost of the next
    shape (``_STEP_PRODUCTS`` products, ``_FULL_PRODUCTS`` at the full shape; the rate grows with
    the shape, so the prediction errs long); the climb stops when the time spent plus that cost
    would exceed ``budget_s``. The first shape always runs. Intermediate figures are the best of
    their products (load only ever slows a product down, and a 4-MFLOP product on busy threads
    can stall for milliseconds); the full-shape figure is :func:`matmul_gflops`'s median.

    Args:
        dtype: the operand dtype.
        shape: the full ``(m, k, n)``.
        device: where to run.
        budget_s: the time budget in seconds (0: the small shape only).
        reference_gflops: fp32's rate on this device, or None: a rate below ``slow_ratio`` x
            ``reference_gflops`` is marked slow.
        slow_ratio: see ``reference_gflops``.
        small: the caps of the first shape.
        layout: the operands' layout, one of :data:`LAYOUTS` (default "nn": both row-major).

    Returns:
        ``{"gflops", "shape" (where the figure was measured), "full_size" (bool), "slow" (bool),
        "note" (why it stopped short, or ""), "spent_s" (seconds of products timed),
        "layout"}``.

    Raises:
        ValueError: a negative ``budget_s``, a ``slow_ratio`` outside [0, 1] or an unknown
            ``layout``.
    """
    if not budget_s >= 0:
        raise ValueError(f"budget_s must be >= 0 seconds; got {budget_s!r}")
    if not 0 <= slow_ratio <= 1:
        raise ValueError(f"slow_ratio must be between 0 and 1; got {slow_ratio!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    shape = tuple(shape)
    rate, reached, spent, stop_note = None, None, 0.0, ""
    for step in probe_shapes(shape, small):
        flops = 2.0 * math.prod(step)
        full = step == shape
        if rate is not None:
            cost = (_FULL_PRODUCTS if full else _STEP_PRODUCTS) * flops / (rate * 1e9)
            if spent + cost > budget_s:
                stop_note = (f"the {_shape_text(step)} product would take ~{cost:.2g} s more "
                             f"(budget {budget_s:g} s)")
                break
        if full:
            times = _product_times(dtype, step, device, min(0.4, budget_s - spent), 3, 2, layout)
            rate, warm = flops / statistics.median(times) / 1e9, 2
        else:
            times = _product_times(dtype, step, device, 0.0, _STEP_PRODUCTS - 1, 1, layout)
            rate, warm = flops / min(times) / 1e9, 1
        spent += sum(times) * (1 + warm / len(times))
        reached = step
    result = {"gflops": rate, "shape": list(reached), "full_size": reached == shape,
              "slow": False, "note": "", "spent_s": spent, "layout": layout}
    notes = []
    if reference_gflops and rate < slow_ratio * reference_gflops:
        result["slow"] = True
        notes.append(f"slow: {reference_gflops / rate:.0f}x below fp32")
    if not result["full_size"]:
        result["slow"] = True
        notes.append(f"measured at {_shape_text(reached)} only: {stop_note}")
    result["note"] = "; ".join(notes)
    return result


def _mixprec_note(name: str, info: dict, device: str) -> str:
    """What mixprec does about a dtype that is not fast here."""
    if name == "fp16" and not info["fast"] and torch.device(device).type == "cpu":
        return ("mixprec emulates fp16 matmul/conv/attention here with fp32 kernels on "
                "fp16-rounded values (fp16 numerics, fp32 speed; see mixprec.emulation)")
    return ""


def doctor_report(device="cpu", shape=DEFAULT_SHAPE, measure: bool = True,
                  budget_s: float = DEFAULT_BUDGET_S) -> dict:
    """Everything ``mixprec doctor`` prints, as a dict (what ``--json`` emits).

    Args:
        device: the device to probe.
        shape: the GEMM shape ``(m, k, n)`` of the throughput probe.
        measure: False skips the throughput probe.
        budget_s: per dtype, the time budget of the probe (see :func:`probe_matmul`); fp32's
            rate is the reference that marks the others slow.

    Returns:
        A dict; per dtype (``dtypes``): ``supported``, ``fast``, ``why``, ``mixprec`` (what
        mixprec does about a slow dtype, "" if nothing) and, when measured, ``matmul_gflops``,
        ``matmul_shape`` (where it was measured), ``matmul_full_size``, ``matmul_slow`` and
        ``matmul_note``; ``auto_dtype`` and ``auto_reason`` (what ``dtype="auto"`` resolves
        to, and why); ``gemm_probe``: on a CPU, the bf16/fp32 measurement ``auto`` decided
        from (:func:`mixprec.hardware.cpu_gemm_probe`), else None.
    """
    caps = device_capabilities(device)
    dtypes, reference = {}, None
    for name, info in caps["dtypes"].items():
        row = dict(info)
        row["mixprec"] = _mixprec_note(name, info, caps["device"])
        if measure and info["supported"]:
            probe = probe_matmul(to_dtype(name), shape, caps["device"], budget_s=budget_s,
                                 reference_gflops=reference)
            if name == "fp32":
                reference = probe["gflops"]
            row.update(matmul_gflops=round(probe["gflops"], 2), matmul_shape=probe["shape"],
                       matmul_full_size=probe["full_size"], matmul_slow=probe["slow"],
                       matmul_note=probe["note"])
        dtypes[name] = row
    return {
        "device": caps["device"],
        "name": caps["name"],
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "flags": caps.get("flags", []),
        "matmul_shape": list(shape),
        "probe_budget_s": budget_s,
        "dtypes": dtypes,
        "auto_dtype": caps["auto_dtype"],
        "auto_reason": caps["auto_reason"],
        "gemm_probe": caps.get("gemm_probe"),
    }


def _gflops_text(row: dict) -> str:
    if "matmul_gflops" not in row:
        return "-"
    gf = row["matmul_gflops"]
    text = f"{gf:.0f}" if gf >= 10 else f"{gf:.2g}"
    return text + ("*" if not row["matmul_full_size"] else " ")


def _print(rep: dict) -> None:
    m, k, n = rep["matmul_shape"]
    print(f"device      {rep['device']}: {rep['name']}")
    print(f"cpu         {rep['cpu_model']}")
    print(f"torch       {rep['torch']} (python {rep['python']}), {rep['threads']} threads, "
          f"{rep['cpu_count']} CPUs")
    if rep["flags"]:
        print(f"cpu flags   {' '.join(rep['flags'])}")
    print(f"\n{'dtype':<6} {'supported':<10} {'fast':<5} {'matmul GFLOP/s':>15}  why")
    for name, row in rep["dtypes"].items():
        print(f"{name:<6} {'yes' if row['supported'] else 'no':<10} "
              f"{'yes' if row['fast'] else 'no':<5} {_gflops_text(row):>16} {row['why']}")
    small = any(not row.get("matmul_full_size", True) for row in rep["dtypes"].values())
    if any(row.get("matmul_gflops") is not None for row in rep["dtypes"].values()):
        print(f"\n(matmul: median of ({m}x{k}) @ ({k}x{n}) products after warm-up"
              + ("; *: a smaller shape, see below)" if small else ")"))
    else:
        print("\n(matmul: not measured, --no-measure)")
    for name, row in rep["dtypes"].items():
        if row.get("matmul_note"):
            print(f"* {name}: {row['matmul_note']}")
    for name, row in rep["dtypes"].items():
        if row.get("mixprec"):
            print(f"{name}: {row['mixprec']}")
    print(f"dtype='auto' -> {rep['auto_dtype']}: {rep['auto_reason']}")


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--shape must be three positive integers M,K,N; got {text!r}")
    return shape


def resolve_device(name: str) -> str:
    """``"auto"``: the GPU where torch sees one (``"cuda"``), else ``"cpu"``; any other name as
    given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "meta":
        raise ValueError("--device meta: a meta tensor holds no values; there is nothing to "
                         "probe or measure there")
    if device.type not in ("cpu", "cuda"):  # (cuda: device_capabilities says it is missing)
        try:
            torch.empty(1, device=device)
        except (RuntimeError, AssertionError) as error:
            raise ValueError(f"device {name} was asked for but torch cannot make a tensor "
                             f"there (no {device.type} backend in this build)") from error
    return name


def _run(args) -> int:
    rep = doctor_report(resolve_device(args.device), _parse_shape(args.shape),
                        measure=not args.no_measure, budget_s=args.budget)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        _print(rep)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="device capabilities and measured matmul throughput",
                              description="Show which dtypes this device supports and which are "
                              "fast, measure matmul GFLOP/s per dtype, and say what dtype='auto' "
                              "means. Slow kernels are measured at a smaller shape, so it takes "
                              "seconds.")
    p.add_argument("--device", default="auto",
                   help="device to probe: auto (the GPU where torch sees one, else the CPU), "
                   "cpu, cuda, cuda:1, ... (default: auto)")
    p.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)),
                   help="GEMM shape M,K,N for the throughput probe (default: %(default)s)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                   help="time budget of each dtype's probe: a kernel too slow to reach the full "
                   "shape within it is measured at a smaller one (default: %(default)s)")
    p.add_argument("--no-measure", action="store_true", help="skip the throughput measurement")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run)
