"""dtype="auto" on a CPU decides from a measured bf16/fp32 GEMM ratio, not from CPU flags, and
says why. The measurement is injected here (no timing in these tests)."""

import logging

import pytest
import torch

import mixprec as mp
from mixprec import hardware, policy
from mixprec.commands import doctor

# an Intel Xeon with AVX512-BF16 and no AMX, as measured (bf16 GEMMs slower than fp32's)
SLOWER = {"fp32_gflops": 80.0, "bf16_gflops": 43.2, "ratio": 0.54, "shape": [1024, 1024, 1024]}
# a CPU with AMX: bf16 several times fp32
FASTER = {"fp32_gflops": 100.0, "bf16_gflops": 600.0, "ratio": 6.0, "shape": [1024, 1024, 1024]}


@pytest.fixture
def cpu(monkeypatch):
    """Inject a probe measurement and CPU flags; forget which devices were told about."""
    monkeypatch.delenv("MIXPRECISION_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(policy, "_told", set())
    monkeypatch.setattr(hardware, "_warned", set())

    def use(probe, flags=()):
        monkeypatch.setattr(hardware, "cpu_gemm_probe", lambda: dict(probe))
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    return use


def test_bf16_flags_with_slower_measured_gemms_resolve_auto_to_fp32_saying_why(cpu, caplog):
    cpu(SLOWER, flags={"avx512_bf16"})
    caps = mp.device_capabilities("cpu")
    assert caps["dtypes"]["bf16"]["fast"] is False
    assert caps["auto_dtype"] == "fp32"
    assert "43.2 GFLOP/s in bf16 against 80 in fp32 (0.54x)" in caps["auto_reason"]
    assert caps["gemm_probe"]["ratio"] == 0.54
    with caplog.at_level(logging.INFO, logger="mixprec"):
        with pytest.warns(mp.SlowDtypeWarning, match=r"auto.*fp32.*0\.54x.*slower than fp32"):
            assert policy.resolve_dtype("auto", "cpu") == torch.float32
    told = [r.getMessage() for r in caplog.records if r.name == "mixprec"]
    assert len(told) == 1 and told[0].startswith("dtype='auto' -> fp32 on cpu:")
    assert "0.54x" in told[0]
    with pytest.warns(mp.SlowDtypeWarning, match=r"bf16 is not fast .*0\.54x"):
        policy.resolve_dtype("bf16", "cpu")  # asked for explicitly: trained in, with a note


def test_faster_measured_bf16_resolves_auto_to_bf16_without_any_bf16_flag(cpu, caplog):
    cpu(FASTER, flags=())
    with caplog.at_level(logging.INFO, logger="mixprec"):
        assert policy.resolve_dtype("auto", "cpu") == torch.bfloat16
        policy.resolve_dtype("auto", "cpu")  # logged once per device
    told = [r.getMessage() for r in caplog.records if r.name == "mixprec"]
    assert told == ["dtype='auto' -> bf16 on cpu: bf16 is fast here (a 1024x1024x1024 GEMM "
                    "measured 600 GFLOP/s in bf16 against 100 in fp32 (6.00x))"]


@pytest.mark.parametrize("ratio,fast", [(0.99, False), (1.0, True), (1.3, True)])
def test_the_verdict_turns_at_fp32s_rate(ratio, fast):
    probe = {**SLOWER, "ratio": ratio}
    assert hardware.bf16_verdict(probe)[0] is fast


def test_doctor_reports_the_measured_ratio_behind_auto(cpu, capsys):
    cpu(SLOWER, flags={"avx512_bf16", "avx512f"})
    rep = doctor.doctor_report("cpu", measure=False)
    assert rep["auto_dtype"] == "fp32" and rep["dtypes"]["bf16"]["fast"] is False
    assert rep["gemm_probe"] == SLOWER
    doctor._print(rep)
    out = capsys.readouterr().out
    assert "dtype='auto' -> fp32:" in out and "(0.54x)" in out


def test_the_probe_is_measured_once_per_process():
    hardware.cpu_gemm_probe()  # may run here, or ran before
    first = hardware.cpu_gemm_probe.cache_info()
    again = hardware.cpu_gemm_probe()
    assert hardware.cpu_gemm_probe.cache_info().hits == first.hits + 1
    assert set(again) == {"fp32_gflops", "bf16_gflops", "ratio", "shape"}
    assert again["fp32_gflops"] > 0 and again["bf16_gflops"] > 0
