"""The kernel table's choices beyond the gradient passes, each run here on the CPU with the
table's CUDA row imposed: the master step CUDA takes (and that no fp32 master gradient lives
between steps on any path), torch's fused optimizers by device, the monitor's probe, and norm
layers fed 16-bit activations."""

import pytest
import torch
import torch.nn.functional as F
from test_kernel_table import CudaAmpKernel
from torch import nn

import mixprec as mp
from mixprec import kernel_table
from mixprec.optim import kernels
from mixprec.optim.params import held_grad

pytestmark = pytest.mark.filterwarnings(
    "ignore::mixprec.hardware.SlowDtypeWarning",
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")

BF16 = torch.bfloat16


@pytest.fixture
def cuda_limits(monkeypatch):
    """CPU tensors take CUDA's kernel paths, with a fake of torch's CUDA check kernel."""
    monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing(
        "cuda", kernels={"amp_check_and_unscale": CudaAmpKernel()}))


# -- the master step CUDA takes, and no fp32 master gradient between steps ------------------------
def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))


def data(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def fp32_gradient_bytes(model, opt):
    """Gradient bytes held beyond the model's own gradients (what masters hold), measured."""
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    held = mp.bytes_per_parameter(model, opt)["gradients"] * count
    return held - sum(p.grad.numel() * p.grad.element_size() for p in params
                      if p.grad is not None)


def test_a_compiling_trainer_takes_cudas_master_step_under_cudas_limits(cuda_limits):
    def fused_of(trainer_compile):
        model = net()
        return mp.Trainer(model, F.mse_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                          level="O2", dtype="bf16", compile=trainer_compile,
                          progress=False).optimizer.fused
    assert fused_of(True) == "auto"  # torch's fused kernels, as on a GPU
    assert fused_of(False) == "auto"


def test_a_compiling_trainer_on_the_cpu_takes_the_compiled_master_step():
    model = net()
    trainer = mp.Trainer(model, F.mse_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                         level="O2", dtype="bf16", compile=True, progress=False)
    assert trainer.optimizer.fused == "compile"


HOWS = ["step", "scaler.step", "unscale_ then step", "skipped step"]


@pytest.mark.parametrize("fused,how", [(f, h) for f in ("cuda's choice", False) for h in HOWS]
                         + [("compile", "step"), ("compile", "unscale_ then step")])
def test_no_fp32_master_gradient_lives_between_steps(cuda_limits, fused, how):
    """The step drops every master's fp32 gradient on every path (4 B/param otherwise), also
    after an unscale_ made them all and when an overflow skips the step."""
    model = net()
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level="O2",
                            dtype="bf16")
    choice = kernel_table.TABLE.master_step("cpu")  # "fused" here: CUDA's row
    assert choice == "fused" and kernels.torch_fused_problem(opt.inner, [
        t for g in opt.param_groups for t in g["params"]]) is None
    opt.fused = "auto" if fused == "cuda's choice" else fused
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    for i in range(2):
        opt.zero_grad()
        x, y = data(i)
        loss = F.mse_loss(model(x).float(), y)
        if how == "step":
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss * (float("inf") if how == "skipped step" else 1)).backward()
            if how == "unscale_ then step":
                scaler.unscale_(opt)
                assert fp32_gradient_bytes(model, opt) > 0  # made, for clipping
            assert scaler.step(opt) is (how != "skipped step")
            scaler.update()
        assert fp32_gradient_bytes(model, opt) == 0
        assert all(held_grad(m) is None for m in opt.masters_by_param().values())


# -- torch's fused optimizers, by the table -------------------------------------------------------
@pytest.mark.parametrize("row", ["cpu", "cuda", "other"])
def test_the_master_step_takes_torchs_fused_kernel_where_the_table_has_one(monkeypatch, row):
    """CPU and CUDA rows: torch's fused AdamW; a device without one (MPS, XPU here): the
    optimizer's own step. Same masters either way, to fp32 rounding."""
    if row != "cpu":
        monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing(
            "xpu" if row == "other" else row))
    entered = []  # torch's fused kernel, through the inner step or the cached lists
    real, real_call = kernels.torch_fused, kernels.fused_call
    monkeypatch.setattr(kernels, "torch_fused", lambda inner: entered.append(1) or real(inner))
    monkeypatch.setattr(kernels, "fused_call",
                        lambda *a: entered.append(1) or real_call(*a))
    model = net()
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level="O2",
                            dtype="bf16")
    masters = [m.detach().clone().requires_grad_() for m in opt.masters_by_param().values()]
    ref = torch.optim.AdamW(masters, lr=1e-2, foreach=False)
    for i in range(2):
        opt.zero_grad()
        x, y = data(i)
        F.mse_loss(model(x).float(), y).backward()
        for m, p in zip(masters, opt.masters_by_param()):
            m.grad = p.grad.float()
        ref.step()
        opt.step()
    problem = kernels.torch_fused_problem(opt.inner, masters)
    assert (problem is None) is (row != "other") and (len(entered) > 0) is (row != "other")
    if row == "other":
        assert "torch.float32 tensor on cpu" in problem
    for m, want in zip(opt.masters_by_param().values(), masters):
        torch.testing.assert_close(m, want, rtol=1e-6, atol=1e-7)


def test_the_monitors_probe_uses_torchs_fused_kernel_where_the_table_has_one(monkeypatch):
    from mixprec.monitor import statistics
    group = {"params": [torch.zeros(2)]}
    inner = torch.optim.AdamW(group["params"])
    assert statistics._fused_options(inner, group) == {"fused": True, "foreach": False}
    monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing("mps"))
    assert statistics._fused_options(inner, group) == {}


# -- norm layers fed 16-bit activations -----------------------------------------------------------
@pytest.mark.parametrize("row", ["cpu", "cuda"])
def test_an_fp32_layernorm_reads_bf16_input_on_the_cpu_and_casts_it_up_on_cuda(monkeypatch, row):
    if row == "cuda":
        monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing("cuda"))
    fp32 = net()
    model = mp.prepare(net(), level="O2", dtype="bf16")
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == BF16
    assert model[1].forward.cast_inputs is (row == "cuda")
    seen = []
    model[1].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    x, _ = data(0)
    torch.testing.assert_close(model(x).float(), fp32(x), rtol=0.05, atol=0.05)
    assert seen == [torch.float32 if row == "cuda" else BF16]


# -- the piece a master step works on: a fixed size per device type ------------------------------
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_master_steps_piece_is_the_tables_for_the_device_whatever_the_models_size(
        device_type, monkeypatch):
    """fp32 masters' gradient buckets and the compact methods' pieces hold at most the table's
    piece for the device type (CUDA's row imposed on the CPU tensors: its cap, not the CPU's),
    for a model 16 times larger too (its tensors larger than a piece: a bucket of their own,
    stepped a slice at a time; cut into slices); ``bucket_mb`` overrides it."""
    if device_type == "cuda":
        monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing("cuda"))
    # 1/16 of the elements stepped, at least 2^20, at most the device type's cap: on the CPU
    # 2^20 whatever the model; on CUDA up to 2^25 (a model of 2^26 elements: 2^22)
    table = kernel_table.TABLE
    for elements, cpu, cuda in ((1000, 1 << 20, 1 << 20), (1 << 26, 1 << 20, 1 << 22),
                                (1 << 34, 1 << 20, 1 << 25)):
        assert table.step_piece("cpu", elements) == (cuda if device_type == "cuda" else cpu)
    for row in kernel_table.STEP_PIECE:  # the device's row at 4096 elements, the others huge
        monkeypatch.setitem(kernel_table.STEP_PIECE, row, 4096 if row == device_type else 1 << 30)
    for width in (32, 128):
        torch.manual_seed(0)
        layers = [nn.Linear(width, width) for _ in range(8)]
        model = nn.Sequential(*layers).bfloat16()
        fp32 = mp.MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        sizes = [[t.numel() for ts in b for t in ts] for b in fp32.buckets()]
        assert all(sum(s) <= 4096 or len(s) == 1 for s in sizes), sizes
        assert len(sizes) > 1
        model(torch.randn(4, width, dtype=BF16)).float().sum().backward()
        fp32.step()
        assert max(b.numel() for b in fp32.scratch.tensors()) <= 4096  # one slice at a time
        compact = mp.optim.CompactMasterOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3), "split")
        compact.step()
        held = max(b.numel() for b in compact.scratch.tensors())
        assert held <= 4096 and (held == 4096 or width * width < 4096)
    fp32.bucket_mb = compact.bucket_mb = 1  # 2^18 fp32 elements: every tensor in one bucket
    assert len(fp32.buckets()) == 1
    compact.step()
    assert max(b.numel() for b in compact.scratch.tensors()) == 8 * (width * width + width)
