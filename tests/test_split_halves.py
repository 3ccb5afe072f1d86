"""``master="split"`` through the halves of fp32 words (how the step loads and stores a piece):
:func:`load_halves` and :func:`store_halves` give bitwise the masters, weights and remainders of
the element-wise split, into and out of strided slices too, and odd and even parameters step as
fp32 masters do.

Tolerances: none, bit-exact: every 16-bit remainder pattern (NaN-looking ones included: a
remainder never passes through a float) and every bf16 weight pattern are loaded; a sample of
fp32 patterns with the edges (ties, infinities, NaNs with payloads) is stored (a NaN weight
compared as a NaN: torch's cast writes a NaN's bits as its vectorized or element-wise loop does).
"""

import pytest
import torch
from torch import nn

from mixprec.masters.split_bits import load_halves, split_load, split_of, store_halves
from mixprec.optim import CompactMasterOptimizer, MasterWeightOptimizer


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


# None: through the words' 16-bit halves (CUDA); a spare: whole-word passes (the CPU)
SPARE = pytest.mark.parametrize("spare", [False, True], ids=["halves", "words"])


@SPARE
def test_every_pattern_loads_bitwise_as_the_element_wise_join(spare):
    weight, rem = every_pattern()
    half = weight.numel() // 2
    # a contiguous run, and a strided view (a slice of a transposed tensor)
    weights = [weight[:half], weight[half:].view(-1, 4).t()]
    rems = [rem[:half], rem[half:].view(-1, 4).t()]
    out = torch.empty(weight.numel())
    load_halves(out, weights, rems, torch.empty(weight.numel() + 3) if spare else None)
    expect = torch.cat([split_load(w, r).reshape(-1) for w, r in zip(weights, rems)])
    assert torch.equal(out.view(torch.int32), expect.view(torch.int32))


@SPARE
def test_stores_bitwise_as_the_element_wise_split_into_strided_slices(spare):
    new = fp32_patterns()
    weight, rem = split_of(new)
    got_w = torch.empty(new.numel() // 2, 2, dtype=torch.bfloat16)
    got_r = torch.empty(new.numel() // 2, 2, dtype=torch.int16)
    # the second half of the patterns goes into a strided (column) view
    targets_w, targets_r = [got_w.view(-1)[:1000], got_w[500:, 1]], [got_r.view(-1)[:1000],
                                                                     got_r[500:, 1]]
    n = 1000 + targets_w[1].numel()
    kept = torch.full((n,), 7.0)
    store_halves(new[:n].clone(), targets_w, targets_r, kept if spare else None)
    assert torch.equal(kept, torch.full((n,), 7.0))  # the store leaves a spare as it is
    got = torch.cat([t.reshape(-1) for t in targets_w]), torch.cat([t.reshape(-1)
                                                                    for t in targets_r])
    nan = weight[:n].isnan()  # torch's cast writes a NaN's bits as its loop does
    assert torch.equal(got[0].isnan(), nan)
    assert torch.equal(got[0][~nan].view(torch.int16), weight[:n][~nan].view(torch.int16))
    assert torch.equal(got[1], rem[:n])
    back = split_load(*got)
    finite = ~new[:n].isnan()
    assert torch.equal(back[finite].view(torch.int32), new[:n][finite].view(torch.int32))
    assert back[~finite].isnan().all()


def test_odd_and_even_parameters_step_as_fp32_masters_bitwise():
    """Odd and even lengths in one piece (their words straddle each other in the halves)."""
    g = torch.Generator().manual_seed(2)
    starts = [torch.randn(n, generator=g) for n in (64, 33, 7)]
    grads = [[torch.randn(s.shape, generator=g).bfloat16() * 1e-2 for s in starts]
             for _ in range(3)]
    split_params = [nn.Parameter(s.bfloat16()) for s in starts]
    fp32_params = [nn.Parameter(s.bfloat16()) for s in starts]
    split = CompactMasterOptimizer(torch.optim.AdamW(split_params, lr=1e-2), "split",
                                   initial_values=dict(zip(split_params, starts)))
    fp32 = MasterWeightOptimizer(torch.optim.AdamW(fp32_params, lr=1e-2),
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
