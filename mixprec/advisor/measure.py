"""What one layer does in one format: its output and weight gradient when only it runs in that
format, the range of the tensors it would hold, and the loss change.

Each layer runs alone on the inputs the reference pass recorded for it: once in fp32 (the
reference), once per format. The backward takes the output gradient the reference pass recorded
(times the loss scale the policy would use, then divided out again). So what is measured is the
layer's own error, exactly as in a model where only that layer runs in the format: its inputs
are the same, and so is the gradient that reaches it.

* 16-bit formats: parameters, floating buffers and inputs are cast to the format and the layer
  runs with autocast off (fp16 GEMMs on a CPU through mixprec's fp16 emulation, the numbers of a
  GPU's fp16 GEMM).
* low-bit formats (``fp8_e4m3``, ``mxfp8``, ``nvfp4``: each :mod:`mixprec.lowbit` format's
  :attr:`~mixprec.lowbit.LowBitFormat.advisor_format`): Linear and Conv1D layers only, through
  the format's simulation (its three GEMMs on operands cast as the format casts them, exactly:
  per tensor, per row, or per block along the reduction dimension, in fp32).

The loss change is estimated to first order, ``sum(dL/dy * (y_fmt - y))``, from numbers the
passes already have; ``ablation=True`` measures it with one more forward pass per layer and
format (the layer's output replaced by its output in the format).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from torch import nn
from torch.func import functional_call

from .. import lowbit
from ..autocast import PrecisionContext, cast_floating
from ..fp8.choice import gemm_dims
from ..lowbit.base import is_conv1d
from ..scaling import DynamicLossScaler
from .capture import LayerCall, isolated, loss_of

__all__ = ["FORMATS", "Measurement", "reference", "measure", "gradient_peak", "loss_scale_for",
           "describe_scale", "ablation_loss", "supports", "format_names", "lowbit_formats"]

#: the 16-bit formats the advisor measures, and the dtype each runs in
SIXTEEN = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _lowbit_classes() -> dict[str, type]:
    return {cls.advisor_format: cls for cls in lowbit.formats().values()}


#: the formats the advisor measures: the dtype of each 16-bit one, the :mod:`mixprec.lowbit`
#: class of each low-bit one (its GEMMs simulated)
FORMATS = {**SIXTEEN, **_lowbit_classes()}


def format_names() -> tuple[str, ...]:
    """The formats :func:`mixprec.advise` measures (registered low-bit formats included)."""
    return (*SIXTEEN, *_lowbit_classes())


def lowbit_formats(formats, fp8_recipe: str) -> dict[str, lowbit.LowBitFormat]:
    """``{name: format}`` for the low-bit formats among ``formats``."""
    classes = _lowbit_classes()
    return {f: classes[f].for_advisor(fp8_recipe) for f in formats if f in classes}
#: DynamicLossScaler's default max_scale: where dynamic scaling stops growing
_MAX_SCALE = inspect.signature(DynamicLossScaler).parameters["max_scale"].default
_START = inspect.signature(DynamicLossScaler).parameters["init_scale"].default
_GROWTH = inspect.signature(DynamicLossScaler).parameters["growth_interval"].default
_MIN_SCALE = 2.0 ** -24


@dataclasses.dataclass
class Measurement:
    """One layer in one format.

    Attributes:
        out_error: ``||y_fmt - y|| / ||y||`` of the layer's output.
        grad_error: the same for its parameters' gradients (all of them, concatenated); None
            without trained parameters or without a gradient reaching the layer.
        loss_change: first-order estimate of ``|L_fmt - L| / |L|`` with only this layer in the
            format.
        measured_loss_change: the same, measured (``ablation=True``), else None.
        overflow: per tensor ("input", "output", "weight", "grad_output", "weight_grad"), the
            fraction of values beyond the format's largest value (gradients at the loss scale;
            FP8: after its dynamic scale), inf/NaN included.
        underflow: per tensor, the fraction of nonzero values flushed to zero.
        amax: per tensor, the largest magnitude (gradients at the loss scale).
    """

    out_error: float
    grad_error: float | None
    loss_change: float
    measured_loss_change: float | None = None
    overflow: dict = dataclasses.field(default_factory=dict)
    underflow: dict = dataclasses.field(default_factory=dict)
    amax: dict = dataclasses.field(default_factory=dict)


def supports(fmt: str, module: nn.Module) -> bool:
    """Can ``module`` run in ``fmt``? (Low-bit formats: Linear and Conv1D layers only.)"""
    return fmt in SIXTEEN or gemm_dims(module) is not None


def _trained(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if p.requires_grad]


def _w_t(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A Linear's or Conv1D's weight as ``(in_features, out_features)``."""
    return weight if is_conv1d(module) else weight.t()


def _run(call: LayerCall, fmt: str | None, low: lowbit.LowBitFormat | None, scale: float):
    """The layer's output (fp32) and its parameters' gradients (fp32, unscaled); ``low``: the
    low-bit format ``fmt`` names, if it is one."""
    mod = call.module
    leaves = {n: p.detach().requires_grad_(p.requires_grad) for n, p in mod.named_parameters()}
    device = call.output.device.type
    if low is not None:
        out = low.simulate(call.args[0], _w_t(mod, leaves["weight"]))
        if leaves.get("bias") is not None:
            out = out + leaves["bias"]
        out_dtype = torch.float32
    else:
        dt = SIXTEEN.get(fmt, torch.float32)
        params = {n: t.to(dt) for n, t in leaves.items()}
        buffers = {n: b.to(dt, copy=True) if b.is_floating_point() else b.clone()
                   for n, b in mod.named_buffers()}
        args, kwargs = cast_floating((call.args, call.kwargs), dt)
        context = PrecisionContext.fixed(dt, device)
        out = context.run(functional_call, (mod, (params, buffers), args, kwargs), {})
        out_dtype = dt
    trained = [n for n in _trained(mod) if leaves[n].requires_grad]
    grads = {}
    if call.grad is not None and trained and out.requires_grad:
        g = (call.grad.float() * scale).to(out_dtype)
        got = torch.autograd.grad(out, [leaves[n] for n in trained], g, allow_unused=True)
        grads = {n: (torch.zeros_like(leaves[n]) if t is None else t.float() / scale)
                 for n, t in zip(trained, got)}
    return out.detach().float(), grads


@torch.no_grad()
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    ref, diff = torch.stack([b.norm(), (a - b).norm()]).tolist()
    return diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf"))


@torch.no_grad()
def _range_16(t: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """(overflow fraction, underflow fraction, amax) of ``t * scale`` in ``dtype``."""
    fi = torch.finfo(dtype)
    a = t.detach().abs().float()
    over = a.numel() - torch.count_nonzero(a <= fi.max / scale)  # beyond the range, inf, NaN
    nonzero = torch.count_nonzero(a)
    under = torch.count_nonzero(a <= fi.tiny * fi.eps / 2 / scale) - (a.numel() - nonzero)
    over, under, nonzero, amax = torch.stack([over, under, nonzero, a.max()]).tolist()
    return over / a.numel(), under / max(nonzero, 1), amax * scale


def _ranges(call: LayerCall, fmt: str, low, scale: float, grads) -> tuple:
    """(overflow, underflow, amax) dicts of the tensors the layer holds in ``fmt``."""
    over, under, amax = {}, {}, {}
    x = next((a for a in call.args if isinstance(a, torch.Tensor) and a.is_floating_point()),
             None)
    if low is not None:
        ranges = low.ranges(x, _w_t(call.module, call.module.weight.detach()), call.grad)
        for role, (a, sat, flush) in ranges.items():
            over[role], under[role], amax[role] = float(sat), float(flush), float(a)
        return over, under, amax
    dt = SIXTEEN[fmt]
    tensors = {"input": (x, 1.0), "output": (call.output, 1.0), "grad_output": (call.grad, scale)}
    if grads:
        tensors["weight_grad"] = (torch.cat([g.flatten() for g in grads.values()]), scale)
    for role, (t, s) in tensors.items():
        if t is not None and t.numel():
            over[role], under[role], amax[role] = _range_16(t, dt, s)
    return over, under, amax


def reference(call: LayerCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The layer's fp32 output and its parameters' gradients, computed alone."""
    return _run(call, None, None, 1.0)


def measure(call: LayerCall, ref: tuple, formats, lowbits: dict, scales: dict, loss: float,
            ) -> tuple[dict[str, Measurement], dict[str, torch.Tensor]]:
    """Measure one layer in each format it supports, against ``ref`` (:func:`reference`);
    ``lowbits``: the low-bit formats among ``formats`` (:func:`lowbit_formats`).

    Returns:
        ``{format: Measurement}`` and ``{format: the layer's output in it}`` (for an ablation).
    """
    ref_out, ref_grads = ref
    ref_flat = torch.cat([g.flatten() for g in ref_grads.values()]) if ref_grads else None
    results, outputs = {}, {}
    for fmt in formats:
        if not supports(fmt, call.module):
            continue
        scale = scales.get(fmt, 1.0)
        out, grads = _run(call, fmt, lowbits.get(fmt), scale)
        grad_error = None
        if ref_flat is not None and grads:
            grad_error = _rel(torch.cat([g.flatten() for g in grads.values()]), ref_flat)
        change = 0.0
        if call.grad is not None:
            change = abs(float((call.grad.float() * (out - ref_out)).sum()))
        over, under, amax = _ranges(call, fmt, lowbits.get(fmt), scale, ref_grads)
        results[fmt] = Measurement(_rel(out, ref_out), grad_error,
                                   change / abs(loss) if loss else change, None, over, under,
                                   amax)
        outputs[fmt] = out
    return results, outputs


def gradient_peak(calls, refs) -> float:
    """The largest output or parameter gradient magnitude of the layers (fp32)."""
    peaks = [call.grad.detach().abs().max() for call in calls
             if call.grad is not None and call.grad.numel()]
    peaks += [g.abs().max() for _, (_, grads) in refs for g in grads.values() if g.numel()]
    return float(torch.stack([p.float().cpu() for p in peaks]).max()) if peaks else 0.0


def loss_scale_for(fmt: str, peak: float, loss_scale) -> float:
    """The loss scale a policy in ``fmt`` would train with: 1 for bf16 and low-bit formats; for fp16
    ``"auto"``/``"dynamic"`` gives the scale a dynamic scaler reaches on this batch: it halves
    on overflow and grows while nothing overflows, so it settles at the largest power of two
    that keeps the largest gradient, ``peak``, finite in fp16, capped at the scaler's
    ``max_scale`` (2^24); a number gives itself, None gives 1.
    """
    if fmt != "fp16" or loss_scale is None:
        return 1.0
    if loss_scale not in ("auto", "dynamic"):
        return float(loss_scale)
    if not peak > 0:
        return _MAX_SCALE
    fmax = torch.finfo(torch.float16).max
    scale = min(_MAX_SCALE, 2.0 ** math.floor(math.log2(fmax / peak)) if math.isfinite(peak)
                else _MIN_SCALE)
    while peak * scale > fmax and scale > _MIN_SCALE:  # log2's rounding at a power of two
        scale /= 2
    return max(scale, _MIN_SCALE)


def describe_scale(loss_scale, scale: float) -> str:
    """How the fp16 gradient verdicts' loss scale was chosen, for the table."""
    if loss_scale in ("auto", "dynamic"):
        text = (f"fp16 gradient ranges judged at loss scale {_pow2(scale)} (dynamic scaling's "
                f"on this batch: the largest power of two keeping every gradient finite, at "
                f"most max_scale {_pow2(_MAX_SCALE)})")
        if scale > _START:  # (the scaler grows there one doubling per clean interval)
            steps = round(math.log2(scale / _START)) * _GROWTH
            text += (f"; a dynamic scaler starts at {_pow2(_START)} and doubles every "
                     f"{_GROWTH} clean steps, so it reaches that after about {steps} steps, "
                     f"and more gradients flush to zero until then (loss_scale="
                     f"2.**{round(math.log2(_START))} judges the start)")
        return text
    return f"fp16 gradient ranges judged at the fixed loss scale {_pow2(scale)}"


def _pow2(x: float) -> str:
    k = math.log2(x) if x > 0 else 0.5
    return f"2^{int(k)}" if k == int(k) else f"{x:g}"


@torch.no_grad()
def ablation_loss(model: nn.Module, batch, loss_fn, module: nn.Module, output: torch.Tensor,
                  seed: int) -> float:
    """The model's loss with ``module``'s first output replaced by ``output`` (one forward)."""
    seen = []

    def hook(mod, args, result):
        seen.append(True)
        return output.to(result.dtype) if len(seen) == 1 else None

    handle = module.register_forward_hook(hook)
    try:
        with isolated(model, seed):
            return float(loss_of(model, batch, loss_fn))
    finally:
        handle.remove()
