"""``MixprecPrecision`` under Lightning's multi-process strategies, two gloo ranks on the CPU:
``strategy="ddp"``, ``"ddp_spawn"`` (Lightning spawns the ranks) and ``ModelParallelStrategy``
(FSDP2), against one process at the same global batch.

One launch per strategy runs every configuration on both ranks (module fixture): 2 epochs
whole, and 1 epoch saved then resumed into a fresh LightningModule with ``fit(ckpt_path=)``.
The ranks end bitwise equal, within the batch split's tolerance of one process, the resumed run
is bitwise the whole one, and rank 0's checkpoint resumes in one process (2 ranks -> 1). The
clip (``gradient_clip_val=0.05``) is below every step's norm, so a norm measured on one rank's
shard alone would move the weights away from one process.
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

L = pytest.importorskip("lightning.pytorch")
import lightning_cases as lc  # noqa: E402
from lightning.pytorch.strategies import (  # noqa: E402
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)
from parallel_cases import launch, max_diff  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

import mixprec as mp  # noqa: E402
from mixprec.integrations import lightning_checkpoints as checkpoints  # noqa: E402
from mixprec.integrations import lightning_strategies as strategies  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning"),
              pytest.mark.filterwarnings(
                  r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings."
                                         "PossibleUserWarning"),
              pytest.mark.filterwarnings("ignore:.*weights_only.*:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*ModelParallelStrategy.*:UserWarning")]
gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                          reason="needs torch.distributed with gloo")

# Each level and master method under each strategy, once: (level, dtype, master). Under DDP the
# compact methods' buffers start from the fp32 values the cast replaced (kept from
# convert_module to connect); under ModelParallelStrategy they are sharded as the weights, and
# Lightning's one-file checkpoint gathers them (a split remainder as int32: gloo has no int16).
CONFIGS = {"ddp": [("O1", "bf16", None), ("O2", "bf16", None), ("O3", "bf16", None),
                   ("O2", "bf16", "split"), ("O2", "fp16", "kahan"), ("O2", "bf16", "stochastic")],
           "fsdp2": [("O1", "bf16", None), ("O2", "fp16", None), ("O3", "bf16", None),
                     ("O2", "bf16", "split"), ("O2", "bf16", "kahan"),
                     ("O2", "bf16", "stochastic")]}
# Max abs weight difference from one process at the same global batch (8 SGD steps, clipped):
# as the engine's (tests/test_parallel_engine.py); measured <= 6.5e-3 at O2.
TOLERANCE = {"O0": 1e-5, "O1": 1e-2, "O2": 1e-2, "O3": 2e-2}


@pytest.fixture(scope="module")
def single():
    configs = {lc.name(c): c for c in [*CONFIGS["ddp"], *CONFIGS["fsdp2"]]}
    return {k: lc.fit("ddp", c, world=1, epochs=2)["weights"] for k, c in configs.items()}


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def ranks(request, tmp_path_factory):
    strategy = request.param
    return strategy, launch(lc.rank_case, tmp_path_factory.mktemp(strategy), strategy,
                            configs_of(strategy), timeout=1800)


def configs_of(strategy):
    return CONFIGS[strategy]


@pytest.mark.slow
@gloo
def test_two_ranks_train_like_one_process_and_agree_bitwise(ranks, single):
    strategy, (r0, r1) = ranks
    for config in configs_of(strategy):
        key = lc.name(config)
        a, b = r0[key]["whole"]["weights"], r1[key]["whole"]["weights"]
        assert r0[key]["whole"]["sharded"] == (strategy == "fsdp2")
        assert all(torch.equal(a[k], b[k]) for k in a), (strategy, key)
        print(f"FIGURE lightning {strategy} {key}: {max_diff(a, single[key]):.1e}")
        assert max_diff(a, single[key]) <= TOLERANCE[config[0]], (strategy, key)
        if config[2] == "stochastic":
            assert bf16_ulps_apart(a, single[key]) <= 1.0, (strategy, key)


def bf16_ulps_apart(a: dict, b: dict) -> float:
    """The largest difference between the bf16-stored weights of ``a`` and ``b`` (the tensors
    whose values are all bf16 numbers in both) in bf16 ulps of ``b``'s values. Stochastic
    rounding draws the same bits at 2 ranks as in one process, but the batch split moves the
    fp32 value it rounds by ~1e-7: where that crosses a drawn threshold, the weight lands one
    ulp away (measured: 5 of 152 bf16 weights, one ulp each, 2.0e-3 at magnitudes in
    [0.25, 0.5))."""
    worst = 0.0
    for k, x in a.items():
        y = b[k]
        if not (torch.equal(x, x.bfloat16().float()) and torch.equal(y, y.bfloat16().float())):
            continue  # an fp32 parameter (the norms): not stochastically rounded
        ulp = torch.ldexp(torch.ones_like(y), torch.frexp(y.abs().clamp_min(1e-30))[1] - 8)
        worst = max(worst, ((x - y).abs() / ulp).max().item())
    return worst


@pytest.mark.slow
@gloo
def test_fit_from_a_checkpoint_resumes_bitwise_at_the_same_world_size(ranks):
    strategy, results = ranks
    for config in configs_of(strategy):
        for r in results:
            got = r[lc.name(config)]
            assert got["resumed"]["step"] == got["whole"]["step"] == 8
            assert all(torch.equal(got["whole"]["weights"][k], got["resumed"]["weights"][k])
                       for k in got["whole"]["weights"]), (strategy, lc.name(config))


@pytest.mark.slow
@gloo
def test_a_model_with_dropout_resumes_bitwise_under_ddp(tmp_path):
    """Every rank's RNG states travel in the plugin's state (Lightning saves none)."""
    for r in launch(lc.dropout_case, tmp_path, timeout=600):
        assert r["resumed"]["step"] == r["whole"]["step"] == 8
        a, b = r["whole"]["weights"], r["resumed"]["weights"]
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@gloo
def test_under_fsdp2_the_plugin_shards_when_configure_model_does_not(ranks):
    strategy, results = ranks
    if strategy != "fsdp2":
        pytest.skip("FSDP2 only")
    for r in results:
        auto, own = r["left to the plugin"], r["O2-fp16"]["whole"]
        assert auto["sharded"]
        assert all(torch.equal(auto["weights"][k], own["weights"][k]) for k in own["weights"])


@pytest.mark.slow
@gloo
def test_split_masters_resume_bitwise_from_the_strategys_sharded_checkpoint_too(ranks):
    """ModelParallelStrategy's default checkpoint, a directory of shards (torch's distributed
    checkpoint: no collective moves the remainders' data)."""
    strategy, results = ranks
    if strategy != "fsdp2":
        pytest.skip("FSDP2 only")
    for r in results:
        got, whole = r["split, sharded checkpoint"], r[lc.name(lc.SPLIT)]["whole"]
        assert got["step"] == 8
        assert all(torch.equal(got["weights"][k], whole["weights"][k]) for k in whole["weights"])
    # 2 -> 1 is not allowed from it: a one-device Trainer loads one file (Lightning's error)
    directory = os.path.join(os.path.dirname(results[0][lc.name(lc.SPLIT)]["ckpt"]),
                             "fsdp2-split-sharded")
    with pytest.raises(IsADirectoryError, match="fsdp2-split-sharded"):
        lc.fit(strategy, lc.SPLIT, world=1, epochs=2, ckpt_path=directory)


@pytest.mark.slow
@gloo
def test_a_two_rank_checkpoint_resumes_in_one_process(ranks):
    strategy, (r0, _) = ranks
    for config in configs_of(strategy):
        got = r0[lc.name(config)]
        one = lc.fit(strategy, config, world=1, epochs=2, ckpt_path=got["ckpt"])
        assert one["step"] == 8
        print(f"FIGURE lightning {strategy} 2->1 {lc.name(config)}: "
              f"{max_diff(one['weights'], got['whole']['weights']):.1e}")
        assert max_diff(one["weights"], got["whole"]["weights"]) <= TOLERANCE[config[0]]


@pytest.mark.slow
@gloo
def test_a_one_process_split_checkpoint_resumes_at_two_ranks_under_fsdp2(tmp_path):
    """1 -> 2: Lightning loads a one-file checkpoint at several ranks by broadcasting rank 0's
    optimizer state, and gloo has no int16: the split remainder saved in one process (no
    FSDP, so not sharded) crosses as int32 and is each rank's int16 shard again."""
    path = str(tmp_path / "one-process-split.ckpt")
    lc.fit("ddp", lc.SPLIT, world=1, epochs=1, save=path)
    r0, r1 = launch(lc.resume_case, tmp_path, "fsdp2", lc.SPLIT, path, timeout=900)
    assert r0["step"] == r1["step"] == 8 and r0["sharded"]
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    whole = lc.fit("ddp", lc.SPLIT, world=1, epochs=2)["weights"]  # one process throughout
    print(f"FIGURE lightning 1->2 fsdp2 {lc.name(lc.SPLIT)}: {max_diff(r0['weights'], whole):.1e}")
    assert max_diff(r0["weights"], whole) <= TOLERANCE["O2"]


@pytest.mark.slow
@gloo
def test_ddp_spawn_trains_like_one_process(tmp_path):
    """Lightning spawns the ranks itself and hands rank 0's fp32 weights back to this process."""
    out = tmp_path / "spawn.pt"
    script = os.path.join(os.path.dirname(__file__), "lightning_spawn.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    done = subprocess.run([sys.executable, script, str(out)], env=env, timeout=900,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    assert max_diff(got["spawned"], got["single"]) <= TOLERANCE["O2"]


LOOP = pytest.mark.skipif(os.environ.get("MIXPREC_LAUNCH_LOOP") is None,
                          reason="20 launches in a row: MIXPREC_LAUNCH_LOOP=1 (tens of minutes)")


@pytest.mark.slow
@LOOP
@gloo
def test_twenty_ddp_spawn_launches_in_a_row_exit_zero(tmp_path):
    for i in range(20):
        (tmp_path / str(i)).mkdir()
        test_ddp_spawn_trains_like_one_process(tmp_path / str(i))
        print(f"FIGURE lightning ddp_spawn launch {i + 1}/20 exit 0")


@pytest.mark.slow
@LOOP
@gloo
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_twenty_launches_in_a_row_exit_zero(strategy, tmp_path):
    """2 gloo ranks launched 20 times (a rank exiting non-zero fails the launch)."""
    for i in range(20):
        (tmp_path / str(i)).mkdir()
        r0, r1 = launch(lc.launch_case, tmp_path / str(i), strategy, timeout=600)
        assert all(torch.equal(r0[k], r1[k]) for k in r0), (strategy, i)
        print(f"FIGURE lightning {strategy} launch {i + 1}/20 exit 0")


# -- one rank of a strategy: on the CPU (gloo), and on a GPU (NCCL) --------------------------------
@pytest.mark.slow
@gloo
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_one_rank_of_a_strategy_trains_like_no_strategy(strategy):
    """DDP and FSDP2 over a one-rank process group: the plugin's seams with the strategy's own
    collectives, against the same fit with no strategy (O2 bf16). DDP's all-reduce over one
    rank leaves the gradients as they are (measured: bitwise); FSDP2's fp32 shards step apart
    by fp32 roundings (measured 3.0e-8)."""
    alone = lc.fit_alone("auto", ("O2", "bf16", None))
    got = lc.fit_alone(strategy, ("O2", "bf16", None))
    assert alone["backend"] is None and got["backend"] == "gloo"
    diff = max_diff(got["weights"], alone["weights"])
    print(f"FIGURE lightning one {strategy} rank vs none: {diff:.1e}")
    assert diff <= (0.0 if strategy == "ddp" else 1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_on_a_gpu_one_nccl_rank_trains_like_no_strategy(strategy):
    """The same on a CUDA GPU, where Lightning's strategies make an NCCL process group."""
    alone = lc.fit_alone("auto", ("O2", "bf16", None), accelerator="gpu")
    got = lc.fit_alone(strategy, ("O2", "bf16", None), accelerator="gpu")
    assert got["backend"] == "nccl"
    assert max_diff(got["weights"], alone["weights"]) <= TOLERANCE["O2"]


# -- refusals and the seams' logic (no process group) ---------------------------------------------
def test_fsdp1_and_deepspeed_are_refused_naming_why_and_what_to_use():
    with pytest.raises(RuntimeError, match="FSDPStrategy: it is FSDP1.*ModelParallelStrategy"):
        strategies.kind_of(FSDPStrategy())
    assert strategies.kind_of(DDPStrategy()) == "ddp"
    assert strategies.kind_of(DDPStrategy(start_method="spawn")) == "ddp"


def _as_if_sharded(module: nn.Module) -> nn.Module:
    """What fully_shard does to a module's class (FSDP2's own marker), without a process group."""
    module.__class__ = type(f"FSDP{type(module).__name__}", (FSDPModule, type(module)), {})
    return module


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_model_sharded_by_the_users_fully_shard_is_refused_at_16_bit_storage(level):
    engine = mp.MixedPrecision(level=level, dtype="bf16")
    module = lc.Classifier()
    _as_if_sharded(module.net.blocks[0])
    with pytest.raises(RuntimeError, match=r"precision_plugin\.shard\(self\)"):
        strategies._adopt_user_shards(engine, module, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"mp\.parallel\.fsdp\(model, opt, mixed_precision"):
        mp.MixedPrecision(level=level, dtype="bf16").setup(module)


def test_a_parameter_no_optimizer_holds_is_refused_under_ddp_at_o2():
    """Under DDP the model is cast before the optimizers exist: a trainable parameter that no
    optimizer then holds would have no master (its fp32 value lost)."""
    engine = mp.MixedPrecision(level="O2", dtype="bf16")
    module = lc.Classifier()
    before = {p: p.data for p in module.parameters()}
    mp.prepare(module, level="O2", dtype="bf16")
    originals = {p: v for p, v in before.items() if p.dtype != v.dtype}
    head_only = torch.optim.SGD(module.net.head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no optimizer holds.*blocks"):
        strategies.attach(engine, module, module, [head_only], {"originals": originals})


@pytest.mark.parametrize("master", ["fp32", pytest.param("split", marks=pytest.mark.slow)])
def test_masters_made_after_ddp_wraps_equal_those_prepare_makes(master):
    """The DDP path (cast in convert_module, masters wrapped in connect) against mp.prepare
    with the optimizer: the same masters, bitwise, and the same step."""
    def run(late):
        module = lc.Classifier()
        engine = mp.MixedPrecision(level="O2", dtype="bf16", master=master)
        if late:
            before = {p: p.data for p in module.parameters()}
            mp.prepare(module, policy=engine.resolve_policy(torch.device("cpu"), module))
            originals = {p: v for p, v in before.items() if p.dtype != v.dtype}
            opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
            (opt,) = strategies.attach(engine, module, module, [opt], {"originals": originals})
        else:
            opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
            module, opt = engine.setup(module, opt)
        x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(3)), torch.arange(8) % 3
        engine.backward(torch.nn.functional.cross_entropy(module(x), y))
        engine.step(opt, max_grad_norm=lc.CLIP)
        return mp.fp32_state_dict(module, opt)

    early, late = run(False), run(True)
    assert all(torch.equal(early[k], late[k]) for k in early)


def _stepped(master: str, dtype: str = "bf16", steps: int = 3):
    """A Classifier and its compact master optimizer after ``steps`` clipped SGD steps."""
    engine = mp.MixedPrecision(level="O2", dtype=dtype, master=master)
    module = lc.Classifier()
    module, opt = engine.setup(module, torch.optim.SGD(module.parameters(), lr=0.1,
                                                       momentum=0.9))
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=gen), torch.arange(8) % 3
        engine.backward(torch.nn.functional.cross_entropy(module(x), y))
        engine.step(opt, max_grad_norm=lc.CLIP)
    return engine, module, opt


def test_kahan_pairs_take_a_sub_modules_own_load_under_a_sharded_model(tmp_path):
    """Lightning loads an FSDP2 model one sub-module at a time, and a sharded model has no
    fp32 companions for the prepared model's own load hooks: the plugin's hook sets each Kahan
    pair from the loaded value (dropped this session, with the pair then keeping its stale
    compensation: 5.1e-3 off on two gloo ranks). One rank here."""
    from torch.distributed.tensor import distribute_tensor
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        net, opt = mp.parallel.fsdp(net, torch.optim.SGD(net.parameters(), lr=0.05,
                                                         momentum=0.9),
                                    level="O2", dtype="bf16", master="kahan")
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            torch.nn.functional.cross_entropy(net(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        net._trainer = SimpleNamespace(strategy=ModelParallelStrategy())  # what strategy_of reads
        checkpoints.register(net, [opt])
        head, value = net[2], torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
        w = head.weight
        head.load_state_dict({"weight": distribute_tensor(value, w.device_mesh, w.placements),
                              "bias": distribute_tensor(torch.zeros(3), w.device_mesh,
                                                        w.placements)})
        weight = head.weight.full_tensor()
        comp = opt.compensation(head.weight).full_tensor()
        assert torch.equal(weight, value.to(torch.bfloat16))
        assert torch.equal(comp, (value - weight.float()).to(torch.bfloat16))
    finally:
        dist.destroy_process_group()


def test_kahan_pairs_take_a_sub_modules_own_load_under_model_parallel():
    """Lightning loads an FSDP2 model one sub-module at a time: each Kahan pair must stand for
    the loaded value (weight to nearest, compensation the rest), not keep a compensation from
    before (torch's zero-lr step before the optimizer's load would add it to the weight). The
    prepared model's sub-modules do it themselves (a Lightning-only hook did before)."""
    _, module, opt = _stepped("kahan")
    value = torch.randn(module.net.head.weight.shape, generator=torch.Generator().manual_seed(5))
    module.net.head.load_state_dict({"weight": value, "bias": torch.zeros(3)})
    weight, comp = module.net.head.weight, opt.compensation(module.net.head.weight)
    assert torch.equal(weight, value.to(torch.bfloat16))
    assert torch.equal(comp, (value - weight.float()).to(torch.bfloat16))


def test_fp16_kahan_with_gradient_clipping_trains_as_fp32_masters_in_one_process():
    """Lightning unscales, then clips (``gradient_clip_val``), then steps: with fp16 weights and
    ``master="kahan"`` the clip reaches the fp32 gradient copies the step reads (measured 2.2e-6
    from fp32 masters after 4 steps)."""
    kahan = lc.fit("ddp", ("O2", "fp16", "kahan"), world=1, epochs=1)
    fp32 = lc.fit("ddp", ("O2", "fp16", "fp32"), world=1, epochs=1)
    assert kahan["step"] == fp32["step"] == 4
    assert max_diff(kahan["weights"], fp32["weights"]) < 2e-5
