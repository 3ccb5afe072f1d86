"""``mp.AveragedModel``: an EMA or SWA of a model trained in 16 bits, averaged in fp32 from the
values the model trains, bit for bit torch's ``AveragedModel`` over an fp32 model holding them;
torch's own class over the same model freezes (the failure it replaces).
"""

import copy
import io

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel as TorchAveragedModel
from torch.optim.swa_utils import get_ema_multi_avg_fn, update_bn

import mixprec as mp
from mixprec.averaging import fp32_parameters

METHODS = ("fp32", "split", "kahan", "stochastic")


def mlp(norm=False):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16) if norm else nn.ReLU(),
                         nn.Linear(16, 4))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def trained(master="fp32", level="O2", norm=False, **averaging):
    """A short O2 run that updates ``mp.AveragedModel`` after each step and, beside it, torch's
    ``AveragedModel`` over a plain fp32 model set to the run's fp32 values before each update
    (the reference)."""
    amp = mp.MixedPrecision(level=level, dtype="bf16", master=master)
    model = mlp(norm)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ours = mp.AveragedModel(model, **averaging)
    plain = mlp(norm)
    plain.load_state_dict(mp.fp32_state_dict(model))
    ref = TorchAveragedModel(plain, **averaging)
    for x, y in batches(6):
        amp.backward(nn.functional.mse_loss(model(x).float(), y))
        amp.step(opt)
        opt.zero_grad()
        ours.update_parameters(model)
        plain.load_state_dict(mp.fp32_state_dict(model))
        ref.update_parameters(plain)
    return model, ours, ref


def assert_same(ours, ref):
    mine, theirs = ours.state_dict(), ref.state_dict()
    assert list(mine) == list(theirs)
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype, key
        assert torch.equal(mine[key], value), key


@pytest.mark.parametrize("master", METHODS)
def test_an_ema_of_an_o2_run_is_torchs_over_the_fp32_values_bit_for_bit(master):
    model, ours, ref = trained(master, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    assert_same(ours, ref)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("averaging", [
    {},  # torch's running mean (SWA)
    {"avg_fn": lambda avg, new, n: avg + (new - avg) / (n + 1)},  # per tensor
    {"multi_avg_fn": get_ema_multi_avg_fn(0.5), "use_buffers": True},
], ids=["swa", "avg_fn", "ema with buffers"])
def test_every_way_torch_averages_runs_on_the_fp32_values(averaging):
    _, ours, ref = trained("fp32", norm=True, **averaging)
    assert_same(ours, ref)
    assert int(ours.n_averaged) == 6


def test_torchs_averaged_model_of_an_o2_model_freezes_where_ours_follows_the_run():
    """The failure this class exists for: torch's EMA (decay 0.999) over the 16-bit weights
    leaves most weights where its first update (a copy) put them: all but those near zero,
    whose ulp is small; the fp32 average moves every one."""
    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    net = mlp()
    model, opt = amp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    ema = get_ema_multi_avg_fn(0.999)
    theirs = TorchAveragedModel(model, multi_avg_fn=ema)
    ours = mp.AveragedModel(model, multi_avg_fn=ema)
    for i, (x, y) in enumerate(batches(20)):
        amp.backward(nn.functional.mse_loss(model(x).float(), y))
        amp.step(opt)
        opt.zero_grad()
        theirs.update_parameters(model)
        ours.update_parameters(model)
        if i == 0:
            first = mp.fp32_state_dict(model)
    frozen = total = 0
    for (name, t), o in zip(theirs.module.named_parameters(), ours.module.parameters()):
        assert t.dtype == torch.bfloat16 and o.dtype == torch.float32
        frozen += int((t == first[name].bfloat16()).sum())
        total += t.numel()
        assert (o != first[name]).all(), name
    assert frozen / total > 0.8


def test_the_average_stores_fp32_and_computes_as_the_prepared_model():
    amp = mp.MixedPrecision(level="O2", dtype="bf16", master="kahan")
    net = mlp()
    model, _ = amp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    ours = mp.AveragedModel(model)
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    exact = mp.fp32_state_dict(model)
    assert all(torch.equal(v, exact[k]) for k, v in ours.module.state_dict().items())
    x = torch.randn(4, 8)
    assert torch.equal(ours(x), model(x))  # O2's compute: bf16 matmuls, fp32 output
    assert ours(x).dtype == model(x).dtype


def test_an_o3_models_16_bit_buffers_are_averaged_in_fp32():
    """At O3 the norm statistics are bf16 too: with use_buffers an EMA's lerp of them against
    the fp32 copy raised a dtype error."""
    model, ours, ref = trained(None, level="O3", norm=True, use_buffers=True,
                               multi_avg_fn=get_ema_multi_avg_fn(0.9))
    assert model[1].running_mean.dtype == torch.bfloat16
    assert ours.module[1].running_mean.dtype == torch.float32
    assert_same(ours, ref)


def test_a_plain_fp32_model_averages_as_torchs_class():
    model = mlp()
    ours, ref = mp.AveragedModel(model), TorchAveragedModel(copy.deepcopy(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(3):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ours.update_parameters(model)
        ref.update_parameters(model)
    assert_same(ours, ref)


def test_a_plain_bf16_model_is_averaged_in_fp32():
    model = mlp().to(torch.bfloat16)
    ours = mp.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ours.update_parameters(model)  # the first update copies
    ours.update_parameters(model)
    assert all(p.dtype == torch.float32 for p in ours.parameters())


def test_a_state_dict_round_trip_continues_bit_for_bit():
    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    net = mlp()
    model, opt = amp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    ours = mp.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    data = batches(4)

    def step(average, x, y):
        amp.backward(nn.functional.mse_loss(model(x).float(), y))
        amp.step(opt)
        opt.zero_grad()
        average.update_parameters(model)

    step(ours, *data[0])
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    resumed = mp.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    resumed.load_state_dict(torch.load(buffer))
    for x, y in data[1:]:
        step(ours, x, y)
        resumed.update_parameters(model)
    assert_same(resumed, ours)


def test_update_bn_recomputes_the_averages_norm_statistics():
    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    net = mlp(norm=True)
    model, _ = amp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ours = mp.AveragedModel(model)
    norm = ours.module[1]
    update_bn([x for x, _ in batches(3)], ours)
    assert norm.running_mean.dtype == torch.float32
    assert not torch.equal(norm.running_mean, torch.zeros(16))
    assert int(norm.num_batches_tracked) == 3


def test_a_ddp_wrapped_model_gives_its_modules_values():
    class Wrapped(nn.Module):  # as DDP: the user's module under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    net = mlp()
    model, _ = amp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    values = fp32_parameters(Wrapped(model))
    exact = mp.fp32_state_dict(model)
    assert [v.dtype for v in values] == [torch.float32] * 4
    assert all(torch.equal(v, exact[k]) for v, k in zip(values, exact))


def test_bad_input_is_refused_with_what_was_given():
    with pytest.raises(TypeError, match="nn.Module; got dict"):
        mp.AveragedModel({})
    ours = mp.AveragedModel(mlp())
    with pytest.raises(ValueError, match="holds 4 parameters, the model given 2"):
        ours.update_parameters(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.Module; got list"):
        ours.update_parameters([])
