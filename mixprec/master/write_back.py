"""The bf16 write-back of fp32 masters: the 16-bit forward weights rewritten after each update.

The rounding is the split's (to nearest, exact ties away from zero: see
:mod:`mixprec.masters.split_bits`), so fp32 and split masters give the same forward weights.
torch's own cast rounds ties to even, so it takes a few element-wise passes
(:func:`mixprec.masters.split_bits.round_into_`: a cast, a tie test, an or, over one flat copy).
How they run is the kernel table's choice
(:meth:`mixprec.kernel_table.KernelTable.write_back_path`):

* ``"compiled"`` (CUDA): one ``torch.compile``-d pass over the flat copy (read fp32, write the 16
  bits: about 18 bytes a parameter with the copy in and out, where the eager passes move about
  42 and torch's cast 6), checked against its eager twin before it is trusted
  (:class:`mixprec.master.guard.GuardedKernel`: the bits must be equal). Where ``torch.compile``
  can't build it (no Triton), the eager passes run.
* ``"chunks"`` (CPU): the eager passes over pieces of at most :data:`CHUNK` elements (small tensors
  together, large ones in slices), so each piece's passes stay in the cache: measured 6-10x
  faster than the same passes over one flat copy of 20M parameters, about 4x torch's cast
  (``bench/write_back_speed.py``). A model below :data:`CHUNK` parameters is one piece.
* ``"flat"`` (other devices): the eager passes over one flat copy.

Inside a region dynamo is tracing, the flat passes are traced. Every path writes the same bits.
"""

from __future__ import annotations

import torch

from .. import kernel_table
from ..masters import split_bits
from .guard import GuardedKernel, can_compile

__all__ = ["round_into_", "rounded_bits_", "CHUNK"]

#: Elements of one piece of the CPU write-back (1 MB of fp32 masters: the passes stay in cache).
CHUNK = 1 << 18


def rounded_bits_(flat: torch.Tensor, out: torch.Tensor) -> None:
    """Write into the int16 ``out`` the bits of the split's bf16 weight of the flat fp32
    ``flat`` (:func:`mixprec.masters.split_bits.split_of`: to nearest, exact ties away from zero;
    a NaN stays NaN): one pass once compiled (the unused remainder is left out)."""
    out.copy_(split_bits.split_of(flat)[0].view(torch.int16))


_KERNEL = GuardedKernel("fp32-master write-back", rounded_bits_, {"cpp.dynamic_threads": True})


def _pieces(params: list[torch.Tensor], values: list[torch.Tensor]):
    """``(params, values)`` lists of at most :data:`CHUNK` elements in all: neighbours together,
    a larger contiguous tensor in slices of its flat view."""
    group_p, group_v, size = [], [], 0
    for p, v in zip(params, values):
        n = p.numel()
        if n > CHUNK and p.is_contiguous() and v.is_contiguous():
            if group_p:
                yield group_p, group_v
                group_p, group_v, size = [], [], 0
            flat_p, flat_v = p.view(-1), v.view(-1)
            for start in range(0, n, CHUNK):
                yield [flat_p[start:start + CHUNK]], [flat_v[start:start + CHUNK]]
            continue
        if group_p and size + n > CHUNK:
            yield group_p, group_v
            group_p, group_v, size = [], [], 0
        group_p.append(p)
        group_v.append(v)
        size += n
    if group_p:
        yield group_p, group_v


def _compiled_round(flat: torch.Tensor) -> torch.Tensor:
    out = torch.empty(flat.shape, dtype=torch.int16, device=flat.device)
    _KERNEL(flat, out)
    return out.view(torch.bfloat16)


def round_into_(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Write the fp32 ``values`` into the 16-bit ``params`` (same shapes): bf16 rounded as the
    split rounds, fp16 by torch's cast, by the path the kernel table gives the device (see the
    module docstring). Bit for bit the same on every path; no host sync after the compiled
    kernel's first check."""
    if not params:
        return
    device_type = params[0].device.type
    path = "flat" if torch.compiler.is_compiling() else \
        kernel_table.TABLE.write_back_path(device_type)
    if path == "compiled" and any(p.dtype == torch.bfloat16 for p in params) \
            and can_compile(device_type):
        split_bits.round_into_(params, values, _compiled_round)
    elif path == "chunks":
        for piece_params, piece_values in _pieces(params, values):
            split_bits.round_into_(piece_params, piece_values)
    else:
        split_bits.round_into_(params, values)
