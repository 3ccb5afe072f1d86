"""The CUDA paths: prepare, the master-optimizer protocol with torch's fused kernels and the
compiled step, loss scaling, clipping, the Trainer with exact resume, and one compiled graph.

Every test needs a CUDA device and is skipped without one (see conftest.py).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.benchmodels import TinyGPT
from mixprec.optim.params import held_grad

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")]

DEV = "cuda"


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8)).to(DEV)


def batch(i, n=64):
    """Inputs and learnable targets (a fixed random tanh map of the inputs)."""
    g = torch.Generator(device=DEV).manual_seed(i)
    x = torch.randn(n, 32, device=DEV, generator=g)
    w = torch.randn(32, 8, device=DEV, generator=torch.Generator(device=DEV).manual_seed(99))
    return x, torch.tanh(x @ w / 4)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_levels_on_cuda_cast_compute_and_train(level, dtype):
    model = net()
    # SGD: at O3 Adam's state is fp16 too, and its eps (1e-8) rounds to 0 there
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = mp.prepare(model, opt, level=level, dtype=dtype)
    low = mp.policy_of(model).compute_dtype
    assert model[0].weight.dtype == (torch.float32 if level == "O1" else low)
    assert model[1].weight.dtype == (low if level == "O3" else torch.float32)
    scaler = mp.make_loss_scaler("auto", mp.policy_of(model))
    losses = []
    for i in range(20):
        x, y = batch(i % 4)
        loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("fused", ["auto", False, "compile"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_master_step_on_cuda_matches_an_fp32_reference(dtype, fused):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = mp.prepare(model, opt, level="O2", dtype=dtype)
    opt.fused = fused
    masters = [opt.master_param(p).detach().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=False)
    scaler = mp.StaticLossScaler(1024.0)
    for i in range(3):
        opt.zero_grad()
        x, y = batch(i)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float() / 1024.0
        torch.nn.utils.clip_grad_norm_(masters, 0.5)
        ref.step()
        scaler.clip_grad_norm_(opt, 0.5)
        assert scaler.step(opt)
        scaler.update()
        for p, m in zip(model.parameters(), masters):
            torch.testing.assert_close(opt.master_param(p), m, rtol=1e-5, atol=1e-6)
            m = opt.master_param(p).detach()  # written with torch's cast
            assert torch.equal(p, m.to(p.dtype))


def test_inf_on_cuda_skips_and_backs_off_without_touching_anything():
    model = net()
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            level="O2", dtype="fp16")
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 16)
    x, y = batch(0)
    scaler.scale(F.mse_loss(model(x), y)).backward()
    assert scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    state = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    scaler.scale(F.mse_loss(model(x), y) * float("inf")).backward()
    assert scaler.step(opt) is False
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 15
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    for key, value in opt.state_dict()["state"].items():
        assert torch.equal(value["momentum_buffer"], state["state"][key]["momentum_buffer"])


def test_no_fp32_gradient_between_steps_on_cuda():
    model = net()
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level="O2",
                            dtype="bf16")
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    opt.step()
    # held, not read: reading a master's .grad makes its fp32 gradient from the model's
    masters = opt.masters_by_param().values()
    assert masters and all(held_grad(m) is None for m in masters)
    count = sum(p.numel() for p in model.parameters())
    model_grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert mp.bytes_per_parameter(model, opt)["gradients"] * count == model_grads
    torch.cuda.synchronize()


def test_trainer_on_cuda_resumes_bitwise(tmp_path):
    data = [batch(i, 32) for i in range(6)]

    def trainer():
        model = net()
        return mp.Trainer(model, F.mse_loss, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          level="O2", dtype="fp16", max_grad_norm=1.0, progress=False)

    ref = trainer()
    ref.fit(data, epochs=2)
    first = trainer()
    first.fit(data, epochs=1)
    first.save(tmp_path / "ck.pt")
    resumed = trainer()
    resumed.load(tmp_path / "ck.pt")
    resumed.fit(data, epochs=2)
    for a, b in zip(resumed.model.parameters(), ref.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_prepared_model_on_cuda_is_one_graph_and_compiles(level):
    torch.manual_seed(0)
    model = mp.prepare(TinyGPT(64, 64, 2, 2, 32).to(DEV), level=level, dtype="bf16")
    x = torch.randint(0, 64, (4, 32), device=DEV)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch.testing.assert_close(torch.compile(model)(x), model(x), rtol=2e-2, atol=2e-2)


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
def test_cuda_forward_scale_unscale_and_clip_force_no_host_sync():
    model = net()
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level="O2",
                            dtype="fp16")
    scaler = mp.DynamicLossScaler()
    for i in range(2):  # the first iteration moves the scale to the GPU (one copy)
        x, y = batch(i)
        sync_checked = i == 1
        try:
            if sync_checked:
                torch.cuda.set_sync_debug_mode("error")
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.clip_grad_norm_(opt, 1.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert scaler.step(opt)  # reads the overflow flag: the one sync of an iteration
        scaler.update()
        opt.zero_grad()
