"""The arithmetic of ``master="split"``: an fp32 master held exactly as a bf16 weight (the high
half of its bits, rounded) and an int16 remainder (the rest).

**Store** (``new`` -> weight, remainder). With ``b`` the fp32 bits of ``new`` as an int32, ``lo``
its low 16 bits (0..65535) and ``top = b >> 16`` (an arithmetic shift: the high 16 bits, signed):
``up = lo >= 0x8000``; the weight's bits are ``top + up`` and the remainder is ``lo - 65536 * up``
(-32768..32767, an int16). Adding one to the high half of a float's bits moves it one bf16 ulp
away from zero whatever its sign, so the weight is ``new`` rounded to nearest bf16, **exact ties
(``lo == 0x8000``) rounded away from zero** (torch's own ``.to(torch.bfloat16)`` rounds ties to
even: the two differ only at exact ties). A master above bf16's largest finite value (from
``0x7F7F8000`` up) rounds to inf, as torch's cast does; the remainder still holds the rest, so
the master stays exact. A NaN master gives a NaN weight (the high half's quiet bit set: a NaN
whose high half alone would read as inf stays NaN) and loads back as a NaN, its payload not
kept.

**Load** (weight, remainder -> ``new``): ``up = remainder < 0``; the high half is the weight's
bits minus ``up``; the fp32 bits are ``high * 65536 + (remainder & 0xFFFF)``. Every step stays
inside int32 for finite and infinite masters, so both directions are exact and bit for bit the
same eagerly and under ``torch.compile`` (inductor lowers the ``view(dtype)`` bitcasts).
"""

from __future__ import annotations

import torch

__all__ = ["split_store", "split_load", "split_of"]


def split_of(new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bf16 weight, int16 remainder)`` holding the fp32 tensor ``new`` exactly."""
    bits = new.contiguous().view(torch.int32)
    top = bits >> 16
    lo = bits & 0xFFFF
    nan = new != new
    up = ((lo >= 0x8000) & ~nan).to(torch.int32)
    high = torch.where(nan, top | 0x40, top + up)
    return high.to(torch.int16).view(torch.bfloat16), (lo - 65536 * up).to(torch.int16)


def split_load(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master a bf16 ``weight`` and its int16 ``remainder`` hold (a new tensor)."""
    rem = remainder.to(torch.int32)
    high = weight.contiguous().view(torch.int16).to(torch.int32) - (rem < 0).to(torch.int32)
    return (high * 65536 + (rem & 0xFFFF)).view(torch.float32)


def split_store(weight: torch.Tensor, remainder: torch.Tensor, new: torch.Tensor) -> None:
    """Write the fp32 ``new`` into a bf16 ``weight`` and its int16 ``remainder``, in place."""
    high, rem = split_of(new)
    weight.copy_(high)
    remainder.copy_(rem)
