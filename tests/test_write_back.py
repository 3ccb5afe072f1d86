"""The bf16 write-back of fp32 masters (mixprec.master.write_back): CUDA's compiled pass, driven on
the CPU with CUDA's row of the kernel table imposed, writes the same bits as the eager passes and
as the split's weight, on every kind of value (exact ties either side of an even or odd high
half, just below and above a half, infinities, the largest finite value rounding to inf, NaNs of
every payload, zeros, subnormals), and a run of O2 bf16 steps is bit for bit the same on both
paths."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from torch import nn

from mixprec import kernel_table
from mixprec.master import guard, write_back
from mixprec.master.guard import can_compile
from mixprec.master.optimizer import MasterWeightOptimizer
from mixprec.masters import split_bits

needs_compiler = pytest.mark.skipif(not can_compile("cpu"),
                                    reason="torch.compile on the CPU needs a C++ compiler")
# (the first compile of the kernel takes seconds on a 2-core CPU: these run in make test-slow)
KERNEL = "fp32-master write-back"


def _bits(*words: int) -> torch.Tensor:
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32)


def special_values() -> torch.Tensor:
    lows = (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF)
    highs = (0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0000, 0x8000, 0x0001, 0x7F7F, 0xFF7F, 0x7F80,
             0xFF80, 0x7FC0, 0x7FFF, 0xFFFF, 0x7F81)
    words = [(h << 16) | lo for h in highs for lo in lows]
    words = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    gen = torch.Generator().manual_seed(0)
    return torch.cat([_bits(*words), torch.randn(4096, generator=gen),
                      torch.randn(4096, generator=gen).to(torch.bfloat16).float() + 2.0 ** -9])


@pytest.fixture
def cuda_row(monkeypatch):
    monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing("cuda"))
    guard.forget_verdicts()
    yield
    guard.forget_verdicts()


def test_the_table_compiles_the_write_back_on_cuda_and_cuts_it_into_pieces_on_the_cpu():
    assert kernel_table.TABLE.write_back_path("cuda") == "compiled"
    assert kernel_table.TABLE.write_back_path("cpu") == "chunks"
    assert kernel_table.TABLE.write_back_path("mps") == "flat"
    assert kernel_table.TABLE.imposing("cuda").write_back_path("cpu") == "compiled"


def test_cpu_pieces_write_the_bits_of_one_flat_pass(monkeypatch):
    """Small tensors go together, a large contiguous one in slices, a large transposed one
    whole; fp16 weights by torch's cast: every bit as the flat passes write them."""
    monkeypatch.setattr(write_back, "CHUNK", 64)
    values = special_values()
    cut = [values[:10], values[10:40], values[40:300], values[300:500].reshape(10, 20).t(),
           values[500:530], values[530:4000], values[4000:4100].reshape(10, 10)]
    dtypes = [torch.bfloat16] * 6 + [torch.float16]
    params = [torch.empty(v.shape, dtype=d) for v, d in zip(cut, dtypes)]
    flat = [torch.empty(v.shape, dtype=d) for v, d in zip(cut, dtypes)]
    sizes = [sum(p.numel() for p in ps) for ps, _ in write_back._pieces(params, cut)]
    assert max(s for s in sizes if s != 200) <= 64 and 200 in sizes  # the transposed one whole
    assert sum(sizes) == sum(v.numel() for v in cut)
    write_back.round_into_(params, cut)
    split_bits.round_into_(flat, cut)
    for p, f in zip(params, flat):
        nan = f.isnan()
        assert torch.equal(p[~nan].view(torch.int16), f[~nan].view(torch.int16))
        assert bool(p[nan].isnan().all())


def test_eager_write_back_runs_no_compiled_kernel_on_the_cpu_row():
    guard.forget_verdicts()
    values = special_values()
    out = torch.empty_like(values, dtype=torch.bfloat16)
    write_back.round_into_([out], [values])
    assert not any(key[0] == KERNEL for key in guard.verdicts())
    expect = split_bits.split_of(values)[0]
    finite = ~values.isnan()
    assert torch.equal(out[finite].view(torch.int16), expect[finite].view(torch.int16))
    assert bool(out[~finite].isnan().all())


@pytest.mark.slow
@needs_compiler
@pytest.mark.filterwarnings("error::mixprec.master.guard.CompiledKernelWarning")
def test_compiled_write_back_writes_the_eager_bits_on_every_kind_of_value(cuda_row):
    values = special_values()
    cut = [values[:90], values[90:4000].reshape(10, -1)[:, :390].contiguous(), values[4000:]]
    parts = [v.reshape(-1) for v in cut]
    compiled = [torch.empty(v.shape, dtype=torch.bfloat16) for v in cut]
    write_back.round_into_(compiled, cut)
    assert guard.verdicts()[(KERNEL, "cpu", (torch.float32, torch.int16))] is True
    eager = [torch.empty(v.shape, dtype=torch.bfloat16) for v in cut]
    split_bits.round_into_(eager, cut)
    for c, e, v in zip(compiled, eager, parts):
        nan = v.isnan()
        c, e = c.reshape(-1), e.reshape(-1)
        assert torch.equal(c[~nan].view(torch.int16), e[~nan].view(torch.int16))
        assert torch.equal(c[~nan].view(torch.int16),
                           split_bits.split_of(v)[0][~nan].view(torch.int16))
        assert bool(c[nan].isnan().all()) and bool(e[nan].isnan().all())
    # the ties: away from zero, where torch's cast goes to even
    tie = _bits(0x3F808000, -0x407F8000)  # 1 + 2**-8 (tie, even high), its negative
    out = torch.empty(2, dtype=torch.bfloat16)
    write_back.round_into_([out], [tie])
    assert out.view(torch.int16).tolist() == [0x3F81, -0x407F]
    assert tie.to(torch.bfloat16).view(torch.int16).tolist() == [0x3F80, -0x4080]


@pytest.mark.slow
@needs_compiler
def test_fp16_and_bf16_weights_in_one_call(cuda_row):
    values = [torch.randn(7, 5), torch.randn(33)]
    params = [torch.empty(7, 5, dtype=torch.float16), torch.empty(33, dtype=torch.bfloat16)]
    write_back.round_into_(params, values)
    assert torch.equal(params[0], values[0].half())
    assert torch.equal(params[1].view(torch.int16),
                       split_bits.split_of(values[1])[0].view(torch.int16))


def _train(steps: int = 5) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = torch.randn(64, 16, dtype=torch.bfloat16), torch.randn(64, 4)
    for _ in range(steps):
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return ([p.detach().clone() for p in model.parameters()],
            [opt.master_param(p).detach().clone() for p in model.parameters()])


@pytest.mark.slow
@needs_compiler
def test_o2_steps_are_bitwise_the_same_on_both_paths(monkeypatch):
    weights, masters = _train()
    monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing("cuda"))
    guard.forget_verdicts()
    got_w, got_m = _train()
    assert guard.verdicts()[(KERNEL, "cpu", (torch.float32, torch.int16))] is True
    guard.forget_verdicts()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(weights, got_w))
    assert all(torch.equal(a, b) for a, b in zip(masters, got_m))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not can_compile("cuda"), reason="needs Triton")
def test_cuda_compiled_write_back_is_trusted_and_writes_the_split_bits():
    guard.forget_verdicts()
    values = special_values().cuda()
    out = torch.empty(values.shape, dtype=torch.bfloat16, device="cuda")
    write_back.round_into_([out], [values])
    assert guard.verdicts()[(KERNEL, "cuda:0", (torch.float32, torch.int16))] is True
    nan = values.isnan()
    assert torch.equal(out[~nan].view(torch.int16),
                       split_bits.split_of(values)[0][~nan].view(torch.int16))
    assert bool(out[nan].isnan().all())


@pytest.mark.slow
@needs_compiler
def test_the_write_back_benchmark_times_four_ways(capsys):
    path = pathlib.Path(__file__).resolve().parents[1] / "bench/write_back_speed.py"
    spec = importlib.util.spec_from_file_location("write_back_speed", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tensors", "3", "--numel", "1000", "--rounds", "1", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    for way in ("torch cast", "flat passes", "passes in pieces", "compiled pass"):
        assert way in out
