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


# host-side views of the fp32 gradient scratch buffer: no kernel on any device
VIEWS = {"aten.as_strided", "aten.view", "aten.alias", "aten.detach"}


def test_o2_fp16_step_runs_at_most_what_autocast_and_gradscaler_run_plus_the_masters():
    """The allowance, per step: one overflow check per 16-bit gradient on the CPU (a single
    fused launch on CUDA; on the CPU ``torch.aminmax`` per tensor is the faster check) and
    24 more ops: the two foreach copies of the masters (16-bit gradients into the fp32
    scratch, fp32 masters back into the 16-bit weights), the one unscale, the one host read
    of the overflow flag, and the dynamic scaler's update, ~20 scalar ops on 0-d tensors where
    GradScaler has one fused kernel (hysteresis and the skips-at-min count are mixprec's)."""
    bench = _bench()
    width, layers = 32, 1
    ref = bench.count("autocast-fp16", width, layers)
    ops = bench.count("O2-fp16", width, layers)
    n_grads = ops["aten.aminmax"]
    n_params = len(list(bench._model(width, layers, "cpu").parameters()))
    assert n_grads == n_params  # one check per gradient, nothing else per tensor
    launches = sum(n for op, n in ops.items() if op not in VIEWS)
    assert launches <= sum(ref.values()) + n_grads + 24, bench.diff(ops, ref)
    assert ops["aten._foreach_copy_"] == 2 and ops["aten._foreach_mul_"] == 1
    assert ops["aten._local_scalar_dense"] == 1  # the overflow flag, read once
    assert ops["aten.stack"] < n_grads  # the extremes stacked once, not per tensor


def test_o2_bf16_step_runs_fewer_ops_than_autocast_bf16():
    bench = _bench()
    ops, ref = bench.count("O2-bf16", 32, 1), bench.count("autocast-bf16", 32, 1)
    launches = sum(n for op, n in ops.items() if op not in VIEWS)
    assert launches < sum(ref.values()), bench.diff(ops, ref)
