"""The arithmetic of ``master="split"``: an fp32 master held exactly as a bf16 weight (the high
half of its bits, rounded) and an int16 remainder (the rest).

**Store** (``new`` -> weight, remainder). With ``lo`` the low 16 bits of ``new``'s fp32 word, the
remainder is ``lo`` read as a signed int16 (``lo - 65536`` from ``0x8000`` up) and the weight is
``new`` rounded to nearest bf16 with **exact ties (``lo == 0x8000``) rounded away from zero**:
torch's own cast (``.to(torch.bfloat16)``, ties to even) of ``new`` with a tie's low half made
``0x8001``, so the two differ only at exact ties. The remainder needs it: a bf16 weight with an
even last bit is the nearest-even rounding of 65537 fp32 values, one more than 16 bits can tell
apart; with ties away, the weight is the high half plus one exactly where the remainder is
negative. Ties away from zero live only here; fp32 masters write their weights with torch's
cast. A master above bf16's largest finite value (from ``0x7F7F8000`` up) rounds to inf, as
torch's cast does; the remainder still holds the rest, so the master stays exact. A NaN master
gives the NaN torch's cast gives (no change to a low half turns a number into a NaN or back) and
loads back as a NaN, its payload not kept.

**Load** (weight, remainder -> ``new``): the fp32 word is ``weight * 65536 + remainder`` in
int32 arithmetic (a negative remainder borrows one from the high half), so both directions are
exact, for finite and infinite masters alike, eagerly and under ``torch.compile``.

**Over a piece of a param group** (:func:`load_halves`, :func:`store_halves`), through the
16-bit halves of a flat fp32 buffer's words (a little-endian machine's layout), in place: the
load sign-extends the remainders into the words and adds the weights' bits to their high halves
(int16 arithmetic wraps: the borrow); the store narrows the words to int16 (their low halves) as
the remainders,
turns a tie's ``0x8000`` into ``0x8001`` (a clamp of the low halves at -32767) and casts the
words into the weights. Three passes each, nothing allocated: the same bits as the element-wise
functions. Where a ``spare`` buffer is given (the CPU, where an in-place op on every other
int16 runs element by element, at about three times a contiguous pass's time: measured in
docs/benchmarks.md), every pass runs over whole words instead: the load widens the weights'
bits into the spare and adds them, times 65536, to the sign-extended remainders; the store sets
the lowest bit of every word (which turns a tie's ``0x8000`` into ``0x8001`` and rounds nothing
else differently) after clamping the values to the largest finite fp32 magnitude (the bit would
turn an infinity into a NaN; the largest finite value rounds to the infinity torch's cast gives).
The same bits again.
"""

from __future__ import annotations

import torch

__all__ = ["split_store", "split_load", "split_of", "load_halves", "store_halves"]

_TIE = -0x7FFF  # a low half of 0x8000 (-32768) made 0x8001: ties round away from zero
_FP32_MAX = torch.finfo(torch.float32).max


def _untied(bits: torch.Tensor) -> torch.Tensor:
    """The flat int32 ``bits`` with every low half of ``0x8000`` made ``0x8001`` (a new tensor):
    torch's cast of it rounds ties away from zero, and nothing else differently."""
    out = bits.reshape(-1).clone()
    out.view(torch.int16)[0::2].clamp_(min=_TIE)
    return out


def split_of(new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bf16 weight, int16 remainder)`` holding the fp32 tensor ``new`` exactly (the store
    above): the remainder is the low half of each word, the weight torch's cast with ties away
    from zero."""
    bits = new.contiguous().view(torch.int32)
    weight = _untied(bits).view(torch.float32).to(torch.bfloat16).view(new.shape)
    return weight, bits.to(torch.int16)


def split_load(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master a bf16 ``weight`` and its int16 ``remainder`` hold (a new tensor):
    ``weight * 65536 + remainder`` in int32."""
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
_unflatten = torch._C._nn.unflatten_dense_tensors


def load_halves(out: torch.Tensor, weights: list[torch.Tensor],
                remainders: list[torch.Tensor], spare: torch.Tensor | None = None) -> None:
    """:func:`split_load` of each (weight, remainder) pair (any strides), one after the other, into
    the flat fp32 ``out``: the remainders sign-extended into its words (one ``_foreach_copy_``),
    then the weights' bits added to the words' high halves (one ``_foreach_add_``; int16
    arithmetic wraps, which is the borrow of a negative remainder). With a flat fp32 ``spare`` of
    ``out``'s size: the weights' bits sign-extended into it and added times 65536 to the words
    (int32 arithmetic: the same borrow), three passes over whole words. A little-endian
    machine's word layout."""
    words = out.view(torch.int32)
    torch._foreach_copy_(_unflatten(words, remainders), remainders)
    bits = [w.view(torch.int16) for w in weights]
    if spare is None:
        torch._foreach_add_(_unflatten(out.view(torch.int16)[1::2], weights), bits)
        return
    wide = spare[:out.numel()].view(torch.int32)
    torch._foreach_copy_(_unflatten(wide, weights), bits)
    words.add_(wide, alpha=65536)


def store_halves(values: torch.Tensor, weights: list[torch.Tensor],
                 remainders: list[torch.Tensor], spare: torch.Tensor | None = None) -> None:
    """:func:`split_store` of the flat fp32 ``values`` into each (weight, remainder) pair,
    overwriting ``values``: the remainders are its words narrowed to int16 (one
    ``_foreach_copy_``: the low halves); a tie's low half is then made ``0x8001`` (one clamp of
    the low halves; given a ``spare``, whose contents it leaves, over whole words instead: the
    values clamped to the largest finite fp32 magnitude, then every word's lowest bit set) and the
    words cast into the weights (one ``_foreach_copy_``, torch's cast). A little-endian machine's
    word layout."""
    words = values.view(torch.int32)
    torch._foreach_copy_(remainders, _unflatten(words, remainders))
    if spare is None:
        values.view(torch.int16)[0::2].clamp_(min=_TIE)
    else:
        values.clamp_(min=-_FP32_MAX, max=_FP32_MAX)  # NaN stays NaN
        words.bitwise_or_(1)
    torch._foreach_copy_(weights, _unflatten(values, weights))
