"""Every O2 recipe under FSDP2 on two gloo ranks: masters (fp32, Kahan, stochastic) x moments
(fp32, bf16) x 16-bit dtype (bf16, fp16) x clipping, against one process and against DDP; the
FSDP cells of the differential matrix; the Kahan compensation from the first step to the export;
checkpoints moving between one-process/DDP files and FSDP directories.

One 2-rank launch runs every case (module fixture). fp16 runs start at a loss scale of 2**10:
at 2**16 a half batch's fp16 gradients overflow where the whole batch's do not, so DDP and FSDP
would skip a step one process takes (a difference of the batch split, not of the strategy).
"""

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_cases import (
    GLOBAL_BATCH,
    WORLD,
    Net,
    dataset,
    launch,
    loader,
    make_trainer,
    max_diff,
)

import mixprec as mp

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings(
                  r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning",
                  "ignore::mixprec.hardware.SlowDtypeWarning",
                  # inductor's note on a kernel reading fp16 weights and bf16 moments
                  "ignore:bf16 and fp16 are mixed in the scheduler node:UserWarning"),
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

RECIPES = [r for r in itertools.product(["fp32", "split", "kahan", "stochastic"], ["fp32", "bf16"],
                                        ["bf16", "fp16"], [None, 0.05])
           if not (r[0] in ("split", "stochastic") and r[2] == "fp16")]  # bf16 weights only
LR = 1e-2
MAX_NORM = 0.05
STEPS = 3
EPS = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def _recipe_id(r):
    return f"{r[0]}-{r[1]}_states-{r[2]}-{'clip' if r[3] else 'noclip'}"


def _fit(strategy, recipe, world):
    master, state_dtype, dtype, clip = recipe
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 10) if dtype == "fp16" else "auto"
    trainer = make_trainer(strategy, "O2", adam=True, master=master, state_dtype=state_dtype,
                           dtype=dtype, clip=clip, scaler=scaler)
    history = trainer.fit(loader(GLOBAL_BATCH // world), epochs=2)
    weights = mp.fp32_state_dict(trainer.model, trainer.optimizer)
    return {"weights": {k: v.cpu() for k, v in weights.items()}, "loss": history.loss,
            "skipped": history.skipped}


# -- the differential cells: one FSDP step against an fp32 step on the gathered values ----------
def _tolerance(master, state_dtype, dtype):
    """As test_differential's compact cells; fp32 masters: the fp32 arithmetic of one process."""
    if master in ("fp32", "split"):  # split: exact fp32 masters
        tol = {"rtol": 1e-5, "atol": 1e-7}
    elif master == "kahan":
        tol = {"rtol": STEPS * 2.0 ** -15, "atol": 1e-7}
    else:
        tol = {"rtol": 2 * STEPS * EPS[dtype], "atol": LR * 8 * EPS[dtype]}
    if state_dtype == "bf16":
        tol["atol"] += LR * 2.0 ** -6
    return tol


def _differential_cell(rank, master, state_dtype, dtype, opt_name, clip):
    torch.manual_seed(0)
    model = Net()
    make = ((lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, weight_decay=0.01))
            if opt_name == "sgd" else (lambda ps: torch.optim.AdamW(ps, lr=LR)))
    model, opt = mp.parallel.fsdp(model, make(model.parameters()), level="O2", dtype=dtype,
                                  master=master, state_dtype=state_dtype)
    if hasattr(opt, "fused"):
        opt.fused = False  # the eager kernels (the compiled ones: the recipe runs)
    names = [n for n, _ in model.named_parameters()]
    values = mp.fp32_state_dict(model, opt)
    weights = [values[n].clone().requires_grad_() for n in names]
    ref_opt = make(weights)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    worst = 0.0
    for i in range(STEPS):
        opt.zero_grad()
        x, y = dataset()[8 * i + 4 * rank: 8 * i + 4 * rank + 4]
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scale = scaler.get_scale()
        for w, p in zip(weights, model.parameters()):
            w.grad = p.grad.full_tensor().float() / scale
        if clip:
            scaler.clip_grad_norm_(opt, MAX_NORM)
            torch.nn.utils.clip_grad_norm_(weights, MAX_NORM)
        assert scaler.step(opt)
        scaler.update()
        ref_opt.step()
        got = mp.fp32_state_dict(model, opt)
        for n, ref in zip(names, weights):
            torch.testing.assert_close(got[n], ref.detach(), **_tolerance(master, state_dtype,
                                                                          dtype))
            worst = max(worst, (got[n] - ref.detach()).abs().max().item())
    return worst


DIFFERENTIAL = [c for c in itertools.product(["fp32", "split", "kahan", "stochastic"],
                                             ["fp32", "bf16"], ["bf16", "fp16"], ["sgd", "adamw"],
                                             [False, True])
                if not (c[0] in ("split", "stochastic") and c[2] == "fp16")]


# -- the Kahan compensation across sharding -------------------------------------------------------
def _kahan_from_the_first_step(master="kahan"):
    torch.manual_seed(0)
    initial = Net().state_dict()
    torch.manual_seed(0)
    model = Net()
    model, opt = mp.parallel.fsdp(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                  level="O2", dtype="bf16", master=master)
    before = mp.fp32_state_dict(model, opt)
    weights_only = mp.fp32_state_dict(model)
    return {"before": max_diff(before, initial), "weights_only": max_diff(weights_only, initial),
            "refused": _stochastic_fp16_refusal()}


def _stochastic_fp16_refusal():
    model = Net()
    try:
        mp.parallel.fsdp(model, torch.optim.SGD(model.parameters(), lr=LR), dtype="fp16",
                         master="stochastic")
    except ValueError as exc:
        return str(exc)
    return None


# -- checkpoints across strategies ----------------------------------------------------------------
def _crossing(rank, out, master, state_dtype):
    """FSDP directory -> one process (directly, and through convert_checkpoint), and one
    process's file -> FSDP: the loaded weights and moments are the saved ones, and training goes
    on where it stopped."""
    options = dict(adam=True, master=master, state_dtype=state_dtype)
    per_rank = GLOBAL_BATCH // WORLD
    whole = make_trainer("fsdp", "O2", **options)
    whole.fit(loader(per_rank), epochs=2)
    directory = os.path.join(out, f"fsdp-{master}")
    fsdp = make_trainer("fsdp", "O2", **options)
    fsdp.fit(loader(per_rank), epochs=1)
    fsdp.save(directory)
    saved, saved_moments = mp.fp32_state_dict(fsdp.model, fsdp.optimizer), _moments(fsdp.optimizer)
    ddp = make_trainer("ddp", "O2", **options)
    ddp.load(directory)  # each DDP rank reads the whole directory
    into_ddp = max_diff(mp.fp32_state_dict(ddp.model, ddp.optimizer), saved)
    file = os.path.join(out, f"converted-{master}-{rank}.pt")
    mp.convert_checkpoint(directory, file)
    results = {"whole": mp.fp32_state_dict(whole.model, whole.optimizer), "into_ddp": into_ddp}
    for name, source in (("directory", directory), ("converted", file)):
        single = make_trainer("single", "O2", **options)
        single.load(source)
        loaded = mp.fp32_state_dict(single.model, single.optimizer)
        moments = _moments(single.optimizer)
        single.fit(loader(GLOBAL_BATCH), epochs=2)
        results[name] = {"loaded": max_diff(loaded, saved), "step": single.global_step,
                         "moments": all(torch.equal(a, b) for a, b in zip(moments,
                                                                          saved_moments)),
                         "final": mp.fp32_state_dict(single.model, single.optimizer)}
    single = make_trainer("single", "O2", **options)
    single.fit(loader(GLOBAL_BATCH), epochs=1)
    one_file = os.path.join(out, f"single-{master}-{rank}.pt")
    single.save(one_file)
    want, want_moments = mp.fp32_state_dict(single.model, single.optimizer), _moments(
        single.optimizer)
    sharded = make_trainer("fsdp", "O2", **options)
    sharded.load(one_file)
    got = mp.fp32_state_dict(sharded.model, sharded.optimizer)
    moments = _moments(sharded.optimizer)
    sharded.fit(loader(per_rank), epochs=2)
    results["into_fsdp"] = {"loaded": max_diff(got, want), "step": sharded.global_step,
                            "moments": all(torch.equal(a, b) for a, b in zip(moments,
                                                                             want_moments)),
                            "final": mp.fp32_state_dict(sharded.model, sharded.optimizer)}
    return results


def _moments(optimizer):
    """Adam's first moments in parameter order, full tensors (gathered under FSDP)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            m = optimizer.state[p]["exp_avg"]
            full = m.full_tensor() if hasattr(m, "full_tensor") else m
            out.append(full.to("cpu", torch.float32, copy=True))  # not the live state
    return out


def _unwritable(rank, out):
    blocker = os.path.join(out, f"a-file-{rank}")
    with open(blocker, "w") as f:
        f.write("not a directory")
    trainer = make_trainer("fsdp", "O2", master="kahan")
    try:
        trainer.save(os.path.join(blocker, "ckpt"))
    except Exception as exc:  # noqa: BLE001 - the point: an Exception, not a BaseException
        return f"{type(exc).__name__}: {exc}"
    return None


def suite(rank, out):
    results = {("fit", strategy, r): _fit(strategy, r, WORLD)
               for r in RECIPES for strategy in ("ddp", "fsdp")}
    results["differential"] = {c: _differential_cell(rank, *c) for c in DIFFERENTIAL}
    results["kahan"] = _kahan_from_the_first_step()
    results["split"] = _kahan_from_the_first_step("split")
    results["crossing"] = {m: _crossing(rank, out, m, s) for m, s in (("kahan", "bf16"),
                                                                      ("split", "bf16"),
                                                                      ("fp32", "fp32"))}
    results["unwritable"] = _unwritable(rank, out)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(suite, tmp_path_factory.mktemp("recipes"), timeout=900.0)


@pytest.mark.parametrize("recipe", RECIPES, ids=_recipe_id)
def test_fsdp_lands_as_close_to_one_process_as_ddp(ranks, recipe):
    single = _fit("single", recipe, 1)
    a, b = (r[("fit", "fsdp", recipe)] for r in ranks)
    assert max_diff(a["weights"], b["weights"]) == 0 and a["loss"] == b["loss"]
    ddp = ranks[0][("fit", "ddp", recipe)]
    assert a["skipped"] == ddp["skipped"] == single["skipped"]
    to_ddp = max_diff(ddp["weights"], single["weights"])
    to_fsdp = max_diff(a["weights"], single["weights"])
    # measured (AMD EPYC VM, AVX2, torch 2.13.0+cpu): FSDP's distance within 3.9e-4 of DDP's in
    # every recipe (either side; DDP's: 3.5e-5 to 8.8e-3). With clipping a run's distance to
    # one process is decided by where a reduction order tips the clip (measured on an Intel Xeon
    # VM, fp32 masters with bf16 moments: DDP 8.8e-3 and FSDP 8.5e-3 on one tree, 7.4e-4 and
    # 8.5e-3 on the next): there only the bound below holds
    if not recipe[3]:
        assert abs(to_fsdp - to_ddp) <= 1e-3
    assert to_fsdp <= 1e-2  # parallel_cases.TOLERANCE["O2"]; measured at most 8.7e-3


@pytest.mark.parametrize("cell", DIFFERENTIAL, ids=lambda c: "-".join(map(str, c)))
def test_fsdp_differential_cell_matches_the_fp32_reference(ranks, cell):
    for r in ranks:
        assert cell in r["differential"]  # asserted against the reference inside the ranks


def test_kahan_compensation_holds_what_the_cast_lost_from_the_first_step(ranks):
    for r in ranks:
        k = r["kahan"]
        assert k["before"] <= 2e-5  # one process: 1.5e-5; a bf16 weight alone: 7.8e-3
        assert k["weights_only"] > 1e-4  # the model alone holds its 16-bit weights
        assert "master='stochastic' rounds into bf16 weights" in k["refused"]


def test_split_shards_hold_the_exact_originals_from_the_first_step(ranks):
    for r in ranks:
        assert r["split"]["before"] == 0  # the pair starts from the exact fp32 original
        assert r["split"]["weights_only"] > 1e-4  # the model alone holds its 16-bit weights


@pytest.mark.parametrize("master", ["kahan", "split", "fp32"])
def test_checkpoints_move_between_fsdp_directories_and_one_process_files(ranks, master):
    for r in ranks:
        c = r["crossing"][master]
        for name in ("directory", "converted", "into_fsdp"):
            assert c[name]["loaded"] == 0 and c[name]["moments"]
            assert c[name]["step"] == 8  # saved at step 4 (epoch 1), trained on to step 8
            # as one process vs FSDP: measured at most 5.8e-4 (was allowed 1e-2)
            assert max_diff(c[name]["final"], c["whole"]) <= 5e-3
        assert max_diff(c["directory"]["final"], c["converted"]["final"]) == 0
        assert c["into_ddp"] == 0


def test_an_unwritable_fsdp_checkpoint_path_raises_an_exception(ranks):
    for r in ranks:
        assert r["unwritable"] is not None and r["unwritable"].startswith("RuntimeError: saving")
