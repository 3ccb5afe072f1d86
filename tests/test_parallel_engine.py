"""The engine in a user's own torchrun loop: ``amp.setup`` then DDP (``mp.parallel.ddp`` or torch's
own ``DistributedDataParallel``), and FSDP2 through ``mp.parallel.fsdp(..., mixed_precision=amp)``,
on two gloo ranks against one process at the same global batch.

One launch per host runs every configuration on both ranks (module fixtures): parity with one
process, ranks bitwise equal, the overflow flag agreed (rank 1 alone writes an inf after the
reduction: both ranks skip), resume bitwise at the same world size, and a checkpoint that a single
process resumes (2 ranks -> 1). The clip is tight (``max_grad_norm=0.05``, below every step's
norm), so a clip norm measured on one rank's shard alone would move the weights away from one
process.
"""

import copy
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_cases import GLOBAL_BATCH, SAMPLES, WORLD, Net, dataset, launch, max_diff
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

import mixprec as mp

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning"),
              pytest.mark.filterwarnings(
                  r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning"),
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

STEPS, STOP, CLIP = 8, 3, 0.05
# (level, dtype, master): every level, both 16-bit dtypes at O2, a compact master method (the
# others step through the same engine calls; tests/test_parallel_compact.py runs each under DDP
# and FSDP2, and every rank compiles its kernel: about a minute each on a 2-core machine)
CONFIGS = [("O0", "bf16", None), ("O1", "bf16", None), ("O2", "bf16", None),
           ("O2", "fp16", None), ("O3", "bf16", None), ("O2", "bf16", "split")]
# Max abs weight difference from one process at the same global batch: fp32 sums reassociated
# (O0), 16-bit rounding of half-batch activations and gradients (the others; measured <= 4e-3).
TOLERANCE = {"O0": 1e-5, "O1": 1e-2, "O2": 1e-2, "O3": 2e-2}


def name(config) -> str:
    level, dtype, master = config
    return f"{level}-{dtype}" + (f"-{master}" if master else "")


def build(host, config):
    """Model, optimizer and engine as the user's script builds them (the same seed everywhere)."""
    level, dtype, master = config
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    amp = mp.MixedPrecision(level=level, dtype=dtype, master=master)
    if host == "fsdp":
        model, opt = mp.parallel.fsdp(net, opt, mixed_precision=amp)
        return amp, model, opt
    model, opt = amp.setup(net, opt)
    if host == "ddp":
        model = mp.parallel.ddp(model)
    elif host == "torch-ddp":
        model = DistributedDataParallel(model)
    return amp, model, opt


def train(amp, model, opt, steps, *, rank=0, world=1, start=0, inf_at=None):
    """SGD steps over the data in order; this rank's slice of each global batch."""
    data, per = dataset(), GLOBAL_BATCH // world
    applied, norms = [], []
    for step in range(start, steps):
        lo = step * GLOBAL_BATCH % SAMPLES + rank * per
        x, y = data[lo:lo + per]
        amp.backward(F.cross_entropy(model(x), y))
        norms.append(float(amp.grad_norm(opt)))  # the global norm: every rank's gradients
        if step == inf_at and rank == 1:  # after the reduction: only rank 1 sees it
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("inf")
        applied.append(amp.step(opt, max_grad_norm=CLIP))
        opt.zero_grad()
    train.norms = norms  # the last run's, for the tests
    return applied


def weights(model, opt) -> dict:
    return {k: v.cpu() for k, v in mp.fp32_state_dict(model, opt).items()}


def checkpoint(host, amp, model, opt) -> dict:
    """What the user saves: the fp32 weights, the optimizer (masters included) and the engine.
    DDP: the module's state (plain names) on every rank alike; FSDP2: this rank's shards."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return copy.deepcopy({"model": module.state_dict(), "optimizer": opt.state_dict(),
                          "amp": amp.state_dict()})  # as written to disk: not the live tensors


def restore(host, config, ckpt):
    ckpt = copy.deepcopy(ckpt)  # as read from disk: torch's load_state_dict keeps the tensors
    amp, model, opt = build(host, config)
    module = model.module if isinstance(model, DistributedDataParallel) else model
    module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    return amp, model, opt


def full_checkpoint(amp, model, opt) -> dict:
    """An FSDP2 run's checkpoint in one-process form (torch's full state dicts, gathered)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    names = [n for n, _ in model.named_parameters()]
    osd = get_optimizer_state_dict(model, opt, options=options)
    msd = get_model_state_dict(model, options=options)
    if not osd:  # cpu_offload: rank 0 alone receives the full tensors
        return None
    by_position = {names.index(k): v for k, v in osd["state"].items()}
    groups = [{**g, "params": [names.index(k) for k in g["params"]]} for g in osd["param_groups"]]
    return {"model": msd, "optimizer": {"state": by_position, "param_groups": groups},
            "amp": amp.state_dict()}


def rank_case(rank, out, host):
    results = {}
    for config in CONFIGS:
        if host == "torch-ddp" and config[0] != "O2":
            continue
        amp, model, opt = build(host, config)
        train(amp, model, opt, STEPS, rank=rank, world=WORLD)
        whole, norms = weights(model, opt), train.norms
        amp, model, opt = build(host, config)
        train(amp, model, opt, STOP, rank=rank, world=WORLD)
        ckpt = checkpoint(host, amp, model, opt)
        single = full_checkpoint(amp, model, opt) if host == "fsdp" else ckpt
        torch.manual_seed(1234 + rank)  # nothing random may leak into the resumed run
        amp, model, opt = restore(host, config, ckpt)
        train(amp, model, opt, STEPS, rank=rank, world=WORLD, start=STOP)
        resumed = weights(model, opt)
        results[name(config)] = {"whole": whole, "resumed": resumed, "norms": norms,
                                 "resume_equal": all(torch.equal(whole[k], resumed[k])
                                                     for k in whole),
                                 "single_ckpt": single if rank == 0 else None}
    if host != "torch-ddp":
        amp, model, opt = build(host, ("O2", "fp16", None))
        applied = train(amp, model, opt, 3, rank=rank, world=WORLD, inf_at=1)
        results["skip"] = {"applied": applied, "scale": amp.scaler.get_scale(),
                           "weights": weights(model, opt)}
    return results


def one_process(config, steps=STEPS, ckpt=None, start=0):
    if ckpt is None:
        amp, model, opt = build("single", config)
    else:
        amp, model, opt = restore("single", config, ckpt)
    train(amp, model, opt, steps, start=start)
    return weights(model, opt)


@pytest.fixture(scope="module")
def single():
    out = {}
    for c in CONFIGS:
        out[name(c)] = one_process(c)
        out[name(c) + " norms"] = train.norms
    return out


@pytest.fixture(scope="module", params=["ddp", "torch-ddp", "fsdp"])
def ranks(request, tmp_path_factory):
    host = request.param
    return host, launch(rank_case, tmp_path_factory.mktemp(host), host, timeout=400)


def configs_of(host):
    return [c for c in CONFIGS if host != "torch-ddp" or c[0] == "O2"]


def test_two_ranks_train_like_one_process_and_agree_bitwise(ranks, single):
    host, (r0, r1) = ranks
    for config in configs_of(host):
        key = name(config)
        a, b = r0[key]["whole"], r1[key]["whole"]
        assert all(torch.equal(a[k], b[k]) for k in a), (host, key)
        print(f"FIGURE engine {host} {key}: {max_diff(a, single[key]):.1e}")
        assert max_diff(a, single[key]) <= TOLERANCE[config[0]], (host, key)


def test_the_gradient_norm_is_the_global_one_on_every_rank(ranks, single):
    """amp.grad_norm (and so the clip in amp.step) measures every rank's gradients: under FSDP2
    each rank holds a shard, and a shard's norm alone would be about 1/sqrt(2) of it."""
    host, (r0, r1) = ranks
    for config in configs_of(host):
        key = name(config)
        got, want = (torch.tensor(n) for n in (r0[key]["norms"], single[key + " norms"]))
        torch.testing.assert_close(got, torch.tensor(r1[key]["norms"]), rtol=0, atol=0,
                                   equal_nan=True)
        done = want.isfinite() & got.isfinite()  # fp16 may overflow at the initial scale
        assert done.sum() >= STEPS - 2 and bool((want[done] > CLIP).all())  # the clip acted
        first = int(done.nonzero()[0])
        assert float(got[first]) == pytest.approx(float(want[first]), rel=1e-2), (host, key)
        torch.testing.assert_close(got[done], want[done], rtol=0.1, atol=0)


def test_resume_at_the_same_world_size_is_bitwise(ranks):
    host, results = ranks
    for config in configs_of(host):
        for r in results:
            assert r[name(config)]["resume_equal"], (host, name(config))


def test_rank_one_overflow_alone_skips_the_step_on_both_ranks(ranks):
    host, results = ranks
    if host == "torch-ddp":
        pytest.skip("covered by the mp.parallel.ddp run (the same scaler)")
    r0, r1 = (r["skip"] for r in results)
    assert r0["applied"] == r1["applied"] == [True, False, True]
    assert r0["scale"] == r1["scale"]
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])


def test_a_two_rank_checkpoint_resumes_in_one_process(ranks):
    """The checkpoint of step 3 (DDP: the module's state; FSDP2: torch's full state dicts,
    the split remainder gathered as int32 and narrowed again on load) loads into one process,
    which continues like the two ranks did."""
    host, (r0, _) = ranks
    for config in configs_of(host):
        ckpt = r0[name(config)]["single_ckpt"]
        got = one_process(config, ckpt=ckpt, start=STOP)
        assert max_diff(got, r0[name(config)]["whole"]) <= TOLERANCE[config[0]], (host, config)


def _wrapped_without_a_group() -> DistributedDataParallel:
    fake = DistributedDataParallel.__new__(DistributedDataParallel)  # no process group needed
    torch.nn.Module.__init__(fake)
    fake.module = Net()
    return fake


def test_setup_refuses_a_wrapped_model_and_names_the_order():
    with pytest.raises(TypeError, match="before it is wrapped in DistributedDataParallel"):
        mp.MixedPrecision(level="O2", dtype="bf16").setup(_wrapped_without_a_group())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_prepare_refuses_a_wrapped_model_and_names_the_order(level):
    """After the cast DDP's hooks no longer average the gradients: the ranks would drift."""
    fake = _wrapped_without_a_group()
    before = {n: p.detach().clone() for n, p in fake.named_parameters()}
    with pytest.raises(TypeError, match=r"then model = mp.parallel.ddp\(model\)"):
        mp.prepare(fake, torch.optim.SGD(fake.parameters(), lr=0.1), level=level, dtype="bf16")
    assert mp.policy_of(fake) is None
    assert all(torch.equal(p, before[n]) for n, p in fake.named_parameters())


def test_prepare_sees_ddp_inside_torch_compile_s_wrapper():
    with pytest.raises(TypeError, match="before it is wrapped in DistributedDataParallel"):
        mp.prepare(torch.compile(_wrapped_without_a_group()), level="O2", dtype="bf16")


def test_fsdp_refuses_a_ddp_model_and_says_what_to_pass():
    with pytest.raises(TypeError, match="pass model.module"):
        mp.parallel.fsdp(_wrapped_without_a_group(), level="O2", dtype="bf16")


def test_an_optimizer_over_replaced_parameters_is_refused_at_the_first_step():
    """What fully_shard after setup() does: the model gets new parameters, the optimizer keeps
    the old ones (stepping them would train nothing)."""
    torch.manual_seed(0)
    amp = mp.MixedPrecision(level="O1", dtype="bf16")
    model = amp.setup(Net())
    stale = torch.optim.SGD([torch.nn.Parameter(p.detach().clone())
                             for p in model.parameters()], lr=0.1)
    amp.backward(model(torch.randn(2, 8)).float().sum())
    with pytest.raises(RuntimeError, match="mixed_precision=amp"):
        amp.step(stale)


def test_mixed_precision_with_precision_keywords_beside_it_is_refused():
    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    with pytest.raises(TypeError, match="mixed_precision= and level"):
        mp.parallel.fsdp(Net(), level="O3", mixed_precision=amp)


@pytest.mark.skipif(os.environ.get("MIXPREC_LAUNCH_LOOP") is None,
                    reason="20 launches in a row: set MIXPREC_LAUNCH_LOOP=1 (minutes)")
@pytest.mark.parametrize("host", ["ddp", "fsdp"])
def test_twenty_launches_in_a_row_exit_zero(host, tmp_path):
    for i in range(20):
        (tmp_path / f"{host}{i}").mkdir()
        out = launch(short_case, tmp_path / f"{host}{i}", host, timeout=300)
        assert [r["applied"] for r in out] == [[True] * 3] * 2


def short_case(rank, out, host):
    amp, model, opt = build(host, ("O2", "bf16", None))
    return {"applied": train(amp, model, opt, 3, rank=rank, world=WORLD)}


def test_a_fresh_engine_pickles_as_spawned_ranks_need():
    """Lightning's "ddp_spawn" pickles the plugin and its engine (before set-up) to every rank,
    where it then sets up and steps."""
    amp = pickle.loads(pickle.dumps(mp.MixedPrecision(level="O2", dtype="bf16")))
    torch.manual_seed(0)
    net = Net()
    model, opt = amp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    amp.backward(F.cross_entropy(model(torch.randn(4, 8)), torch.arange(4) % 3))
    assert amp.step(opt) and amp.policy.level == "O2"
