"""The noise table stochastic rounding reads its random bits from: its counts, exact
unbiasedness over the keys, the same bits for a tensor alone, in a flat run of tensors and as a
shard, and the same table in every process."""

import subprocess
import sys

import pytest
import torch

from mixprec.masters.rounding import (
    KEY_STRIDE,
    TABLE_SIZE,
    RoundingGenerator,
    noise16,
    noise_at,
    noise_lists,
    noise_table,
    offset_key,
    round_fp16_with,
    round_into_lists,
    stochastic_round,
)

L = TABLE_SIZE


def key(k: int) -> torch.Tensor:
    return torch.tensor(k, dtype=torch.int32)


def neighbours(value: float) -> tuple[float, float]:
    """The bf16 numbers below and above ``value`` in magnitude."""
    lo = torch.tensor(value).bfloat16()
    if lo.float().abs() > abs(value):
        lo = torch.nextafter(lo, torch.zeros_like(lo))
    hi = torch.nextafter(lo, torch.tensor(float("inf") if value > 0 else float("-inf"),
                                          dtype=torch.bfloat16))
    return lo.float().item(), hi.float().item()


# -- the table ------------------------------------------------------------------------------------
def test_every_16_bit_value_appears_equally_often():
    table = noise_table()
    assert table.dtype == torch.int32 and table.numel() == L == 2 ** 20
    assert torch.equal(torch.bincount(table, minlength=2 ** 16),
                       torch.full((2 ** 16,), L // 2 ** 16))
    assert torch.equal(table, noise_at(torch.arange(L)))
    assert torch.equal(noise_at(torch.arange(3 * L, 3 * L + 5)), table[:5])  # modulo L


def test_neighbouring_entries_are_unrelated():
    """Each entry's number against the next one's (correlation, and a chi-square of their top
    6 bits, 4095 degrees of freedom: its 99.9% point is 4387)."""
    t = noise_table().double() / 2 ** 16 - 0.5
    for lag in (1, 2, 3, 16, 1024):
        r = (t[:-lag] * t[lag:]).mean() / t.var()
        assert abs(r.item()) < 4 / L ** 0.5
    top = noise_table() >> 10
    counts = torch.bincount(top[:-1] * 64 + top[1:], minlength=4096).double()
    expected = (L - 1) / 4096
    assert ((counts - expected) ** 2 / expected).sum().item() < 4387


def test_keys_are_uniform_over_the_table_and_salted_keys_stay_in_it():
    drawn = torch.stack(RoundingGenerator(1).keys(200_000)).long()
    assert drawn.min() >= 0 and drawn.max() < L
    assert abs(drawn.double().mean().item() / L - 0.5) < 0.005
    salted = torch.stack(RoundingGenerator(1).keys(1000, salt=2 ** 40 + 3)).long()
    assert torch.equal(salted, drawn[:1000] ^ 3)


# -- unbiased: over all the keys exactly, over drawn keys statistically ---------------------------
@pytest.mark.parametrize("fraction", [0.5, 2.0 ** -16, 1 - 2.0 ** -16, 1 / 3, 0.01])
@pytest.mark.parametrize("base", [1.0, -3.0, 1e-30, 1e-40])
def test_rounding_over_every_key_is_exactly_unbiased(base, fraction):
    """A value a ``fraction`` of the way between two bf16 neighbours (exactly halfway, the
    smallest and largest fractions there are, ...), rounded with each of the L keys (element i
    of an L-element tensor with key k reads what element 0 reads with key k + i): the mean of
    the results is the value itself, to fp64 rounding."""
    lo, hi = neighbours(base)
    value = torch.tensor(lo + fraction * (hi - lo), dtype=torch.float32)
    x = value.expand(L).contiguous()
    got = stochastic_round(x, key(12345)).double()
    assert set(got.unique().tolist()) <= {lo, hi}
    assert got.mean().item() == pytest.approx(value.double().item(), rel=1e-12, abs=1e-60)


def test_fp16_rounding_over_every_key_is_unbiased_to_its_13_bits():
    lo, hi = 1.0, 1.0 + 2.0 ** -10
    value = lo + (1 / 3) * (hi - lo)
    x = torch.full((L,), value)
    got = round_fp16_with(x, noise16(key(7), x)).double()
    assert abs(got.mean().item() - torch.tensor(value).item()) <= 2.0 ** -13 * (hi - lo)


def test_a_value_exactly_halfway_rounds_up_half_the_time_over_drawn_keys():
    """One element, 4096 keys from the generator: up with probability 1/2, to within 5 standard
    deviations (0.039)."""
    lo, hi = neighbours(1.0)
    x = torch.tensor([lo + (hi - lo) / 2])
    ups = [stochastic_round(x, k).item() == hi for k in RoundingGenerator(11).keys(4096)]
    assert abs(sum(ups) / 4096 - 0.5) < 5 * (0.25 / 4096) ** 0.5


# -- the same bits wherever a tensor is rounded ---------------------------------------------------
SIZES = [(40, 30), (7,), (3, 3), (L + 1000,), (101,)]


def test_a_flat_run_of_tensors_gets_the_bits_each_tensor_gets_alone():
    """The tensors one after the other in one flat run, each key shifted by minus its offset
    (times KEY_STRIDE): the numbers, and the roundings, are those of each tensor with its own
    key, the ones past the table's end included (a key near L, a tensor longer than L)."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) for s in SIZES]
    keys = [key(k) for k in (5, L - 3, 77, L - 500, 0)]
    offsets = torch.tensor([0] + [t.numel() for t in tensors[:-1]]).cumsum(0)
    shifted = torch.stack(keys) - (offsets * KEY_STRIDE).to(torch.int32)
    alone = [noise16(k, t).reshape(-1) for k, t in zip(keys, tensors)]
    sizes = [t.numel() for t in tensors]
    assert torch.equal(noise_lists(shifted, sizes, torch.device("cpu")), torch.cat(alone))
    per_element = torch.repeat_interleave(shifted, torch.tensor(sizes))
    assert torch.equal(noise16(per_element, per_element), torch.cat(alone))
    outs = [torch.empty(s, dtype=torch.bfloat16) for s in SIZES]
    round_into_lists(torch.cat([t.reshape(-1) for t in tensors]), outs, shifted)
    for out, t, k in zip(outs, tensors, keys):
        assert torch.equal(out.view(torch.int16), stochastic_round(t, k).view(torch.int16))


def test_keys_on_a_device_index_the_table_for_the_same_bits(monkeypatch):
    """Keys that live on a device are not read on the host (no sync): the table is indexed
    instead of sliced (here on the CPU, the host read switched off), with the same bits; an
    empty tensor in a run included."""
    from mixprec.masters import rounding
    gen = torch.Generator().manual_seed(2)
    sizes = [(40, 30), (0,), (7,), (L + 3,)]
    tensors = [torch.randn(s, generator=gen) for s in sizes]
    keys = torch.tensor([5, 9, L - 2, 100], dtype=torch.int32)
    offsets = torch.tensor([0] + [t.numel() for t in tensors[:-1]]).cumsum(0)
    shifted = keys - offsets.to(torch.int32)

    def run():
        outs = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
        round_into_lists(torch.cat([t.reshape(-1) for t in tensors]), outs, shifted, 0x7FC0)
        alone = [stochastic_round(t, k) for t, k in zip(tensors, keys)]
        flat = noise_lists(shifted, [t.numel() for t in tensors], torch.device("cpu"))
        return [t.view(torch.int16) for t in outs + alone] + [flat]

    sliced = run()
    monkeypatch.setattr(rounding, "_host_keys", lambda keys: False)
    for a, b in zip(sliced, run()):
        assert torch.equal(a, b)
    for out, alone in zip(sliced[:4], sliced[4:8]):
        assert torch.equal(out, alone)


def test_the_sliced_and_the_indexed_rounding_agree_on_every_kind_of_value():
    """A 0-d key on the CPU slices the table; a key per element (or on a device) indexes it:
    the same bf16 bits, inf, NaN and the largest finite values included."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=gen) * 1e3
    x[:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.3895e38, -0.0, 1e-41])
    k = key(L - 100)  # wraps around the table's end
    sliced = stochastic_round(x, k)
    indexed = stochastic_round(x, k.expand(x.shape))
    assert torch.equal(sliced.view(torch.int16), indexed.view(torch.int16))
    assert sliced[2].isnan() and sliced[0] == float("inf") and sliced[1] == -float("inf")
    empty = torch.empty(0, 3)
    assert stochastic_round(empty, k).shape == stochastic_round(empty, k.expand(0, 3)).shape
    assert noise16(k, empty).shape == (0, 3)
    assert torch.equal(stochastic_round(x.view(50, 100).t(), k).view(torch.int16),
                       stochastic_round(x.view(50, 100).t().contiguous(), k).view(torch.int16))


def test_a_run_rounded_nan_safe_gets_each_tensors_bits_for_every_kind_of_value():
    """``round_into_lists`` with bf16's quiet NaN (the NaNs made fp32's quiet NaN before the
    noise, in one pass) gives the bits ``stochastic_round`` gives each tensor alone (NaNs masked
    after its noise): NaNs of every sign and payload (some one carry from a sign flip or an
    infinity), infinities, the largest finite values, zeros and subnormals, under every key."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (4096,), generator=gen, dtype=torch.int32)
    edges = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7F80FFFF, -0x00400000,
                          -1, -0x7F0001, 0x7F800000, -0x00800000, 0x7F7FFFFF, -0x00800001,
                          0, -2 ** 31, 1, 0x8000, 0x7F7F8000], dtype=torch.int32)
    tensors = [torch.cat([edges, bits[:1000]]).view(torch.float32),
               bits[1000:].view(torch.float32).view(24, -1)]
    # a key under which the +inf (element 7) reads a 0 from the table: made the largest finite
    # value, it would stay finite
    zero = int((noise_table() == 0).nonzero()[0])
    for k in (0, 0xFFFF, L - 10, (zero - 7) % L):
        keys = [key(k), key((k * 7 + 3) % L)]
        shifted = torch.stack(keys) - torch.tensor([0, tensors[0].numel()], dtype=torch.int32)
        outs = [torch.empty(t.shape, dtype=torch.bfloat16) for t in tensors]
        round_into_lists(torch.cat([t.reshape(-1) for t in tensors]), outs, shifted, 0x7FC0)
        for out, t, kk in zip(outs, tensors, keys):
            assert torch.equal(out.view(torch.int16), stochastic_round(t, kk).view(torch.int16))
        assert outs[0][:5].view(torch.int16).eq(0x7FC0).all()  # every NaN: the quiet one


@pytest.mark.parametrize("nan", [None, 0x7FC0, 0x7FFF])
def test_the_high_halves_copied_or_shifted_and_narrowed_give_the_same_bits(monkeypatch, nan):
    """The rounded results leave the noisy words as a copy of their high halves' stride-2 view
    (CUDA's choice, imposed here on the CPU) or as the words shifted right by 16 in place and
    narrowed (the CPU's): the same bits for every kind of value, each NaN mode, the 0-d-key
    rounding of one tensor too; and ``values`` overwritten either way."""
    from mixprec import kernel_table
    gen = torch.Generator().manual_seed(4)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (3000,), generator=gen, dtype=torch.int32)
    edges = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, -1, 0x7F800000, -0x00800000,
                          0x7F7FFFFF, 0, -2 ** 31, 1, 0x8000, 0x7F7F8000, 0x7FFF, -0x8000],
                         dtype=torch.int32)
    values = torch.cat([edges, bits]).view(torch.float32)
    sizes = [(7,), (0,), (40, 25), (values.numel() - 1007,)]
    shifted = torch.tensor([5, 9, L - 2, 100], dtype=torch.int32) - torch.tensor(
        [0, 7, 7, 1007], dtype=torch.int32)

    def run():
        outs = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
        given = values.clone()
        round_into_lists(given, outs, shifted, nan)
        return [o.view(torch.int16) for o in outs] + [
            stochastic_round(values, key(L - 3)).view(torch.int16)], given

    shifted_path, left = run()
    assert not torch.equal(left.view(torch.int32), values.view(torch.int32))
    monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing("cuda"))
    assert kernel_table.TABLE.copies_high_halves("cpu", torch.bfloat16)
    copied_path, _ = run()
    for a, b in zip(shifted_path, copied_path):
        assert torch.equal(a, b)
    if nan is not None:
        assert int(shifted_path[0][:5].eq(nan).sum()) == 4  # the four NaNs


def test_a_shard_offset_key_gets_the_full_tensors_bits():
    """A shard starting ``off`` elements into its full tensor, keyed as shard_key keys a
    DTensor shard (offset_key): the full tensor's numbers from ``off`` on, whatever the key."""
    full = torch.empty(3 * L // 2)
    for k, off in ((9, 1000), (L - 1, L - 7), (123, 2 * L // 3 * 2)):
        whole = noise16(key(k), full)
        shard = noise16(offset_key(key(k), off), full[off:])
        assert torch.equal(shard, whole[off:])


def test_the_table_is_the_same_in_another_process():
    code = ("import torch; from mixprec.masters.rounding import noise_table; "
            "t = noise_table().long(); "
            "print(int((t * torch.arange(1, t.numel() + 1)).sum()))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, check=True)
    t = noise_table().long()
    assert int(other.stdout) == int((t * torch.arange(1, t.numel() + 1)).sum())
