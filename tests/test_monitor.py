"""PrecisionMonitor: the scalars against hand computations, recording cadence and cost shape,
writers (TensorBoard read back with its own EventAccumulator), mp.Trainer, and bad input."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.monitor import JSONLWriter, TensorBoardWriter, read_run
from mixprec.monitor.run import Run

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def batches(n=6, nan_at=None):
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]
    if nan_at is not None:
        out[nan_at] = (out[nan_at][0], torch.full((8, 4), float("nan")))
    return out


def run(level, dtype, monitor, opt_cls=torch.optim.SGD, n=6, nan_at=None, **opt_kwargs):
    amp = mp.MixedPrecision(level, dtype, monitor=monitor)
    model = net()
    model, opt = amp.setup(model, opt_cls(model.parameters(), **(opt_kwargs or {"lr": 0.1})))
    for x, y in batches(n, nan_at):
        amp.backward(F.mse_loss(model(x).float(), y))
        amp.step(opt)
        opt.zero_grad()
    return amp, model, opt


class Layer(nn.Module):
    """One weight of known values; the loss's gradient is ``grad`` exactly."""

    def __init__(self, values):
        super().__init__()
        self.weight = nn.Parameter(values.clone())

    def forward(self, grad):
        return (self.weight.float() * grad).sum()


# -- the update lost, against a hand computation -------------------------------------------------
def lost_after_one_step(level, values, grad, lr, opt_cls=torch.optim.SGD):
    monitor = mp.PrecisionMonitor(every=1)
    amp = mp.MixedPrecision(level, "bf16", monitor=monitor)
    model = Layer(values)
    model, opt = amp.setup(model, opt_cls(model.parameters(), lr=lr))
    amp.backward(model(grad))
    assert amp.step(opt)
    return monitor.records[0]["mixprec/model/weight_update_lost"], model, opt


def hand_lost(start, stored_after, intended):
    """1 - <taken, intended> / <intended, intended>, in float64."""
    taken = stored_after.double() - start.double()
    return 1 - float((taken * intended).sum() / (intended * intended).sum())


def test_update_lost_at_o3_is_near_one_for_tiny_updates_of_weights_in_one_to_two():
    torch.manual_seed(0)
    values = 1 + torch.rand(256)  # [1, 2): the bf16 spacing is 2**-7
    grad = torch.randn(256)
    lost, model, _ = lost_after_one_step("O3", values, grad, lr=1e-5)
    start = values.to(torch.bfloat16)
    intended = -1e-5 * grad.double()  # SGD: -lr * g
    expected = hand_lost(start, model.weight.detach(), intended)
    assert expected == pytest.approx(1.0, abs=1e-12)  # every update rounded away
    assert lost == pytest.approx(expected, abs=1e-6)


def test_update_lost_at_o3_for_updates_near_half_an_ulp_matches_the_hand_computation():
    torch.manual_seed(1)
    values = 1 + torch.rand(512)
    grad = torch.randn(512)
    lr = 2.0 ** -9  # updates of a quarter of a bf16 spacing, times N(0, 1): some round up
    lost, model, _ = lost_after_one_step("O3", values, grad, lr=lr)
    start = values.to(torch.bfloat16)
    # the intended update from the bf16 start, computed in fp32 as an fp32 SGD would, with the
    # gradient a bf16 weight gets (bf16)
    intended = (start.float() - lr * grad.to(torch.bfloat16).float()).double() - start.double()
    expected = hand_lost(start, model.weight.detach(), intended)
    assert 0.2 < expected < 0.99
    assert lost == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_update_lost_at_o2_is_zero_with_fp32_masters(opt_cls):
    torch.manual_seed(0)
    values = 1 + torch.rand(256)
    grad = torch.randn(256)
    lost, model, opt = lost_after_one_step("O2", values, grad, lr=1e-5, opt_cls=opt_cls)
    assert lost == pytest.approx(0.0, abs=1e-6)
    # by hand: the master took the whole update; the bf16 weight alone would have lost it
    master = opt.masters_by_param()[model.weight].detach()
    assert not torch.equal(master, values)
    assert hand_lost(values.to(torch.bfloat16), model.weight.detach(),
                     master.double() - values.double()) > 0.99


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")
def test_update_lost_with_kahan_masters_is_near_zero():
    torch.manual_seed(0)
    values, grad = 1 + torch.rand(256), torch.randn(256)
    monitor = mp.PrecisionMonitor(every=1)
    amp = mp.MixedPrecision("O2", "bf16", master="kahan", monitor=monitor)
    model = Layer(values)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=1e-5))
    amp.backward(model(grad))
    amp.step(opt)
    # weight + compensation kept the update, up to the bf16 compensation's own rounding (of a
    # remainder up to half a spacing, 2**-8: 2**-16 ~ 1.5e-5, the size of the update; measured
    # 0.019 here, against 1.0 for the bf16 weight alone)
    assert abs(monitor.records[0]["mixprec/model/weight_update_lost"]) < 0.05


# -- gradient underflow, activation range ----------------------------------------------------------
def test_grad_underflow_counts_values_below_the_smallest_normal_at_the_current_scale():
    fp16 = mp.formats.get("fp16")
    scale = 2.0 ** 16
    # true gradients: 3 land below fp16's smallest normal at this scale, 1 above, 2 are zero
    true = torch.tensor([fp16.min_normal / scale / 4, fp16.min_normal / scale / 2,
                         fp16.min_subnormal / scale / 4, 1e-3, 0.0, 0.0])
    monitor = mp.PrecisionMonitor(every=1)
    amp = mp.MixedPrecision("O1", "fp16", loss_scale=scale, monitor=monitor)
    model = Layer(torch.ones(6))
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    amp.backward(model(true))
    amp.step(opt)
    record = monitor.records[0]
    assert record["mixprec/model/grad_underflow"] == pytest.approx(3 / 4)
    assert record["mixprec/loss_scale"] == scale
    assert record["mixprec/grad_norm"] == pytest.approx(float(true.norm()), rel=1e-3)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("clip", [None, "folded", "engine", "unscale then torch"])
def test_grad_underflow_is_the_backwards_and_a_clip_does_not_change_it(clip, level):
    """A clip that acts changes no 16-bit gradient the backward stored: the fraction stays
    8/32 (it read 1.0 when the clip's factor entered the threshold, folded or applied)."""
    lin = nn.Linear(4, 8)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.zero_()
    monitor = mp.PrecisionMonitor(every=1)
    amp = mp.MixedPrecision(level, "fp16", loss_scale=mp.StaticLossScaler(2.0 ** 10),
                            monitor=monitor, emulate_fp16=False)
    model, opt = amp.setup(nn.Sequential(lin), torch.optim.SGD(lin.parameters(), lr=0.0))
    x = torch.tensor([[2.0 ** -14, 2.0 ** -6, 1.0, 4.0]])  # held weight-gradient columns:
    amp.backward(model(x).float().sum() * 2.0 ** -22)  # 0, 2^-18 (subnormal), 2^-12, 2^-10
    if clip == "engine":
        amp.clip_grad_norm_(opt, 1e-7)
    elif clip == "unscale then torch":
        amp.unscale_(opt)  # (fp16: the optimizer's fp32 gradients, as documented)
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1e-7)
    amp.step(opt, max_grad_norm=1e-7 if clip == "folded" else None)
    assert monitor.records[0]["mixprec/0/grad_underflow"] == pytest.approx(8 / 32)


def test_activation_amax_and_headroom_are_the_largest_output_and_its_binades_to_fp16_max():
    monitor = mp.PrecisionMonitor(every=1, layers=["0"])
    amp = mp.MixedPrecision("O2", "fp16", monitor=monitor)
    model = net()
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    outputs = []
    model[0].register_forward_hook(lambda m, args, out: outputs.append(out.detach()))
    for x, y in batches(2):  # two micro-batches in one step: the amax over both
        amp.backward(F.mse_loss(model(x).float(), y))
    amp.step(opt)
    expected = max(o.abs().max().item() for o in outputs)
    record = monitor.records[0]
    assert record["mixprec/0/act_amax"] == pytest.approx(expected, rel=1e-3)
    assert record["mixprec/0/act_headroom"] == pytest.approx(math.log2(65504 / expected),
                                                             rel=1e-4)
    assert monitor.layer_names == ["0"]


# -- cadence, skips, cost shape --------------------------------------------------------------------
def test_records_every_nth_step_with_the_skips_and_the_window_mean_loss():
    monitor = mp.PrecisionMonitor(every=2)
    amp, _, _ = run("O2", "fp16", monitor, n=6, nan_at=2)
    assert [r["step"] for r in monitor.records] == [0, 2, 4]
    skipped = [r["mixprec/skipped_steps"] for r in monitor.records]
    assert skipped == [0, 1, 1]
    assert "mixprec/0/weight_update_lost" not in monitor.records[1]  # step 2 was skipped
    assert math.isnan(monitor.records[1]["mixprec/grad_norm"])  # NaN targets
    assert monitor.records[2]["mixprec/loss_scale"] == monitor.records[1]["mixprec/loss_scale"] / 2
    assert set(monitor.layer_names) == {"0", "1", "3"}


def test_hooks_exist_only_during_recorded_steps():
    monitor = mp.PrecisionMonitor(every=3)
    amp = mp.MixedPrecision("O2", "bf16", monitor=monitor)
    model = net()
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def hooks():
        return [len(model[i]._forward_hooks) for i in (0, 1, 2, 3)]
    counts = [hooks()]
    for x, y in batches(3):
        amp.backward(F.mse_loss(model(x).float(), y))
        amp.step(opt)
        counts.append(hooks())
    armed, between = counts[0], counts[1]  # before step 0 (recorded), before step 1
    assert [a - b for a, b in zip(armed, between)] == [1, 1, 0, 1]  # GELU holds no weights
    assert counts[2] == between and counts[3] == armed  # step 3 comes next


def test_a_monitored_run_trains_exactly_as_an_unmonitored_one():
    _, plain, _ = run("O2", "fp16", None, opt_cls=torch.optim.AdamW, lr=1e-2)
    _, watched, _ = run("O2", "fp16", mp.PrecisionMonitor(every=1), opt_cls=torch.optim.AdamW,
                        lr=1e-2)
    for a, b in zip(mp.fp32_state_dict(plain).values(), mp.fp32_state_dict(watched).values()):
        assert torch.equal(a, b)


def test_one_host_sync_per_recorded_step_and_none_between(monkeypatch):
    monitor = mp.PrecisionMonitor(every=4)
    amp, model, opt = run("O3", "bf16", monitor, n=1)
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or real(self))
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(2) or item(self))
    for i in range(4):
        calls.clear()
        x, y = batches(1)[0]
        amp.backward(F.mse_loss(model(x).float(), y))
        amp.step(opt)
        # the step's own read: bf16 skips a step with inf/NaN gradients (one flag per step)
        assert calls.count(2) == 1, i
        assert calls.count(1) == (1 if i == 3 else 0), i  # the monitor's: recorded steps only


# -- writers ---------------------------------------------------------------------------------------
def test_jsonl_writer_writes_one_object_per_recorded_step(tmp_path):
    path = tmp_path / "run" / "precision.jsonl"
    monitor = mp.PrecisionMonitor(every=2, writers=[JSONLWriter(path)])
    run("O2", "fp16", monitor, n=6, nan_at=0)
    monitor.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 4, 5]  # 5: close()'s count of the 6 steps
    assert rows[0]["mixprec/grad_norm"] == "nan"
    assert rows[1] == {k: pytest.approx(v) for k, v in monitor.records[1].items()}
    assert rows[3] == {"step": 5, "mixprec/steps": 6.0, "mixprec/skipped_steps": 1.0}
    assert math.isnan(read_run(path)["mixprec/grad_norm"][0][1])
    series = read_run(path)
    assert series["mixprec/skipped_steps"] == [(0, 1.0), (2, 1.0), (4, 1.0), (5, 1.0)]


def test_tensorboard_events_read_back_with_the_expected_tags(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    monitor = mp.PrecisionMonitor(every=2, writers=[TensorBoardWriter(tmp_path / "tb")])
    run("O2", "bf16", monitor, n=5)
    monitor.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"mixprec/loss", "mixprec/loss_scale", "mixprec/skipped_steps", "mixprec/steps",
                "mixprec/grad_norm"} | {f"mixprec/{n}/{s}" for n in ("0", "1", "3") for s in (
                    "grad_underflow", "act_amax", "act_headroom", "weight_update_lost")}
    assert tags == expected
    assert [e.step for e in events.Scalars("mixprec/loss")] == [0, 2, 4]
    assert [e.value for e in events.Scalars("mixprec/0/act_amax")] == pytest.approx(
        [r["mixprec/0/act_amax"] for r in monitor.records], rel=1e-6)
    assert read_run(tmp_path / "tb")["mixprec/loss"] == [
        (r["step"], pytest.approx(r["mixprec/loss"], rel=1e-6)) for r in monitor.records]


def test_any_object_with_write_and_close_is_a_writer():
    seen = []

    class Mine:
        def write(self, step, scalars):
            seen.append((step, scalars))

        def close(self):
            seen.append("closed")

    monitor = mp.PrecisionMonitor(every=3, writers=[Mine()])
    run("O1", "bf16", monitor, n=4)
    monitor.close()
    # the records, then the closing count at the last step (a recorded one: the count says
    # the run was closed, where a report read it as not closed before)
    assert [s for s, _ in seen[:-1]] == [0, 3, 3] and seen[-1] == "closed"
    assert set(seen[-2][1]) == {"mixprec/steps", "mixprec/skipped_steps"}
    assert "step" not in seen[0][1] and seen[0][1]["mixprec/loss_scale"] == 1.0


@pytest.mark.parametrize("mode", ["w", "a"])
def test_a_jsonl_record_holds_one_object_per_step_the_closing_count_joining_the_last(tmp_path,
                                                                                   mode):
    """Every step recorded: the closing count joins the last step's object (it was a second
    object with the same step), and the report reads the run as before."""
    path = tmp_path / "p.jsonl"
    if mode == "a":
        path.write_text('{"step": 0, "mixprec/loss": 1.0}\n')
    monitor = mp.PrecisionMonitor(every=1, writers=[JSONLWriter(path, mode=mode)])
    run("O1", "bf16", monitor, n=3)
    monitor.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    if mode == "a":
        assert rows.pop(0) == {"step": 0, "mixprec/loss": 1.0}
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["mixprec/steps"] == 3.0 and "mixprec/loss" in rows[-1]
    assert rows[-1]["mixprec/loss"] == pytest.approx(monitor.records[-1]["mixprec/loss"])
    if mode == "w":
        record = Run(read_run(path))
        assert record.steps == [0, 1, 2] and record.step_count == 3 and record.count_exact


def test_a_closing_count_after_another_writers_lines_is_a_line_of_its_own(tmp_path):
    """Two writers on one file: a closing count joins its step's line only where nothing was
    written after it (it truncated the other writer's lines, then corrupted the file)."""
    path = tmp_path / "p.jsonl"
    a, b = JSONLWriter(path), JSONLWriter(path, mode="a")
    a.write(9, {"loss": 1.0})
    b.write(10, {"eval/acc": 0.5})
    a.write(9, {"mixprec/steps": 10.0})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": 9, "loss": 1.0}, {"step": 10, "eval/acc": 0.5},
                    {"step": 9, "mixprec/steps": 10.0}]
    a.write(11, {"loss": 2.0})
    a.write(11, {"loss": 3.0})  # not a closing count: a line of its own
    assert len(path.read_text().splitlines()) == 5


# -- through mp.Trainer ----------------------------------------------------------------------------
def test_trainer_records_through_its_engine_with_accumulation(tmp_path):
    monitor = mp.PrecisionMonitor(every=2, writers=[JSONLWriter(tmp_path / "p.jsonl")])
    model = net()
    trainer = mp.Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                         level="O2", dtype="bf16", grad_accum_steps=2, progress=False,
                         monitor=monitor)
    history = trainer.fit(batches(8))
    assert trainer.engine.monitor is monitor
    assert [r["step"] for r in monitor.records] == [0, 2]
    # the window's loss is the mean of the steps' losses (each step two micro-batches)
    assert monitor.records[0]["mixprec/loss"] == pytest.approx(history.loss[0], rel=1e-5)
    assert monitor.records[1]["mixprec/loss"] == pytest.approx(
        (history.loss[1] + history.loss[2]) / 2, rel=1e-5)


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("every", [0, -1, 1.5, True, "50"])
def test_bad_every_is_refused(every):
    with pytest.raises(ValueError, match="every must be a positive integer"):
        mp.PrecisionMonitor(every=every)


def test_bad_writers_layers_and_monitor_are_refused():
    with pytest.raises(TypeError, match="write\\(step, scalars\\)"):
        mp.PrecisionMonitor(writers=[object()])
    with pytest.raises(TypeError, match="layers holds"):
        mp.PrecisionMonitor(layers=[3])
    with pytest.raises(TypeError, match="monitor must be a mixprec.PrecisionMonitor"):
        mp.MixedPrecision("O2", "bf16", monitor="tensorboard")
    monitor = mp.PrecisionMonitor(layers=["h.*.mlp"])
    amp = mp.MixedPrecision("O2", "bf16", monitor=monitor)
    with pytest.raises(ValueError, match="matches no module.*0, 1, 3"):
        amp.setup(net())


def test_read_run_refuses_what_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run at"):
        read_run(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"loss": 1}\n')
    with pytest.raises(ValueError, match="not a JSON object with a 'step'"):
        read_run(bad)


def test_fp8_layers_record_the_tensorwise_scales_of_their_input_and_weight():
    pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    monitor = mp.PrecisionMonitor(every=1)
    amp = mp.MixedPrecision("O2", "bf16", fp8="tensorwise", monitor=monitor)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert mp.fp8_modules(model) == ["2"]  # first and last stay in 16 bits
    inputs = []
    model[2].register_forward_hook(lambda m, args, out: inputs.append(args[0].detach()))
    amp.backward(model(torch.randn(16, 32)).float().pow(2).mean())
    weight = model[2].weight.detach().clone()
    amp.step(opt)
    record, fmax = monitor.records[0], torch.finfo(torch.float8_e4m3fn).max
    assert record["mixprec/2/fp8_input_scale"] == pytest.approx(
        fmax / inputs[0].abs().max().item(), rel=1e-6)
    assert record["mixprec/2/fp8_weight_scale"] == pytest.approx(
        fmax / weight.abs().max().item(), rel=1e-6)
    assert not any("fp8" in k for k in record if k.startswith(("mixprec/0/", "mixprec/4/")))


def test_a_tied_weight_is_measured_once_and_reported_for_both_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    model[1].weight = model[0].weight  # tied, as GPT-2's lm_head and wte
    monitor = mp.PrecisionMonitor(every=1)
    amp = mp.MixedPrecision("O2", "bf16", monitor=monitor)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 16, (4, 5))
    amp.backward(F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten()))
    amp.step(opt)
    record = monitor.records[0]
    assert record["mixprec/0/weight_update_lost"] == pytest.approx(0.0, abs=1e-6)
    assert record["mixprec/1/weight_update_lost"] == pytest.approx(0.0, abs=1e-6)


# -- what the numbers say --------------------------------------------------------------------------
@pytest.mark.parametrize("level,dtype", [("O2", "fp16"), ("O1", "fp16"), ("O2", "bf16")])
def test_grad_norm_is_the_norm_before_a_clip_by_hand(level, dtype):
    """After ``amp.clip_grad_norm_`` (Lightning's, the HF Trainer's and Accelerate's clips go
    through it) the record read the clipped gradients: ``max_norm``, not the true norm."""
    monitor = mp.PrecisionMonitor(every=1)
    amp = mp.MixedPrecision(level, dtype, monitor=monitor)
    model = net()
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    amp.backward(F.mse_loss(model(x).float(), y))
    true = amp.clip_grad_norm_(opt, 1e-3)
    amp.step(opt)
    assert true.item() > 1e-2
    assert monitor.records[0]["mixprec/grad_norm"] == pytest.approx(true.item(), rel=1e-6)


def test_an_evaluation_between_steps_is_not_in_the_steps_activation_range():
    """The hooks for the next recorded step were armed when a step ended, so an evaluation
    forward in between (its inputs 100 times larger here) set that step's ``act_amax``."""
    monitor = mp.PrecisionMonitor(every=2, layers=["0"])
    amp = mp.MixedPrecision("O2", "bf16", monitor=monitor)
    model = net()
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []
    model[0].register_forward_hook(lambda m, a, o: seen.append(o.detach().abs().max().item()))
    for i, (x, y) in enumerate(batches(3)):
        if i == 2:
            seen.clear()
        amp.backward(F.mse_loss(model(x).float(), y))
        amp.step(opt)
        opt.zero_grad()
        if i == 1:
            with torch.no_grad():
                model(x * 100)  # an evaluation, not step 2's forward
    assert monitor.records[1]["step"] == 2
    assert monitor.records[1]["mixprec/0/act_amax"] == pytest.approx(max(seen), rel=1e-3)


def _report(series):
    from mixprec.monitor.report import advice
    from mixprec.monitor.run import Run
    run = Run(series)
    return run, advice(run)


def test_the_report_counts_closed_and_resumed_runs_and_reads_an_overflow(tmp_path):
    """A monitor closed after a recorded last step read as "not closed"; a resumed run
    appended to its record counted only the first process's steps (5 of 5 skipped, not 5 of
    10); a layer whose outputs overflowed (headroom -inf) got the all-clear; 2 skipped steps of
    50 (4%: the docs' rule is more than 2%) got no finding."""
    path = tmp_path / "run.jsonl"
    monitor = mp.PrecisionMonitor(every=2, writers=[JSONLWriter(path)])
    run("O2", "bf16", monitor, n=5)  # steps 0..4, the last one recorded
    monitor.close()
    counted, _ = _report(read_run(path))
    assert (counted.step_count, counted.count_exact) == (5, True)
    resumed = {"mixprec/loss": [(0, 1.0), (6, 1.0), (9, 1.0)],
               "mixprec/steps": [(4, 5.0)], "mixprec/skipped_steps": [(4, 2.0), (9, 5.0)]}
    counted, said = _report(resumed)
    assert (counted.step_count, counted.count_exact) == (10, False)
    assert any("5 of the first 10 steps" in a for a in said)
    overflow = {"mixprec/loss": [(0, 1.0), (3, 1.0)], "mixprec/steps": [(3, 4.0)],
                "mixprec/0/act_headroom": [(0, 15.0), (3, float("-inf"))]}
    assert any("overflowed" in a and "step 3" in a for a in _report(overflow)[1])
    few = {"mixprec/loss": [(0, 1.0), (49, 1.0)], "mixprec/steps": [(49, 50.0)],
           "mixprec/skipped_steps": [(49, 2.0)]}
    assert any(a.startswith("2 of 50 steps were skipped") for a in _report(few)[1])


def test_a_monitor_used_again_after_close_averages_the_new_window_only():
    """close() reset the window's step count but not its loss sum: the next record averaged
    the closed window's losses over the new window's steps (2.25 for losses of 2.0)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    monitor = mp.PrecisionMonitor(every=5)
    amp = mp.MixedPrecision(level="O2", dtype="bf16", monitor=monitor)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    x = torch.ones(2, 4)

    def step(value):
        amp.backward(model(x).float().sum() * 0 + value)
        amp.step(opt)
        opt.zero_grad()

    for _ in range(7):  # steps 0-6: a record at 5, step 6 in the open window
        step(1.0)
    monitor.close()
    for _ in range(4):  # steps 7-10: a record at 10
        step(2.0)
    monitor.close()
    last = monitor.records[-1]
    assert last["step"] == 10 and last["mixprec/loss"] == 2.0
