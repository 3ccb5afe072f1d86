"""FP8 layers across two gloo ranks: DDP and FSDP2 train like one process (within FP8's error:
each rank scales its own half of the batch), every rank agrees bitwise, resume is bitwise, the
fp32 weights stay fp32 and load into a plain model, and FSDP2 all-gathers the tensorwise FP8
layers' weights in FP8 (torchao's float8 all-gather; it runs on gloo too). MXFP8 layers shard
too: FSDP2 gathers their weights in bf16, the layers cast them after; ranks agree, resume is
bitwise.

One launch runs every case on both ranks (module fixture).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_cases import WORLD, StopAt, launch, max_diff
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec as mp

pytest.importorskip("torchao.float8")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

FEATURES, SAMPLES, GLOBAL_BATCH = 32, 32, 8
CHOSEN = ["blocks.0.fc", "blocks.1.fc"]


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + F.relu(self.norm(self.fc(x)))


class Net(nn.Module):
    def __init__(self, d=FEATURES, classes=3):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loader(batch):
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g),
                         torch.randint(0, 3, (SAMPLES,), generator=g))
    return DataLoader(data, batch_size=batch)


def make_trainer(strategy, callbacks=(), fp8="tensorwise"):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return mp.Trainer(model, F.cross_entropy, opt, level="O2", dtype="bf16", fp8=fp8,
                      fp8_modules=CHOSEN if fp8 else None, strategy=strategy, progress=False,
                      callbacks=callbacks)


def grads(trainer, x, y):
    F.cross_entropy(trainer.model(x), y).backward()
    inner = mp.parallel.unwrap(trainer.model)
    return {n: p.grad.float().clone() for n, p in inner.named_parameters()}


def ddp_grads(rank):
    """The first step's gradients on each rank's half of the first global batch."""
    x, y = next(iter(loader(GLOBAL_BATCH)))
    half = slice(rank * GLOBAL_BATCH // WORLD, (rank + 1) * GLOBAL_BATCH // WORLD)
    return grads(make_trainer("ddp"), x[half], y[half])


def fit(strategy, world, fp8="tensorwise"):
    trainer = make_trainer(strategy, fp8=fp8)
    trainer.fit(loader(GLOBAL_BATCH // world), epochs=2)
    weights = mp.fp32_state_dict(trainer.model, trainer.optimizer)
    inner = mp.parallel.unwrap(trainer.model)
    plain = Net()
    plain.load_state_dict(weights)  # strict: plain names, full fp32 tensors
    return {"weights": {k: v.cpu() for k, v in weights.items()}, "loss": trainer.history.loss,
            "fp8": mp.fp8_modules(inner), "policy": trainer.policy.fp8_modules,
            "dtypes": {v.dtype for v in weights.values()},
            "weight_types": {n: type(getattr(p, "_local_tensor", p)).__name__
                             for n, p in inner.named_parameters() if n.endswith("fc.weight")}}


def resume(rank, out, strategy, fp8="tensorwise"):
    whole = make_trainer(strategy, fp8=fp8)
    whole.fit(loader(GLOBAL_BATCH // WORLD), epochs=2)
    first = make_trainer(strategy, [StopAt(6)], fp8=fp8)
    first.fit(loader(GLOBAL_BATCH // WORLD), epochs=2)
    path = os.path.join(out, f"{strategy}-{fp8}.ckpt")
    first.save(path)
    second = make_trainer(strategy, fp8=fp8)
    second.load(path)
    second.fit(loader(GLOBAL_BATCH // WORLD), epochs=2)
    a = mp.fp32_state_dict(whole.model, whole.optimizer)
    b = mp.fp32_state_dict(second.model, second.optimizer)
    return {"equal": all(torch.equal(a[k], b[k]) for k in a),
            "loss_equal": whole.history.loss == second.history.loss}


def fsdp_direct(rank):
    """``mp.parallel.fsdp(..., fp8=, fp8_modules=callable)``: names resolved and recorded."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mp.parallel.fsdp(model, opt, level="O2", dtype="bf16", fp8="rowwise",
                                  fp8_modules=lambda module, name: name.endswith("fc"))
    x, y = next(iter(loader(4)))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return {"fp8": mp.fp8_modules(model), "policy": mp.policy_of(model).fp8_modules,
            "types": {type(p._local_tensor).__name__ for p in model.parameters()}}


def suite(rank, out):
    return {"ddp": fit("ddp", WORLD), "fsdp": fit("fsdp", WORLD), "grads": ddp_grads(rank),
            "direct": fsdp_direct(rank),
            "resume_ddp": resume(rank, out, "ddp"), "resume_fsdp": resume(rank, out, "fsdp"),
            "mx_fsdp": fit("fsdp", WORLD, fp8="mxfp8"),
            "mx_resume_fsdp": resume(rank, out, "fsdp", fp8="mxfp8")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(suite, tmp_path_factory.mktemp("fp8"), timeout=240.0)


@pytest.fixture(scope="module")
def single():
    return {"fp8": fit("single", 1), "bf16": fit("single", 1, fp8=None),
            "mxfp8": fit("single", 1, fp8="mxfp8")}


def test_ddp_averages_the_ranks_fp8_gradients(ranks):
    """One process, each half of the batch in turn: the mean of the two FP8 gradients is what
    DDP leaves on every rank, to the bf16 rounding of the gradients: each half's bf16 gradient
    (a sum over rows, whose order depends on the thread count) is within a few bf16 units of
    the tensor's largest gradient, so atol is 2^-7 of that largest value."""
    x, y = next(iter(loader(GLOBAL_BATCH)))
    halves = [grads(make_trainer("single"), x[i * 4:(i + 1) * 4], y[i * 4:(i + 1) * 4])
              for i in range(WORLD)]
    for r in ranks:
        for name, got in r["grads"].items():
            want = (halves[0][name] + halves[1][name]) / 2
            atol = 2.0 ** -7 * float(want.abs().max())
            torch.testing.assert_close(got, want, rtol=2.0 ** -7, atol=atol)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fp8_trains_like_one_process_and_ranks_agree(ranks, single, strategy):
    """After 8 steps (SGD, momentum 0.9) each rank's FP8 casts, scaled over its half of the
    batch, leave the weights as far from one process's FP8 run as FP8 itself leaves them from
    bf16 (measured: ~0.1 either way, max over weights)."""
    a, b = (r[strategy] for r in ranks)
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert a["loss"] == b["loss"]
    fp8_effect = max_diff(single["fp8"]["weights"], single["bf16"]["weights"])
    assert max_diff(a["weights"], single["fp8"]["weights"]) < 1.5 * fp8_effect
    assert a["loss"][-1] == pytest.approx(single["fp8"]["loss"][-1], rel=0.25)
    assert a["fp8"] == CHOSEN and a["policy"] == tuple(CHOSEN) == single["fp8"]["policy"]
    assert a["dtypes"] == {torch.float32}


def test_fsdp_all_gathers_the_fp8_weights_in_fp8(ranks):
    fsdp = ranks[0]["fsdp"]["weight_types"]
    assert set(fsdp.values()) == {"WeightWithDynamicFloat8CastTensor"}
    assert set(ranks[0]["ddp"]["weight_types"].values()) == {"Parameter"}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_is_bitwise(ranks, strategy):
    for r in ranks:
        assert r[f"resume_{strategy}"] == {"equal": True, "loss_equal": True}


def test_fsdp_takes_fp8_arguments_and_a_callable(ranks):
    for r in ranks:
        assert r["direct"]["fp8"] == CHOSEN and r["direct"]["policy"] == tuple(CHOSEN)
        assert r["direct"]["types"] == {"Tensor"}  # rowwise: gathered in bf16, cast after


def test_fsdp_shards_mxfp8_layers_which_cast_after_the_gather(ranks, single):
    """MXFP8 on two FSDP2 ranks against one process (each rank's blocks of 32 run along the
    features, so the forward casts match; the weight gradient's blocks run along each rank's
    half of the batch): as far as MXFP8 itself moves the weights from bf16, or less."""
    a, b = (r["mx_fsdp"] for r in ranks)
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert a["fp8"] == CHOSEN and a["dtypes"] == {torch.float32}
    assert set(a["weight_types"].values()) == {"Tensor"}  # gathered in bf16, cast after
    mx_effect = max_diff(single["mxfp8"]["weights"], single["bf16"]["weights"])
    assert max_diff(a["weights"], single["mxfp8"]["weights"]) < 1.5 * mx_effect
    for r in ranks:
        assert r["mx_resume_fsdp"] == {"equal": True, "loss_equal": True}
