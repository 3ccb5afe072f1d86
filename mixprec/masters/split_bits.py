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

**In pairs** (:func:`pair_views`, :func:`split_load_pairs`, :func:`split_store_pairs`): inductor's
CPU backend vectorizes no int16 arithmetic, so a compiled step that touches the int16 remainder
(or the bf16 weight's bits as int16) runs one element at a time. Viewed as int32, each word
holds two neighbours (the first in the low half: the pair views are only taken on little-endian
machines); the same arithmetic on those words, in int32 and int64 only, vectorizes: the load
makes each pair's two fp32 masters as one int64 word (viewed back as two fp32 values), the
store splits a pair of fp32 results read as one int64 word. No remainder ever passes through a
float (a bf16/fp32 conversion may change a NaN's bits), the NaN test is on the bits, and the
results are bit for bit those above.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["split_store", "split_load", "split_of", "pair_views",
           "split_load_pairs", "split_store_pairs", "split_pairs_of", "load_halves",
           "store_halves"]

_NAN = 0x7FC0  # the weight of a NaN master: bf16's quiet NaN


def _high_and_rest(bits: torch.Tensor, nan: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's bits and the remainder (both int32) of fp32 ``bits`` (int32)."""
    top = bits >> 16
    lo = bits & 0xFFFF
    up = ((lo >= 0x8000) & ~nan).to(torch.int32)
    return torch.where(nan, _NAN, top + up), lo - 65536 * up


def _joined(high: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """The fp32 bits (int32) held by a weight's bits and a remainder (both int32)."""
    return (high - (rem < 0).to(torch.int32)) * 65536 + (rem & 0xFFFF)


def split_of(new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bf16 weight, int16 remainder)`` holding the fp32 tensor ``new`` exactly: the bits of
    ``_high_and_rest`` in few passes (eager, each pass is one): the remainder is the low 16 bits
    read as signed (``lo - 65536 * up``), the weight the high half of ``b + 0x8000`` (a low half of
    ``0x8000`` or more carries into it: ``top + up``), a NaN's the quiet NaN."""
    bits = new.contiguous().view(torch.int32)
    high = bits + 0x8000
    high >>= 16
    weight = high.to(torch.int16).masked_fill_(new.isnan(), _NAN)
    return weight.view(torch.bfloat16), bits.to(torch.int16)


def split_load(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master a bf16 ``weight`` and its int16 ``remainder`` hold (a new tensor):
    ``weight * 65536 + remainder`` in int32, which is ``_joined``'s
    ``(weight - up) * 65536 + (remainder & 0xFFFF)`` in three passes."""
    bits = weight.contiguous().view(torch.int16).to(torch.int32)
    bits *= 65536
    bits += remainder
    return bits.view(torch.float32)


def split_store(weight: torch.Tensor, remainder: torch.Tensor, new: torch.Tensor) -> None:
    """Write the fp32 ``new`` into a bf16 ``weight`` and its int16 ``remainder``, in place."""
    high, rem = split_of(new)
    weight.copy_(high)
    remainder.copy_(rem)


def pair_views(weight: torch.Tensor,
               remainder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A flat bf16 ``weight`` and its int16 ``remainder`` as int32 views of neighbour pairs, or
    None where they can't be (an odd length or offset, not flat and contiguous, a big-endian
    machine)."""
    if sys.byteorder != "little":
        return None
    for t in (weight, remainder):
        if t.dim() != 1 or t.stride(0) != 1 or t.numel() % 2 or t.storage_offset() % 2:
            return None
    return weight.view(torch.int32), remainder.view(torch.int32)


def _halves(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two sign-extended 16-bit halves (int32) of int32 ``words``, low half first."""
    wide = words.to(torch.int64)
    return ((wide << 48) >> 48).to(torch.int32), (wide >> 16).to(torch.int32)


def split_load_pairs(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """:func:`split_load` of the int32 pair views (:func:`pair_views`): the fp32 masters, flat
    (a new tensor)."""
    (w0, w1), (r0, r1) = _halves(weight), _halves(remainder)
    first = _joined(w0, r0).to(torch.int64) & 0xFFFFFFFF
    return (first | (_joined(w1, r1).to(torch.int64) << 32)).view(torch.float32)


def split_pairs_of(new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split_of` of the flat, even-length fp32 ``new`` as int32 words of neighbour pairs
    (the weight's words, the remainder's words; new tensors)."""
    words = new.contiguous().view(torch.int64)
    pairs = []
    for bits in (((words << 32) >> 32).to(torch.int32), (words >> 32).to(torch.int32)):
        pairs.append(_high_and_rest(bits, (bits & 0x7FFFFFFF) > 0x7F800000))
    (h0, q0), (h1, q1) = pairs
    return (h0 & 0xFFFF) | (h1 << 16), (q0 & 0xFFFF) | (q1 << 16)


def split_store_pairs(weight: torch.Tensor, remainder: torch.Tensor, new: torch.Tensor) -> None:
    """:func:`split_store` into the int32 pair views (:func:`pair_views`) of the flat fp32
    ``new``, in place."""
    high, rem = split_pairs_of(new)
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
    """:func:`split_load` of each contiguous (weight, remainder) pair, one after the other, into
    the flat fp32 ``out``: the weights into the high halves and the remainders into the low
    halves of its words (two copies), then one borrow from the high half where the remainder is
    negative (``weight * 65536 + remainder``). A little-endian machine's word layout."""
    low, high, lows, highs = _half_runs(out, weights, remainders)
    torch._foreach_copy_(highs, weights)
    torch._foreach_copy_(lows, remainders)
    high.add_(low >> 15)  # -1 where the remainder is negative


def store_halves(values: torch.Tensor, weights: list[torch.Tensor],
                 remainders: list[torch.Tensor]) -> None:
    """:func:`split_store` of the flat fp32 ``values`` into each contiguous (weight, remainder)
    pair, overwriting ``values``: the remainder is the low half of each word; adding ``0x8000``
    carries a low half of ``0x8000`` or more into the high half, the weight (a NaN's: the quiet
    NaN). A little-endian machine's word layout."""
    nan = values.isnan()
    _, high, lows, highs = _half_runs(values, weights, remainders)
    torch._foreach_copy_(remainders, lows)
    values.view(torch.int32).add_(0x8000)
    high.masked_fill_(nan, _NAN)
    torch._foreach_copy_(weights, highs)
