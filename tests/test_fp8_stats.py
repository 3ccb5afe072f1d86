"""Per-layer FP8 statistics: what they record (against direct computations), that recording
adds no host sync, the table, plot and dict, and the Trainer callback that warns."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec as mp

pytest.importorskip("torchao.float8")


class Massive(nn.Module):
    """Adds ``value`` to one feature: a massive activation the next layer reads."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        offset = torch.zeros(x.shape[-1], dtype=x.dtype)
        offset[3] = self.value
        return x + offset


def net(outlier=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), Massive(outlier),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def data(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(n)]


def flushed(t, dtype):
    """Fraction of nonzero values of ``t`` a tensorwise cast to ``dtype`` rounds to zero."""
    fi = torch.finfo(dtype)
    a = t.detach().abs().float()
    return float(((a * (fi.max / a.max()) <= fi.tiny * fi.eps / 2) & (a > 0)).sum()
                 / (a > 0).sum())


def test_recorded_amax_scale_and_underflow_match_the_tensors():
    model = mp.prepare(net(outlier=3e4), level="O2", dtype="bf16", fp8="tensorwise",
                       fp8_modules=["2", "4"])
    seen, grads = {}, []

    def keep(module, args, out):
        seen["x"] = args[0].detach()
        out.register_hook(grads.append)

    model[4].register_forward_hook(keep)
    stats = mp.debug.fp8_stats(model)
    x, y = data(1)[0]
    F.cross_entropy(model(x), y).backward()
    rec = stats.summary()["4"]
    x4 = seen["x"].float()
    assert rec["input"]["amax"] == pytest.approx(float(x4.abs().max()), rel=1e-6)
    assert rec["input"]["scale"] == pytest.approx(448 / float(x4.abs().max()), rel=1e-6)
    assert rec["input"]["underflow"] == pytest.approx(flushed(x4, torch.float8_e4m3fn))
    assert rec["input"]["underflow"] > 0.05  # the outlier flushes much of the rest
    weight = model[4].weight.detach().float()
    assert rec["weight"]["amax"] == pytest.approx(weight.abs().max().item())
    assert rec["grad_output"]["amax"] == pytest.approx(float(grads[0].abs().max()), rel=1e-6)
    assert rec["grad_output"]["format"] == "e5m2" and rec["input"]["format"] == "e4m3"
    assert all(e["calls"] == 1 and e["saturated"] == 0 for e in rec.values())
    assert stats.summary()["2"]["input"]["underflow"] == 0.0


def test_rowwise_layers_record_per_row_scales():
    model = mp.prepare(net(), level="O2", dtype="bf16", fp8="rowwise")
    stats = mp.debug.fp8_stats(model)
    x, y = data(1)[0]
    F.cross_entropy(model(x), y).backward()
    rec = stats.summary()["2"]
    assert rec["grad_output"]["format"] == "e4m3"  # the rowwise recipe casts gradients to e4m3
    assert rec["input"]["scale"] == pytest.approx(448 / rec["input"]["amax"], rel=1e-6)


class _CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(), float(t), bool(t)
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def _step_syncs(record: bool) -> int:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = mp.MixedPrecision("O2", "bf16", fp8="tensorwise")
    model, opt = amp.setup(model, opt)
    stats = mp.debug.fp8_stats(model) if record else None
    x, y = data(1)[0]
    with _CountSyncs() as counter:
        amp.backward(F.cross_entropy(model(x), y))
        amp.step(opt)
    if record:
        assert stats.summary()["2"]["input"]["calls"] == 1
    return counter.syncs


def test_recording_adds_no_host_sync_to_a_step():
    assert _step_syncs(record=True) == _step_syncs(record=False)


def test_table_plot_dict_reset_close_and_two_handles(tmp_path):
    pytest.importorskip("matplotlib")
    model = mp.prepare(net(), level="O1", dtype="bf16", fp8="tensorwise")
    first, second = mp.debug.fp8_stats(model), mp.debug.fp8_stats(model)
    for x, y in data(2):
        F.cross_entropy(model(x), y).backward()
    table = first.table()
    assert "grad_output" in table and "e5m2" in table and table.count("\n") == 6
    assert first.to_dict()["2"]["recipe"] == "tensorwise"
    assert first.summary() == second.summary()
    path = first.plot(tmp_path / "fp8.png")
    assert path.stat().st_size > 1000
    first.reset()
    first.close()
    x, y = data(1)[0]
    F.cross_entropy(model(x), y).backward()
    assert first.summary()["2"]["input"]["calls"] == 0   # closed: no longer recording
    assert second.summary()["2"]["input"]["calls"] == 3  # still recording
    with pytest.raises(ValueError, match="no FP8 layers"):
        mp.debug.fp8_stats(mp.prepare(net(), level="O2", dtype="bf16"))


def _fit(outlier, monitor):
    model = net(outlier)
    trainer = mp.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=1e-3),
                         level="O2", dtype="bf16", fp8="tensorwise", fp8_modules=["2", "4"],
                         callbacks=[monitor], progress=False)
    trainer.fit(data(4), epochs=1)
    return trainer


def test_monitor_warns_when_a_layer_flushes_too_much():
    monitor = mp.FP8Monitor(every_n_steps=2, max_underflow=0.01)
    with pytest.warns(mp.debug.FP8RangeWarning, match=r"4: input underflow"):
        _fit(3e4, monitor)
    assert [step for step, _ in monitor.alerts] == [2, 4]  # one window each; none at the end
    assert all(line.startswith("4: input underflow") for _, line in monitor.alerts)


def test_monitor_is_quiet_on_an_ordinary_model():
    monitor = mp.FP8Monitor(every_n_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mp.debug.FP8RangeWarning)
        _fit(0.0, monitor)
    assert monitor.alerts == []
    with pytest.raises(ValueError, match="every_n_steps"):
        mp.FP8Monitor(every_n_steps=0)


def test_the_table_stays_fp32_under_a_16_bit_default_dtype():
    """Inside a Lightning O3 step torch's default dtype is bf16: the table was made in it, and
    its call counter stopped at 256 (bf16 counts integers exactly to 2**8 only)."""
    from mixprec.lowbit.stats import FIELDS, LayerStats

    stats = LayerStats({"input": torch.float8_e4m3fn}, {"input": None})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        for _ in range(300):
            stats.record("input", torch.ones(4, dtype=torch.float32))
    finally:
        torch.set_default_dtype(previous)
    assert stats.data.dtype == torch.float32
    assert stats.data[0, FIELDS.index("calls")].item() == 300
