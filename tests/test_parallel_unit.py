"""mp.parallel and Trainer(strategy=...) in one process: choosing a strategy, bad input, the
environment, rebuilding data loaders for ranks, and the memory planner (``mixprec plan``)."""

import json
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, WeightedRandomSampler

import mixprec as mp
from mixprec import distenv as env
from mixprec.cli import main as cli_main
from mixprec.parallel.plan import parse_count, plan
from mixprec.training import state as ts
from mixprec.training.choose import make_strategy, resolve_strategy
from mixprec.training.strategy import distributed_loader

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for name in LAUNCHER_VARS + (env.TIMEOUT_ENV,):
        monkeypatch.delenv(name, raising=False)


def _trainer(**kwargs):
    model = nn.Linear(4, 2)
    return mp.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                      level="O0", progress=False, **kwargs)


# ----------------------------------------------------------------- choosing a strategy
def test_auto_is_ddp_under_a_multi_rank_launcher_else_single(monkeypatch):
    assert resolve_strategy("auto") == "single"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_strategy("auto") == "single"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_strategy("auto") == "ddp"
    assert resolve_strategy("fsdp") == "fsdp" and resolve_strategy("single") == "single"


def test_single_process_trainer_is_unchanged():
    trainer = _trainer()
    assert trainer.strategy.name == "single" and isinstance(trainer.model, nn.Linear)
    assert mp.parallel.world_size() == 1 and mp.parallel.rank() == 0
    assert mp.parallel.is_main_process()


@pytest.mark.parametrize("kwargs,match", [
    ({"strategy": "deepspeed"}, "strategy must be one of 'auto', 'single', 'ddp', 'fsdp'"),
    ({"reduce_dtype": "int8"}, "reduce_dtype must be"),
    ({"reduce_dtype": torch.float64}, "reduce_dtype must be 'fp32', 'bf16' or 'fp16'"),
    ({"reduce_dtype": 16}, "reduce_dtype must be"),
])
def test_unknown_strategy_or_reduce_dtype_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _trainer(**kwargs)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_distributed_strategy_without_launcher_or_group_shows_the_torchrun_command(strategy):
    with pytest.raises(ValueError, match=r"torchrun --nproc-per-node 2 train\.py"):
        _trainer(strategy=strategy)


def test_manual_loop_entry_points_refuse_without_a_group():
    with pytest.raises(ValueError, match="torchrun"):
        mp.parallel.ddp(mp.prepare(nn.Linear(4, 2), level="O0"))
    with pytest.raises(ValueError, match="torchrun"):
        mp.parallel.fsdp(nn.Linear(4, 2), level="O0")


def test_fsdp_refuses_bad_units_optimizers_and_prepared_models():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="'nope', which is not a sub-module"):
        mp.parallel.fsdp(net, units=["nope"])
    with pytest.raises(TypeError, match="units entries"):
        mp.parallel.fsdp(net, units=[3])
    master = mp.MasterWeightOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="fp32 shards are the master weights"):
        mp.parallel.fsdp(net, master)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not parameters of the model"):
        mp.parallel.fsdp(net, other)
    with pytest.raises(RuntimeError, match="fresh fp32 model"):
        mp.parallel.fsdp(mp.prepare(nn.Linear(4, 2), level="O0"))
    with pytest.raises(ValueError, match="reduce_dtype"):
        mp.parallel.fsdp(nn.Linear(4, 2), reduce_dtype="fp8_e4m3")


def test_ddp_refuses_a_wrapped_model_and_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        mp.parallel.ddp("model")


# ----------------------------------------------------------------- environment
def test_rank_and_world_come_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (mp.parallel.rank(), mp.parallel.world_size(), mp.parallel.local_rank()) == (3, 4, 1)
    assert not mp.parallel.is_main_process()
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer; got 'four'"):
        mp.parallel.world_size()


def test_process_group_timeout_defaults_to_ten_minutes_and_reads_the_environment(monkeypatch):
    assert env.timeout().total_seconds() == 600.0
    monkeypatch.setenv(env.TIMEOUT_ENV, "42.5")
    assert env.timeout().total_seconds() == 42.5
    for bad in ("soon", "0", "-3", "inf"):
        monkeypatch.setenv(env.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match="MIXPREC_DIST_TIMEOUT must be a positive number"):
            env.timeout()


def test_init_from_env_does_nothing_without_a_launcher():
    assert mp.parallel.init_from_env() is False and not env.is_initialized()


def test_settle_sleeps_its_grace_and_waits_while_c_plus_plus_holds_a_tensor(monkeypatch):
    start = time.monotonic()
    env.settle(grace_s=0.01)
    assert time.monotonic() - start >= 0.01
    w = torch.ones(2, requires_grad=True)
    y = (w * w).sum()  # autograd holds w besides its Python object, as a collective's work does
    monkeypatch.setattr(env, "_SETTLE_TIMEOUT_S", 0.1)
    start = time.monotonic()
    env.settle([w], grace_s=0.0)
    assert time.monotonic() - start >= 0.1  # waited for w until the timeout
    del y
    start = time.monotonic()
    env.settle([w], grace_s=0.0)
    assert time.monotonic() - start < 0.1


# ----------------------------------------------------------------- data loaders
def _dataset(n=20):
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def _collate(batch):
    return torch.utils.data.default_collate(batch)


def test_loader_is_rebuilt_per_rank_keeping_its_options():
    data = DataLoader(_dataset(), batch_size=3, shuffle=True, drop_last=True, collate_fn=_collate,
                      generator=torch.Generator().manual_seed(5))
    rebuilt = distributed_loader(data, rank=1, world=2)
    sampler = rebuilt.sampler
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.shuffle, sampler.seed, sampler.rank, sampler.num_replicas) == (True, 5, 1, 2)
    assert (rebuilt.batch_size, rebuilt.drop_last, rebuilt.collate_fn) == (3, True, _collate)
    assert rebuilt.generator is data.generator and rebuilt.num_workers == 0


def test_unshuffled_ranks_together_see_the_global_batches_of_one_process():
    one = [x.flatten().tolist() for x, _ in DataLoader(_dataset(), batch_size=4)]
    ranks = [[x.flatten().tolist() for x, _ in
              distributed_loader(DataLoader(_dataset(), batch_size=2), rank=r, world=2)]
             for r in range(2)]
    assert [sorted(a + b) for a, b in zip(*ranks)] == one


def test_loaders_that_need_no_rebuilding_or_cannot_be_rebuilt():
    given = DataLoader(_dataset(), batch_size=2,
                       sampler=DistributedSampler(_dataset(), num_replicas=2, rank=0))
    assert distributed_loader(given, rank=0, world=2) is given
    batches = [(torch.zeros(2, 1), torch.zeros(2))]
    assert distributed_loader(batches, rank=0, world=2) is batches
    weighted = DataLoader(_dataset(), batch_size=2, sampler=WeightedRandomSampler([1.0] * 20, 20))
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        distributed_loader(weighted, rank=0, world=2)


def test_builtin_metrics_declare_their_additive_state():
    assert mp.Accuracy.sum_state == ("correct", "total")
    assert mp.training.MeanAbsoluteError.sum_state == ("sum", "count")
    acc = mp.Accuracy()
    acc.update(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), torch.tensor([0, 1, 1]))
    assert make_strategy("single").metric_values([acc], "cpu") == {"accuracy": 2 / 3}


# ----------------------------------------------------------------- weights
def test_fp32_state_dict_of_a_plain_prepared_model_takes_the_masters():
    net = nn.Linear(4, 2)
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2", dtype="bf16")
    sd = mp.fp32_state_dict(net, opt)
    assert sd["weight"].dtype == torch.float32
    assert torch.equal(sd["weight"], opt.master_param(net.weight))
    assert not mp.parallel.is_fsdp(net) and mp.parallel.unwrap(net) is net


def test_import_does_not_load_fsdp():
    code = ("import sys, mixprec; "
            "print('torch.distributed.fsdp' in sys.modules, callable(mixprec.parallel.fsdp), "
            "'torch.distributed.fsdp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True"]


# ----------------------------------------------------------------- planner
def test_plan_counts_bytes_per_rank_for_each_strategy_and_level():
    n = 7_000_000_000
    fsdp = plan("7B", level="O2", strategy="fsdp", world=64, optimizer="adamw")
    assert (fsdp.parameters, fsdp.masters, fsdp.gradients, fsdp.optimizer_state) == \
        (4 * n / 64, 0, 4 * n / 64, 8 * n / 64)
    assert fsdp.traffic == 63 / 64 * n * (2 + 2 + 4)  # gather bf16 twice, reduce-scatter fp32
    ddp = plan(n, level="O2", strategy="ddp", world=8, optimizer="adamw")
    assert (ddp.parameters, ddp.masters, ddp.gradients, ddp.optimizer_state) == \
        (2 * n, 4 * n, 2 * n, 8 * n)
    assert ddp.traffic == 2 * 7 / 8 * n * 4
    assert plan(n, level="O2", strategy="ddp", world=8, reduce_dtype="bf16").traffic == \
        2 * 7 / 8 * n * 2
    o3 = plan(n, level="O3", strategy="single", optimizer="adamw")
    assert o3.bytes_per_parameter() == 2 + 2 + 4 and o3.traffic == 0
    assert plan(n, level="O1", strategy="single", optimizer="sgd").bytes_per_parameter() == 8
    with pytest.warns(DeprecationWarning, match="call bytes_per_parameter"):
        assert o3.bytes_per_param() == 2 + 2 + 4  # the older spelling
    assert plan(n, level="O2", dtype="fp32", strategy="single").masters == 0


@pytest.mark.filterwarnings("ignore:Adam .* keeps its second-moment estimates in fp16")
@pytest.mark.parametrize("level,dtype", [("O3", "bf16"), ("O3", "fp16"), ("O2", "bf16")])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_the_planned_optimizer_state_is_what_a_prepared_optimizer_holds(optimizer, level, dtype):
    """Adagrad makes its state when constructed, from the fp32 model: O3 casts it to the 16-bit
    weights' dtype (it stayed fp32, and trained apart from the model cast by hand); Adam makes
    its state at its first step, in the weights' dtype: the plan says what is held."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Linear(128, 64))
    kind = {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[optimizer]
    model, opt = mp.prepare(model, kind(model.parameters(), lr=1e-3, **(
        {"eps": 1e-4} if dtype == "fp16" else {})), level=level, dtype=dtype)
    model(torch.randn(4, 16).to(next(model.parameters()).dtype)).float().sum().backward()
    opt.step()
    held = mp.bytes_per_parameter(model, opt)["optimizer_state"]
    n = sum(p.numel() for p in model.parameters())
    planned = plan(n, level=level, dtype=dtype, strategy="single", optimizer=optimizer)
    assert planned.optimizer_state / n == pytest.approx(held, abs=0.01)  # (Adam's step: 0-d)


@pytest.mark.parametrize("text,count", [("7e9", 7 * 10 ** 9), ("7B", 7 * 10 ** 9),
                                        ("350M", 350 * 10 ** 6), ("1.3b", 1_300_000_000),
                                        (1000, 1000)])
def test_parameter_counts_parse(text, count):
    assert parse_count(text) == count


@pytest.mark.parametrize("kwargs,match", [
    ({"params": "lots"}, "parameter count"), ({"params": 0}, "at least 1"),
    ({"level": "O4"}, "level must be one of"), ({"strategy": "zero3"}, "strategy must be one of"),
    ({"world": 0}, "world must be an integer >= 1"), ({"strategy": "single", "world": 8},
                                                       "runs one process"),
    ({"optimizer": "shampoo"}, "optimizer must be one of"), ({"dtype": "fp64"}, "dtype must be"),
    ({"dtype": "int8"}, r"plan's dtype must be 'bf16', 'fp16' or 'fp32' \(or their torch"),
    ({"dtype": "auto"}, "'auto' has no device to resolve on"),
])
def test_plan_rejects_bad_input(kwargs, match):
    args = {"params": "7B", "level": "O2", "strategy": "fsdp", "world": 8, **kwargs}
    params = args.pop("params")
    with pytest.raises(ValueError, match=match):
        plan(params, **args)


def test_plan_command_marks_the_chosen_row_and_prints_json(capsys):
    assert cli_main(["plan", "--params", "7e9", "--level", "O2", "--dtype", "bf16", "--strategy",
                     "fsdp", "--world", "64", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    chosen = [line for line in out.splitlines() if line.startswith("*")]
    assert chosen[0].split()[1:4] == ["fsdp", "64", "O2"] and "1.63" in chosen[0]
    assert len([line for line in out.splitlines() if line[:2] in ("  ", "* ")
                and line.split()[-1] == "GiB"]) == 12  # 3 strategies x 4 levels
    assert cli_main(["plan", "--params", "1B", "--strategy", "ddp", "--world", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["strategy"] == "ddp" and len(data["rows"]) == 12
    assert cli_main(["plan", "--params", "huge"]) == 2
    assert "parameter count" in capsys.readouterr().err


def test_plan_command_names_the_training_dtype_and_says_fp32_levels_are_plain_fp32(capsys):
    assert cli_main(["plan", "--params", "1B", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "training dtype bf16" in out.splitlines()[0] and "not a 16-bit type" not in out
    assert cli_main(["plan", "--params", "1B", "--level", "O3", "--dtype", "fp32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "training dtype fp32" in lines[0] and "16-bit dtype" not in lines[0]
    assert lines[2].startswith("fp32 is not a 16-bit type: every level is plain fp32")
    rows = [line.split() for line in lines if line[:2] in ("  ", "* ") and line.endswith("GiB")]
    assert len(rows) == 12 and len({tuple(r[-8:]) for r in rows if r[0] == "single"}) == 1


def test_a_checkpoint_from_another_world_size_loads_only_at_an_epoch_end(tmp_path):
    trainer = _trainer()
    batches = [(torch.randn(4, 4), torch.randint(0, 2, (4,))) for _ in range(3)]
    trainer.fit(batches, epochs=1)
    state = ts.trainer_state(trainer)
    rng = ts.capture_rng()
    state.update(world_size=2, ranks=[{"rng": rng, "epoch_start_rng": None}] * 2)
    state["counters"]["batch_in_epoch"] = 1
    ts.write_checkpoint(state, tmp_path / "mid.pt")
    with pytest.raises(ValueError, match="saved by 2 process.* middle of an epoch.* has 1"):
        _trainer().load(tmp_path / "mid.pt")
    state["counters"]["batch_in_epoch"] = 0
    ts.write_checkpoint(state, tmp_path / "end.pt")
    fresh = _trainer()
    torch.manual_seed(123)
    fresh.load(tmp_path / "end.pt")
    assert fresh.global_step == 3 and torch.equal(torch.get_rng_state(), rng["torch"])


def test_plan_lists_only_the_masters_that_hold_fp16_weights(capsys):
    """``mixprec plan --dtype fp16 --master kahan`` failed ("master='split' holds the high half
    of the master in bf16 weights"): the compact rows listed every method, for any dtype."""
    assert cli_main(["plan", "--params", "7e9", "--dtype", "fp16", "--master", "kahan"]) == 0
    out = capsys.readouterr().out
    chosen = [line for line in out.splitlines() if line.startswith("*")]
    assert "kahan/fp32" in chosen[0]
    assert "split" not in out and "stochastic" not in out and "kahan/bf16" in out
    rows = mp.parallel.plan_table("7B", dtype="bf16", compact=True)
    assert {r.master for r in rows} >= {"split", "stochastic", "kahan"}


def _reduce_int8():
    from mixprec.parallel.ddp import reduce_dtype_of
    reduce_dtype_of("int8")


def _train_fp8():
    from mixprec.policy import resolve_dtype
    resolve_dtype("fp8", "cpu")


@pytest.mark.parametrize("call", [_reduce_int8, _train_fp8])
def test_a_bad_dtype_is_refused_naming_only_the_dtypes_that_are_taken(call):
    """The registry's message listed 'fp64', 'fp8_e4m3' and 'fp8_e5m2' as valid for a reduce
    or training dtype, which are then refused in their turn."""
    with pytest.raises(ValueError) as info:
        call()
    assert "'fp32'" in str(info.value) and "fp64" not in str(info.value)
    assert "fp8_e4m3" not in str(info.value)


@pytest.mark.parametrize("as_view", [False, True])
def test_bytes_per_parameter_counts_ddps_gradient_buckets_as_the_plan_does(tmp_path, as_view):
    """DDP holds a gradient bucket per parameter for the run (the plan counts it; the
    measurement left it out); gradients that are views of the buckets are counted once."""
    import gc

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 32))
        model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                level="O2", dtype="bf16")
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=as_view)
        ddp(torch.randn(4, 64)).float().sum().backward()
        held = mp.bytes_per_parameter(ddp, opt)["gradients"]
        assert held == (2.0 if as_view else 4.0)  # the bf16 buckets, and gradients apart
        opt.step()
        opt.zero_grad(set_to_none=True)
        measured = mp.bytes_per_parameter(ddp, opt)
        assert measured["gradients"] == 2.0  # the buckets stay
        n = sum(p.numel() for p in model.parameters())
        planned = plan(n, level="O2", dtype="bf16", strategy="ddp", world=2, optimizer="adamw")
        assert planned.bytes_per_parameter() == pytest.approx(measured["total"], abs=0.01)
        del ddp
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.parametrize("clip", ["unscale_ then clip_grad_norm_", "clip_grad_value_"])
def test_a_compact_optimizer_s_clip_after_unscale_runs_on_fsdp2_shards(tmp_path, clip):
    """The clipped fp32 copies are shown in the model's gradients through the shards' local
    tensors (a foreach copy of DTensors raised NotImplementedError on every rank)."""
    import gc

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        amp = mp.MixedPrecision(level="O2", dtype="bf16", master="kahan")
        net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        model, opt = mp.parallel.fsdp(net, torch.optim.AdamW(net.parameters(), lr=1e-2),
                                      mixed_precision=amp)
        amp.backward(model(torch.randn(4, 8)).float().square().sum())
        if clip.startswith("unscale_"):
            amp.unscale_(opt)
            amp.clip_grad_norm_(opt, 1e-3)
        else:
            amp.clip_grad_value_(opt, 1e-4)
        assert amp.step(opt)
        del model, opt
    finally:
        gc.collect()
        dist.destroy_process_group()


def test_a_direct_step_of_an_fsdp2_optimizer_on_scaled_gradients_is_refused(tmp_path):
    """``mp.parallel.fsdp(model, opt, mixed_precision=amp)`` is ``setup``'s FSDP2 form: its
    optimizer is watched as ``setup``'s are (``amp.backward`` then ``opt.step()`` at fp16
    applied a 65536x update)."""
    import gc

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        amp = mp.MixedPrecision(level="O2", dtype="fp16", emulate_fp16=False)
        net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        model, opt = mp.parallel.fsdp(net, torch.optim.AdamW(net.parameters(), lr=1e-2),
                                      mixed_precision=amp)
        amp.backward(model(torch.randn(4, 8)).float().square().mean())
        with pytest.raises(RuntimeError, match="a loss was scaled"):
            opt.step()
        assert amp.step(opt) is True
        del model, opt
    finally:
        gc.collect()
        dist.destroy_process_group()
