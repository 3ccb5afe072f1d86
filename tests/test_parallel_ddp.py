"""DDP on two gloo ranks against one process: parity, agreement, reduce dtypes, no_sync, resume.

One launch runs every case on both ranks (module fixture); the tests compare the results with a
single-process run at the same global batch.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_cases import (
    GLOBAL_BATCH,
    WORLD,
    Net,
    assert_matches_one_process,
    assert_ranks_agree,
    dataset,
    fit,
    launch,
    loader,
    make_trainer,
    max_diff,
    resume_case,
    skip_case,
)

import mixprec as mp

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

LEVELS = ("O0", "O1", "O2", "O3")
# Max abs weight difference from one process after 8 SGD steps (weights up to ~1). O0: fp32 sums
# in another order (measured 1.2e-7). O1/O2: bf16 roundings of half-batch gradients and
# activations (measured 2.0e-3 / 2.4e-3, against 5.6e-2 between one process's O2 and O0). O3
# rounds every update to bf16 (measured 7.8e-3, one bf16 ulp at 1.0, against 4.8e-2 between one
# process's O3 and O0).


def _reduced_grads(rank, reduce_dtype):
    torch.manual_seed(0)
    model = mp.parallel.ddp(mp.prepare(Net(), level="O0"), reduce_dtype=reduce_dtype)
    x, y = dataset()[rank * 4: rank * 4 + 4]
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


def _accumulation(rank):
    trainer = make_trainer("ddp", "O0", accum=2)
    calls = []
    no_sync = trainer.model.no_sync

    def counting():
        calls.append(1)
        return no_sync()

    trainer.model.no_sync = counting
    trainer.fit(loader(GLOBAL_BATCH // WORLD // 2), epochs=1)
    weights = mp.fp32_state_dict(trainer.model, trainer.optimizer)
    return {"weights": weights, "no_sync": len(calls), "steps": trainer.global_step}


def _inf_in_data(rank):
    scaler = mp.DynamicLossScaler(init_scale=256.0, growth_interval=1000)
    trainer = make_trainer("ddp", "O0", scaler=scaler)
    trainer.fit(loader(GLOBAL_BATCH // WORLD, inf_at=9), epochs=1)  # sample 9: rank 1, step 2
    h = trainer.history
    return {"skipped": h.skipped, "scale": h.loss_scale,
            "weights": mp.fp32_state_dict(trainer.model)}


def _state_dict_and_logging(rank, out):
    lines = []
    ckpts = os.path.join(out, "ckpts")
    saver = mp.ModelCheckpoint(ckpts, every_n_steps=2, every_epoch=False, keep_last=1)
    trainer = make_trainer("ddp", "O2", callbacks=[mp.LossMonitor(print_fn=lines.append), saver])
    trainer.fit(loader(GLOBAL_BATCH // WORLD), epochs=1)
    dist.barrier()  # rank 0 deletes old files after its save returned
    sd = mp.fp32_state_dict(trainer.model, trainer.optimizer)
    plain = Net()
    plain.load_state_dict(sd)  # strict: plain names, nothing missing
    module = trainer.model.module
    masters_equal = all(torch.equal(sd[n], trainer.optimizer.master_param(p))
                        for n, p in module.named_parameters())
    x = dataset().tensors[0][:8]
    with torch.no_grad():
        out_diff = (plain(x) - trainer.model(x)).abs().max().item()
    return {"lines": lines, "keys": list(sd), "checkpoints": sorted(os.listdir(ckpts)),
            "masters_equal": masters_equal, "out_diff": out_diff,
            "optimizer": type(trainer.optimizer).__name__,
            "wrapper": type(trainer.model).__name__,
            "linear_dtype": module.blocks[0].fc.weight.dtype,
            "norm_dtype": module.blocks[0].norm.weight.dtype}


def _ddp_skip_model():
    torch.manual_seed(0)
    model = mp.parallel.ddp(mp.prepare(Net(), level="O0"))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _different_initial_weights(rank):
    """Ranks seeded differently: the Trainer broadcasts rank 0's fp32 weights before preparing;
    mp.parallel.ddp on a model prepared at O2 refuses (its masters would differ)."""
    torch.manual_seed(rank)
    model = Net()
    trainer = mp.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                         level="O2", dtype="bf16", strategy="ddp", progress=False)
    masters = mp.fp32_state_dict(trainer.model, trainer.optimizer)
    torch.manual_seed(rank)
    net = Net()
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2", dtype="bf16")
    try:
        mp.parallel.ddp(net)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"masters": masters, "error": error}


def suite(rank, out):
    results = {f"fit_{level}": fit("ddp", level, world=WORLD) for level in LEVELS}
    results["fit_O2_bf16_reduce"] = fit("ddp", "O2", world=WORLD, reduce="bf16")
    results["grads_fp32"] = _reduced_grads(rank, "fp32")
    results["grads_bf16"] = _reduced_grads(rank, "bf16")
    results["accum"] = _accumulation(rank)
    results["skip"] = skip_case(rank, _ddp_skip_model)
    results["inf_data"] = _inf_in_data(rank)
    results["resume"] = resume_case(rank, out, "ddp", "O2")
    results["misc"] = _state_dict_and_logging(rank, out)
    results["seeds"] = _different_initial_weights(rank)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(suite, tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def single():
    out = {level: fit("single", level) for level in LEVELS}
    out["accum"] = fit("single", "O0", epochs=1, accum=2)
    return out


@pytest.mark.parametrize("level", LEVELS)
def test_ddp_matches_one_process_at_the_same_global_batch(ranks, single, level):
    assert_matches_one_process(ranks, single, level)


@pytest.mark.parametrize("level", LEVELS)
def test_every_rank_holds_the_same_weights_history_and_evaluation(ranks, level):
    assert_ranks_agree(ranks, level)


def test_fp32_reduction_averages_and_bf16_reduction_rounds(ranks):
    torch.manual_seed(0)
    full = Net()
    x, y = dataset()[:8]
    F.cross_entropy(full(x), y).backward()
    for r in ranks:
        for name, p in full.named_parameters():
            g32, g16 = r["grads_fp32"][name], r["grads_bf16"][name]
            torch.testing.assert_close(g32, p.grad, rtol=1e-5, atol=1e-6)  # an average, not a sum
            assert torch.equal(g16, g16.bfloat16().float())  # reduced in bf16
            torch.testing.assert_close(g16, p.grad, rtol=2 ** -7, atol=1e-3)
    assert all(torch.equal(ranks[0]["grads_bf16"][k], ranks[1]["grads_bf16"][k])
               for k in ranks[0]["grads_bf16"])


def test_bf16_reduction_trains_like_one_process(ranks, single):
    for r in ranks:
        assert max_diff(r["fit_O2_bf16_reduce"]["weights"], single["O2"]["weights"]) <= 1e-2


def test_accumulation_skips_the_reduction_of_all_but_the_last_micro_batch(ranks, single):
    for r in ranks:
        acc = r["accum"]
        assert acc["steps"] == 4 and acc["no_sync"] == 4  # one no_sync micro-batch per step
        assert max_diff(acc["weights"], single["accum"]["weights"]) <= 1e-5


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(ranks):
    for r in ranks:  # only rank 1 saw the inf (in its already-reduced gradient)
        assert r["skip"]["applied"] == [True, False, True]
        assert r["skip"]["scales"] == [256.0, 128.0, 128.0]
    a, b = (r["inf_data"] for r in ranks)
    assert a["skipped"] == b["skipped"] == [False, True, False, False]
    assert a["scale"] == b["scale"] == [256.0, 256.0, 128.0, 128.0]
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def test_resume_is_bitwise_equal_to_the_uninterrupted_run(ranks):
    for r in ranks:
        res = r["resume"]
        assert res["stopped_at"] == 6 and res["steps"] == 8  # rank 0 asked; both stopped
        assert res["equal"] and res["loss_equal"] and not res["is_dir"]


def test_fp32_state_dict_has_plain_names_and_loads_into_a_plain_model(ranks):
    for r in ranks:
        misc = r["misc"]
        assert misc["wrapper"] == "DistributedDataParallel"
        assert misc["optimizer"] == "MasterWeightOptimizer"
        assert (misc["linear_dtype"], misc["norm_dtype"]) == (torch.bfloat16, torch.float32)
        assert misc["keys"] == list(Net().state_dict())
        assert misc["masters_equal"]
        assert misc["out_diff"] < 2e-2  # bf16 model vs its fp32 masters


def test_loss_monitor_prints_on_rank_zero_only_and_rank_zero_writes_one_file(ranks):
    assert len(ranks[0]["misc"]["lines"]) == 4 and ranks[1]["misc"]["lines"] == []
    assert ranks[0]["misc"]["checkpoints"] == ranks[1]["misc"]["checkpoints"] == ["ckpt-step4.pt"]


def test_ranks_start_from_rank_zeros_weights_and_masters(ranks):
    torch.manual_seed(0)
    rank0_init = Net().state_dict()
    for r in ranks:
        masters = r["seeds"]["masters"]
        assert all(torch.equal(masters[k], rank0_init[k]) for k in rank0_init)
        assert "parameters differ across ranks" in r["seeds"]["error"]


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.aux = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)  # aux: never used

    def forward(self, x):
        return self.body(x)


def _unused_and_hooks(rank, out):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(3)]
    model = _WithUnused()
    trainer = mp.Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                         level="O2", dtype="bf16", strategy="ddp", progress=False,
                         ddp_kwargs={"find_unused_parameters": True})
    trainer.fit(data)
    wrapped = mp.parallel.ddp(mp.prepare(_WithUnused(), level="O2", dtype="bf16"))
    try:
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        refusal = None
    except RuntimeError as exc:
        refusal = str(exc)
    return {"steps": trainer.global_step, "refusal": refusal}


def test_ddp_options_reach_ddp_and_a_second_hook_is_refused_saying_why(tmp_path):
    """Trainer(strategy="ddp") had no way to pass find_unused_parameters (a model with a
    parameter its forward does not use failed at the second step, in torch's words); a hook of
    one's own after mp.parallel.ddp at O2 got torch's bare "can only be called once"."""
    for r in launch(_unused_and_hooks, tmp_path, timeout=240.0):
        assert r["steps"] == 3
        assert r["refusal"].startswith("mp.parallel.ddp registered its own communication hook")
    with pytest.raises(ValueError, match="ddp_kwargs are DistributedDataParallel's options"):
        mp.Trainer(torch.nn.Linear(2, 2), F.mse_loss, torch.optim.SGD(
            torch.nn.Linear(2, 2).parameters(), lr=0.1), strategy="single",
            ddp_kwargs={"find_unused_parameters": True})
