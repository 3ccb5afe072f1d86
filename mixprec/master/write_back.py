"""The bf16 write-back of fp32 masters: the 16-bit forward weights rewritten after each update.

The rounding is the split's (to nearest, exact ties away from zero: see
:mod:`mixprec.masters.split_bits`), so fp32 and split masters give the same forward weights.
Eagerly (:func:`mixprec.masters.split_bits.round_into_`) that is a few element-wise passes over
one flat copy of the masters: on a GPU, where the write-back is bound by memory traffic, about
42 bytes read and written per parameter where torch's own cast (ties to even) moves 6. On the
devices where :meth:`mixprec.kernel_table.KernelTable.write_back_path` says ``"compiled"``
(CUDA), the rounding is one ``torch.compile``-d pass instead (read fp32, write the 16 bits: 18
bytes a parameter with the flat copy and the copy back), checked against its eager twin before
it is trusted (:class:`mixprec.master.guard.GuardedKernel`: the bits must be equal). Where
``torch.compile`` can't build it (no Triton), inside a region dynamo is tracing, or for fp16
weights, the eager passes run.
"""

from __future__ import annotations

import torch

from .. import kernel_table
from ..masters import split_bits
from .compact_kernels import can_compile
from .guard import GuardedKernel

__all__ = ["round_into_", "rounded_bits_"]


def rounded_bits_(flat: torch.Tensor, out: torch.Tensor) -> None:
    """Write into the int16 ``out`` the bits of the flat fp32 ``flat`` rounded to bf16 as the
    split rounds (its weight's bits: to nearest, exact ties away from zero; a NaN stays NaN):
    one pass once compiled."""
    bits = flat.view(torch.int32)
    nan = flat != flat
    top = bits >> 16
    up = ((bits & 0xFFFF) >= 0x8000) & ~nan
    out.copy_(torch.where(nan, top | 0x40, top + up.to(torch.int32)).to(torch.int16))


_KERNEL = GuardedKernel("fp32-master write-back", rounded_bits_, {"cpp.dynamic_threads": True})


def _compiled_path(params: list[torch.Tensor]) -> bool:
    device_type = params[0].device.type
    return (kernel_table.TABLE.write_back_path(device_type) == "compiled"
            and not torch.compiler.is_compiling() and can_compile(device_type))


def _compiled_round(flat: torch.Tensor) -> torch.Tensor:
    out = torch.empty(flat.shape, dtype=torch.int16, device=flat.device)
    _KERNEL(flat, out)
    return out.view(torch.bfloat16)


def round_into_(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Write the fp32 ``values`` into the 16-bit ``params`` (same shapes): bf16 rounded as the
    split rounds, fp16 by torch's cast; one pass over a flat copy where the kernel table says
    ``"compiled"``, the eager passes of :func:`mixprec.masters.split_bits.round_into_`
    elsewhere. Bit for bit the same either way; no host sync after the first call's check."""
    compiled = any(p.dtype == torch.bfloat16 for p in params) and _compiled_path(params)
    split_bits.round_into_(params, values, _compiled_round if compiled else None)
