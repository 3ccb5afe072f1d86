"""An Accelerate loop on the engine: the same numbers as the engine's own loop, skip on
overflow, exact save/load_state, what it refuses; and over two gloo ranks (DDP and FSDP2)
against one process at the same global batch, ranks equal, resume bitwise, 2 ranks into 1."""

import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_cases import GLOBAL_BATCH, TOLERANCE, Net, dataset, launch, max_diff

import mixprec as mp

pytest.importorskip("accelerate")
import hf_cases as hc  # noqa: E402

from mixprec.integrations.accelerate import MixprecAccelerator  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::mixprec.hardware.SlowDtypeWarning",
    # torch's own, when the compact masters' kernels first import inductor
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")

LEVELS = ("O0", "O1", "O2", "O3")
MASTERS = ("kahan", "split", "stochastic")
# (FSDP2, master, state_dtype) of the resumed runs: DDP and FSDP2 at fp32 masters, FSDP2 with
# each compact master (the split remainder and the Kahan compensation sharded in the
# optimizer's DCP state) and with bf16 moments
RESUMED = ((False, None, None), (True, None, None), *((True, m, None) for m in MASTERS),
           (True, None, "bf16"))


def batches(n=4, inf_at=None):
    x, y = dataset().tensors
    x = x.clone()
    if inf_at is not None:
        x[inf_at, 0] = float("inf")
    return [(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]) for i in range(n)]


def net_and_opt():
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def lockstep(acc, model, opt, amp, ref, ref_opt) -> list:
    """The accelerator's loop (in its ``autocast()``, clipped to 0.5) and the engine's own over
    the same batches; their fp32 weights end bitwise equal. Returns the accelerator's norms."""
    norms = []
    for x, y in batches():
        with acc.autocast():  # Accelerate's own autocast: nothing on top of the engine
            loss = F.cross_entropy(model(x).float(), y)
        acc.backward(loss)
        norms.append(acc.clip_grad_norm_(model.parameters(), 0.5))
        opt.step()
        opt.zero_grad()
        amp.backward(F.cross_entropy(ref(x).float(), y))
        amp.step(ref_opt, max_grad_norm=0.5)
        ref_opt.zero_grad()
    a, b = mp.fp32_state_dict(model, opt.optimizer), mp.fp32_state_dict(ref, ref_opt)
    assert all(torch.equal(a[k], b[k]) for k in a)
    return norms


def test_the_loop_takes_the_engines_steps_exactly():
    """One changed line: the accelerator's loop gives the engine's own loop's masters, bit for
    bit (prepare, backward, clip_grad_norm_, optimizer.step)."""
    acc = hc.accelerator("O2", loss_scale=mp.DynamicLossScaler(init_scale=2.0 ** 8))
    model, opt = acc.prepare(*net_and_opt())
    assert isinstance(opt.optimizer, mp.MasterWeightOptimizer)
    assert model.blocks[0].fc.weight.dtype == torch.bfloat16
    amp = mp.MixedPrecision("O2", "bf16", loss_scale=mp.DynamicLossScaler(init_scale=2.0 ** 8))
    ref, ref_opt = amp.setup(*net_and_opt())
    norms = lockstep(acc, model, opt, amp, ref, ref_opt)
    assert all(n > 0.5 for n in norms)  # the clip acted (true norms, not scaled ones)
    assert acc.unwrap_model(model).state_dict()["head.weight"].dtype == torch.float32


@pytest.mark.parametrize("level,fused", [("O2", False), ("O1", True)])
def test_an_overflow_skips_the_step_and_the_scheduler(level, fused):
    """Accelerate tells a skipped step by the optimizer's ``step()`` not being called: at O1 a
    torch optimizer built with ``fused=True`` (which could skip on the device) is not stepped
    on an overflow either."""
    acc = MixprecAccelerator(level=level, dtype="fp16", cpu=True)
    model, opt = net_and_opt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if fused else opt
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    model, opt, sched = acc.prepare(model, opt, sched)
    skipped = []
    for i, (x, y) in enumerate(batches(3, inf_at=9)):  # sample 9: step 2
        before = mp.fp32_state_dict(model, opt.optimizer)
        acc.backward(F.cross_entropy(model(x).float(), y))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
        if skipped[-1]:
            after = mp.fp32_state_dict(model, opt.optimizer)
            assert all(torch.equal(before[k], after[k]) for k in before)
            assert opt.optimizer.state[next(model.parameters())]["step"] == 1
    assert skipped == [False, True, False]
    assert sched.scheduler.last_epoch == 2  # stepped after the applied updates only
    assert acc.engine.scaler.skipped_steps == 1


def test_save_and_load_state_restore_the_run_exactly(tmp_path):
    def run(stop=None, load=None):
        acc = MixprecAccelerator(level="O2", dtype="fp16", cpu=True)
        model, opt = acc.prepare(*net_and_opt())
        if load:
            acc.load_state(load)
        for i, (x, y) in enumerate(batches()):
            if load and i < 2:
                continue
            acc.backward(F.cross_entropy(model(x).float(), y))
            opt.step()
            opt.zero_grad()
            if i + 1 == stop:
                acc.save_state(str(tmp_path / "state"))
                return None
        return mp.fp32_state_dict(model, opt.optimizer), acc.engine.scaler.state_dict()

    whole = run()
    run(stop=2)
    assert {"scaler.pt", "optimizer.bin"} <= set(os.listdir(tmp_path / "state"))
    resumed = run(load=str(tmp_path / "state"))
    assert all(torch.equal(whole[0][k], resumed[0][k]) for k in whole[0])
    assert whole[1] == resumed[1]
    other = MixprecAccelerator(level="O1", dtype="fp16", cpu=True)
    other.prepare(*net_and_opt())
    with pytest.raises(ValueError, match=r"made under the policy O2\(.*this run uses O1\("):
        other.load_state(str(tmp_path / "state"))


def test_accelerates_own_mixed_precision_is_refused_saying_why(monkeypatch):
    with pytest.raises(ValueError, match=r"mixed_precision='bf16' turns on Accelerate's own mixed "
                                         r"precision.*cast and scale twice"):
        MixprecAccelerator(mixed_precision="bf16", cpu=True)
    hc.reset_accelerate()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match="accelerator was configured for mixed precision"):
        MixprecAccelerator(level="O2", cpu=True)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    hc.reset_accelerate()
    assert MixprecAccelerator(mixed_precision="no", cpu=True).engine.policy is None  # "auto"


@pytest.mark.parametrize("kw, named", [
    ({"level": "O0", "dtype": "bf16"}, "no"), ({"level": "O1", "dtype": "fp16"}, "fp16"),
    ({"level": "O2", "dtype": "bf16"}, "bf16"), ({"level": "O3", "dtype": "fp16"}, "fp16"),
    ({"level": "O2", "dtype": "bf16", "fp8": "rowwise"}, "fp8"),
    ({"level": "O2"}, "auto")])
def test_mixed_precision_names_what_the_model_computes_in_as_accelerate_does(kw, named):
    """What Accelerate's own values say, while Accelerate's own switch stays off: no autocast
    of its own, no GradScaler of its own (the engine is the scaler). "auto" is named as it
    resolves on the accelerator's device, without being resolved yet."""
    if named == "auto":  # this CPU's 16-bit type, or fp32 where it has no fast one
        auto = mp.Policy.from_level("O2", "auto", "cpu", warn=False).compute_dtype
        named = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(auto, "no")
    hc.reset_accelerate()
    acc = MixprecAccelerator(cpu=True, **kw)
    assert acc.mixed_precision == named
    assert acc.state.mixed_precision == "no" and not acc.native_amp
    assert isinstance(acc.scaler, mp.integrations.accelerate.EngineGradScaler)
    with acc.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert (acc.engine.policy is None) == ("dtype" not in kw)


def test_a_script_branching_on_mixed_precision_pads_and_trains_as_the_engine():
    """Accelerate's checkpointing example pads batches to a multiple of 16 for "fp8", of 8 for
    any other mixed precision, not at all for "no": under O2 fp16 it takes the padding path,
    and the run is bitwise the engine's own loop (nothing autocast or scaled a second time)."""
    hc.reset_accelerate()
    acc = MixprecAccelerator(level="O2", dtype="fp16", cpu=True,
                             loss_scale=mp.DynamicLossScaler(init_scale=2.0 ** 8))
    pad_to = 16 if acc.mixed_precision == "fp8" else 8 if acc.mixed_precision != "no" else None
    assert pad_to == 8
    model, opt = acc.prepare(*net_and_opt())
    amp = mp.MixedPrecision("O2", "fp16", loss_scale=mp.DynamicLossScaler(init_scale=2.0 ** 8))
    ref, ref_opt = amp.setup(*net_and_opt())
    lockstep(acc, model, opt, amp, ref, ref_opt)
    assert acc.engine.scaler.get_scale() == amp.scaler.get_scale()


def test_bad_arguments_are_refused():
    engine = mp.MixedPrecision("O2", "bf16")
    with pytest.raises(TypeError, match="got mixed_precision= and master"):
        MixprecAccelerator(mixed_precision=engine, master="kahan", cpu=True)
    with pytest.raises(TypeError, match="keyword arguments only"):
        MixprecAccelerator(True)
    acc = MixprecAccelerator(mixed_precision=engine, cpu=True)
    assert acc.engine is engine
    model, opt = net_and_opt()
    model = acc.prepare(model)
    with pytest.raises(ValueError, match="pass the model and its optimizer to one prepare"):
        acc.prepare(opt)
    model, opt = acc.prepare(*net_and_opt())
    acc.backward(F.cross_entropy(model(batches(1)[0][0]).float(), batches(1)[0][1]))
    with pytest.raises(ValueError, match="clip the parameters of one prepared optimizer"):
        acc.clip_grad_norm_(list(model.parameters())[:2] + [torch.zeros(1, requires_grad=True)],
                            1.0)


def _ddp_hooks_on_16_bit_parameters_only() -> None:
    from torch.nn.parallel import DistributedDataParallel

    from mixprec.integrations.accelerate import reduce_in_fp32

    low = DistributedDataParallel(mp.prepare(Net(), level="O2", dtype="bf16"))
    reduce_in_fp32(low)
    reduce_in_fp32(low)  # a second call leaves the one hook
    fp32 = DistributedDataParallel(Net())
    reduce_in_fp32(fp32)
    reduce_in_fp32(Net())  # not DDP: nothing
    assert low._mixprec_hook and not getattr(fp32, "_mixprec_hook", False)
    x, y = dataset()[:8]
    F.cross_entropy(low(x).float(), y).backward()  # the hook runs
    assert low.module.blocks[0].fc.weight.grad.dtype == torch.bfloat16


def test_ddp_of_16_bit_parameters_reduces_in_fp32(tmp_path):
    """The hook goes on a DDP model with 16-bit parameters, once; not on an fp32 one. The DDP
    models (their reducers hold the process group) are gone before the group is destroyed: a
    reducer freed after it can leave gloo's destructor waiting on its threads."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        _ddp_hooks_on_16_bit_parameters_only()
    finally:
        gc.collect()
        dist.destroy_process_group()


# -- two ranks ------------------------------------------------------------------------------

def suite(rank, out):
    hc.launcher_env(2)
    res = {}
    for level in LEVELS:
        res[("ddp", level)] = hc.accelerate_fit(level, 2)
        res[("fsdp", level)] = hc.accelerate_fit(level, 2, shard=True)
    for master in MASTERS:  # compact masters: FSDP2 shards them (16-bit shards and buffers)
        res[("fsdp", master)] = hc.accelerate_fit("O2", 2, master=master, shard=True)
    res[("ddp", "kahan")] = hc.accelerate_fit("O2", 2, master="kahan")
    for shard, master, state_dtype in RESUMED:
        res[("resume", shard, master, state_dtype)] = hc.accelerate_resume(
            out, "O2", 2, master=master, shard=shard, state_dtype=state_dtype)
    return res


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    return launch(suite, tmp_path_factory.mktemp("accelerate"), timeout=900)


@pytest.fixture(scope="module")
def single():
    out = {level: hc.accelerate_fit(level, 1) for level in LEVELS}
    out.update({m: hc.accelerate_fit("O2", 1, master=m) for m in MASTERS})
    return out


CASES = ([(host, level) for host in ("ddp", "fsdp") for level in LEVELS]
         + [("fsdp", master) for master in MASTERS] + [("ddp", "kahan")])


@pytest.mark.slow
@pytest.mark.parametrize("host, case", CASES)
def test_two_ranks_train_like_one_process_and_agree_bitwise(ranks, single, host, case):
    tol = TOLERANCE.get(case, TOLERANCE["O2"])
    got = [r[(host, case)] for r in ranks]
    assert max_diff(got[0]["weights"], single[case]["weights"]) <= tol
    assert got[0]["loss"] == pytest.approx(single[case]["loss"], abs=tol)
    a, b = got
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert a["loss"] == b["loss"]
    # DDP of 16-bit parameters (O2, O3) averages in fp32; fp32 parameters need no hook
    assert a["fp32_reduce"] == (host == "ddp" and case in ("O2", "O3", "kahan"))


@pytest.mark.slow
@pytest.mark.parametrize("shard, master, state_dtype", RESUMED,
                         ids=["ddp", "fsdp", *(f"fsdp-{m}" for m in MASTERS), "fsdp-bf16-moments"])
def test_two_ranks_resume_bitwise(ranks, shard, master, state_dtype):
    """save_state then load_state in a fresh run: the weights (with a compact master's buffers:
    the fp32 values they hold) equal the saved ones, and the run ends bitwise as the
    uninterrupted one."""
    for r in ranks:
        result = r[("resume", shard, master, state_dtype)]
        assert result["loaded"] and result["equal"]
    expected = {"optimizer_0", "pytorch_model_fsdp_0"} if shard else {"optimizer.bin",
                                                                       "model.safetensors"}
    assert expected | {"scaler.pt", "random_states_0.pkl", "random_states_1.pkl"} <= set(
        ranks[0][("resume", shard, master, state_dtype)]["files"])


def one_rank(rank, out, cases):
    hc.launcher_env(1)
    return {master: hc.accelerate_load(path, "O2", 1, master=master, shard=True)
            for master, path in cases}


@pytest.mark.slow
def test_an_fsdp2_state_of_two_ranks_loads_into_one_process(ranks, tmp_path):
    """The 2-rank FSDP2 state at step 6 (DCP directories), loaded by one FSDP2 process: the
    fp32 values (masters, or weights with their remainder/compensation) are the saved ones
    bitwise; the run then goes on like the 2-rank run, within the batch split's tolerance (one
    batch of 8 where two ranks each ran 4: other roundings in the bf16 forward and backward)."""
    cases = [(m, ranks[0][("resume", True, m, None)]["path"]) for m in (None, "split", "kahan")]
    got = launch(one_rank, tmp_path, cases, world=1, timeout=300)[0]
    for master, _ in cases:
        two = ranks[0][("resume", True, master, None)]
        one = got[master]
        assert all(torch.equal(one["loaded"][k], two["saved"][k]) for k in two["saved"])
        assert max_diff(one["weights"], two["weights"]) <= TOLERANCE["O2"]
    acc = hc.accelerator("O2")  # one process without FSDP2: refused, naming it
    hc.build(acc, 1)
    with pytest.raises(ValueError, match="was saved under FSDP2.*configure fsdp_version=2"):
        acc.load_state(cases[0][1])


@pytest.mark.slow
def test_a_ddp_state_of_two_ranks_loads_into_one_process(ranks, single):
    """The 2-rank state at step 6, loaded by one process: the same masters and scaler, and the
    run goes on like the 2-rank run (the batch split's tolerance)."""
    saved = ranks[0][("resume", False, None, None)]
    acc = hc.accelerator("O2")
    model, opt, data = hc.build(acc, 1)
    acc.load_state(saved["path"])
    state = torch.load(os.path.join(saved["path"], "scaler.pt"), weights_only=True)
    assert acc.engine.state_dict() == state
    per_epoch = len(data)  # 4 steps of the global batch
    hc.train(acc, model, opt, data, first_epoch=1, skip=6 - per_epoch)
    two = ranks[0][("ddp", "O2")]["weights"]
    assert max_diff(hc.weights(model, opt), two) <= TOLERANCE["O2"]
    assert GLOBAL_BATCH == 8


# -- compact masters' state across hosts' checkpoints (one process) -------------------------

def compact(master):
    torch.manual_seed(0)
    model = mp.prepare(Net(), level="O2", dtype="bf16")
    return model, mp.CompactMasterOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                            master)


@pytest.mark.parametrize("master", ["split", "kahan"])
def test_an_unstepped_compact_optimizer_stays_fresh_across_a_state_dict_round_trip(master):
    """What Accelerate's optimizer wrapper does on prepare: state_dict() then load_state_dict().
    The buffers come back held aside, so the state stays empty and torch's distributed
    checkpointing still lays it out (measured before: a load missing the fp32 norm weights'
    state)."""
    model, opt = compact(master)
    held = {p: opt.compensation(p).clone() for p in opt._low}
    opt.load_state_dict(opt.state_dict())
    assert not opt.state
    assert all(torch.equal(opt.compensation(p), held[p]) for p in held)
    F.cross_entropy(model(dataset()[:8][0]).float(), dataset()[:8][1]).backward()
    opt.step()  # the buffers enter the state with the first step
    assert all(set(opt.state[p]) >= {"exp_avg", opt.master.buffer_key} for p in held)


def test_a_remainder_saved_as_int32_loads_as_int16_and_a_foreign_one_is_refused():
    model, opt = compact("split")
    F.cross_entropy(model(dataset()[:8][0]).float(), dataset()[:8][1]).backward()
    opt.step()
    live = {i: opt.state[p]["remainder"].clone()
            for i, p in enumerate(opt.param_groups[0]["params"]) if "remainder" in opt.state[p]}
    wide = opt.state_dict()  # int32 (gloo carries no int16), also in one process
    assert live and all(wide["state"][i]["remainder"].dtype == torch.int32
                        and torch.equal(wide["state"][i]["remainder"], r.int())
                        for i, r in live.items())
    opt.load_state_dict(wide)
    params = opt.param_groups[0]["params"]
    assert all(opt.state[params[i]]["remainder"].dtype == torch.int16
               and torch.equal(opt.state[params[i]]["remainder"], r) for i, r in live.items())
    first = next(iter(live))
    wide["state"][first]["remainder"] = wide["state"][first]["remainder"] + 2 ** 16
    with pytest.raises(ValueError, match="'remainder' of parameter .* int32 with values "
                                         "outside int16"):
        opt.load_state_dict(wide)


def test_a_one_process_split_state_crosses_gloo_into_fsdp2_shards(tmp_path):
    """Resuming a one-process checkpoint at several ranks (Lightning's ModelParallelStrategy:
    torch's set_optimizer_state_dict with broadcast_from_rank0) sends every tensor of the
    state through a broadcast, and gloo has no int16 ("Invalid scalar type", one rank
    included): the remainder of an unsharded split optimizer is saved as int32, and the FSDP2
    optimizer takes it as its int16 shards, the same integers."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = compact("split")
    x, y = dataset()[:8]
    F.cross_entropy(model(x).float(), y).backward()
    opt.step()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        full = StateDictOptions(full_state_dict=True)
        saved = get_optimizer_state_dict(model, opt, options=full)  # by name, as a file holds
        torch.manual_seed(0)
        net = Net()
        sharded, sharded_opt = mp.parallel.fsdp(net, torch.optim.AdamW(net.parameters(),
                                                                       lr=1e-2),
                                                level="O2", dtype="bf16", master="split")
        set_optimizer_state_dict(sharded, sharded_opt, saved, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        got = dict(zip([n for n, _ in sharded.named_parameters()],
                       [sharded_opt.state.get(p, {}).get("remainder")
                        for p in sharded.parameters()]))
        want = {n: opt.state[p]["remainder"] for n, p in model.named_parameters()
                if "remainder" in opt.state[p]}
        assert want and all(got[n].dtype == torch.int16 and torch.equal(got[n].full_tensor(), r)
                            for n, r in want.items())
    finally:
        dist.destroy_process_group()


def test_a_sharded_remainder_is_saved_as_int32_and_the_live_one_stays_int16(tmp_path):
    """gloo cannot gather or broadcast int16 ("Invalid scalar type"): a full state dict of an
    FSDP2 split optimizer gathers the remainder as int32; loading makes it int16 again."""
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        net = Net()
        model, opt = mp.parallel.fsdp(net, torch.optim.AdamW(net.parameters(), lr=1e-2),
                                      level="O2", dtype="bf16", master="split")
        F.cross_entropy(model(dataset()[:8][0]).float(), dataset()[:8][1]).backward()
        opt.step()
        live = [s["remainder"] for s in opt.state.values() if "remainder" in s]
        saved = [s["remainder"] for s in opt.state_dict()["state"].values() if "remainder" in s]
        assert live and all(isinstance(r, DTensor) and r.dtype == torch.int16 for r in live)
        assert all(r.dtype == torch.int32 for r in saved)
        assert all(torch.equal(a.to_local().to(torch.int32), b.to_local())
                   for a, b in zip(live, saved))
        opt.load_state_dict(opt.state_dict())
        assert all(s["remainder"].dtype == torch.int16 for s in opt.state.values()
                   if "remainder" in s)
    finally:
        dist.destroy_process_group()


def test_a_prepared_scheduler_waits_on_its_own_optimizer_only():
    """At O2 Accelerate matched a scheduler to its optimizer by identity with the master
    optimizer around it, failed, and bound it to every optimizer: a skipped step of another
    optimizer held this one's schedule back (O1 was right)."""
    acc = MixprecAccelerator(level="O2", dtype="bf16", cpu=True)
    torch.manual_seed(0)
    enc, head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
    o1 = torch.optim.SGD(enc.parameters(), lr=1.0)
    o2 = torch.optim.SGD(head.parameters(), lr=1.0)
    s1 = torch.optim.lr_scheduler.LambdaLR(o1, lambda s: 0.5 ** s)
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, lambda s: 0.5 ** s)
    enc, head, o1, o2, s1, s2 = acc.prepare(enc, head, o1, o2, s1, s2)
    assert len(s1.optimizers) == len(s2.optimizers) == 1
    acc.backward(F.mse_loss(head(enc(torch.randn(8, 8))).float(), torch.randn(8, 1)))
    next(head.parameters()).grad[0, 0] = float("nan")  # only the head's step is skipped
    with pytest.warns(RuntimeWarning, match="skipped a step"):
        o1.step()
        o2.step()
    s1.step()
    s2.step()
    assert (o1.step_was_skipped, o2.step_was_skipped) == (False, True)
    assert (s1.get_last_lr(), s2.get_last_lr()) == ([0.5], [1.0])


def test_save_state_with_total_limit_keeps_what_it_just_wrote(tmp_path):
    """With automatic naming and total_limit, a save whose number sorted below older
    directories (a run resumed with load_state, which resets the count, as Accelerate's own
    does) deleted the checkpoint it had just written."""
    from accelerate.utils import ProjectConfiguration
    for n in (3, 4):
        (tmp_path / "checkpoints" / f"checkpoint_{n}").mkdir(parents=True)
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True,
                                  total_limit=2)
    acc = MixprecAccelerator(level="O2", dtype="bf16", cpu=True, project_config=config)
    model, opt = net_and_opt()
    model, opt = acc.prepare(model, opt)
    for want in ("checkpoint_0", "checkpoint_1"):
        path = acc.save_state()
        assert os.path.isdir(path) and path.endswith(want)
        assert sorted(os.listdir(tmp_path / "checkpoints")) == [want, "checkpoint_4"]
