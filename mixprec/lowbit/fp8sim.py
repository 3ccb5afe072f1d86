"""The numbers of an FP8 GEMM, computed in fp32: what the advisor measures FP8 layers with.

An FP8 linear layer (torchao's recipes, see :mod:`mixprec.lowbit.float8`) casts each GEMM
operand to FP8 with a dynamic scale, ``q = saturate(x * s)`` with ``s = fmax / amax``,
multiplies the FP8 values exactly and accumulates in fp32, and divides by the scales.
:func:`fake_quant` returns ``q / s`` in fp32, so ``fake_quant(a) @ fake_quant(b)`` is that
GEMM's result up to the order of fp32 accumulation (with rowwise scales then rounded to bf16,
what that kernel returns whatever the layer's dtype). :func:`float8_matmul` does this for the
forward GEMM and both backward GEMMs (the output gradient in e5m2 for the tensorwise recipe, in
e4m3 with rowwise scales for the rowwise ones), with autograd. It needs no torchao and runs on
any device. Block-scaled formats (MXFP8, NVFP4) are simulated by :mod:`.blocks`;
:func:`fp8_matmul` runs any format's simulation.
"""

from __future__ import annotations

import torch

from .base import resolve

__all__ = ["fake_quant", "float8_matmul", "fp8_matmul"]

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_EPS = 1e-12


def fake_quant(x: torch.Tensor, dtype: torch.dtype, axis: int | None = None) -> torch.Tensor:
    """``x`` rounded through an FP8 ``dtype`` cast with a dynamic scale, back in fp32.

    Args:
        x: any floating tensor.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        axis: rowwise scaling: one scale per slice along ``axis``, rounded down to a power of
            two (torchao's rowwise recipes); None: one scale for the tensor.
    """
    fmax = torch.finfo(dtype).max
    a = x.float()
    amax = a.abs().amax() if axis is None else a.abs().amax(dim=axis, keepdim=True)
    scale = (fmax / amax.double().clamp(min=_EPS)).float()
    if axis is not None:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (a * scale).clamp(-fmax, fmax).to(dtype).float() / scale


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w_t, rowwise: bool, weight_grad_fp8: bool):
        ctx.save_for_backward(x2, w_t)
        ctx.rowwise, ctx.weight_grad_fp8 = rowwise, weight_grad_fp8
        return _result(fake_quant(x2, _E4M3, -1 if rowwise else None)
                       @ fake_quant(w_t, _E4M3, 0 if rowwise else None), rowwise)

    @staticmethod
    def backward(ctx, grad):
        x2, w_t = ctx.saved_tensors
        rowwise = ctx.rowwise
        g_dtype = _E4M3 if rowwise else _E5M2
        grad_x = _result(fake_quant(grad, g_dtype, -1 if rowwise else None)
                         @ fake_quant(w_t, _E4M3, -1 if rowwise else None).t(), rowwise)
        if not ctx.weight_grad_fp8:
            return grad_x, x2.t() @ grad, None, None
        grad_w = _result(fake_quant(x2, _E4M3, 0 if rowwise else None).t()
                         @ fake_quant(grad, g_dtype, 0 if rowwise else None), rowwise)
        return grad_x, grad_w, None, None


def _result(product: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """A GEMM's fp32 result as the FP8 kernel returns it: with rowwise scales in bf16
    (``torch._scaled_mm``'s rowwise kernel writes only bf16; torchao casts it to an fp32 or fp16
    layer's dtype after, and its power-of-two scales round nothing more)."""
    return product.to(torch.bfloat16).float() if rowwise else product


def float8_matmul(x: torch.Tensor, w_t: torch.Tensor, rowwise: bool = False,
                  weight_grad_fp8: bool = True) -> torch.Tensor:
    """``x @ w_t`` as torchao's FP8 GEMMs compute it (fp32 result, autograd included).

    Args:
        x: ``(..., K)``.
        w_t: ``(K, N)`` (a Linear's ``weight.t()``).
        rowwise: per-row scales (rounded down to powers of two), else one per tensor.
        weight_grad_fp8: False: the weight gradient's GEMM in high precision.
    """
    out = _FP8Matmul.apply(x.reshape(-1, x.shape[-1]).float(), w_t.float(), rowwise,
                           weight_grad_fp8)
    return out.reshape(*x.shape[:-1], w_t.shape[-1])


def fp8_matmul(x: torch.Tensor, w_t: torch.Tensor, recipe="tensorwise") -> torch.Tensor:
    """``x @ w_t`` as the GEMMs of a low-bit format compute it (fp32, autograd included).

    Args:
        x: ``(..., K)``.
        w_t: ``(K, N)`` (a Linear's ``weight.t()``).
        recipe: a :mod:`mixprec.lowbit` format or its shorthand ("tensorwise", "rowwise",
            "rowwise_gw_hp", "mxfp8", "nvfp4").

    Raises:
        ValueError: an unknown shorthand.
    """
    return resolve(recipe).simulate(x, w_t)
