"""``mixprec doctor``: what this device supports, what is fast, and measured matmul throughput."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from ..hardware import cpu_model, device_capabilities

__all__ = ["matmul_gflops", "doctor_report", "register"]

DEFAULT_SHAPE = (512, 2048, 2048)  # nine-linear's GEMM: batch 512 x width 2048 x width 2048
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(dtype: torch.dtype, shape=DEFAULT_SHAPE, device="cpu", budget_s: float = 0.4,
                  min_reps: int = 3) -> float:
    """Measured GEMM throughput: the median GFLOP/s of ``(m, k) @ (k, n)`` in ``dtype``.

    Runs two warm-up products, then repeats for about ``budget_s`` seconds (at least
    ``min_reps`` times) and returns ``2*m*k*n / median_time``. The median, not the best, so a
    busy machine gives the throughput it actually delivers.

    Args:
        dtype: the operand dtype.
        shape: ``(m, k, n)``.
        device: where to run.
        budget_s: rough time budget for the timed repetitions.
        min_reps: minimum number of timed repetitions.

    Returns:
        GFLOP/s (1e9 floating-point operations per second, a multiply-add counting as 2).
    """
    device = torch.device(device)
    m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=gen).to(dtype)
    b = torch.randn(k, n, device=device, generator=gen).to(dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2.0 * m * k * n / statistics.median(times) / 1e9


def doctor_report(device="cpu", shape=DEFAULT_SHAPE, measure: bool = True) -> dict:
    """Everything ``mixprec doctor`` prints, as a dict (what ``--json`` emits)."""
    caps = device_capabilities(device)
    dtypes = {}
    for name, info in caps["dtypes"].items():
        row = dict(info)
        if measure and info["supported"]:
            row["matmul_gflops"] = round(matmul_gflops(_DTYPES[name], shape, caps["device"]), 1)
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
        "dtypes": dtypes,
        "auto_dtype": caps["auto_dtype"],
        "auto_reason": caps["auto_reason"],
    }


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
        gf = f"{row['matmul_gflops']:.0f}" if "matmul_gflops" in row else "-"
        print(f"{name:<6} {'yes' if row['supported'] else 'no':<10} {'yes' if row['fast'] else 'no':<5} "
              f"{gf:>15}  {row['why']}")
    print(f"\n(matmul: median of ({m}x{k}) @ ({k}x{n}) products after warm-up)")
    print(f"dtype='auto' -> {rep['auto_dtype']}: {rep['auto_reason']}")


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--shape must be three positive integers M,K,N; got {text!r}")
    return shape


def _run(args) -> int:
    rep = doctor_report(args.device, _parse_shape(args.shape), measure=not args.no_measure)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        _print(rep)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="device capabilities and measured matmul throughput",
                              description="Show which dtypes this device supports and which are "
                              "fast, measure matmul GFLOP/s per dtype, and say what dtype='auto' means.")
    p.add_argument("--device", default="cpu", help="device to probe (default: cpu)")
    p.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)),
                   help="GEMM shape M,K,N for the throughput probe (default: %(default)s)")
    p.add_argument("--no-measure", action="store_true", help="skip the throughput measurement")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run)
