"""A master optimizer's ``step(closure, **kwargs)`` (compact methods, and fp32 masters alike): the
closure runs first and makes the gradients; an optimizer that re-evaluates inside its step (LBFGS)
sees the model at the values it steps and their new gradients, so ``master="split"`` steps LBFGS
bit for bit as fp32 masters do; keywords reach the inner optimizer's ``step``.

Tolerances: split against fp32 masters none (bit-exact: the same fp32 values, the same torch
cast shown to the model); Kahan and stochastic rounding within 2% of fp32 masters' loss after
4 LBFGS steps (their weights round differently from the first store on).
"""

import pytest
import torch
from torch import nn

from mixprec.optim import CompactMasterOptimizer, MasterWeightOptimizer


def _wrapped(inner, master):
    return (MasterWeightOptimizer(inner) if master == "fp32"
            else CompactMasterOptimizer(inner, master))


def _closure(opt, loss_of, calls, after=lambda calls: None):
    """A closure: zero the gradients, backward ``loss_of()``, count the call in ``calls``, then
    ``after(calls)``."""
    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = loss_of()
        loss.backward()
        after(calls)
        return loss
    return closure


def _lbfgs_run(master, steps=4, norm=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(torch.bfloat16)
    if norm:  # an fp32 parameter after a 16-bit one in the group (a norm kept fp32 at O2)
        model.insert(1, nn.LayerNorm(8))
    x, y = torch.randn(32, 6).bfloat16(), torch.randn(32, 1)
    opt = _wrapped(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5), master)
    calls = []
    closure = _closure(opt, lambda: ((model(x).float() - y) ** 2).mean(), calls)
    losses = [float(opt.step(closure).detach()) for _ in range(steps)]
    return model, losses, len(calls)


@pytest.mark.parametrize("norm", [False, True])
def test_split_steps_lbfgs_bitwise_as_fp32_masters(norm):
    """LBFGS reads a group as one flat vector: the values stand in for the parameters in the
    group's order (with the fp32 ones put first its dot products rounded otherwise: 2.4e-7)."""
    fp32_model, fp32_losses, fp32_calls = _lbfgs_run("fp32", norm=norm)
    model, losses, calls = _lbfgs_run("split", norm=norm)
    assert calls == fp32_calls > 4  # re-evaluated inside each step
    assert losses == fp32_losses and losses[-1] < 0.5 * losses[0]
    for p, q in zip(model.parameters(), fp32_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_kahan_and_stochastic_step_lbfgs_as_fp32_masters_within_2_percent(master):
    _, fp32_losses, _ = _lbfgs_run("fp32")
    _, losses, _ = _lbfgs_run(master)
    assert losses[-1] == pytest.approx(fp32_losses[-1], rel=0.02)


@pytest.mark.parametrize("master", ["fp32", "split", "kahan"])
def test_a_closure_of_a_per_parameter_optimizer_runs_once_before_the_step(master):
    """AdamW with a closure: it runs once, its loss is returned, and the step is the one a
    backward then ``step()`` takes (bitwise: torch's fused kernel, on the cached lists after the
    first step), for fp32 masters as for the compact methods."""
    def make():
        torch.manual_seed(0)
        model = nn.Linear(4, 3).to(torch.bfloat16)
        return model, _wrapped(torch.optim.AdamW(model.parameters(), lr=1e-2), master)
    x = torch.randn(5, 4).bfloat16()
    a, opt_a = make()
    b, opt_b = make()
    calls = []
    closure = _closure(opt_a, lambda: a(x).float().pow(2).mean(), calls)
    for _ in range(3):
        loss = opt_a.step(closure)
        opt_b.zero_grad()
        expected = b(x).float().pow(2).mean()
        expected.backward()
        assert opt_b.step() is None
        assert torch.equal(loss.detach(), expected.detach())
    assert len(calls) == 3
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def step(self, closure=None, optim=None):
        self.seen.append(optim)
        return super().step(closure)


def test_keywords_reach_the_inner_optimizer():
    model = nn.Linear(4, 2).to(torch.bfloat16)
    inner = _RecordingSGD(model.parameters(), lr=0.1)
    opt = CompactMasterOptimizer(inner, "kahan")
    model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
    before = model.weight.detach().clone()
    opt.step(optim="sgd")
    assert inner.seen == ["sgd"] and not torch.equal(model.weight, before)


def test_a_re_evaluation_without_a_gradient_reads_zeros_as_torchs_lbfgs():
    """A closure that leaves a parameter without a gradient on a re-evaluation: that gradient
    reads zeros, as torch's LBFGS reads it (bitwise as fp32 masters)."""
    def run(master):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).to(torch.bfloat16)
        opt = _wrapped(torch.optim.LBFGS(model.parameters(), max_iter=3), master)
        x = torch.randn(4, 3).bfloat16()

        def drop(calls):
            if len(calls) > 1:
                model[0].bias.grad = None

        opt.step(_closure(opt, lambda: model(x).float().pow(2).sum(), [], drop))
        return model

    for p, q in zip(run("split").parameters(), run("fp32").parameters()):
        assert torch.equal(p, q)
