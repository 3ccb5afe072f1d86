"""bench/launch_count.py: what one O2 fp16 training step runs beyond torch.autocast fp16 +
GradScaler (aten ops over a whole step, counted by a dispatch mode on the CPU)."""

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("launch_count", ROOT / "bench/launch_count.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernels(bench, ops):
    return sum(n for op, n in ops.items() if op not in bench.VIEWS)


def test_o2_fp16_step_runs_no_more_ops_than_autocast_and_gradscaler():
    """Per step, O2 fp16 runs no more aten ops (views included) than torch.autocast fp16 +
    GradScaler + fused AdamW: one fused inf/NaN check per dtype group (no op per gradient), the
    two foreach copies of the masters (16-bit gradients into the fp32 scratch, masters back into
    the weights), no unscale pass (the loss scale goes to torch's fused kernel as grad_scale),
    the overflow flag handed to the kernel (found_inf: it takes back its step count with one
    ``_foreach_sub_``, as under GradScaler), and one host read of the flag."""
    bench = _bench()
    width, layers = 32, 1
    ref = bench.count("autocast-fp16", width, layers)
    ops = bench.count("O2-fp16", width, layers)
    assert sum(ops.values()) <= sum(ref.values()), bench.diff(ops, ref)
    assert _kernels(bench, ops) < _kernels(bench, ref), bench.diff(ops, ref)  # views left out
    # one fused check per gradient dtype (fp16 weights, fp32 norm parameters), none per tensor
    assert ops["aten._amp_foreach_non_finite_check_and_unscale_"] == 2
    assert ops["aten.aminmax"] == 0 and ops["aten.stack"] <= ref["aten.stack"]  # none per grad
    assert ops["aten._foreach_copy_"] == 2 and ops["aten._foreach_mul_"] == 0
    assert ops["aten._foreach_sub_"] == 1  # the fused kernel took found_inf
    assert ops["aten._local_scalar_dense"] == 1  # the overflow flag, read once


def test_o2_fp16_reads_the_flag_after_the_step_and_the_scale_update():
    """By phase: the check is one launch (and its 0-d flag), the dynamic scale update torch's
    one kernel plus 8 ops on 0-d tensors (bounds, the skips at min_scale), and the only host
    read comes after both are queued."""
    bench = _bench()
    phases = bench.count("O2-fp16", 32, 1, by_phase=True)
    assert phases["check"] <= 4, phases
    assert phases["scale update"] <= 9, phases
    assert phases["read"] == 1, phases  # the _local_scalar_dense, after update()
    assert phases["step"] == 0, phases  # nothing else in amp.step


def test_o2_bf16_step_runs_fewer_ops_than_autocast_bf16():
    bench = _bench()
    ops, ref = bench.count("O2-bf16", 32, 1), bench.count("autocast-bf16", 32, 1)
    assert _kernels(bench, ops) < _kernels(bench, ref), bench.diff(ops, ref)
