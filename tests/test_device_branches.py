"""The branches that only a CUDA device takes outside the kernel table (device queries,
synchronisation, memory counters, capability checks), driven here on the CPU: torch.cuda's
queries are answered by stand-ins for the test's duration, and the branch's own logic runs."""

import types

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import distenv as env
from mixprec import hardware
from mixprec.advisor.capture import cuda_indices
from mixprec.commands import doctor, memory
from mixprec.compat.apex_casts import disable_casts
from mixprec.fp8 import choice
from mixprec.lowbit import backend
from mixprec.lowbit.mxfp8 import MXFP8
from mixprec.parallel.ddp import _comm_hook, device_ids_for
from mixprec.training.checks import check_device
from mixprec.training.state import capture_rng, restore_rng

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """torch.cuda answers as for one GPU of a given compute capability (default 9.0)."""
    calls = []
    fake = types.SimpleNamespace(capability=(9, 0), calls=calls)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.ones(3, dtype=torch.uint8)])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: calls.append(("rng", s)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: fake.capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: fake.capability >= (8, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("sync", d)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda d=None: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 3 * 2 ** 20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 10 * 2 ** 20)
    hardware._cuda_caps_cached.cache_clear()
    yield fake
    hardware._cuda_caps_cached.cache_clear()


def test_a_cuda_device_without_an_index_is_the_current_one(gpu):
    assert hardware._normalize_device("cuda") == torch.device("cuda", 1)
    assert hardware._normalize_device("cuda:0") == CUDA0


@pytest.mark.parametrize("capability,auto", [((9, 0), "bf16"), ((7, 5), "fp16"), ((6, 1), "fp32")])
def test_cuda_capabilities_and_the_auto_dtype_follow_the_compute_capability(gpu, capability,
                                                                              auto, monkeypatch):
    monkeypatch.delenv("MIXPRECISION_AUTO_DTYPE", raising=False)
    gpu.capability = capability
    caps = mp.device_capabilities("cuda:0")
    assert caps["auto_dtype"] == auto and caps["device"] == "cuda:0"
    assert "Stand-in GPU" in caps["name"]


def test_cuda_asked_for_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        hardware.device_capabilities("cuda:0")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        check_device("cuda")


def test_the_trainers_device_check_accepts_cuda_where_there_is_one(gpu):
    assert check_device("cuda:0") == CUDA0


def test_synchronize_and_the_peak_memory_counters_read_cuda_on_cuda(gpu):
    memory.synchronize(torch.device("cpu"))
    memory.synchronize(CUDA0)
    base = memory.reset_peak(CUDA0)
    assert base == 3 * 1024  # KiB
    assert memory.peak_mb(CUDA0, base) == 7.0
    assert gpu.calls == [("sync", CUDA0), ("reset", CUDA0)]


def test_doctors_fp16_note_is_for_the_cpu_only():
    slow = {"fast": False}
    assert "emulates fp16" in doctor._mixprec_note("fp16", slow, "cpu")
    assert doctor._mixprec_note("fp16", slow, "cuda") == ""


@pytest.mark.parametrize("capability,ok", [((8, 0), False), ((8, 9), True), ((9, 0), True)])
def test_fp8_needs_compute_capability_8_9(gpu, capability, ok):
    gpu.capability = capability
    backend.check_device(torch.device("cpu"))  # CPU: emulated, never refused
    if ok:
        backend.check_device(CUDA0)
    else:
        with pytest.raises(RuntimeError, match=r"8\.9 or newer.*Stand-in GPU is 8\.0"):
            backend.check_device(CUDA0)


@pytest.mark.parametrize("capability,native", [((9, 0), False), ((10, 0), True)])
def test_mxfp8_runs_natively_on_blackwell_only(gpu, capability, native):
    gpu.capability = capability
    assert MXFP8().native(CUDA0) is native
    assert MXFP8(emulate=True).native(CUDA0) is False
    assert MXFP8().native(torch.device("cpu")) is False


@pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")
def test_on_cuda_the_default_fp8_choice_applies_torchaos_shape_filter(monkeypatch):
    """Layers too small to gain from FP8 on an H100 stay in 16 bits on CUDA; the CPU (for
    numerics) keeps every eligible layer."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    assert mp.fp8_modules(mp.prepare(build(), level="O2", dtype="bf16",
                                     fp8="tensorwise")) == ["1", "2"]
    monkeypatch.setattr(choice, "module_device", lambda model: CUDA0)
    with pytest.warns(UserWarning, match="converts no layer"):
        model = mp.prepare(build(), level="O2", dtype="bf16", fp8="tensorwise")
    assert mp.fp8_modules(model) == []
    keep = backend.shape_filter("tensorwise")
    assert keep(nn.Linear(8192, 8192, device="meta"), "big")
    assert not keep(nn.Linear(64, 64, device="meta"), "small")


def test_ddp_gets_device_ids_on_cuda_only():
    assert device_ids_for(CUDA0) == {"device_ids": [CUDA0]}
    assert device_ids_for(torch.device("cpu")) == {}


def test_the_advisors_isolated_pass_forks_the_random_state_of_each_cuda_device():
    on = [types.SimpleNamespace(device=torch.device("cuda", i)) for i in (1, 0, 1)]
    assert cuda_indices([torch.zeros(1), *on]) == [0, 1]
    assert cuda_indices([torch.zeros(1)]) == []


def test_apex_disable_casts_turns_cuda_autocast_off_too(gpu):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with disable_casts():
            assert not torch.is_autocast_enabled("cpu")
            assert not torch.is_autocast_enabled("cuda")
        assert torch.is_autocast_enabled("cpu")


def test_a_checkpoints_rng_state_carries_the_cuda_generators(gpu):
    state = capture_rng()
    assert [t.tolist() for t in state["cuda"]] == [[1, 1, 1]]
    restore_rng(state)
    assert gpu.calls == [("rng", state["cuda"])]


def test_autocast_defaults_to_cuda_where_there_is_one(gpu):
    assert mp.autocast("bf16").device_type == "cuda"


def test_ddp_compresses_bf16_gradients_with_torchs_hook_on_nccl(gpu, monkeypatch):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert _comm_hook(torch.bfloat16, None) is default_hooks.bf16_compress_hook
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert _comm_hook(torch.bfloat16, None) is not default_hooks.bf16_compress_hook


def test_each_rank_takes_its_cuda_device_and_nccl_under_torchrun(gpu, monkeypatch):
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(name, value)
    made = []
    monkeypatch.setattr(env, "is_initialized", lambda: False)
    monkeypatch.setattr(env.dist, "init_process_group", lambda *a, **k: made.append((a, k)))
    monkeypatch.setattr(env, "_register_exit_hook", lambda: None)
    monkeypatch.setattr(env, "_created_here", False)
    assert env.device() == torch.device("cuda", 1)  # LOCAL_RANK 3 of 2 GPUs
    assert env.init_from_env(timeout_s=5) is True
    assert gpu.calls == [("set_device", torch.device("cuda", 1))]
    assert made[0][0] == ("cpu:gloo,cuda:nccl",)
    assert (made[0][1]["rank"], made[0][1]["world_size"]) == (1, 2)
