"""bench/step_bytes.py and its counter (bench/_bytes.py): bytes each aten op reads and writes by
its schema, checked on ops whose traffic is known, and the script's run on a tiny model; and the
rows the step benchmarks (peer_memory.py, step_speed.py) train."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 1000


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bytes_mod():
    return _load("_bytes")


def _fp32(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def test_in_place_add_reads_both_and_writes_self(bytes_mod):
    a, b = _fp32(0), _fp32(1)
    t = bytes_mod.count(lambda: a.add_(b))
    assert (t.read, t.written, t.launches) == (8 * N, 4 * N, 1)


def test_cast_to_bf16_reads_four_writes_two(bytes_mod):
    a = _fp32()
    t = bytes_mod.count(lambda: a.to(torch.bfloat16))
    assert (t.read, t.written, t.total, t.launches) == (4 * N, 2 * N, 6 * N, 1)


def test_copy_destination_is_written_not_read(bytes_mod):
    src, dst = _fp32(), torch.zeros(N, dtype=torch.bfloat16)
    t = bytes_mod.count(lambda: dst.copy_(src))
    assert (t.read, t.written) == (4 * N, 2 * N)
    t = bytes_mod.count(lambda: dst.zero_())
    assert (t.read, t.written) == (0, 2 * N)


def test_out_argument_is_written_not_read(bytes_mod):
    a, b, out = _fp32(0), _fp32(1), torch.empty(N)
    t = bytes_mod.count(lambda: torch.mul(a, b, out=out))
    assert (t.read, t.written) == (8 * N, 4 * N)


def test_views_and_allocations_move_nothing(bytes_mod):
    a = _fp32()
    t = bytes_mod.count(lambda: (a.view(10, N // 10).t()[1:], a.detach(), torch.empty(N)))
    assert (t.total, t.launches) == (0, 0)


def test_peak_live_is_the_most_allocated_memory_alive_at_once(bytes_mod):
    """Two fp32 buffers alive together, then one: the peak is both, and nothing stays live."""
    def work():
        x = torch.empty(N)
        y = x + 1
        del x, y
        torch.empty(N)
    t = bytes_mod.count(work)
    assert (t.peak_live, t.live) == (8 * N, 0)
    a, b = _fp32(0), _fp32(1)
    assert bytes_mod.count(lambda: a.add_(b)).peak_live == 0  # in place: nothing allocated


def test_tensor_lists_count_every_tensor(bytes_mod):
    xs, ys = [_fp32(i) for i in range(3)], [_fp32(10 + i) for i in range(3)]
    t = bytes_mod.count(lambda: torch._foreach_add_(xs, ys))
    assert (t.read, t.written, t.launches) == (3 * 8 * N, 3 * 4 * N, 1)
    assert t.by_op == {"aten._foreach_add_": 3 * 12 * N}


def test_fused_adamw_moves_32_bytes_per_fp32_parameter(bytes_mod):
    """torch's fused AdamW marks params, grads, exp_avg and exp_avg_sq mutated: each read and
    written (32 B), plus its 0-d step count."""
    p = torch.nn.Parameter(_fp32())
    p.grad = _fp32(1)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    t = bytes_mod.count(opt.step)
    assert t.by_op["aten._fused_adamw_"] == 32 * N + 4  # + the fp32 step read
    assert abs(t.total / N - 32) < 0.05


def _run_script(tmp_path, *flags) -> tuple[str, dict]:
    """bench/step_bytes.py on 2 x Linear(32, 32) in a fresh process: its output and rows."""
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench/step_bytes.py"), "--layers", "2",
                           "--width", "32", "--batch", "1", *flags, "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, {r["name"]: r for r in json.loads(out.read_text())["rows"]}


def test_script_on_a_tiny_model(tmp_path):
    """The script runs eagerly in a fresh process and its rows hold the known counts: torch's
    fused step 32 B/param, widen + kernel + cast 44, the computed ideal 28, autocast's weight
    cast in the forward and gradient cast in the backward 6 each beyond a bf16 model's."""
    stdout, rows = _run_script(tmp_path, "--backward")
    assert "| row | step B/param |" in stdout
    assert len(rows) == 7
    autocast = rows["torch fused AdamW, fp32 params, `torch.autocast` bf16"]
    assert autocast["step"] == pytest.approx(32, abs=0.2)
    assert autocast["transient"] == pytest.approx(0, abs=0.1)  # torch's kernel: in place
    assert autocast["forward"] == pytest.approx(6, abs=0.5)  # + the input's cast, one token
    assert autocast["backward"] == pytest.approx(6, abs=0.5)
    fused_only = next(r for name, r in rows.items() if name.startswith("O2 with torch's fused"))
    assert fused_only["step"] == pytest.approx(44, abs=0.2)
    assert rows["ideal fused O2 step (computed)"]["step"] == 28
    for name in ("O2 bf16, fp32 masters", 'O2 `master="split"`', 'O2 `master="kahan"`',
                 'O2 `master="stochastic"`'):
        assert rows[name]["step"] >= 28 and rows[name]["launches"] >= 1, rows[name]


def test_script_with_bf16_moments_counts_their_rounding(tmp_path):
    """``--state-dtype bf16``: mixprec's rows widen each bf16 moment for the update and round it
    back (at least 2 + 4 read and written per moment, twice), torch's rows are unchanged."""
    steps = {}
    for state_dtype in ("fp32", "bf16"):
        out = tmp_path / f"{state_dtype}.json"
        proc = subprocess.run([sys.executable, str(ROOT / "bench/step_bytes.py"), "--layers", "2",
                               "--width", "32", "--batch", "1", "--state-dtype", state_dtype,
                               "--json", str(out)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(out.read_text())
        assert report["state_dtype"] == state_dtype
        steps[state_dtype] = {r["name"]: r["step"] for r in report["rows"]}
    for name, fp32 in steps["fp32"].items():
        if name.startswith("O2 bf16") or name.startswith("O2 `master"):
            assert steps["bf16"][name] >= fp32 + 12, name
        else:
            assert steps["bf16"][name] == fp32, name


@pytest.mark.parametrize("row", ["autocast", "O2", "optimi-kahan"])
def test_llama_rows_train_at_a_tiny_size(row):
    """The rows bench/peer_memory.py and bench/step_speed.py compare build and train (loss
    falls over 3 steps) on a tiny Llama-like stack; optimi's row needs the bench extra. (The
    other master methods share O2's builder; their first steps compile, too slow here.)"""
    if row == "optimi-kahan":
        pytest.importorskip("optimi")
    sys.path.insert(0, str(ROOT / "bench"))
    llama = _load("_llama")
    trainee = llama.make(row, vocab=64, dim=32, layers=1, heads=2, hidden=64)
    losses = [trainee.step() for _ in range(3)]
    assert losses[-1] < losses[0], losses
    assert trainee.timed_update() > 0
    if row == "O2":
        assert next(trainee.model.parameters()).dtype == torch.bfloat16


def test_compiled_master_step_row_counts_its_kernel_by_hand(tmp_path):
    """With --compiled, the compiled fp32-master step's kernel (torch's AdamW between the
    widening and the cast, one kernel per parameter) reads the bf16 gradient, the master and
    the moments and writes them and the bf16 weight: 28 B/param, the ideal fused step, and the
    row adds what runs around it (the bf16 inf/NaN check)."""
    _, rows = _run_script(tmp_path, "--compiled")
    row = next(r for name, r in rows.items() if "compile" in name)
    assert row["step_ops"]["compiled master kernel"] == pytest.approx(28, abs=0.3)
    assert row["step_launches"]["compiled master kernel"] == 4  # one per parameter
    assert row["step"] < rows["O2 bf16, fp32 masters"]["step"]


def test_cuda_paths_check_bf16_gradients_read_only(tmp_path):
    """``--paths cuda`` counts with CUDA's kernel choices imposed: a bf16 step's inf/NaN check
    is a read-only inf-norm (2 B/param) where the CPU's choice reads and writes (4), so fp32
    masters' step moves 2 B/param less; torch's rows are unchanged."""
    _, cpu = _run_script(tmp_path, "--paths", "cpu")
    _, cuda = _run_script(tmp_path, "--paths", "cuda")
    masters = "O2 bf16, fp32 masters"
    assert cuda[masters]["step"] == pytest.approx(cpu[masters]["step"] - 2, abs=0.1)  # + norms
    for name in ("torch fused AdamW, fp32 params, `torch.autocast` bf16",
                 "ideal fused O2 step (computed)"):
        assert cuda[name]["step"] == cpu[name]["step"]
