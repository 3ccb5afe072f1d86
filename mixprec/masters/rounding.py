"""Stochastic rounding into bf16 (and fp16), and the generator its random bits come from.

Rounding an fp32 value to bf16 keeps the top 16 bits of its bit pattern. Stochastic rounding adds
a uniformly random 16-bit integer to the pattern before dropping the low 16 bits: the magnitude
rounds up with probability (dropped bits) / 2**16, which is exactly the value's distance to its
lower neighbour over the gap between the two neighbours, so the expected result is the fp32 value
itself (unbiased), whatever the size of the update. An update far below half an ulp, which
round-to-nearest loses every time, moves the weight now and then by one ulp, as often as its size
asks. inf and NaN pass unchanged.

The random bits are a counter-based hash of (key, element index): the same function in eager code
and inside a compiled kernel, so both give the same bits. The keys come from a
``torch.Generator`` (one draw per tensor per step, :meth:`RoundingGenerator.keys`); its state is
what a checkpoint saves, so a resumed run rounds exactly as the uninterrupted one, and a skipped
step, which draws nothing, leaves it untouched.
"""

from __future__ import annotations

import torch

from ..shards import is_dtensor

__all__ = ["RoundingGenerator", "random16", "stochastic_round", "stochastic_round_fp16",
           "round_stochastically", "shard_key", "weyl16", "noise_lists", "round_into_lists",
           "DEFAULT_SEED"]

#: Where a rounding generator starts unless told otherwise: the same in every process, so the
#: replicas of a data-parallel run draw the same keys and stay bitwise equal.
DEFAULT_SEED = 0x5EED

# int32 arithmetic that wraps around (two's complement), in eager torch and in compiled kernels
_GOLDEN = -0x61C8864F  # 0x9E3779B1 as int32: spreads consecutive indices over 32 bits
_MIX = 0x45D9F3B
_GOLDEN_TWICE = 2 * _GOLDEN + 2 ** 32  # 2 * 0x9E3779B1 modulo 2**32, as int32
_KEY_RANGE = 2 ** 31 - 1


def random16(key: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Uniform random integers in [0, 2**16), one per element of ``like``.

    Args:
        key: a 0-d int32 tensor (drawn from a :class:`RoundingGenerator`).
        like: the tensor whose elements get a random number each (flat index order).

    Returns:
        An int32 tensor shaped as ``like``.
    """
    idx = torch.arange(like.numel(), device=like.device, dtype=torch.int32).view(like.shape)
    x = idx * _GOLDEN + key
    x = ((x >> 16) ^ x) * _MIX
    x = ((x >> 16) ^ x) * _MIX
    return ((x >> 16) ^ x) & 0xFFFF


def weyl16(key: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Integers in [0, 2**16), one per element of ``like``: bits 15-30 of
    ``index * 0x9E3779B1 + key`` (a Weyl sequence), one multiply-add per element.

    Keys are uniform in [0, 2**31), so bits 15-30 of ``c + key`` run through every 16-bit
    value equally often (bit 31 would not): for a fresh key each element's number is
    uniform, which is all an unbiased
    rounding needs; within one key the numbers are evenly spread rather than independent (the
    rounding errors of neighbours partly cancel). :func:`random16` mixes further, for roundings
    whose errors should be independent (the weights of ``master="stochastic"``).
    """
    idx = torch.arange(like.numel(), device=like.device, dtype=torch.int32).view(like.shape)
    return ((idx * _GOLDEN + key) >> 15) & 0xFFFF


# -- eagerly, over a flat buffer of several tensors (in place, few passes) ------------------------
def noise_lists(keys: torch.Tensor, tensors: list[torch.Tensor], total: int,
                noise=random16) -> torch.Tensor:
    """:func:`random16` or :func:`weyl16` of each of the contiguous ``tensors``, one after the
    other, as one flat int32 tensor of ``total`` elements: element ``i`` of the flat run gets
    the bits of ``i * 0x9E3779B1 + keys[t]`` for the tensor ``t`` it falls in (``keys``: per
    tensor, already shifted by minus each tensor's flat offset times the multiplier, so a
    tensor's elements get the bits its own key gives them alone). The same bits as ``noise``,
    computed in place over one buffer (one ``_foreach_add_`` for the keys), the steps that
    touch 16 bits of a word on its int16 halves (a little-endian machine's layout)."""
    if noise is not random16 and noise is not weyl16:
        raise ValueError(f"noise is random16 or weyl16; got {noise!r}")
    weyl = noise is weyl16
    # weyl16's bits 15-30 of the sum are bits 16-31 (the high half) of twice the sum
    x = torch.arange(total, dtype=torch.int32, device=keys.device)
    x.mul_(_GOLDEN_TWICE if weyl else _GOLDEN)
    unflatten = torch._C._nn.unflatten_dense_tensors
    torch._foreach_add_(list(unflatten(x, tensors)), list((keys * 2 if weyl else keys).unbind(0)))
    low, high = x.view(torch.int16)[0::2], x.view(torch.int16)[1::2]
    if weyl:
        low.copy_(high)
    else:  # three rounds of x ^= x >> 16 (the low half takes the high; the high its sign)
        for _ in range(2):
            low.bitwise_xor_(high)
            high.bitwise_xor_(high >> 15)
            x.mul_(_MIX)
        low.bitwise_xor_(high)
    high.zero_()  # the & 0xFFFF
    return x


def round_into_lists(values: torch.Tensor, outs: list[torch.Tensor], noise: torch.Tensor,
                     nan: int | None = None) -> None:
    """:func:`stochastic_round` of the flat fp32 ``values`` (overwritten) into the contiguous
    bf16 ``outs``, one after the other, with the flat int32 ``noise`` (:func:`noise_lists`):
    the noise is added to the words in place and their high halves are the rounded values (a
    little-endian machine's layout). ``nan``: the bf16 bit pattern written where a value is NaN
    (None: the NaN's own high half, which a carry from its low half can turn into another
    value; for a buffer whose NaNs the weight holds anyway)."""
    bad = values.isnan() if nan is not None else None
    values.view(torch.int32).add_(noise)
    high = values.view(torch.int16)[1::2]
    if bad is not None:
        high.masked_fill_(bad, nan)
    unflatten = torch._C._nn.unflatten_dense_tensors
    torch._foreach_copy_(outs, unflatten(high.view(outs[0].dtype), outs))


def stochastic_round(value: torch.Tensor, key: torch.Tensor, noise=random16) -> torch.Tensor:
    """``value`` (fp32) rounded stochastically to bf16 with the random bits of ``key``.

    The result holds exact bf16 values in an fp32 tensor's place, returned as bf16 (the final
    conversion is exact). ``noise``: :func:`random16` or :func:`weyl16`. Works eagerly and under
    ``torch.compile``.
    """
    # finite patterns never overflow int32 here; inf/NaN are passed through by the where
    bits = value.view(torch.int32) + noise(key, value)
    rounded = (bits & -65536).view(torch.float32)
    return torch.where(value.isfinite(), rounded, value).to(torch.bfloat16)


def shard_key(key: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """The key that gives a DTensor's local shard the random bits the full tensor's elements
    get with ``key`` (``tensor`` itself otherwise), so sharded training rounds each element as
    one process does. Exact for shards that are contiguous runs of the flat tensor (FSDP2's
    row shards); other layouts still get distinct, unbiased bits."""
    if not is_dtensor(tensor):
        return key
    # torch's DTensor helper (loaded with DTensor itself: see mixprec.shards.is_dtensor)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, start = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                     tensor.placements)
    strides = torch.empty(tensor.shape, device="meta").stride()
    offset = sum(i * s for i, s in zip(start, strides))
    # random16 hashes index * _GOLDEN + key: shifting the index is shifting the key (mod 2**32)
    shift = (offset * _GOLDEN) % 2 ** 32
    shift = shift - 2 ** 32 if shift >= 2 ** 31 else shift
    return key + torch.tensor(shift, dtype=torch.int32, device=key.device)


def stochastic_round_fp16(value: torch.Tensor, key: torch.Tensor,
                          noise=random16) -> torch.Tensor:
    """``value`` (fp32) rounded stochastically to fp16 with the random bits of ``key``.

    fp16's exponent range is narrower than fp32's, so the bit-dropping of
    :func:`stochastic_round` would be wrong for its subnormals: instead each value is rounded on
    the grid of its fp16 neighbours, ``floor(value / q + u) * q`` with ``q`` the fp16 spacing at
    ``value`` (2**-24 in the subnormal range) and ``u`` uniform in [0, 1) (13 bits), whose
    expectation is ``value`` (to 2**-13 of a spacing in fp16's subnormal range). Works eagerly
    and under ``torch.compile``. Values beyond fp16's range become inf, as a cast would make
    them.
    """
    exponent = ((value.view(torch.int32) >> 23) & 0xFF) - 127  # floor(log2|value|), normal fp32
    spacing_exp = torch.clamp(exponent - 10, min=-24)  # fp16: 10 stored mantissa bits
    q = ((spacing_exp + 127) << 23).view(torch.float32)
    # 13 random bits: an fp32 value holds 13 bits below the fp16 grid, and value / q + u must
    # stay exact in fp32 (16 bits could round a sum up to the next integer)
    u = (noise(key, value) >> 3).float() * (1.0 / 8192)
    rounded = torch.floor(value / q + u) * q
    return torch.where(value.isfinite(), rounded, value).to(torch.float16)


def round_stochastically(value: torch.Tensor, key: torch.Tensor, dtype: torch.dtype,
                         noise=random16) -> torch.Tensor:
    """``value`` (fp32) rounded stochastically to ``dtype`` (bf16 or fp16; fp32: unchanged)."""
    if dtype == torch.bfloat16:
        return stochastic_round(value, key, noise)
    if dtype == torch.float16:
        return stochastic_round_fp16(value, key, noise)
    return value.to(dtype)


class RoundingGenerator:
    """Per-step keys for stochastic rounding, from a ``torch.Generator`` on the CPU.

    Args:
        seed: the generator's seed (default :data:`DEFAULT_SEED`, the same in every process).

    Raises:
        TypeError: ``seed`` is not an int.
    """

    def __init__(self, seed: int = DEFAULT_SEED):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int; got {seed!r}")
        self.generator = torch.Generator().manual_seed(seed)

    def keys(self, count: int, salt: int = 0) -> list[torch.Tensor]:
        """``count`` fresh 0-d int32 keys on the CPU (advances the generator; no host sync)."""
        drawn = torch.randint(0, _KEY_RANGE, (max(count, 1),), generator=self.generator,
                              dtype=torch.int32)
        if salt:
            drawn = drawn ^ salt
        return list(drawn.unbind(0))[:count]

    def state_dict(self) -> torch.Tensor:
        """The generator's state (a uint8 CPU tensor)."""
        return self.generator.get_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            TypeError: ``state`` is not a uint8 tensor.
        """
        if not (torch.is_tensor(state) and state.dtype == torch.uint8):
            raise TypeError(f"a rounding generator state is a uint8 tensor; got {state!r}")
        self.generator.set_state(state.cpu())
