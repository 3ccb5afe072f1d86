"""The compact step on cached lists (mixprec.optim.compact_lists) against the generic step
through the inner optimizer's own ``step()``: bitwise equal, and layout changes fall back."""

import pytest
import torch
from torch import nn

from mixprec.optim import CompactMasterOptimizer, compact_lists

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
