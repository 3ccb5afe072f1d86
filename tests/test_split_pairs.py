"""``master="split"`` in int32 pairs (the form the CPU one-pass kernels use, so inductor
vectorizes them): the load and the store give bitwise the masters, weights and remainders of the
element-wise split, eagerly and compiled.

Tolerances: none, bit-exact: every 16-bit remainder pattern (NaN-looking ones included: a
remainder never passes through a float) and every bf16 weight pattern are loaded; a sample of
fp32 patterns with the edges (ties, infinities, NaNs with payloads) is stored.
"""

import pytest
import torch

from mixprec.masters.split_bits import (
    pair_views,
    split_load,
    split_load_pairs,
    split_of,
    split_store_pairs,
)

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")


def every_pattern(seed=0):
    """(weight, remainder): every 16-bit pattern of each against random patterns of the other."""
    g = torch.Generator().manual_seed(seed)
    every = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    other = torch.randint(-2 ** 15, 2 ** 15, (2 * every.numel(),), generator=g,
                          dtype=torch.int32).to(torch.int16)
    weight = torch.cat([every, other[:every.numel()]])
    rem = torch.cat([other[every.numel():], every])
    return weight.view(torch.bfloat16), rem


def fp32_patterns(n=1 << 18, seed=1):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), generator=g, dtype=torch.int32)
    edges = torch.tensor([0, -2 ** 31, 1, 0x8001, 0x00018000, 0x3F808000, -0x40800000 | 0x8000,
                          0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, -0x00800000,
                          0x7F800001, 0x7F808000, 0x7FC00000, 0x7FFFFFFF, -1, -0x7FFF],
                         dtype=torch.int32)
    return torch.cat([bits, (bits & ~0xFFFF) | 0x8000, edges]).view(torch.float32)


def store_pairs(new):
    weight = torch.empty(new.shape, dtype=torch.bfloat16)
    rem = torch.empty(new.shape, dtype=torch.int16)
    split_store_pairs(*pair_views(weight, rem), new)
    return weight, rem


@pytest.mark.parametrize("compiled", [False, True])
def test_the_paired_load_is_bitwise_the_element_wise_one(compiled):
    weight, rem = every_pattern()
    load = torch.compile(split_load_pairs, dynamic=True) if compiled else split_load_pairs
    got = load(*pair_views(weight, rem))
    assert got.dtype == torch.float32 and got.shape == weight.shape
    assert torch.equal(got.view(torch.int32), split_load(weight, rem).view(torch.int32))


@pytest.mark.parametrize("compiled", [False, True])
def test_the_paired_store_is_bitwise_the_element_wise_one(compiled):
    new = fp32_patterns()
    weight, rem = split_of(new)
    store = torch.compile(store_pairs, dynamic=True) if compiled else store_pairs
    got_weight, got_rem = store(new)
    assert torch.equal(got_weight.view(torch.int16), weight.view(torch.int16))
    assert torch.equal(got_rem, rem)
    finite = ~new.isnan()
    back = split_load_pairs(*pair_views(got_weight, got_rem))
    assert torch.equal(back[finite].view(torch.int32), new[finite].view(torch.int32))
    assert back[~finite].isnan().all()


def test_pairs_are_views_of_even_flat_tensors_only():
    weight = torch.zeros(8, dtype=torch.bfloat16)
    rem = torch.zeros(8, dtype=torch.int16)
    w32, r32 = pair_views(weight, rem)
    assert w32.dtype == r32.dtype == torch.int32 and w32.numel() == 4
    assert w32.data_ptr() == weight.data_ptr() and r32.data_ptr() == rem.data_ptr()
    assert pair_views(weight[:7], rem[:7]) is None  # odd length
    assert pair_views(weight[1:7], rem[1:7]) is None  # odd offset
    assert pair_views(weight[::2], rem[::2]) is None  # strided
    assert pair_views(weight.view(2, 4), rem.view(2, 4)) is None  # not flat


def test_odd_and_even_parameters_step_as_fp32_masters_bitwise():
    """Compiled, an even-length parameter goes through the pairs, an odd one element-wise: both
    masters equal ``master="fp32"``'s under the same compiled step, bit for bit (eagerly, the
    pairs meet the plain fp32 reference step in the split master tests)."""
    from torch import nn

    from mixprec.optim import CompactMasterOptimizer, MasterWeightOptimizer

    g = torch.Generator().manual_seed(2)
    starts = [torch.randn(n, generator=g) for n in (64, 33)]
    grads = [[torch.randn(s.shape, generator=g).bfloat16() * 1e-2 for s in starts]
             for _ in range(3)]
    split_params = [nn.Parameter(s.bfloat16()) for s in starts]
    fp32_params = [nn.Parameter(s.bfloat16()) for s in starts]
    split = CompactMasterOptimizer(torch.optim.AdamW(split_params, lr=1e-2), "split",
                                   fused="compile", initial_values=dict(zip(split_params, starts)))
    fp32 = MasterWeightOptimizer(torch.optim.AdamW(fp32_params, lr=1e-2), fused="compile",
                                 initial_masters={p: s.clone()
                                                  for p, s in zip(fp32_params, starts)})
    for step in grads:
        for p, q, grad in zip(split_params, fp32_params, step):
            p.grad, q.grad = grad.clone(), grad.clone()
        split.step()
        fp32.step()
    masters, fp32_masters = split.fp32_values(), fp32.masters_by_param()
    for p, q in zip(split_params, fp32_params):
        assert torch.equal(masters[p].view(torch.int32),
                           fp32_masters[q].detach().view(torch.int32))
        assert torch.equal(p.detach().view(torch.int16), split_of(masters[p])[0].view(torch.int16))
