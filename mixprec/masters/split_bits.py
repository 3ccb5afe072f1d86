"""The arithmetic of ``master="split"``: an fp32 master held exactly as a bf16 weight (the high
half of its bits, rounded) and an int16 remainder (the rest).

**Store** (``new`` -> weight, remainder). With ``b`` the fp32 bits of ``new`` as an int32, ``lo``
its low 16 bits (0..65535) and ``top = b >> 16`` (an arithmetic shift: the high 16 bits, signed):
``up = lo >= 0x8000``; the weight's bits are ``top + up`` and the remainder is ``lo - 65536 * up``
(-32768..32767, an int16). Adding one to the high half of a float's bits moves it one bf16 ulp away
from zero whatever its sign, so the weight is ``new`` rounded to nearest bf16, **exact ties (``lo
== 0x8000``) rounded away from zero** (torch's own ``.to(torch.bfloat16)`` rounds ties to even: the
two differ only at exact ties). The remainder needs it: a bf16 weight with an even last bit is the
nearest-even rounding of 65537 fp32 values, one more than 16 bits can tell apart. Ties away from
zero live only here; fp32 masters write their weights with torch's cast. A master above bf16's
largest finite value (from ``0x7F7F8000`` up) rounds to inf, as torch's cast does; the remainder
still holds the rest, so the master stays exact. A NaN master gives a NaN weight (bf16's quiet NaN,
``0x7FC0``) and loads back as a NaN, its payload not kept.

**Load** (weight, remainder -> ``new``): ``up = remainder < 0``; the high half is the weight's
bits minus ``up``; the fp32 bits are ``high * 65536 + (remainder & 0xFFFF)``. Every step stays
inside int32 for finite and infinite masters, so both directions are exact and bit for bit the
same eagerly and under ``torch.compile`` (inductor lowers the ``view(dtype)`` bitcasts).

**Over a piece of a param group** (:func:`load_halves`, :func:`store_halves`): the weights and
remainders are copied into and out of the 16-bit halves of a flat fp32 buffer's words (a
little-endian machine's layout), with one pass for the borrow or the carry: the same bits.
"""

from __future__ import annotations

import torch

__all__ = ["split_store", "split_load", "split_of", "load_halves", "store_halves"]

_NAN = 0x7FC0  # the weight of a NaN master: bf16's quiet NaN


def split_of(new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bf16 weight, int16 remainder)`` holding the fp32 tensor ``new`` exactly (the store above)
    in few passes: the remainder is the low 16 bits read as signed (``lo - 65536 * up``), the
    weight the high half of ``b + 0x8000`` (a low half of ``0x8000`` or more carries into it:
    ``top + up``), a NaN's the quiet NaN."""
    bits = new.contiguous().view(torch.int32)
    high = bits + 0x8000
    high >>= 16
    weight = high.to(torch.int16).masked_fill_(new.isnan(), _NAN)
    return weight.view(torch.bfloat16), bits.to(torch.int16)


def split_load(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master a bf16 ``weight`` and its int16 ``remainder`` hold (a new tensor):
    ``weight * 65536 + remainder`` in int32, which is the load above,
    ``(weight - up) * 65536 + (remainder & 0xFFFF)``, in three passes."""
    bits = weight.contiguous().view(torch.int16).to(torch.int32)
    bits *= 65536
    bits += remainder
    return bits.view(torch.float32)


def split_store(weight: torch.Tensor, remainder: torch.Tensor, new: torch.Tensor) -> None:
    """Write the fp32 ``new`` into a bf16 ``weight`` and its int16 ``remainder``, in place."""
    high, rem = split_of(new)
    weight.copy_(high)
    remainder.copy_(rem)


# -- eagerly, straight from the lists: the fp32 words' 16-bit halves (little-endian) -------------
def _half_runs(flat: torch.Tensor, weights: list[torch.Tensor], remainders: list[torch.Tensor]):
    """The low and high int16 halves of the flat fp32 ``flat``'s words (strided views), and
    their runs shaped as each remainder (int16) and each weight (bf16), in a constant number of
    torch calls."""
    halves = flat.view(torch.int16)
    low, high = halves[0::2], halves[1::2]
    unflatten = torch._C._nn.unflatten_dense_tensors
    return low, high, unflatten(low, remainders), unflatten(high.view(torch.bfloat16), weights)


def load_halves(out: torch.Tensor, weights: list[torch.Tensor],
                remainders: list[torch.Tensor]) -> None:
    """:func:`split_load` of each (weight, remainder) pair (any strides), one after the other, into
    the flat fp32 ``out``: the weights into the high halves and the remainders into the low
    halves of its words (two copies), then one borrow from the high half where the remainder is
    negative (``weight * 65536 + remainder``). A little-endian machine's word layout."""
    low, high, lows, highs = _half_runs(out, weights, remainders)
    torch._foreach_copy_(highs, weights)
    torch._foreach_copy_(lows, remainders)
    high.add_(low >> 15)  # -1 where the remainder is negative


def store_halves(values: torch.Tensor, weights: list[torch.Tensor],
                 remainders: list[torch.Tensor]) -> None:
    """:func:`split_store` of the flat fp32 ``values`` into each (weight, remainder)
    pair, overwriting ``values``: the remainder is the low half of each word; adding ``0x8000``
    carries a low half of ``0x8000`` or more into the high half, the weight (a NaN's: the quiet
    NaN). A little-endian machine's word layout."""
    nan = values.isnan()
    _, high, lows, highs = _half_runs(values, weights, remainders)
    torch._foreach_copy_(remainders, lows)
    values.view(torch.int32).add_(0x8000)
    high.masked_fill_(nan, _NAN)
    torch._foreach_copy_(weights, highs)
