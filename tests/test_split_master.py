"""``master="split"``: an exact fp32 master as a bf16 weight (the high half, rounded) and an int16
remainder.

Tolerances:

* the split itself: bit-exact round trip (every finite and infinite fp32 pattern sampled,
  NaNs stay NaN); the weight equals torch's round-to-nearest-even cast except at exact ties,
  which go away from zero; eager and compiled bitwise equal.
* the masters under a constant gradient (the forward weight plays no part): bitwise equal to a
  plain fp32 reference step written as the kernels compute it (eager), and to
  ``master="fp32"``'s compiled step (compiled); within 2 fp32 ulps per step of torch's own
  optimizer (which fuses its multiply-adds differently).
* a real small model (the forward weight does play a part: it differs from fp32 masters' only
  at exact ties), 30 AdamW steps against ``master="fp32"`` with the same compiled step: masters
  within 1e-6 absolute, losses within 1e-5 relative (measured: bitwise equal; for scale, torch's
  own fused AdamW on the fp32 masters differs from the compiled step by 1.4e-5, and
  ``master="kahan"`` by 3.3e-4).
"""

import copy

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.masters.split_bits import load_halves, split_load, split_of, store_halves
from mixprec.optim import CompactMasterOptimizer, MasterWeightOptimizer

pytestmark = [pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::mixprec.SlowDtypeWarning")]

BF16_MAX = torch.finfo(torch.bfloat16).max


def sample_bits(n=1 << 20, seed=0):
    """Random fp32 bit patterns plus the edges: +-0, subnormals, ties, bf16's max and the
    masters just above it, fp32's max, infinities, NaNs with payloads in either half."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), generator=g, dtype=torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000
    edges = torch.tensor([0, -2 ** 31, 1, 0x8001, 0x007FFFFF, 0x00018000, 0x3F808000,
                          -0x40800000 | 0x8000, 0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000,
                          0x7F7FFFFF, 0x7F800000, -0x00800000, 0x7F800001, 0x7F808000,
                          0x7FC00000, 0x7FFFFFFF, -1, -0x7FFF], dtype=torch.int32)
    return torch.cat([bits, ties, edges]).view(torch.float32)


def same_weights(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal bf16 weights, where a NaN is any NaN (torch's cast of a NaN writes
    different bits on its vectorized and element-wise loops, and inductor's others)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan())
                and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16)))


def test_the_split_round_trips_every_fp32_pattern_exactly():
    x = sample_bits()
    weight, rem = split_of(x)
    assert weight.dtype == torch.bfloat16 and rem.dtype == torch.int16
    back = split_load(weight, rem)
    finite = ~x.isnan()
    assert torch.equal(back[finite].view(torch.int32), x[finite].view(torch.int32))
    assert back[~finite].isnan().all() and weight[~finite].isnan().all()
    # the weight is torch's round to nearest, except exact ties: away from zero, not to even
    lo = x.view(torch.int32) & 0xFFFF
    torch_cast = x.to(torch.bfloat16)
    differ = (weight.view(torch.int16) != torch_cast.view(torch.int16)) & finite
    assert differ.any() and (lo[differ] == 0x8000).all()
    tie = finite & (lo == 0x8000) & (x.abs() < BF16_MAX)
    assert (weight[tie].float().abs() > x[tie].abs()).all()
    # above bf16's largest finite value the weight is inf, as torch's cast; the master stays
    big = torch.tensor([0x7F7F8000, 0x7F7FFFFF], dtype=torch.int32).view(torch.float32)
    w_big, r_big = split_of(big)
    assert w_big.isinf().all() and torch.equal(split_load(w_big, r_big), big)
    assert torch.equal(big.to(torch.bfloat16), w_big)


def test_the_split_is_bitwise_the_same_compiled():
    x = sample_bits(1 << 16, seed=1)
    weight, rem = split_of(x)
    c_weight, c_rem = torch.compile(split_of, dynamic=True)(x)
    assert same_weights(c_weight, weight)
    assert torch.equal(c_rem, rem)
    c_back = torch.compile(split_load, dynamic=True)(weight, rem)
    assert torch.equal(c_back.view(torch.int32), split_load(weight, rem).view(torch.int32))


def test_the_eager_list_form_writes_the_bits_of_the_element_wise_split():
    """store_halves/load_halves (the CPU's eager group step: straight from the lists, through the
    halves of the fp32 words) against split_of/split_load, on tensors of odd and even lengths:
    every stored bit equal (a NaN weight is a NaN: torch's cast writes different NaN bits on its
    vectorized and element-wise loops), and every remainder pattern loaded equal."""
    x = sample_bits(1 << 16, seed=2)
    cut = [x[:999], x[999:1000], x[1000:1000 + 7 * 9000].reshape(-1, 7)[:, :5].contiguous(),
           x[-(1 << 16) - 20:]]  # the ties and the edges (infinities, NaNs)
    weights = [torch.empty(t.shape, dtype=torch.bfloat16) for t in cut]
    rems = [torch.empty(t.shape, dtype=torch.int16) for t in cut]
    store_halves(torch.cat([t.reshape(-1) for t in cut]), weights, rems)
    for t, w, r in zip(cut, weights, rems):
        w0, r0 = split_of(t)
        assert same_weights(w, w0) and torch.equal(r, r0)
    g = torch.Generator().manual_seed(3)
    weights = [torch.randint(-2 ** 15, 2 ** 15, t.shape, generator=g, dtype=torch.int16)
               .view(torch.bfloat16) for t in cut]
    rems = [torch.randint(-2 ** 15, 2 ** 15, t.shape, generator=g, dtype=torch.int16)
            for t in cut]
    out = torch.empty(sum(t.numel() for t in cut))
    load_halves(out, weights, rems)
    expect = torch.cat([split_load(w, r).reshape(-1) for w, r in zip(weights, rems)])
    assert torch.equal(out.view(torch.int32), expect.view(torch.int32))


def test_fp16_and_unknown_masters_are_refused_naming_what_works():
    with pytest.raises(ValueError, match="master='split'.*bf16.*got fp16.*'fp32' or 'kahan'"):
        mp.Policy.from_level("O2", "fp16", warn=False).replace(master="split")
    w = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="master='split'.*got fp16 parameter of shape"):
        CompactMasterOptimizer(torch.optim.SGD([w], lr=0.1), "split")
    with pytest.raises(ValueError, match="master must be one of .*'split'.*got 'exact'"):
        CompactMasterOptimizer(torch.optim.SGD([w], lr=0.1), "exact")


# -- the masters evolve as fp32 ones --------------------------------------------------------------
def constant_grads(shape, n=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).bfloat16() for _ in range(n)]


def inner(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


@pytest.mark.parametrize("fused", [False, "auto"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_masters_equal_fp32_masters_bitwise_under_a_constant_gradient(kind, fused):
    steps = 60
    start = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)) * 0.1
    grads = constant_grads(start.shape)
    w = nn.Parameter(start.bfloat16())
    opt = CompactMasterOptimizer(inner(kind, [w]), "split", fused=fused,
                                 initial_values={w: start})
    m = nn.Parameter(start.bfloat16())
    fp32 = MasterWeightOptimizer(inner(kind, [m]), fused=fused,
                                 initial_masters={m: start.clone()})
    torch_ref = nn.Parameter(start.clone())
    torch_opt = inner(kind, [torch_ref])
    for i in range(steps):
        w.grad, m.grad, torch_ref.grad = (grads[i % 3].clone(), grads[i % 3].clone(),
                                          grads[i % 3].float())
        opt.step()
        fp32.step()
        torch_opt.step()
    master = opt.fp32_values()[w]
    assert torch.equal(w, split_of(master)[0])  # the weight is the master's high half
    if fused == "auto":  # torch's fused kernel on both
        assert torch.equal(master, fp32.masters_by_param()[m].detach())
    else:  # torch's own step (single-tensor on the CPU) on the exact master: the fp32 one's
        assert torch.equal(master, torch_ref.detach())
    ulp = torch.finfo(torch.float32).eps * torch_ref.detach().abs().clamp_min(1e-3)
    assert ((master - torch_ref.detach()).abs() <= 2 * steps * ulp).all()


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64),
                         nn.GELU(), nn.Linear(64, 4))


def test_tracks_fp32_masters_on_a_small_model():
    """Both through torch's fused AdamW (the default path), so only the forward weights can differ,
    at exact ties (split's weight rounds a tie away from zero, torch's cast to even). A weight that
    differs changes every later gradient: with one intra-op thread this run meets a tie and the two
    drift apart by up to 1.9e-4 in a master and 2.3e-4 (relative) in a loss over 30 steps; with none
    the runs are bitwise equal. Lockstep equality (same gradients: masters bitwise equal) is
    tests/test_master_family.py's."""
    base = small_model()
    runs = {}
    for master in ("fp32", "split"):
        net = copy.deepcopy(base)
        net, opt = mp.prepare(net, torch.optim.AdamW(net.parameters(), lr=3e-3), level="O2",
                              dtype="bf16", master=master)
        losses = []
        for i in range(30):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
            loss = nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[master] = (mp.fp32_state_dict(net, opt), losses)
    (ref, ref_losses), (got, losses) = runs["fp32"], runs["split"]
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)


def test_the_pair_starts_from_the_exact_original_and_exports_it():
    torch.manual_seed(0)
    net = nn.Linear(8, 8)
    exact = net.weight.detach().clone()
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2",
                          dtype="bf16", master="split")
    assert torch.equal(opt.fp32_values()[net.weight], exact)
    assert torch.equal(net.weight, split_of(exact)[0])  # re-derived by the split
    assert torch.equal(mp.fp32_state_dict(net)["weight"], exact)
    fresh = nn.Linear(8, 8)
    fresh, fresh_opt = mp.prepare(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1),
                                  level="O2", dtype="bf16", master="split")
    fresh.load_state_dict(mp.fp32_state_dict(net))  # a model state_dict splits exactly again
    assert torch.equal(fresh_opt.fp32_values()[fresh.weight], exact)


# -- checkpoints of another method ----------------------------------------------------------------
@pytest.mark.parametrize("saved,loaded", [("kahan", "split"), ("split", "kahan"),
                                          ("split", "stochastic")])
def test_a_state_of_another_master_method_is_refused(saved, loaded):
    def make(master):
        torch.manual_seed(0)
        net = nn.Linear(8, 8)
        return mp.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3), level="O2",
                          dtype="bf16", master=master)

    net, opt = make(saved)
    net(torch.randn(2, 8)).float().sum().backward()
    opt.step()
    _, other = make(loaded)
    with pytest.raises(ValueError, match=f"holds a '(compensation|remainder)' buffer .*"
                                         f"master='{loaded}'.*same master method"):
        other.load_state_dict(opt.state_dict())


# -- bytes per parameter with torchao's 8-bit AdamW -----------------------------------------------
def test_bytes_per_parameter_with_8bit_adamw():
    """split + torchao's AdamW8bit (generic path): 2 weight + 2 remainder + 2 x ~1 byte moments
    (plus their per-block scales)."""
    optim = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    net, opt = mp.prepare(net, optim.AdamW8bit(net.parameters(), lr=1e-3), level="O2",
                          dtype="bf16", master="split")
    net(torch.randn(2, 512)).float().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    got = mp.bytes_per_parameter(net, opt)
    assert got["compensation"] == 2 and got["masters"] == 0
    assert 6 <= got["total"] < 6.2
    assert mp.parallel.plan(1e6, level="O2", strategy="single", master="split").masters == 2e6


def test_a_remainder_of_another_dtype_is_refused():
    net = nn.Linear(8, 8)
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2",
                          dtype="bf16", master="split")
    net(torch.randn(2, 8)).float().sum().backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        if "remainder" in entry:
            entry["remainder"] = entry["remainder"].to(torch.int64)  # int32: FSDP2's wire form
    with pytest.raises(ValueError, match="torch.int64 'remainder' buffer .*keeps it in "
                                         "torch.int16"):
        opt.load_state_dict(sd)
