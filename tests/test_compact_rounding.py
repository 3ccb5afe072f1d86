"""The Kahan compensation's own rounding (stochastic, so the pair is unbiased), fp16 stochastic
rounding, the noise-table numbers it uses, and the fp32 export of a weight whose compensation
sits exactly half an ulp away.
"""

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.masters.rounding import RoundingGenerator, noise16, round_fp16_with, stochastic_round
from mixprec.optim import CompactMasterOptimizer
from mixprec.optim.writes import rounds_to

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")


# -- the drift of many small updates of one sign --------------------------------------------------
def test_kahan_follows_fp32_under_updates_far_below_an_ulp():
    """Weights in [1, 2), SGD, a constant gradient giving updates of 1e-5 (1/780 of a bf16 ulp
    there), 2000 steps: fp32 moves the weights by 0.0200. A compensation rounded to nearest
    drifted to 0.0221 (+10.6%); rounded stochastically, measured: -0.03%."""
    torch.manual_seed(0)
    start = 1 + torch.rand(1024)
    ref = nn.Parameter(start.clone())
    ref_opt = torch.optim.SGD([ref], lr=1.0)
    w = nn.Parameter(start.bfloat16())
    opt = CompactMasterOptimizer(torch.optim.SGD([w], lr=1.0), "kahan", fused=False,
                                 initial_values={w: start})
    grad = torch.tensor(-1e-5, dtype=torch.bfloat16)  # both step with the same gradient
    for _ in range(2000):
        ref.grad = torch.full_like(ref, grad.item())
        w.grad = torch.full_like(w, grad.item())
        ref_opt.step()
        opt.step()
    moved = (opt.fp32_values()[w] - start).mean().item()
    want = (ref.detach() - start).mean().item()
    assert want == pytest.approx(0.0200, rel=5e-3)
    assert moved == pytest.approx(want, rel=0.02)


def test_kahan_saves_its_generator_without_other_state_and_resumes_bitwise():
    """Plain SGD keeps no state of its own: the generator rides on a compensation's entry."""
    def run(steps, resume_from=None, first=0):
        torch.manual_seed(0)
        w = nn.Parameter(torch.rand(64).bfloat16())
        opt = CompactMasterOptimizer(torch.optim.SGD([w], lr=1e-3), "kahan", fused=False)
        if resume_from is not None:
            w.data.copy_(resume_from[0])
            opt.load_state_dict(resume_from[1])
        for i in range(first, first + steps):
            w.grad = torch.linspace(-1, 1, 64, dtype=torch.bfloat16) * (i + 1)
            opt.step()
        return w.detach().clone(), opt.state_dict()

    whole = run(6)[0]
    w, sd = run(3)
    assert "rounding_generator" in sd["state"][0]
    resumed = run(3, resume_from=(w, sd), first=3)[0]
    assert torch.equal(whole, resumed)


# -- fp16 stochastic rounding and the table's numbers --------------------------------------------
def fp16_round(x, key):
    """``x`` rounded stochastically to fp16 with the numbers of ``key``, as a Kahan pair's fp16
    compensation is."""
    return round_fp16_with(x, noise16(key, x))


@pytest.mark.parametrize("per_element", [False, True], ids=["one key", "a key per element"])
@pytest.mark.parametrize("value", [1.0 + 1 / 3 * 2.0 ** -10, -3e-3, 1e-7, 3.3e-6, 6e4,
                                   6e4 + 8])
def test_fp16_stochastic_rounding_is_unbiased_and_lands_on_neighbours(value, per_element):
    x = torch.full((2 ** 14,), value)
    lo = x[:1].half()
    other = torch.nextafter(lo, torch.full_like(lo, float("inf") if lo.float() < x[0] else
                                                float("-inf")))
    key = RoundingGenerator(3).keys(1)[0]
    got = fp16_round(x, key.expand(x.shape) if per_element else key).float()
    assert set(got.unique().tolist()) <= {lo.float().item(), other.float().item()}
    gap = (other.float() - lo.float()).abs().item()
    p = abs(value - lo.float().item()) / gap
    sd = gap * (p * (1 - p) / x.numel()) ** 0.5
    assert abs(got.mean().item() - value) < 5 * sd + 1e-12 * abs(value)


def test_fp16_stochastic_rounding_passes_specials_and_exact_values():
    key = RoundingGenerator().keys(1)[0]
    x = torch.tensor([0.0, 65504.0, -1.5, 2.0 ** -24, 2.0 ** -14, float("inf"), -float("inf")])
    assert torch.equal(fp16_round(x, key).float(), x)
    assert torch.isinf(fp16_round(torch.tensor([1e6]), key)).all()
    assert torch.isnan(fp16_round(torch.tensor([float("nan")]), key)).all()


def test_table_numbers_are_uniform_over_keys_for_every_element():
    like = torch.empty(8)
    drawn = torch.stack([noise16(k, like) for k in RoundingGenerator(5).keys(20000)]).float()
    assert drawn.min() >= 0 and drawn.max() <= 65535
    assert (drawn.mean(0) / 65535 - 0.5).abs().max() < 0.01
    x = torch.full((4096,), 1.0 + 0.25 * 2.0 ** -7)  # a quarter of the way to the next bf16
    up = (stochastic_round(x, RoundingGenerator(9).keys(1)[0]).float() > 1).float()
    assert up.mean().item() == pytest.approx(0.25, abs=0.02)


# -- the fp32 export at ties ----------------------------------------------------------------------
def test_rounds_to_accepts_both_neighbours_of_a_tie_only():
    w = torch.tensor([1.0078125, 1.0078125, 1.0078125, 0.0, -2.0], dtype=torch.bfloat16)
    half = 2.0 ** -8  # half a bf16 ulp at 1
    v = torch.tensor([1.0078125 + half, 1.0078125 - half, 1.0078125 + 1.01 * half, 1e-41, -2.0])
    assert rounds_to(v, w).tolist() == [True, True, False, True, True]


def test_state_dict_keeps_weight_plus_compensation_at_half_an_ulp():
    """A compensation of exactly half an ulp beside an odd weight: weight + compensation rounds
    (to even) to the other neighbour, yet it is the value the optimizer steps: the export keeps
    it (it once took the 16-bit weight, as if the parameter had been written directly)."""
    model = nn.Sequential(nn.Linear(4, 4))
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level="O2",
                            dtype="bf16", master="kahan")
    w = model[0].weight
    with torch.no_grad():
        w.fill_(1.0078125)  # odd: its last mantissa bit is 1
        comp = opt.compensation(w)
        comp.zero_()
        comp[0, 0] = 2.0 ** -8  # exactly half an ulp
        comp[0, 1] = 2.0 ** -12
    want = w.float() + comp.float()
    assert want[0, 0].bfloat16() != w[0, 0]  # a tie, rounded to the even neighbour
    for exported in (model.state_dict()["0.weight"], mp.fp32_state_dict(model)["0.weight"],
                     mp.fp32_state_dict(model, opt)["0.weight"]):
        assert torch.equal(exported, want)
    with torch.no_grad():
        w[1, 1] = 3.0  # a direct write is still taken as the truth
    assert model.state_dict()["0.weight"][1, 1] == 3.0
