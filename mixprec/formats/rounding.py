"""A format's rounding rule: round-to-nearest-even, computed exactly in float64.

The quantum of a value is a power of two, so ``round(x / q) * q`` is exact in float64 arithmetic.
The rule agrees with torch's own casts for every value they round once; it differs from them in
two documented places: torch casts float64 to fp16/bf16/fp8 through float32 (double rounding,
e.g. 1 + 2^-11 + 2^-40 becomes 1.0 instead of 1.0009765625), and torch's CPU cast to
``float8_e4m3fn`` saturates out-of-range values (and inf) to +-448, where the rule reports an
overflow and stores NaN, the format's only non-finite value.
"""

from __future__ import annotations

import math

import torch

from .table import FloatFormat

__all__ = ["round_to"]


def round_to(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round a float64 tensor to ``fmt`` (nearest-even); overflow gives inf (NaN without inf).

    Args:
        x: a float64 tensor.
        fmt: the :class:`~mixprec.formats.FloatFormat` to round to.

    Returns:
        A new float64 tensor holding the values ``fmt`` stores.
    """
    if fmt.bits >= 64:
        return x.clone()
    _, exp = torch.frexp(x.abs())  # |x| = m * 2**exp with 0.5 <= m < 1
    exp = (exp - 1).clamp_(min=fmt.emin)  # below min_normal the quantum stays fixed: subnormals
    quantum = torch.ldexp(torch.ones_like(x), exp - fmt.mantissa_bits)
    out = torch.round(x / quantum) * quantum
    overflow_to = math.inf if fmt.has_inf else math.nan
    out = torch.where(out.abs() > fmt.max, torch.copysign(torch.full_like(x, overflow_to), x), out)
    if not fmt.has_inf:
        out = torch.where(torch.isinf(x), torch.copysign(torch.full_like(x, math.nan), x), out)
    return torch.where(torch.isnan(x), x, out)
