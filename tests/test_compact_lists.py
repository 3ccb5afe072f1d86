"""The compact step on cached lists (mixprec.optim.compact_lists) against the generic step
through the inner optimizer's own ``step()``: bitwise equal, and layout changes fall back."""

import copy
import types

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.masters.rounding import RoundingGenerator
from mixprec.optim import CompactMasterOptimizer, compact_lists, family

INNERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def _model(seed=0):
    torch.manual_seed(seed)
    # a 24x40 weight (960 elements) is cut into slices by a 256-element piece
    return nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 8), nn.Linear(8, 3)).to(torch.bfloat16)


def _grads(model, step, skip=()):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(model.parameters()):
        p.grad = None if i in skip else (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)


def _run(master, inner, state_dtype, steps, generic, monkeypatch, skips=None):
    model = _model()
    opt = CompactMasterOptimizer(INNERS[inner](model.parameters()), master,
                                 state_dtype=state_dtype, bucket_mb=256 / 2 ** 18)
    used = []
    with monkeypatch.context() as m:
        if generic:
            m.setattr(compact_lists, "prepare", lambda opt, items: None)
        for i in range(steps):
            _grads(model, i, (skips or {}).get(i, ()))
            was = opt.lists
            opt.step()
            used.append(was is not None and opt.lists is was)
    return model, opt, used


def _same(a, b):
    (ma, oa), (mb, ob) = a, b
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa.view(torch.int16), pb.view(torch.int16))
        sa, sb = oa.state[pa], ob.state[pb]
        assert sorted(sa) == sorted(sb)
        for k, v in sa.items():
            if torch.is_tensor(v):
                assert v.dtype == sb[k].dtype and torch.equal(v, sb[k]), k


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("master", ["split", "kahan", "stochastic"])
def test_lists_equal_generic_bitwise(master, inner, state_dtype, monkeypatch):
    fast = _run(master, inner, state_dtype, 4, False, monkeypatch)
    slow = _run(master, inner, state_dtype, 4, True, monkeypatch)
    assert fast[2] == [False, True, True, True]  # the first step makes the state, then lists
    assert not any(slow[2])
    _same(fast[:2], slow[:2])


@pytest.mark.parametrize("salt", [0, 5, 2 ** 21 + 3])
def test_the_step_keys_are_the_rounding_generators(salt):
    """family.draw_keys draws what RoundingGenerator.keys draws, in its order (a resumed run
    continues bitwise whichever draws)."""
    a, b = RoundingGenerator(7), RoundingGenerator(7)
    opt = types.SimpleNamespace(rounding=a, salt=salt, master=mp.masters.Kahan(),
                                state_dtype=torch.float32)
    items = [None] * 5
    for _ in range(2):
        got = family.draw_keys(opt, items)
        assert torch.equal(got, torch.stack(b.keys(3 * len(items), salt)).view(-1, 3))
    assert torch.equal(a.state_dict(), b.state_dict())
    # split with fp32 moments rounds nothing stochastically: nothing drawn (a skipped step on
    # the device then leaves the generator as a skipped step on the host does); bf16 moments do
    opt.master = mp.masters.Split()
    assert family.draw_keys(opt, items) is None
    assert torch.equal(a.state_dict(), b.state_dict())
    opt.state_dtype = torch.bfloat16
    assert torch.equal(family.draw_keys(opt, items),
                       torch.stack(b.keys(3 * len(items), salt)).view(-1, 3))


@pytest.mark.parametrize("master", ["split", "kahan", "stochastic"])
def test_a_parameter_without_a_gradient_steps_through_the_inner_step(master, monkeypatch):
    """A step where one parameter has no gradient falls back (and makes lists for that layout);
    the step after it, with every gradient again, falls back too; then the lists hold again.
    Bitwise equal to the generic step throughout."""
    skips = {2: (1,)}
    fast = _run(master, "adamw", "bf16", 6, False, monkeypatch, skips)
    slow = _run(master, "adamw", "bf16", 6, True, monkeypatch, skips)
    assert fast[2] == [False, True, False, False, True, True]
    _same(fast[:2], slow[:2])


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_add_param_group_makes_the_lists_again(inner, monkeypatch):
    def run(generic):
        with monkeypatch.context() as m:
            if generic:
                m.setattr(compact_lists, "prepare", lambda opt, items: None)
            model = _model()
            opt = CompactMasterOptimizer(INNERS[inner](list(model[0].parameters())), "kahan",
                                         state_dtype="bf16", bucket_mb=256 / 2 ** 18)
            used = []
            for i in range(5):
                if i == 2:
                    opt.add_param_group({"params": list(model[1:].parameters()), "lr": 3e-3})
                    assert opt.lists is None
                _grads(model, i)
                was = opt.lists
                opt.step()
                used.append(was is not None and opt.lists is was)
        return model, opt, used

    fast, slow = run(False), run(True)
    assert fast[2] == [False, True, False, True, True]
    _same(fast[:2], slow[:2])


@pytest.mark.parametrize("master", ["split", "kahan", "stochastic"])
def test_load_state_dict_makes_the_lists_again(master, monkeypatch):
    """A checkpoint taken after 2 steps (on the lists), loaded into the optimizer after 2 more:
    the lists are made again, and the next 2 steps repeat the first run's bit for bit."""
    model, opt, _ = _run(master, "adam", "bf16", 2, False, monkeypatch)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    after = []
    for round_ in range(2):
        for i in range(2, 4):
            _grads(model, i)
            opt.step()
        after.append([p.detach().clone() for p in model.parameters()]
                     + [opt.compensation(p) for p in model.parameters()])
        assert opt.lists is not None
        model.load_state_dict(saved_model)
        opt.load_state_dict(copy.deepcopy(saved_opt))
        assert opt.lists is None
    for a, b in zip(*after):
        assert (a is None and b is None) or torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("inner", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, maximize=True),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-3)])
def test_options_the_lists_skip_step_through_the_inner_step(inner, monkeypatch):
    model = _model()
    opt = CompactMasterOptimizer(inner(model.parameters()), "kahan")
    for i in range(3):
        _grads(model, i)
        opt.step()
        assert opt.lists is None


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
@pytest.mark.parametrize("master", ["kahan", "split"])
def test_a_loss_scale_and_fp32_parameters_beside(master, inner, monkeypatch):
    """Gradients carrying a factor of 1024 (``step(grad_scale=)``: torch's kernel divides while
    reading) and an fp32 parameter in the group (stepped by the inner optimizer's own step):
    bitwise equal to the generic step, the lists used from the second step."""
    def run(generic):
        with monkeypatch.context() as m:
            if generic:
                m.setattr(compact_lists, "prepare", lambda opt, items: None)
            model = _model()
            extra = nn.Parameter(torch.linspace(-1, 1, 6))
            opt = CompactMasterOptimizer(INNERS[inner]([*model.parameters(), extra]), master)
            scale = torch.tensor(1024.0)
            used = []
            for i in range(4):
                _grads(model, i)
                for p in model.parameters():
                    p.grad *= 1024
                extra.grad = torch.full((6,), 0.25 * (i + 1)) * 1024
                was = opt.lists
                opt.step(grad_scale=scale)
                used.append(was is not None and opt.lists is was)
        return model, opt, used, extra

    fast, slow = run(False), run(True)
    assert fast[2] == [False, True, True, True] and not any(slow[2])
    _same(fast[:2], slow[:2])
    assert torch.equal(fast[3], slow[3])


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_a_nan_moment_on_the_lists_comes_with_a_nan_weight(master, inner, monkeypatch):
    """bf16 moments on the lists are rounded without the NaN pass: a NaN gradient element in a
    step taken on the lists leaves the weight NaN there (NaN-safe store), bitwise as the generic
    step everywhere else, and the moments differ from the generic step's (which keeps them NaN)
    only where the generic ones are NaN."""
    def run(generic):
        model = _model()
        opt = CompactMasterOptimizer(INNERS[inner](model.parameters()), master,
                                     state_dtype="bf16", bucket_mb=256 / 2 ** 18)
        with monkeypatch.context() as m:
            if generic:
                m.setattr(compact_lists, "prepare", lambda opt, items: None)
            for i in range(3):
                _grads(model, i)
                if i == 2:
                    first = next(model.parameters())
                    first.grad[0, :5] = float("nan")
                opt.step()
        return model, opt

    (fm, fo), (gm, go) = run(False), run(True)
    assert fo.lists is not None  # the NaN step ran on the lists
    for pf, pg in zip(fm.parameters(), gm.parameters()):
        nan = pg.isnan()
        assert torch.equal(pf.isnan(), nan)
        assert torch.equal(pf[~nan].view(torch.int16), pg[~nan].view(torch.int16))
        for key, value in go.state[pg].items():
            if not (torch.is_tensor(value) and value.shape == pg.shape):
                continue
            bad = value.isnan()
            assert bad.sum() == (5 if pf is next(fm.parameters()) else 0), key
            assert nan[bad].all()  # where a moment is NaN, so is the weight
            assert torch.equal(fo.state[pf][key][~bad].view(torch.int16),
                               value[~bad].view(torch.int16)), key
