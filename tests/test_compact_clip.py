"""Clipping after ``unscale_`` with a compact fp16 optimizer (``master="kahan"``): torch code and
Lightning's plugin unscale, then clip, then step. The clip must reach the fp32 copies of the fp16
gradients the step reads, and the model's gradients must read as the clipped ones."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp

CLIP = 0.05


def _run(master: str, unscale_first: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    amp = mp.MixedPrecision(level="O2", dtype="fp16", master=master)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    norms, shown = [], []
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=gen), torch.arange(8) % 3
        amp.backward(F.cross_entropy(model(x).float(), y))
        if unscale_first:
            amp.unscale_(opt)
        norms.append(float(amp.clip_grad_norm_(opt, CLIP)))
        shown.append(float(torch.linalg.vector_norm(
            torch.cat([p.grad.float().flatten() for p in model.parameters()]))))
        assert amp.step(opt) is True
    return mp.fp32_state_dict(model, opt), norms, shown


@pytest.mark.parametrize("unscale_first", [True, False])
def test_kahan_fp16_clipped_after_unscale_steps_as_fp32_masters_do(unscale_first):
    kahan, kahan_norms, shown = _run("kahan", unscale_first)
    fp32, fp32_norms, _ = _run("fp32", unscale_first)
    assert all(n > CLIP for n in kahan_norms)  # the clip acts on every step
    # the same true gradients: norms within fp16's rounding of the same weights (measured: equal)
    assert kahan_norms == pytest.approx(fp32_norms, rel=1e-3)
    # Kahan's masters carry ~22 bits: measured 1.3e-7 from fp32 masters over 3 steps
    for key in fp32:
        torch.testing.assert_close(kahan[key], fp32[key], rtol=0, atol=1e-6)
    # the model's fp16 gradients read as the clipped ones (measured 2.6e-5 off: fp16 rounding)
    assert shown == pytest.approx([CLIP] * 3, rel=1e-4)


def test_a_clip_of_the_fp16_gradients_after_unscale_is_refused_with_clips_that_work():
    """The refusal names only what works for a compact optimizer (its ``param_groups`` hold the
    fp16 parameters, so clipping them is what it refuses), and each clip it names steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    amp = mp.MixedPrecision(level="O2", dtype="fp16", master="kahan")
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 8), torch.arange(8) % 3
    amp.backward(F.cross_entropy(model(x).float(), y))
    amp.unscale_(opt)
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], CLIP)
    before = {k: v.clone() for k, v in mp.fp32_state_dict(model, opt).items()}
    with pytest.raises(RuntimeError, match=r"amp\.clip_grad_value_\(optimizer, clip_value\)") \
            as refused:
        amp.step(opt)
    assert "param_groups" not in str(refused.value)
    assert all(torch.equal(v, before[k]) for k, v in mp.fp32_state_dict(model, opt).items())
    amp.scaler.update()  # the refused step changed nothing; the next iteration
    for clip in (lambda: amp.clip_grad_norm_(opt, CLIP), lambda: amp.clip_grad_value_(opt, 1e-3)):
        opt.zero_grad()
        amp.backward(F.cross_entropy(model(x).float(), y))
        amp.unscale_(opt)
        clip()  # what the refusal names
        assert amp.step(opt) is True
