"""The kernel table: its rows checked against torch's kernels, each CUDA-only branch run here on
the CPU with CUDA's limits imposed (a fake of torch's CUDA check-and-unscale kernel that refuses
bf16 exactly as the real one does), and the portable paths of a device type with no rows."""

import pytest
import torch
from test_differential import CLIPS, run
from torch import nn

from mixprec import kernel_table
from mixprec.scaling.unscale import check_and_unscale_, found_nonfinite

pytestmark = pytest.mark.filterwarnings(
    "ignore::mixprec.hardware.SlowDtypeWarning",
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = (F16, BF16, F32, F64, *FP8)
CUDA_AMP_DTYPES = (F16, F32, F64)  # AT_DISPATCH_FLOATING_TYPES_AND_HALF in AmpKernels.cu


# What the table decides is checked where it shows: the rows against torch's kernels (below),
# CUDA's paths run on the CPU under CUDA's limits (below), the CPU's by every training test.
@pytest.mark.parametrize("device_type", ["mps", "xpu"])
def test_a_device_type_without_rows_of_its_own_assumes_no_fused_kernel(device_type):
    """Every floating gradient takes the inf-norm check, the optimizer its own foreach step,
    norm layers an upcast input, the compiling Trainer torch's step; fp8 gradients are
    refused naming the dtype."""
    table = kernel_table.TABLE
    for dtype in (F16, BF16, F32, F64):
        assert table.unscale_path(device_type, dtype) == "inf_norm"
        assert table.check_path(device_type, dtype) == "inf_norm"
        assert table.fused_optimizer(device_type, dtype) is False
    for dtype in FP8:
        for path in (table.unscale_path, table.check_path):
            with pytest.raises(TypeError, match=rf"{dtype}.*must be one of"):
                path(device_type, dtype)
    assert table.master_step(device_type) == "fused"
    for kind in ("batch_norm", "layer_norm", "group_norm"):
        assert table.norm_reads_low_precision(kind, device_type) is False


def _accepts_torch(device, dtype):
    """What torch's own kernels on ``device`` accept for ``dtype``, by running them."""
    out = {}
    t = torch.tensor([1.0, -2.0, 3.0], device=device).to(dtype)
    tries = {
        "amp_check_and_unscale": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            [t.clone()], torch.zeros((), device=device), torch.ones((), device=device)),
        "foreach_norm_mul": lambda: (torch._foreach_norm([t], float("inf")),
                                     torch._foreach_mul_([t.clone()],
                                                         torch.ones((), device=device))),
        "aminmax": lambda: torch.aminmax(t),
    }
    for name, call in tries.items():
        try:
            call()
            out[name] = True
        except (NotImplementedError, RuntimeError):
            out[name] = False
    p = nn.Parameter(torch.ones(3, device=device).to(dtype)) if dtype not in FP8 else None
    if p is None:
        out["fused_optimizer"] = False
    else:
        p.grad = torch.ones_like(p)
        try:
            torch.optim.AdamW([p], lr=0.1, fused=True).step()
            out["fused_optimizer"] = True
        except (NotImplementedError, RuntimeError):
            out["fused_optimizer"] = False
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cpu_rows_are_what_torchs_cpu_kernels_accept(dtype):
    for name, accepted in _accepts_torch("cpu", dtype).items():
        assert kernel_table.TABLE.accepts(name, "cpu", dtype) is accepted, name


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cuda_rows_are_what_torchs_cuda_kernels_accept(dtype):
    for name, accepted in _accepts_torch("cuda", dtype).items():
        if name == "aminmax" and dtype in FP8:
            continue  # never asked on CUDA: the table refuses fp8 gradients before
        assert kernel_table.TABLE.accepts(name, "cuda", dtype) is accepted, name


# -- CUDA's limits imposed on the CPU -------------------------------------------------------------
class CudaAmpKernel:
    """torch's CUDA ``_amp_foreach_non_finite_check_and_unscale_`` as far as dtypes go: refuses
    what AT_DISPATCH_FLOATING_TYPES_AND_HALF does not cover, with the same error; else runs the
    CPU kernel (the same arithmetic: check the value, multiply in float32, round once)."""

    names = {BF16: "BFloat16", torch.float8_e4m3fn: "Float8_e4m3fn",
             torch.float8_e5m2: "Float8_e5m2"}

    def __init__(self):
        self.calls = []

    def __call__(self, tensors, found_inf, inv_scale):
        for t in tensors:
            if t.dtype not in CUDA_AMP_DTYPES:
                raise NotImplementedError(f'"_amp_foreach_non_finite_check_and_unscale_cuda" not '
                                          f"implemented for '{self.names[t.dtype]}'")
        self.calls.append(tuple(t.dtype for t in tensors))
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)


@pytest.fixture
def cuda_limits(monkeypatch):
    """CPU tensors take CUDA's kernel paths, with the fake kernel in place of torch's."""
    fake = CudaAmpKernel()
    monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing(
        "cuda", kernels={"amp_check_and_unscale": fake}))
    return fake


def test_the_fake_refuses_bf16_as_torchs_cuda_kernel_does():
    with pytest.raises(NotImplementedError, match="not implemented for 'BFloat16'"):
        CudaAmpKernel()([torch.ones(2, dtype=BF16)], torch.zeros(()), torch.ones(()))


def grads(dtype, bad):
    """Three gradients of ``dtype`` (one empty); ``bad`` (inf, -inf, NaN or None) in the second."""
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(5, 3, generator=g).mul(300).to(dtype), torch.randn(7, generator=g).to(dtype),
           torch.empty(0, dtype=dtype)]
    if bad is not None:
        out[1][3] = bad
    return out


BAD = [None, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("inv", [None, 0.125, 4.0])
@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_check_and_unscale_under_cudas_limits(cuda_limits, dtype, bad, inv):
    tensors = grads(dtype, bad)
    before = [t.clone() for t in tensors]
    inv_t = None if inv is None else torch.tensor(inv)
    found = check_and_unscale_(tensors, inv_t)
    assert found.dtype == torch.float32 and found.shape == ()
    assert (found.item() > 0) is (bad is not None)
    for t, b in zip(tensors, before):  # checked before multiplying, multiplied in fp32
        want = b if inv is None else (b.float() * inv).to(dtype)
        torch.testing.assert_close(t, want, rtol=0, atol=0, equal_nan=True)
    assert cuda_limits.calls == ([] if dtype is BF16 else [(dtype,) * 3])


@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_found_nonfinite_under_cudas_limits_reads_only(cuda_limits, dtype, bad):
    tensors = grads(dtype, bad)
    before = [t.clone() for t in tensors]
    found = found_nonfinite(tensors)
    assert (found.item() > 0) is (bad is not None)
    for t, b in zip(tensors, before):
        torch.testing.assert_close(t, b, rtol=0, atol=0, equal_nan=True)
    assert cuda_limits.calls == ([] if dtype is BF16 else [(dtype,) * 3])


def test_mixed_dtypes_and_a_sparse_gradient_under_cudas_limits(cuda_limits):
    """Each (device, dtype) group takes its own path; one flag for all."""
    sparse = torch.sparse_coo_tensor([[0, 2]], torch.tensor([1.0, float("nan")]), (4,),
                                     dtype=BF16, check_invariants=True).coalesce()
    for bad_one in range(3):
        tensors = [grads(d, None)[0] for d in (BF16, F16, F32)]
        tensors[bad_one][0, 0] = float("inf")
        assert found_nonfinite(tensors).item() > 0
        assert check_and_unscale_(tensors, torch.tensor(0.5)).item() > 0
    assert found_nonfinite([grads(F32, None)[0], sparse]).item() > 0
    fine = [grads(d, None)[0] for d in (BF16, F16, F32)]
    assert found_nonfinite(fine).item() == 0


def test_fp8_gradients_are_refused_with_the_dtype_named(cuda_limits):
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        found_nonfinite([torch.zeros(3, dtype=torch.float8_e4m3fn)])


def test_the_inf_norm_path_equals_the_fused_kernel_bitwise():
    """bf16 on CUDA's path and on the CPU's give the same flag and the same unscaled values."""
    plain = grads(BF16, float("nan"))
    imposed = [t.clone() for t in plain]
    inv = torch.tensor(1 / 3)
    flag = check_and_unscale_(plain, inv)
    table = kernel_table.TABLE.imposing("cuda", kernels={"amp_check_and_unscale": CudaAmpKernel()})
    saved, kernel_table.TABLE = kernel_table.TABLE, table
    try:
        assert kernel_table.TABLE.unscale_path("cpu", BF16) == "inf_norm"
        flag_imposed = check_and_unscale_(imposed, inv)
    finally:
        kernel_table.TABLE = saved
    assert (flag > 0).item() and (flag_imposed > 0).item()
    for a, b in zip(plain, imposed):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


# The CUDA cells that crashed on bf16 (O2/O3, a loss scale): the same runs here, CUDA's limits on.
BF16_SCALED = [(level, scaling, opt, clip) for level in ("O2", "O3")
               for scaling in ("dynamic", "overflow") for opt in ("sgd", "adamw_fused")
               for clip in CLIPS]


@pytest.mark.parametrize("level,scaling,opt_name,clip", BF16_SCALED)
def test_bf16_cells_with_a_loss_scale_match_fp32_under_cudas_limits(cuda_limits, level, scaling,
                                                                    opt_name, clip):
    run(level, "bf16", scaling, "channels_last", opt_name, clip)
    assert all(BF16 not in call for call in cuda_limits.calls)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_checkpointed_bf16_model_under_cudas_limits_computes_as_the_plain_one(cuda_limits, level):
    runs = [run(level, "bf16", "dynamic", "channels_last", "adamw_fused", "no clip", ckpt=c)[0]
            for c in (None, "non-reentrant")]
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert torch.equal(p, q)


# -- FSDP2 shards: one flag for all ranks, on CUDA's path as on the fused kernel's ----------------
BAD_ROWS = [None, 1, 6]  # rows 0-3 are rank 0's shard, 4-7 rank 1's


def _rank_flags(rank, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mixprec.shards import local
    kernel_table.TABLE = kernel_table.TABLE.imposing(
        "cuda", kernels={"amp_check_and_unscale": CudaAmpKernel()})
    mesh = init_device_mesh("cpu", (2,))
    out = []
    for bad_row in BAD_ROWS:
        full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        if bad_row is not None:
            full[bad_row, 1] = float("inf")
        shards = [distribute_tensor(full.to(d), mesh, [Shard(0)]) for d in (BF16, F32)]
        found = local(found_nonfinite(shards))
        unscaled = local(check_and_unscale_(shards, torch.tensor(0.5)))
        out.append({"found": found.item(), "unscaled": unscaled.item(),
                    "values": [s.to_local().float() for s in shards]})
    return out


@pytest.mark.slow  # two spawned gloo ranks
def test_sharded_bf16_gradients_under_cudas_limits_flag_on_every_rank(tmp_path):
    """An inf in one rank's shard flags the step on both, on CUDA's bf16 path too."""
    from parallel_cases import launch
    results = launch(_rank_flags, tmp_path)
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4) * 0.5
    for rank, per_case in enumerate(results):
        for bad_row, result in zip(BAD_ROWS, per_case):
            assert (result["found"] > 0) is (result["unscaled"] > 0) is (bad_row is not None)
            mine = full[4 * rank:4 * rank + 4]
            for values in result["values"]:
                ok = torch.isfinite(values)
                assert ok.sum() == 16 - (bad_row is not None and bad_row // 4 == rank)
                assert torch.equal(values[ok], mine[ok])


def _sharding_rules() -> set[str]:
    """The aten ops DTensor has a sharding rule for (what an FSDP2 shard can be stepped with)."""
    import torch.distributed.tensor._ops  # noqa: F401  (registers the rules)
    from torch.distributed.tensor import DTensor
    prop = DTensor._op_dispatcher.sharding_propagator
    return {str(op) for name in dir(prop) if isinstance(getattr(prop, name), dict)
            for op in getattr(prop, name)}


@pytest.mark.parametrize("optimizer_type,op", [(torch.optim.SGD, "aten._fused_sgd_.default"),
                                               (torch.optim.Adam, "aten._fused_adam_.default"),
                                               (torch.optim.AdamW, "aten._fused_adamw_.default")])
def test_fused_optimizers_on_fsdp2_shards_are_the_ones_dtensor_has_a_rule_for(optimizer_type, op):
    """The table's row is torch's registry: SGD's fused kernel has no DTensor rule (an FSDP2 run
    whose fp32 norms a compact master stepped with it raised NotImplementedError)."""
    assert kernel_table.TABLE.fused_optimizer_on_shards(optimizer_type) == (op in _sharding_rules())
