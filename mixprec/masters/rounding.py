"""Stochastic rounding into bf16 (and fp16), and where its random bits come from.

Rounding an fp32 value to bf16 keeps the top 16 bits of its bit pattern. Stochastic rounding adds
a uniformly random 16-bit integer to the pattern before dropping the low 16 bits: the magnitude
rounds up with probability (dropped bits) / 2**16, which is exactly the value's distance to its
lower neighbour over the gap between the two neighbours, so the expected result is the fp32 value
itself (unbiased), whatever the size of the update. An update far below half an ulp, which
round-to-nearest loses every time, moves the weight now and then by one ulp, as often as its size
asks. inf and NaN pass unchanged.

**The random bits are read from a fixed noise table.** The table ``T`` holds
:data:`TABLE_SIZE` (``L = 2**20``) integers in [0, 2**16), each 16-bit value exactly
``L / 2**16`` = 16 times, in a scrambled order: ``T[j]`` is the low 16 bits of a fixed bijection
of the 20-bit integers (:func:`noise_at`: three xor-shift-multiply rounds; no generator, so the
table is the same in every process, on every device and with every torch version). Element ``i``
of a tensor rounded with key ``k`` gets ``T[(k + i) mod L]``. Keys are drawn uniformly from
[0, L), so each element's number is exactly uniform over [0, 2**16) at every step: every
rounding is exactly unbiased. Eagerly the numbers of a tensor are one or two contiguous slices
of the table (one more per ``L`` elements), added to the fp32 words in place: 4 bytes read per
element, nothing computed. Keys on a device index the table instead (no host sync; the same
bits).

Within one key the numbers of neighbouring elements are those of neighbouring table entries
(unrelated); two tensors rounded in one step read windows of the table at independent random
places, and an element ``L`` places after another in the same tensor reads the same entry. None of
that biases a rounding: each element's number is uniform for its fresh key.

The keys come from a ``torch.Generator`` (one draw per tensor per step,
:meth:`RoundingGenerator.keys`); its state is what a checkpoint saves, so a resumed run rounds
exactly as the uninterrupted one, and a skipped step, which draws nothing, leaves it untouched.
Several tensors rounded as one flat run keep their own bits: a tensor placed ``off`` elements
into the run gets the key ``k - off * KEY_STRIDE`` (:data:`KEY_STRIDE` is 1: element ``j`` of the
run reads ``T[(j + key) mod L]``), and an FSDP2 shard starting ``off`` elements into its full
tensor the key ``k + off * KEY_STRIDE`` (:func:`shard_key`).
"""

from __future__ import annotations

import itertools
import math
import sys

import torch

from .. import kernel_table
from ..dtypes import is_low_precision
from ..shards import is_dtensor

__all__ = ["rounds_to", "RoundingGenerator", "noise16", "noise_at", "noise_table", "noise_lists",
           "stochastic_round", "round_fp16_with", "round_into_lists", "shard_key",
           "DEFAULT_SEED", "TABLE_SIZE", "KEY_STRIDE", "BF16_NAN"]

#: Where a rounding generator starts unless told otherwise: the same in every process, so the
#: replicas of a data-parallel run draw the same keys and stay bitwise equal.
DEFAULT_SEED = 0x5EED
#: Entries of the noise table (``L``): keys are uniform in [0, L), and element ``i`` of a tensor
#: with key ``k`` reads entry ``(k + i) mod L``.
TABLE_SIZE = 1 << 20
#: How far one element moves the table index: element ``j`` of a flat run with key ``k`` reads
#: entry ``(j * KEY_STRIDE + k) mod L``, so a tensor placed ``off`` elements into a run keeps its
#: own bits with the key ``k - off * KEY_STRIDE``.
KEY_STRIDE = 1
#: What a NaN rounds to: bf16's quiet NaN (its bit pattern as an int16).
BF16_NAN = 0x7FC0

_MASK = TABLE_SIZE - 1
# the bijection of 20-bit integers behind the table: x ^= x >> shift; x *= odd (mod 2**20)
_ROUNDS = ((10, 0x2C1B3), (9, 0x9E485), (11, 0x5D5A7))
_LITTLE = sys.byteorder == "little"
_TABLES: dict[torch.device, torch.Tensor] = {}
_CHUNK = 1 << 16  # the table is made a chunk at a time (it is often made in a first step)


def noise_at(index: torch.Tensor) -> torch.Tensor:
    """``T[index mod L]`` computed from the index (int64 arithmetic: no wrap-around); an int32
    tensor shaped as ``index``. :func:`noise_table` is made with it."""
    x = index.to(torch.int64) & _MASK
    for shift, odd in _ROUNDS:
        x = ((x ^ (x >> shift)) * odd) & _MASK
    return ((x ^ (x >> 10)) & 0xFFFF).to(torch.int32)


def noise_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The noise table on ``device`` (int32, :data:`TABLE_SIZE` entries; made once per process
    and device, 4 MiB). Read it, never write it."""
    device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0"
    table = _TABLES.get(device)
    if table is None:
        cpu = _TABLES.get(torch.device("cpu"))
        if cpu is None:
            cpu = torch.empty(TABLE_SIZE, dtype=torch.int32)
            for start in range(0, TABLE_SIZE, _CHUNK):  # int64 temporaries of a chunk only
                cpu[start:start + _CHUNK] = noise_at(torch.arange(start, start + _CHUNK))
            _TABLES[torch.device("cpu")] = cpu
        table = _TABLES[device] = cpu.to(device)
    return table


def _runs(key: int, count: int) -> list[tuple[int, int, int]]:
    """``(start, stop, entry)``: elements ``start:stop`` of a run of ``count`` elements with
    ``key`` read the table from ``entry`` on (contiguous slices; a new one at each wrap)."""
    runs, start, entry = [], 0, key % TABLE_SIZE
    while start < count:
        stop = min(count, start + TABLE_SIZE - entry)
        runs.append((start, stop, entry))
        start, entry = stop, 0
    return runs


def _host_keys(keys: torch.Tensor) -> bool:
    """Keys the table can be sliced at without a device sync (on the CPU)."""
    return keys.device.type == "cpu"


def _gathered(keys: torch.Tensor, count: int, device: torch.device) -> torch.Tensor:
    """The numbers of ``count`` elements, element ``j`` with ``keys[j]`` (a key per element, or
    one 0-d key), read by index (keys on a device: no host sync)."""
    index = torch.arange(count, device=device) + keys.to(device).reshape(-1)
    return noise_table(device)[index & _MASK]


def noise16(key: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The random numbers in [0, 2**16) of ``like``'s elements: element ``i`` (flat index) gets
    ``T[(key + i) mod L]``.

    Args:
        key: a 0-d int32 tensor (drawn from a :class:`RoundingGenerator`), or one key per
            element (shaped as ``like``; element ``i`` then gets ``T[(key[i] + i) mod L]``).
        like: the tensor whose elements get a number each.

    Returns:
        A new int32 tensor shaped as ``like``.
    """
    if key.dim() == 0 and _host_keys(key):
        flat = noise_lists(key.reshape(1), [like.numel()], like.device)
    else:
        flat = _gathered(key, like.numel(), like.device)
    return flat.view(like.shape)


def _slices(table: torch.Tensor, keys: list[int], sizes: list[int],
            runs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The ``runs`` (tensors of ``sizes`` elements, one after the other in a flat run, element
    ``j`` of the run in tensor ``t`` reading entry ``(j + keys[t]) mod L``) cut where they wrap
    past the table's end, and the table's slices they read."""
    entries = [(k + o) % TABLE_SIZE for k, o in zip(keys, itertools.accumulate(sizes, initial=0))]
    if all(e + n <= TABLE_SIZE for e, n in zip(entries, sizes)):  # no wrap: a slice each
        return runs, [table[e:e + n] for e, n in zip(entries, sizes)]
    cut, read = [], []
    for run, entry, size in zip(runs, entries, sizes):
        for start, stop, e in _runs(entry, size):
            cut.append(run[start:stop])
            read.append(table[e:e + stop - start])
    return cut, read


def noise_lists(keys: torch.Tensor, sizes: list[int], device: torch.device) -> torch.Tensor:
    """The numbers of a flat run of tensors of ``sizes`` elements, one after the other: element
    ``j`` of the run, in tensor ``t``, gets ``T[(j + keys[t]) mod L]`` (``keys``: per tensor,
    already shifted by minus each tensor's offset in the run, so a tensor gets the numbers its
    own key gives it alone). A flat int32 tensor."""
    total = sum(sizes)
    if not _host_keys(keys):
        per_element = torch.repeat_interleave(keys, torch.tensor(sizes, device=keys.device),
                                              output_size=total)
        return _gathered(per_element, total, device)
    out = torch.empty(total, dtype=torch.int32, device=device)
    if total:
        runs, read = _slices(noise_table(device), keys.tolist(), sizes, list(out.split(sizes)))
        torch._foreach_copy_(runs, read)
    return out


def _add_noise_(words: torch.Tensor, keys: torch.Tensor, sizes: list[int]) -> None:
    """Add :func:`noise_lists` to the flat int32 ``words`` in place (eagerly with host keys:
    one ``_foreach_add_`` of table slices onto the tensors' runs, nothing made)."""
    if not _host_keys(keys):
        words.add_(noise_lists(keys, sizes, words.device))
    elif words.numel():
        runs, read = _slices(noise_table(words.device), keys.tolist(), sizes,
                             list(words.split(sizes)))
        torch._foreach_add_(runs, read)


def round_into_lists(values: torch.Tensor, outs: list[torch.Tensor], keys: torch.Tensor,
                     nan: int | None = None) -> None:
    """:func:`stochastic_round` of the flat fp32 ``values`` (overwritten) into the contiguous
    bf16 ``outs``, one after the other, with per-tensor ``keys`` (shifted as
    :func:`noise_lists` says): the table's numbers are added to the words in place and their
    high halves are the rounded values (a little-endian machine's layout). ``nan``: the bf16
    bit pattern written where a value is NaN (None: the NaN's own high half, which a carry from
    its low half can turn into another value; for a buffer whose NaNs the weight holds
    anyway). bf16's quiet NaN is written by making every NaN fp32's quiet NaN before the noise
    (one in-place pass, infinities kept): no number in the table carries out of its low half."""
    bad = None
    if nan == BF16_NAN:
        values.nan_to_num_(nan=math.nan, posinf=math.inf, neginf=-math.inf)
    elif nan is not None:
        bad = values.isnan()
    words = values.view(torch.int32)
    _add_noise_(words, keys, [o.numel() for o in outs])
    high = _high_halves(words, outs[0].dtype)
    if bad is not None:
        high.masked_fill_(bad, nan)
    unflatten = torch._C._nn.unflatten_dense_tensors
    torch._foreach_copy_([o.view(torch.int16) for o in outs], unflatten(high, outs))


def _high_halves(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The high 16 bits of the flat int32 ``words`` (a little-endian machine's layout), as
    a flat tensor whose copy into int16 keeps them: their stride-2 int16 view, or (where the
    kernel table says a strided copy is slow: the CPU) ``words`` shifted right by 16 in place
    (arithmetic: the low halves are then the high ones; ``words`` is overwritten)."""
    if kernel_table.TABLE.copies_high_halves(words.device.type, dtype):
        return words.view(torch.int16)[1::2]
    return words.bitwise_right_shift_(16)


def stochastic_round(value: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``value`` (fp32) rounded stochastically to bf16 with the numbers of ``key``
    (:func:`noise16`: a 0-d key, or one per element). A 0-d CPU key adds the table's slices to
    the words and keeps their high halves; any other key indexes the table: the same bits."""
    if (_LITTLE and key.dim() == 0 and _host_keys(key) and value.is_contiguous()
            and value.dtype == torch.float32):
        # every NaN made fp32's quiet NaN first (as round_into_lists does), in a new tensor
        words = value.nan_to_num(nan=math.nan, posinf=math.inf, neginf=-math.inf)
        words = words.view(torch.int32).reshape(-1)
        _add_noise_(words, key.reshape(1), [words.numel()])
        rounded = torch.empty(value.shape, dtype=torch.int16, device=value.device)
        rounded.view(-1).copy_(_high_halves(words, torch.bfloat16))
        return rounded.view(torch.bfloat16)
    # the high halves of the words plus the numbers (finite patterns never overflow int32, inf
    # stays inf); a NaN becomes bf16's quiet NaN
    bits = value.view(torch.int32) + noise16(key, value)
    bits = torch.where(value.isnan(), BF16_NAN << 16, bits)
    return (bits >> 16).to(torch.int16).view(torch.bfloat16)


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
    return offset_key(key, sum(i * s for i, s in zip(start, strides)))


def offset_key(key: torch.Tensor, offset: int) -> torch.Tensor:
    """The key whose element ``i`` reads what element ``offset + i`` reads with ``key`` (in
    [0, L) for a key in [0, L))."""
    shift = (offset * KEY_STRIDE) % TABLE_SIZE
    return (key + torch.tensor(shift, dtype=torch.int32, device=key.device)) & _MASK


def round_fp16_with(value: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``value`` (fp32) rounded stochastically to fp16 with the numbers ``noise`` (int32, shaped
    as ``value``: :func:`noise16` or :func:`noise_lists`).

    fp16's exponent range is narrower than fp32's, so the bit-dropping of
    :func:`stochastic_round` would be wrong for its subnormals: instead each value is rounded on
    the grid of its fp16 neighbours, ``floor(value / q + u) * q`` with ``q`` the fp16 spacing at
    ``value`` (2**-24 in the subnormal range) and ``u`` uniform in [0, 1) (the top 13 bits of
    the number), whose expectation is ``value`` (to 2**-13 of a spacing in fp16's subnormal
    range). Values beyond fp16's range become inf, as a cast would make them.
    """
    exponent = ((value.view(torch.int32) >> 23) & 0xFF) - 127  # floor(log2|value|), normal fp32
    spacing_exp = torch.clamp(exponent - 10, min=-24)  # fp16: 10 stored mantissa bits
    q = ((spacing_exp + 127) << 23).view(torch.float32)
    # 13 random bits: an fp32 value holds 13 bits below the fp16 grid, and value / q + u must
    # stay exact in fp32 (16 bits could round a sum up to the next integer)
    u = (noise >> 3).float() * (1.0 / 8192)
    rounded = torch.floor(value / q + u) * q
    return torch.where(value.isfinite(), rounded, value).to(torch.float16)


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

    def draw(self, count: int, salt: int = 0) -> torch.Tensor:
        """``count`` fresh int32 keys on the CPU as one tensor, uniform in [0,
        :data:`TABLE_SIZE`) (advances the generator; no host sync). ``salt`` is xor-ed into
        them (modulo the table size: still uniform)."""
        drawn = torch.randint(0, TABLE_SIZE, (count,), generator=self.generator,
                              dtype=torch.int32)
        return drawn ^ (salt % TABLE_SIZE) if salt % TABLE_SIZE else drawn

    def keys(self, count: int, salt: int = 0) -> list[torch.Tensor]:
        """:meth:`draw`'s keys as 0-d tensors (at least one drawn: ``keys(0)`` advances the
        generator too)."""
        return list(self.draw(max(count, 1), salt).unbind(0))[:count]

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


def rounds_to(value: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Where ``low`` (low precision) is a nearest rounding of ``value`` (fp32): ``value`` lies
    within half the gap to ``low``'s neighbour on its side. A tie rounds to either neighbour (a
    Kahan weight + compensation can sit exactly half an ulp from its weight). Where that half
    gap is below ``low``'s dtype's smallest subnormal (fp16 weights under 2^-13), up to that
    subnormal: a Kahan compensation of the weight's dtype can't hold less, so it holds a whole
    ulp there. A parameter stored in fp32 or wider (a prepared model cast with ``.float()``)
    must equal ``value``."""
    if not is_low_precision(low):
        return value.to(low.dtype) == low
    up = torch.nextafter(low, torch.full_like(low, float("inf"))).to(torch.float32)
    down = torch.nextafter(low, torch.full_like(low, float("-inf"))).to(torch.float32)
    mid = low.to(torch.float32)
    info = torch.finfo(low.dtype)
    tiny = info.smallest_normal * info.eps  # the smallest subnormal
    # the midpoints of two adjacent 16-bit values are exact in fp32
    inside = ((value <= torch.maximum((mid + up) / 2, mid + tiny))
              & (value >= torch.minimum((mid + down) / 2, mid - tiny)))
    return inside | (value.to(low.dtype) == low)  # == also covers inf
