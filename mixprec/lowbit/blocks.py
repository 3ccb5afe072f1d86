"""Block-scaled low-bit casts computed in fp32: what the advisor and the statistics measure.

A block-scaled cast splits a tensor, along the GEMM's reduction dimension, into blocks of
``block`` consecutive values; each block gets its own scale, so one large value only coarsens
its own block. Two such formats:

* MXFP8 (the OCP Microscaling spec): blocks of 32, the scale a power of two (E8M0), chosen as
  torchao's "RCEIL" mode does: ``2^ceil(log2(amax / 448))``, the smallest power of two that
  keeps the block's largest value within e4m3's 448; elements are e4m3, rounded to nearest;
* NVFP4: blocks of 16, elements e2m1 (the values 0, 0.5, 1, 1.5, 2, 3, 4, 6), each block's
  scale an e4m3 number times one fp32 scale per tensor, ``amax(tensor) / (6 * 448)``.

:func:`fake_quant` returns the dequantized values (fp32), so a GEMM of two fake-quantized
operands is the low-bit GEMM's result up to the order of fp32 accumulation; :func:`fractions`
measures what the cast does to a tensor (the largest block-scale ratio, values saturated, values
flushed to zero).
"""

from __future__ import annotations

import torch

__all__ = ["MX", "NVFP4", "BlockCast", "round_e2m1", "fake_quant", "fractions", "block_scales",
           "matmul", "operand_ranges"]

_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = torch.finfo(_E4M3).max
_E2M1_MAX = 6.0
_E8M0_BIAS = 127


class BlockCast:
    """How a block-scaled format casts: its block and element format.

    Args:
        block: values per scale.
        element: "e4m3" (MXFP8) or "e2m1" (NVFP4).
        tensor_scale: a second, per-tensor fp32 scale with e4m3 block scales (NVFP4); else
            power-of-two (E8M0) block scales.
    """

    def __init__(self, block: int, element: str, tensor_scale: bool):
        self.block, self.element, self.tensor_scale = block, element, tensor_scale
        self.emax = _E4M3_MAX if element == "e4m3" else _E2M1_MAX
        # a value saturates when it lands beyond the element range by more than the rounding
        # of its block's scale: an e4m3 scale rounds by up to 2^-4 relative, which can put a
        # block's largest value just past the range (clamped: a rounding error, not overflow);
        # a power-of-two scale rounded up (RCEIL) never does
        self.slack = 1 + (2.0 ** -3 if tensor_scale else 2.0 ** -20)
        # the smallest nonzero element: e4m3's smallest subnormal 2^-9; e2m1's 0.5
        self.tiny = 2.0 ** -9 if element == "e4m3" else 0.5

    def round(self, v: torch.Tensor) -> torch.Tensor:
        """Elements (already scaled into range) rounded to the element format, saturated."""
        v = v.clamp(-self.emax, self.emax)
        if self.element == "e4m3":
            return v.to(_E4M3).float()
        return round_e2m1(v)


MX = BlockCast(32, "e4m3", tensor_scale=False)
NVFP4 = BlockCast(16, "e2m1", tensor_scale=True)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """``v`` (within +-6) rounded to the nearest e2m1 value, ties to an even mantissa: one
    mantissa bit, so the spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]."""
    a = v.abs()
    exponent = torch.floor(torch.log2(a.clamp(min=1.0)))  # 0 below 2 (subnormals share it)
    ulp = torch.exp2(exponent - 1)
    return torch.sign(v) * (torch.round(a / ulp) * ulp).clamp(max=_E2M1_MAX)


def _blocks(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """``x`` (fp32) with ``axis`` moved last, padded with zeros to a multiple of ``block``
    (zeros change no block's scale) and split into ``(..., blocks, block)``."""
    moved = x.float().movedim(axis, -1)
    pad = -moved.shape[-1] % block
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // block, block)


def block_scales(x: torch.Tensor, cast: BlockCast, axis: int) -> tuple[torch.Tensor, ...]:
    """``(blocks, scales)``: ``x`` split into blocks along ``axis`` (fp32) and each block's
    dequantization scale (``value = element * scale``), broadcastable against ``blocks``."""
    blocks = _blocks(x, axis, cast.block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if not cast.tensor_scale:
        exponent = torch.ceil(torch.log2(amax / cast.emax)).clamp(-_E8M0_BIAS, _E8M0_BIAS)
        return blocks, torch.exp2(exponent)
    # (an inf or NaN in the tensor makes the tensor scale, hence every block's, NaN or inf:
    # every value NaN, as the real cast gives; a block scale that rounds to 0 zeroes its block)
    outer = (blocks.abs().amax() / (cast.emax * _E4M3_MAX)).clamp(min=torch.finfo().tiny)
    inner = (amax / cast.emax / outer).clamp(max=_E4M3_MAX).to(_E4M3).float()
    return blocks, inner * outer


def _elements(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each block's values over its scale (a block whose scale is 0 holds only zeros: what it
    dequantizes to), before rounding."""
    return blocks / torch.where(scales == 0, torch.ones_like(scales), scales)


def fake_quant(x: torch.Tensor, cast: BlockCast, axis: int) -> torch.Tensor:
    """``x`` cast to the block format along ``axis`` and back, in fp32 (same shape)."""
    blocks, scales = block_scales(x, cast, axis)
    q = (cast.round(_elements(blocks, scales)) * scales).flatten(-2)
    return q[..., :x.shape[axis]].movedim(-1, axis)


@torch.no_grad()
def fractions(x: torch.Tensor, cast: BlockCast, axis: int) -> tuple[torch.Tensor, ...]:
    """What the cast does to ``x``, as 0-d tensors (no host sync): the amax of the tensor, the
    fraction of values saturated (beyond the element range after scaling by more than the
    block scale's rounding, or inf/NaN, or all of them where the tensor's scale is not finite),
    the fraction of nonzero values flushed to zero (a block whose scale rounds to 0 flushes
    all of them), the largest block scale (the dequantization factor of the block holding the
    largest value) and its ratio to the smallest (of the blocks holding a nonzero value)."""
    blocks, scales = block_scales(x, cast, axis)
    a = blocks.abs()
    scaled = _elements(a, scales)
    saturated = ((scaled > cast.emax * cast.slack) & (scales > 0) | ~torch.isfinite(a)
                 | ~torch.isfinite(scales)).float().mean()
    nonzero = a > 0
    flushed = ((cast.round(scaled) == 0) | (scales == 0)) & nonzero
    live = nonzero.any(dim=-1, keepdim=True) & (scales > 0)  # (a flushed block: no scale)
    big = torch.where(live, scales, torch.zeros_like(scales)).amax()
    small = torch.where(live, scales, torch.full_like(scales, float("inf"))).amin()
    ratio = torch.where(torch.isfinite(small), big / small, torch.ones_like(big))
    return a.amax(), saturated, flushed.sum() / nonzero.sum().clamp(min=1), big, ratio


AXES = {"input": -1, "weight": 0, "grad_output": -1}  # each operand's reduction dimension


class _BlockMatmul(torch.autograd.Function):
    """``x @ w_t`` with the three GEMMs of a Linear layer on block-cast operands, each cast
    along its GEMM's reduction dimension, in fp32."""

    @staticmethod
    def forward(ctx, x2, w_t, cast: BlockCast, weight_grad_lowbit: bool):
        ctx.save_for_backward(x2, w_t)
        ctx.cast, ctx.weight_grad_lowbit = cast, weight_grad_lowbit
        return fake_quant(x2, cast, -1) @ fake_quant(w_t, cast, 0)

    @staticmethod
    def backward(ctx, grad):
        x2, w_t = ctx.saved_tensors
        cast = ctx.cast
        grad_x = fake_quant(grad, cast, -1) @ fake_quant(w_t, cast, 1).t()
        if ctx.weight_grad_lowbit:
            grad_w = fake_quant(x2, cast, 0).t() @ fake_quant(grad, cast, 0)
        else:
            grad_w = x2.t() @ grad
        return grad_x, grad_w, None, None


def matmul(x: torch.Tensor, w_t: torch.Tensor, cast: BlockCast,
           weight_grad_lowbit: bool = True) -> torch.Tensor:
    """``x @ w_t`` (``x``: ``(..., K)``, ``w_t``: ``(K, N)``) as block-scaled GEMMs compute it,
    fp32, with autograd; ``weight_grad_lowbit=False``: the weight gradient's GEMM exact."""
    out = _BlockMatmul.apply(x.reshape(-1, x.shape[-1]).float(), w_t.float(), cast,
                             weight_grad_lowbit)
    return out.reshape(*x.shape[:-1], w_t.shape[-1])


def operand_ranges(cast: BlockCast, x, w_t, grad) -> dict[str, tuple]:
    """``{role: (amax, saturated, flushed)}`` of a Linear layer's GEMM operands (input
    ``(..., K)``, ``w_t`` ``(K, N)``, output gradient ``(..., N)``) in the block format."""
    tensors = {"input": x, "weight": w_t, "grad_output": grad}
    return {role: fractions(t if role == "weight" else t.reshape(-1, t.shape[-1]), cast,
                            AXES[role])[:3]
            for role, t in tensors.items() if t is not None}
