"""``mp.advise``: measure which layers of a model can take which format, on one batch."""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .. import lowbit, vocabulary
from ..casting import module_device
from ..fp8.choice import eligible_layers, gemm_dims
from ..lowbit import Float8
from ..lowbit.float8 import RECIPES
from ..policy import Policy
from ..prepare import policy_of
from ..training.batches import to_device
from .advice import Advice, LayerAdvice, Thresholds, judge
from .capture import as_batch, find_layers, reference_pass
from .measure import (
    ablation_loss,
    format_names,
    gradient_peak,
    loss_scale_for,
    lowbit_formats,
    measure,
    reference,
)

__all__ = ["advise"]


def _check(model, formats, fp8_recipe, thresholds) -> tuple[str, ...]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"advise expects an nn.Module; got {type(model).__name__}")
    if policy_of(model) is not None:
        raise ValueError(f"this model was prepared ({policy_of(model)}); advise measures the "
                         f"fp32 model: call it before mp.prepare")
    formats = (formats,) if isinstance(formats, str) else tuple(formats)
    known = format_names()
    unknown = [f for f in formats if f not in known]
    if unknown or not formats:
        raise ValueError(f"formats must be a non-empty list of {list(known)}; got "
                         f"{list(formats)}")
    try:
        named = lowbit.resolve(fp8_recipe)
    except (TypeError, ValueError):
        named = None  # (the recipe's own check below says what is valid)
    if named is not None and not isinstance(named, Float8):  # fp8= elsewhere; here a format
        raise ValueError(f"advise's fp8= is the FP8 recipe its 'fp8_e4m3' format is measured "
                         f"with ({', '.join(map(repr, RECIPES))}); {fp8_recipe!r} is a format "
                         f"of its own: measure it with formats=(..., {str(named)!r}), then "
                         f"Advice.policy(fp8={str(named)!r})")
    lowbit_formats(("fp8_e4m3",), fp8_recipe)  # the recipe's own check
    if thresholds is not None and not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds must be a mixprec.advisor.Thresholds; got "
                        f"{type(thresholds).__name__}")
    return tuple(dict.fromkeys(formats))


def _gemm(call) -> tuple[int, int, int] | None:
    """``(tokens, in_features, out_features)`` of a Linear/Conv1D layer's call, else None."""
    dims = gemm_dims(call.module)
    if dims is None or call.output is None or call.output.shape[-1] != dims[1]:
        return None
    return call.output.numel() // dims[1], dims[0], dims[1]


def _check_model(model: nn.Module) -> None:
    params = list(model.parameters())
    if not params:
        raise ValueError(f"this {type(model).__name__} has no parameters: advise measures the "
                         f"layers that hold them (Linear, conv, norm, embedding layers ...)")
    if not any(p.requires_grad for p in params):
        raise ValueError(f"no parameter of this {type(model).__name__} requires grad: advise "
                         f"measures gradients; unfreeze the layers to measure "
                         f"(p.requires_grad_(True))")


def _tensors(split) -> list[tuple[str, torch.Tensor]]:
    """``(where, tensor)`` for every tensor of the split batch."""
    parts = [(f"input {i}", a) for i, a in enumerate(split.args)]
    parts += [(f"input {k!r}", v) for k, v in split.kwargs.items()]
    parts.append(("target", split.target))
    found = []
    for where, part in parts:
        leaves = tree_flatten(part)[0]
        found += [(where, t) for t in leaves if isinstance(t, torch.Tensor)]
    return found


def _check_batch(split) -> None:
    """Refuse an empty batch and non-finite values (one host sync)."""
    tensors = _tensors(split)
    empty = [f"{where} of shape {tuple(t.shape)}" for where, t in tensors if t.numel() == 0]
    if empty:
        raise ValueError(f"the batch holds an empty tensor ({', '.join(empty)}): advise "
                         f"measures on at least one example")
    floating = [(where, t) for where, t in tensors if t.is_floating_point()]
    if not floating:
        return
    finite = torch.stack([torch.isfinite(t).all().cpu() for _, t in floating]).tolist()
    bad = [where for (where, _), ok in zip(floating, finite) if not ok]
    if bad:
        raise ValueError(f"the batch holds inf or NaN values ({', '.join(bad)}): every layer "
                         f"would read as overflowing; advise measures on finite data")


@vocabulary.takes("loss_scale", "fp8", notes={"fp8": (
    'Here the FP8 scaling the "fp8_e4m3" row measures: "tensorwise", "rowwise" or '
    f'"rowwise_gw_hp"; None: {Float8.recipe!r}.'), "loss_scale": (
    'Here it is the scale fp16 gradients are judged at: "auto" or "dynamic" is where dynamic '
    "scaling settles on this batch (the largest power of two that keeps every measured gradient "
    "finite in fp16, at most the scaler's max_scale 2^24); a number is itself; None is 1. A "
    "scaler object has no use here: no loop runs.")})
def advise(model: nn.Module, batch: Any, loss_fn: Callable | None = None, *,
           formats=("bf16", "fp16", "fp8_e4m3"), loss_scale="auto",
           fp8: str | None = None, layers=None, ablation: bool = False,
           thresholds: Thresholds | None = None, seed: int = 0,
           fp8_recipe: Any = vocabulary.UNSET) -> Advice:
    """Measure, layer by layer, what each format does to the model on ``batch``.

    One fp32 forward and backward records every layer's inputs, output and output gradient.
    Then each layer runs alone, on those inputs, once in fp32 and once per format (with the
    recorded output gradient for its backward): the relative error of its output and of its
    weight gradient when only it runs in the format, the ranges its inputs, outputs and
    gradients reach in the format (gradients at the loss scale the policy would use), and the
    loss change, estimated to first order (``ablation=True``: measured, one forward per layer
    and format). See :mod:`mixprec.advisor.measure`.

    The model is left as it was: no parameter changes, gradients and buffers (BatchNorm
    statistics) are restored, and every pass draws the same dropout masks.

    Of the precision keywords, ``advise`` takes ``loss_scale`` and ``fp8``, the ones that change
    what it measures. It measures every layer in every format of ``formats`` whatever the
    precision would be, so the others (``level``, ``dtype``, ``policy``, ``keep_fp32``, the op
    lists, ``master``, ``state_dtype``, ``fp8_modules``) choose among its results instead:
    :meth:`Advice.policy` takes ``level``, ``dtype`` and ``fp8``. Those of a training run
    (``reduce_dtype``, ``emulate_fp16``, ``monitor``, ``max_consecutive_skips``, ``compile``)
    are absent: no loop runs.

    Args:
        model: the fp32 model (before :func:`mixprec.prepare`), in the mode to measure
            (``train()``: dropout and batch statistics as in training).
        batch: one batch, as the Trainer takes it: ``(inputs..., target)`` or a dict of model
            keyword arguments (moved to the model's device).
        loss_fn: ``(output, target) -> scalar``; None takes the output's ``.loss``.
        formats: any of "bf16", "fp16", and the low-bit formats, for Linear and Conv1D
            layers: "fp8_e4m3" (FP8 with ``fp8``'s scales), "mxfp8" (e4m3 in blocks of
            32 with power-of-two scales), "nvfp4" (e2m1 in blocks of 16).
        {precision keywords}
        layers: qualified names of the layers to measure (default: all).
        ablation: also measure each layer's loss change with a forward pass.
        thresholds: when a measurement makes a layer unsafe (:class:`Thresholds`).
        seed: the random state every pass starts from.
        fp8_recipe: deprecated alias of ``fp8`` (a ``DeprecationWarning``; both: TypeError).

    Returns:
        An :class:`~mixprec.advisor.Advice`: ``unsafe(fmt)``, ``reasons(fmt)``,
        ``policy(level, dtype, fp8)``, ``table()``, ``plot(path)``, ``to_dict()``.

    Raises:
        TypeError: not a module; bad thresholds.
        ValueError: a prepared model, a model without (trainable) parameters, an unknown format
            or recipe, unknown layer names, an empty batch or one holding inf/NaN.

    Example:
        >>> import torch, mixprec as mp
        >>> net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        >>> batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
        >>> advice = mp.advise(net, batch, torch.nn.functional.cross_entropy)
        >>> advice.unsafe("bf16")
        []
    """
    fp8 = vocabulary.alias(fp8, fp8_recipe=fp8_recipe)
    fp8_recipe = Float8.recipe if fp8 is None else fp8
    formats = _check(model, formats, fp8_recipe, thresholds)
    _check_model(model)
    thresholds = thresholds or Thresholds()
    device = module_device(model)
    split = as_batch(to_device(batch, device), loss_fn)
    _check_batch(split)
    chosen = find_layers(model, layers)
    started = time.perf_counter()
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        loss, calls = reference_pass(model, split, loss_fn, chosen, seed)
        if not math.isfinite(float(loss)):  # nothing a 16-bit format does can be judged
            raise ValueError(
                f"the model's fp32 loss on this batch is {float(loss)}: the model overflows in "
                f"fp32 already, so no format can be blamed or advised. Find where with "
                f"mp.debug.trace_nonfinite(model) and fix it (or pass another batch)")
        t_ref = time.perf_counter()
        done = [c for c in calls.values() if c.output is not None]
        refs = [(c, reference(c)) for c in done]
        peak = gradient_peak(done, refs)
        scales = {f: loss_scale_for(f, peak, loss_scale) for f in formats}
        lowbits = lowbit_formats(formats, fp8_recipe)
        eligible = {f: set(eligible_layers(model, Policy(fp8=low)))
                    for f, low in lowbit_formats(("fp8_e4m3", *formats), fp8_recipe).items()}
        results, layer_runs, forwards = [], len(refs), 0
        for call, ref in refs:
            measured, outputs = measure(call, ref, formats, lowbits, scales, loss)
            layer_runs += len(measured)
            if ablation:
                for fmt, out in outputs.items():
                    changed = ablation_loss(model, split, loss_fn, call.module, out, seed)
                    measured[fmt].measured_loss_change = abs(changed - loss) / abs(loss)
                    forwards += 1
            reasons = {f: judge(f, m, thresholds, scales[f]) for f, m in measured.items()}
            results.append(LayerAdvice(call.name, type(call.module).__name__,
                                       call.name in eligible["fp8_e4m3"], measured, reasons,
                                       {f: call.name in names for f, names in eligible.items()},
                                       _gemm(call)))
    finished = time.perf_counter()
    skipped = {c.name: ("not called by the forward pass" if c.calls == 0 else
                        "its output is not a tensor") for c in calls.values()
               if c.output is None}
    cost = {"full_passes": 1, "layer_passes": layer_runs, "ablation_forwards": forwards,
            "seconds": finished - started, "reference_seconds": t_ref - started}
    return Advice(results, formats, loss, scales, fp8_recipe, thresholds, cost, skipped,
                  loss_scale)
