"""The loss-scaler <-> master-optimizer protocol, through every torch.amp idiom, at level O2.

Each idiom runs on a prepared O2 model (low-precision weights, fp32 masters) with a loss scale,
and is compared with a reference step computed by hand in fp32: the same model's scaled
low-precision gradients, upcast and divided by the scale (exact: a power of two), clipped in
fp32, and applied by the same torch optimizer to fp32 copies of the masters. The gradients are
identical; only the order of float32 additions in the norm may differ, so masters agree to
rtol 1e-5 / atol 1e-7, and each model weight is exactly its master rounded.
"""

import copy

import pytest
import torch
from torch import nn

import mixprec as mp

pytestmark = pytest.mark.filterwarnings(
    "ignore::mixprec.hardware.SlowDtypeWarning",
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")

TOL = {"rtol": 1e-5, "atol": 1e-7}
SCALE = {torch.float16: 2.0 ** 16, torch.bfloat16: 1024.0}
MAX_NORM = 0.05  # the gradients' norm is ~0.5: the clip bites


def build(dtype, fused, name="sgd"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}[name]
    model, opt = mp.prepare(model, make(model.parameters()), level="O2", dtype=dtype)
    opt.fused = fused
    return model, opt, make


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)


def loss_of(model, i):
    x, y = batch(i)
    return nn.functional.mse_loss(model(x), y)


class Reference:
    """The fp32-master step done by hand: fp32 copies of the masters, the same torch optimizer."""

    def __init__(self, model, opt, make):
        self.model = model
        self.masters = [opt.master_param(p).detach().clone().requires_grad_() for p in
                        model.parameters()]
        self.opt = make(self.masters)

    def step(self, scale, clip):
        for m, p in zip(self.masters, self.model.parameters()):
            m.grad = p.grad.float() / scale
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, clip)
        self.opt.step()


def idiom_no_clip(scaler, opt, model):
    return scaler.step(opt)


def idiom_clip_optimizer_params(scaler, opt, model):
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], MAX_NORM)
    return scaler.step(opt)


def idiom_scaler_clip(scaler, opt, model):
    norm = scaler.clip_grad_norm_(opt, MAX_NORM)
    assert norm.dtype == torch.float32 and norm > MAX_NORM
    return scaler.step(opt)


def idiom_unscale_then_clip_scaler(scaler, opt, model):
    scaler.unscale_(opt)
    scaler.clip_grad_norm_(opt, MAX_NORM)
    return scaler.step(opt)


IDIOMS = {"no clip": (idiom_no_clip, None),
          "clip optimizer params": (idiom_clip_optimizer_params, MAX_NORM),
          "scaler.clip_grad_norm_": (idiom_scaler_clip, MAX_NORM),
          "unscale_ then scaler.clip_grad_norm_": (idiom_unscale_then_clip_scaler, MAX_NORM)}
FUSED = ["auto", False, pytest.param("compile", marks=pytest.mark.slow)]


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("idiom", IDIOMS)
def test_idiom_matches_the_fp32_master_reference_step(idiom, dtype, fused):
    model, opt, make = build(dtype, fused)
    reference = Reference(model, opt, make)
    scaler = mp.StaticLossScaler(SCALE[dtype])
    run, clip = IDIOMS[idiom]
    for i in range(3):
        opt.zero_grad()
        scaler.scale(loss_of(model, i)).backward()
        reference.step(SCALE[dtype], clip)
        assert run(scaler, opt, model) is True
        scaler.update()
        for p, m in zip(model.parameters(), reference.masters):
            torch.testing.assert_close(opt.master_param(p), m, **TOL)
            m = opt.master_param(p).detach()  # written with torch's cast
            assert torch.equal(p, m.to(p.dtype))


@pytest.mark.parametrize("fused", ["auto", False])
def test_clipping_model_parameters_after_unscale_clips_what_the_step_uses_in_bf16(fused):
    """torch.amp's usual line: unscale_, clip the model's parameters, step. The model's
    gradients read as unscaled after unscale_, and their clipped values are what the step uses
    (reference: the same clipped bf16 gradients applied in fp32)."""
    model, opt, make = build(torch.bfloat16, fused)
    reference = Reference(model, opt, make)
    scaler = mp.StaticLossScaler(SCALE[torch.bfloat16])
    scaler.scale(loss_of(model, 0)).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert 0.1 < norm < 10  # the model's gradients read as unscaled after unscale_
    reference.step(1.0, None)  # the model's gradients are the clipped, unscaled ones now
    assert scaler.step(opt) is True
    for p, m in zip(model.parameters(), reference.masters):
        torch.testing.assert_close(opt.master_param(p), m, **TOL)


def test_clipping_fp16_model_parameters_after_unscale_raises_and_changes_nothing():
    """Unscaled in fp16, gradients below 6.1e-05 lose precision: that clip can't be taken
    exactly, so the step refuses it and points to the clips that work."""
    model, opt, _ = build(torch.float16, "auto")
    scaler = mp.StaticLossScaler(SCALE[torch.float16])
    scaler.scale(loss_of(model, 0)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"scaler\.clip_grad_norm_\(optimizer, max_norm\)"):
        scaler.step(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_grad_report_after_unscale_reports_unscaled_gradients():
    model, opt, _ = build(torch.bfloat16, "auto")
    scaler = mp.StaticLossScaler(1024.0)
    scaler.scale(loss_of(model, 0)).backward()
    scaled = mp.debug.grad_report(model, "bf16").total.max_abs
    scaler.unscale_(opt)
    assert mp.debug.grad_report(model, "bf16").total.max_abs == pytest.approx(scaled / 1024,
                                                                             rel=1e-6)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_an_ignored_optimizer_fails_loudly_at_its_first_step(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = (torch.optim.SGD if name == "sgd" else torch.optim.AdamW)(model.parameters(), lr=0.1)
    mp.prepare(model, opt, level="O2", dtype="bf16")  # the returned optimizer is ignored
    loss_of(model, 0).backward()
    opt.zero_grad()  # does not raise, but clears nothing the model holds...
    with pytest.raises(RuntimeError, match="optimizer prepare returned"):
        opt.step()  # ...and the first step says what to use


def test_skip_with_fold_clip_leaves_everything_untouched_and_recovers():
    model, opt, _ = build(torch.float16, "auto", "adamw")
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 16)
    scaler.scale(loss_of(model, 0) * float("inf")).backward()
    state = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    assert not torch.isfinite(scaler.clip_grad_norm_(opt, 1.0))
    assert scaler.step(opt) is False
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 15
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert opt.state_dict()["state"] == state["state"] == {}
    opt.zero_grad()
    scaler.scale(loss_of(model, 1)).backward()
    assert scaler.step(opt) is True


def test_scaler_protocol_drives_torch_fused_optimizers_and_plain_ones_alike():
    """clip_grad_norm_ on a plain (O1) optimizer: unscale, then torch's clip over param_groups."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = mp.StaticLossScaler(256.0)
    scaler.scale(loss_of(model, 0)).backward()
    norm = scaler.clip_grad_norm_(opt, MAX_NORM)
    loss_of(ref, 0).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    assert scaler.step(opt)
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_clip_grad_norm_rejects_bad_arguments_and_bad_order():
    model, opt, _ = build(torch.bfloat16, "auto")
    scaler = mp.StaticLossScaler(8.0)
    for bad in (0, -1.0, float("inf"), "1", True):
        with pytest.raises(ValueError, match="max_norm must be a positive finite number"):
            scaler.clip_grad_norm_(opt, bad)
    with pytest.raises(ValueError, match="norm_type must be a positive number"):
        scaler.clip_grad_norm_(opt, 1.0, norm_type=0)
    scaler.scale(loss_of(model, 0)).backward()
    scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) called on an optimizer after"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step\\(\\)"):
        scaler.clip_grad_norm_(opt, 1.0)
