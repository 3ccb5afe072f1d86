"""The GEMM peaks ``mixprec bench`` compares its rows with: the three GEMMs of a Linear layer's
training step at the model's representative shape, each in the operand layout autograd runs it,
timed by ``doctor``'s bounded probe, and combined into one rate.

One product in one layout is not that rate: kernels differ by layout (torch's CPU fp16 GEMM runs
``x @ W.t()`` ~8x faster than ``x @ W``), and the weight gradient has another shape.
"""

from __future__ import annotations

import torch

from ..emulation import emulation_context
from ..hardware import is_fast
from ..policy import resolve_dtype
from .doctor import probe_matmul

__all__ = ["matmul_peaks", "combined", "faster", "is_emulated", "TRAINING_GEMMS", "PEAK_BUDGET_S"]

PEAK_BUDGET_S = 2.0  # time budget of one GEMM's probe (see doctor.probe_matmul); 3 per dtype
#: The GEMMs of a Linear layer's training step at the representative shape ``(m, k, n)`` (rows,
#: in features, out features) as autograd runs them: name, operand layout (see
#: ``doctor.LAYOUTS``), and the product's ``(m, k, n)`` as indices into the shape. Forward
#: ``x @ W.t()``; input gradient ``gy @ W``; weight gradient ``gy.t() @ x``.
TRAINING_GEMMS = (("forward", "nt", (0, 1, 2)), ("input_grad", "nn", (0, 2, 1)),
                  ("weight_grad", "tn", (2, 0, 1)))


def is_emulated(dtype_name_: str, device) -> bool:
    """Does mixprec emulate this dtype's GEMMs on ``device`` (fp16 without fast kernels)?"""
    return dtype_name_ == "fp16" and not is_fast(torch.float16, device)


def matmul_peaks(keys, shape, device="cpu", budget_s: float = PEAK_BUDGET_S) -> dict:
    """The GEMM peak at ``shape`` of each key ("fp32", "bf16", "fp16", "fp16 native"), in the
    kernels the rows run: fp16 emulated where mixprec emulates it (fp32 kernels on fp16-rounded
    values) unless the key says "native".

    ``shape`` ``(m, k, n)`` is a Linear layer's (rows, in features, out features); its training
    step runs the three GEMMs of :data:`TRAINING_GEMMS`, each timed by ``doctor``'s bounded
    probe (:func:`mixprec.commands.doctor.probe_matmul`, ``budget_s`` each) in its layout. The
    peak is their combined rate, ``3 / sum(1 / rate)`` (equal FLOPs each): the GFLOP/s of a
    training step that did nothing but these GEMMs, which is what a row's GFLOP/s counts.

    Returns:
        ``{key: {"gflops", "shape", "full_size" (every GEMM probed at its full shape),
        "gemms" ({name: probe dict}), "spent_s", "emulated"}}``.
    """
    device_type = torch.device(device).type
    out = {}
    for key in keys:
        name, _, native = key.partition(" ")
        dt = resolve_dtype(name, device, warn=False)
        emulated = is_emulated(name, device) and native != "native"
        with emulation_context(device_type, dt, emulated):
            gemms = {gemm: probe_matmul(dt, [shape[i] for i in order], device,
                                        budget_s=budget_s, layout=layout)
                     for gemm, layout, order in TRAINING_GEMMS}
        out[key] = combined(shape, gemms, emulated)
    return out


def combined(shape, gemms: dict, emulated: bool) -> dict:
    """One peak from the probes of the training GEMMs (see :func:`matmul_peaks`)."""
    return {"gflops": len(gemms) / sum(1 / g["gflops"] for g in gemms.values()),
            "shape": list(shape), "full_size": all(g["full_size"] for g in gemms.values()),
            "gemms": gemms, "spent_s": sum(g["spent_s"] for g in gemms.values()),
            "emulated": emulated}


def faster(first: dict, again: dict) -> dict:
    """Two probes of one peak merged: each GEMM's faster figure (load only slows a GEMM)."""
    gemms = {name: max(probe, again["gemms"][name], key=lambda g: g["gflops"])
             for name, probe in first["gemms"].items()}
    return combined(first["shape"], gemms, first["emulated"])
