"""torch.nn.Module's contract on a prepared model: casts, hooks, Hugging Face exports.

Casts (``.float()``, ``.double()``, ``.half()``, ``.bfloat16()``, ``.to(...)``, ``.type(...)``)
on an O2 model with master weights either keep the masters exact or are refused, the model left
as it was; device moves pass through. Module hooks (ported from PyTorch's
test/nn/test_module_hooks.py: forward pre/post hooks with and without kwargs, full backward and
backward pre hooks, global module hooks, state_dict and load_state_dict hooks) run as on a plain
module. ``save_pretrained`` of a prepared Hugging Face model loads back, with a plain
``from_pretrained``, as the fp32 masters exactly.
"""

import copy

import pytest
import torch
from torch import nn

import mixprec as mp

pytestmark = pytest.mark.filterwarnings(
    "ignore::mixprec.hardware.SlowDtypeWarning",
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")

MASTERS = ["fp32", "split", "kahan", "stochastic"]


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def batch(i=0):
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def step(model, opt, i=0):
    opt.zero_grad()
    x, y = batch(i)
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    opt.step()


def trained(master, steps=3):
    model = net()
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level="O2",
                            dtype="bf16", master=master)
    if not isinstance(opt, mp.MasterWeightOptimizer):
        opt.fused = False
    for i in range(steps):
        step(model, opt, i)
    return model, opt


def snapshot(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {k: v.clone() for k, v in mp.fp32_state_dict(model).items()})


# -- casts --------------------------------------------------------------------------------------
WIDENING = {
    ".float()": lambda m: m.float(),
    ".to(torch.float32)": lambda m: m.to(torch.float32),
    ".to(dtype=torch.float32)": lambda m: m.to(dtype=torch.float32),
    ".type(torch.float32)": lambda m: m.type(torch.float32),
}
LOSSY = {
    ".half()": lambda m: m.half(),
    ".bfloat16()": lambda m: m.bfloat16(),
    ".to(torch.float16)": lambda m: m.to(torch.float16),
    ".to('cpu', torch.bfloat16)": lambda m: m.to("cpu", torch.bfloat16),
    "[0].half()": lambda m: m[0].half(),
    "[1].bfloat16()": lambda m: m[1].bfloat16(),
    ".double()": lambda m: m.double(),
}
MOVES = {
    ".to('cpu')": lambda m: m.to("cpu"),
    ".cpu()": lambda m: m.cpu(),
    ".to(memory_format=channels_last)": lambda m: m.to(memory_format=torch.channels_last),
    ".share_memory()": lambda m: m.share_memory(),
}


@pytest.mark.parametrize("cast", WIDENING)
@pytest.mark.parametrize("master", MASTERS)
def test_widening_casts_keep_the_masters_exact_and_training_continues(master, cast):
    """0.3: model.float() stored the bf16-rounded weights and the next state_dict() took them
    as the truth (4.9e-4 off the masters, carried into training)."""
    model, opt = trained(master)
    params = list(model.parameters())
    exact = mp.fp32_state_dict(model)
    out = WIDENING[cast](model)
    assert out is model and list(model.parameters()) == params  # identity kept, as torch
    wide = torch.float32
    for name, p in model.named_parameters():
        assert p.dtype == wide and torch.equal(p.detach().float(), exact[name]), name
    torch.testing.assert_close(model.state_dict(), {k: v.to(wide) for k, v in exact.items()},
                               rtol=0, atol=0)
    # the next steps take the fp32 values as their start, as an fp32 AdamW would
    reference = {n: p.detach().float().clone().requires_grad_() for n, p in
                 model.named_parameters()}
    ref_opt = torch.optim.AdamW(reference.values(), lr=1e-2, foreach=False)
    ref_opt.load_state_dict(_plain_state(opt))
    for i in range(3, 5):
        step(model, opt, i)
        for (n, p), r in zip(model.named_parameters(), reference.values()):
            r.grad = p.grad.float()
        ref_opt.step()
    for n, p in model.named_parameters():  # fp32 arithmetic, up to the kernels' reassociation
        torch.testing.assert_close(p.detach().float(), reference[n].detach(), rtol=1e-5,
                                   atol=1e-6)
    torch.testing.assert_close(mp.fp32_state_dict(model),
                               {n: p.detach().float() for n, p in model.named_parameters()},
                               rtol=0, atol=0)


def _plain_state(opt):
    """The optimizer's state as a plain fp32 AdamW's (moments in fp32, our keys dropped)."""
    sd = copy.deepcopy(opt.state_dict())
    sd.pop("master_weights", None)
    for entry in sd["state"].values():
        for key in ("compensation", "remainder", "rounding_generator"):
            entry.pop(key, None)
        for key, value in entry.items():
            if key != "step":
                entry[key] = value.float()
    return sd


@pytest.mark.parametrize("cast", LOSSY)
@pytest.mark.parametrize("master", MASTERS)
def test_lossy_casts_are_refused_and_leave_the_model_as_it_was(master, cast):
    model, opt = trained(master)
    params, fp32 = snapshot(model)
    what = "does not take fp64" if cast == ".double()" else r"would round \d+ parameter"
    with pytest.raises(RuntimeError, match=rf"{what}.*model\.float\(\)"):
        LOSSY[cast](model)
    for name, p in model.named_parameters():
        assert p.dtype == params[name].dtype and torch.equal(p, params[name]), name
    torch.testing.assert_close(mp.fp32_state_dict(model), fp32, rtol=0, atol=0)
    step(model, opt, 3)  # and training goes on


@pytest.mark.parametrize("move", MOVES)
@pytest.mark.parametrize("master", MASTERS)
def test_moves_pass_through(master, move):
    model, opt = trained(master)
    params, fp32 = snapshot(model)
    MOVES[move](model)
    for name, p in model.named_parameters():
        assert p.dtype == params[name].dtype and torch.equal(p, params[name]), name
    torch.testing.assert_close(mp.fp32_state_dict(model), fp32, rtol=0, atol=0)


class ExtraApplyArgument(nn.Module):
    """A module whose ``_apply`` takes its own parameter after ``fn`` (torchmetrics'
    ``Metric._apply(fn, exclude_state="")``): it must receive what the caller passed."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(2))
        self.seen = []

    def forward(self, x):
        return x

    def _apply(self, fn, exclude_state=""):
        self.seen.append(exclude_state)
        if "total" not in exclude_state:  # a bool here: TypeError, as in torchmetrics
            self.total = fn(self.total)
        return super()._apply(fn)


def test_a_sub_module_with_its_own_apply_signature_gets_its_arguments():
    """A cast passed ``recurse`` positionally into every module's ``_apply``: a metric held by
    an O2 model broke ``.cpu()``, ``.float()`` and Lightning's teardown."""
    model = nn.Sequential(nn.Linear(8, 4), ExtraApplyArgument())
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level="O2",
                            dtype="bf16")
    model(torch.randn(2, 8)).float().sum().backward()
    opt.step()
    exact = mp.fp32_state_dict(model)
    model.cpu()
    model.float()
    model[1]._apply(lambda t: t, exclude_state=("total",))
    assert model[1].seen == ["", "", ("total",)]
    assert model[0].weight.dtype == torch.float32
    assert torch.equal(model[0].weight.detach(), exact["0.weight"])
    with pytest.raises(RuntimeError, match="would round"):
        model.bfloat16()  # the guard still reads a cast of the whole model
    model[0]._apply(lambda t: t, recurse=False)  # torch's keyword still reaches torch


def test_a_torchmetrics_metric_inside_an_o2_model_moves_and_casts():
    torchmetrics = pytest.importorskip("torchmetrics")
    model = nn.Sequential(nn.Linear(8, 4))
    model.metric = torchmetrics.MeanMetric()
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level="O2",
                            dtype="bf16")
    model.metric.update(torch.tensor([1.0, 3.0]))
    model.cpu()
    model.float()
    assert model.metric.compute().item() == 2.0
    assert model[0].weight.dtype == torch.float32


def test_a_copy_of_a_prepared_model_keeps_its_shadows_through_float():
    model, _ = trained("fp32")
    exact = mp.fp32_state_dict(model)
    clone = copy.deepcopy(model)
    clone.float()
    for name, p in clone.named_parameters():
        assert torch.equal(p.detach(), exact[name]), name
    with pytest.raises(RuntimeError, match="would round"):
        copy.deepcopy(model).half()


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_without_masters_casts_are_torchs(level):
    """Nothing to keep: O1 (fp32 parameters) and O3 (16-bit, no masters) cast as torch does."""
    model = net()
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level=level,
                            dtype="bf16")
    model.half()
    assert all(p.dtype == torch.float16 for p in model.parameters())
    model.float()
    assert all(p.dtype == torch.float32 for p in model.parameters())


# -- module hooks (test_module_hooks.py) --------------------------------------------------------
@pytest.mark.parametrize("master", ["fp32", "split", "kahan"])
def test_forward_and_backward_hooks_run_once_per_call(master):
    model, opt = trained(master, steps=0)
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append("root pre"))
    model.register_forward_hook(lambda m, args, out: calls.append(("root", out.dtype)))
    model[0].register_forward_pre_hook(lambda m, args, kwargs: calls.append("0 pre kw"),
                                       with_kwargs=True)
    model[0].register_forward_hook(lambda m, args, kwargs, out: calls.append(("0", out.dtype)),
                                   with_kwargs=True)
    model[1].register_full_backward_pre_hook(lambda m, grad_out: calls.append("1 bw pre"))
    model[1].register_full_backward_hook(lambda m, grad_in, grad_out: calls.append("1 bw"))
    step(model, opt)
    assert calls == ["root pre", "0 pre kw", ("0", torch.bfloat16), ("root", torch.float32),
                     "1 bw pre", "1 bw"]


def test_a_forward_pre_hook_may_replace_the_input():
    model, _ = trained("fp32", steps=0)
    x = batch()[0]
    expected = model(x * 2)
    model.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_global_module_hooks_run_once_per_module_call():
    model, _ = trained("fp32", steps=0)
    seen = []
    handles = [nn.modules.module.register_module_forward_pre_hook(
                   lambda m, args: seen.append(("pre", type(m).__name__))),
               nn.modules.module.register_module_forward_hook(
                   lambda m, args, out: seen.append(("post", type(m).__name__)))]
    try:
        model(batch()[0])
    finally:
        for h in handles:
            h.remove()
    names = ["Sequential", "Linear", "LayerNorm", "ReLU", "Linear"]
    assert [n for k, n in seen if k == "pre"] == names
    assert sorted(n for k, n in seen if k == "post") == sorted(names)


@pytest.mark.parametrize("master", MASTERS)
def test_state_dict_and_load_state_dict_hooks(master):
    """Hooks registered on the prepared model see its fp32 state_dict (the masters) and run
    once per call; load_state_dict hooks run once and the masters take the loaded values."""
    model, opt = trained(master)
    exact = mp.fp32_state_dict(model)
    calls = []
    model.register_state_dict_pre_hook(lambda m, prefix, keep_vars: calls.append("pre"))
    model.register_state_dict_post_hook(
        lambda m, sd, prefix, local: calls.append(("post", sd["0.weight"].dtype)))
    model.register_load_state_dict_pre_hook(lambda m, sd, *args: calls.append("load pre"))
    model.register_load_state_dict_post_hook(lambda m, keys: calls.append("load post"))
    sd = model.state_dict()
    torch.testing.assert_close(sd, exact, rtol=0, atol=0)
    other = {k: v + 0.001 for k, v in sd.items()}
    model.load_state_dict(other)
    assert calls == ["pre", ("post", torch.float32), "load pre", "load post"]
    # fp32 and split masters take the loaded values exactly; Kahan's bf16 pair holds ~16 bits
    # of them; stochastic rounding keeps the 16-bit weight, their rounding
    tol = {"fp32": (0, 0), "split": (0, 0), "kahan": (2.0 ** -14, 1e-7),
           "stochastic": (2.0 ** -8, 0)}[master]
    torch.testing.assert_close(mp.fp32_state_dict(model), other, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("master", MASTERS)
def test_what_a_state_dict_hook_puts_in_is_kept(master):
    """A sub-module's state-dict post-hook that replaces or drops its entries, and one of the
    model registered before ``prepare``: their values are kept (in fp32), as torch keeps them
    (the masters were written over them); the other keys, and a copy a hook made of its
    value, hold the masters."""
    model, opt = trained(master)
    exact = mp.fp32_state_dict(model)

    def edit(module, sd, prefix, local):
        sd[prefix + "weight"] = torch.full_like(sd[prefix + "weight"], 3.0)

    def drop(module, sd, prefix, local):  # (and a copy of the weight: its value, the master)
        del sd[prefix + "bias"]
        sd[prefix + "weight"] = sd[prefix + "weight"].clone()
    model[-1].register_state_dict_post_hook(edit)
    model[0].register_state_dict_post_hook(drop)
    sd = model.state_dict()
    last = f"{len(model) - 1}.weight"
    assert "0.bias" not in sd and sd[last].dtype == torch.float32
    assert torch.equal(sd[last], torch.full_like(exact[last], 3.0))
    assert all(torch.equal(v, exact[k]) for k, v in sd.items() if k != last)


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_a_value_without_dense_data_is_refused_naming_its_key(kind):
    """A meta or sparse tensor in the loaded dict: torch names the parameter; mixprec's copy
    into the masters raised "Cannot copy out of meta tensor" (a NotImplementedError) or a
    dense/sparse copy error without the key."""
    model, _ = trained("fp32", steps=1)
    sd = model.state_dict()
    sd["0.weight"] = (torch.zeros(sd["0.weight"].shape, device="meta") if kind == "meta"
                      else torch.zeros(sd["0.weight"].shape).to_sparse())
    with pytest.raises(RuntimeError, match='While copying the parameter named "0.weight"'):
        model.load_state_dict(sd)


@pytest.mark.parametrize("master", ["fp32", "split", "kahan"])
def test_state_dict_keys_renamed_by_a_sub_module_hook_keep_the_masters(master):
    """torch's activation-checkpoint wrapper renames its module's keys (its state-dict hooks
    drop ``_checkpoint_wrapped_module.``): model.state_dict() returned the rounded bf16 weights
    for them, and loading an fp32 dict rounded the masters."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    model = net()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            level="O2", dtype="bf16", master=master)
    for i in range(2):
        step(model, opt, i)
    sd = model.state_dict()
    assert "0.weight" in sd and all(v.dtype == torch.float32 for v in sd.values())
    torch.testing.assert_close(sd, dict(mp.fp32_state_dict(model, opt)), rtol=0, atol=0)
    g = torch.Generator().manual_seed(5)
    other = {k: torch.randn(v.shape, generator=g) for k, v in sd.items()}
    model.load_state_dict(other)
    tol = {"fp32": (0, 0), "split": (0, 0), "kahan": (2.0 ** -14, 1e-7)}[master]
    torch.testing.assert_close(dict(mp.fp32_state_dict(model, opt)), other, rtol=tol[0],
                               atol=tol[1])
    torch.testing.assert_close(model.state_dict(), other, rtol=tol[0], atol=tol[1])


def test_apply_zero_grad_and_train_eval_are_torchs():
    model, opt = trained("fp32", steps=0)
    x, y = batch()
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    visited = []
    model.apply(lambda m: visited.append(type(m).__name__))
    assert visited[-1] == "Sequential" and len(visited) == 5
    assert not model.eval().training and model.train().training


# -- Hugging Face save_pretrained ---------------------------------------------------------------
@pytest.mark.parametrize("optimizer", [True, False])
def test_save_pretrained_of_a_model_without_masters_records_the_dtype_it_writes(optimizer,
                                                                                 tmp_path):
    """At O3 (and at O2 prepared without an optimizer) ``state_dict()`` holds the 16-bit weights
    upcast, so ``save_pretrained`` writes fp32 tensors; its config recorded bfloat16 and a plain
    ``from_pretrained`` made a bf16 model (the Trainer's ``save_model`` an fp32 one). The config
    says float32, and the model loads back with the values written."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(config)
    if optimizer:
        gpt, _ = mp.prepare(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1), level="O3",
                            dtype="bf16")
    else:
        gpt = mp.prepare(gpt, level="O2", dtype="bf16")
    written = mp.fp32_state_dict(gpt)
    gpt.save_pretrained(tmp_path)
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert back.dtype == torch.float32
    loaded = back.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in written.items() if k in loaded)


@pytest.mark.parametrize("master", MASTERS)
def test_save_pretrained_loads_back_as_the_exact_masters(master, tmp_path):
    """0.3 wrote the fp32 masters with config.dtype bfloat16: a plain from_pretrained rounded
    them (3.9e-3 off)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(config)
    gpt, opt = mp.prepare(gpt, torch.optim.AdamW(gpt.parameters(), lr=1e-2), level="O2",
                          dtype="bf16", master=master)
    if not isinstance(opt, mp.MasterWeightOptimizer):
        opt.fused = False
    ids = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        opt.zero_grad()
        gpt(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    exact = mp.fp32_state_dict(gpt)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in exact.values()
               if v.is_floating_point())  # masters that bf16 can't hold
    gpt.save_pretrained(tmp_path / "o2")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "o2")
    assert back.dtype == torch.float32
    loaded = back.state_dict()
    for key, value in exact.items():
        if key in loaded:
            assert torch.equal(loaded[key], value), key
    with pytest.raises(ValueError, match="push_to_hub"):
        gpt.save_pretrained(tmp_path / "hub", push_to_hub=True)


def test_fp32_state_dict_of_a_compiled_model_has_the_plain_names():
    """``mp.fp32_state_dict(torch.compile(model))`` kept ``_orig_mod.`` in every key: the dict
    did not load into a plain model, as its docstring promises."""
    model, opt = trained("fp32", steps=1)
    compiled = torch.compile(model)  # (wrapping only: nothing is compiled until it is called)
    sd = mp.fp32_state_dict(compiled, opt)
    assert list(sd) == list(mp.fp32_state_dict(model, opt))
    net().load_state_dict(sd)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp64"])
def test_fp32_state_dict_saves_in_another_dtype_from_the_masters(dtype):
    """PaddlePaddle's ``decorate(save_dtype=)``: the weights written in a chosen dtype, cast
    once from the fp32 masters (not from the 16-bit weights)."""
    model, opt = trained("fp32", steps=2)
    exact = mp.fp32_state_dict(model, opt)
    target = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[dtype]
    saved = mp.fp32_state_dict(model, opt, dtype=dtype)
    assert all(v.dtype == target for v in saved.values())
    for name, value in saved.items():
        assert torch.equal(value, exact[name].to(target))
    with pytest.raises(ValueError, match="dtype must be 'fp32', 'bf16', 'fp16' or 'fp64'"):
        mp.fp32_state_dict(model, opt, dtype="fp8_e4m3")


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_torch_export_of_a_prepared_model_computes_as_it_does(level):
    """``torch.export.export(model, args)`` failed at every level (an AttributeError: the
    entry that replaces ``forward`` had no ``__code__``, which export names its trace by)."""
    torch.manual_seed(0)
    model = mp.prepare(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(),
                                     nn.Linear(16, 4)), level=level, dtype="bf16")
    x = torch.randn(4, 8)
    exported = torch.export.export(model, (x,)).module()
    assert torch.equal(exported(x), model(x))
    assert exported(x).dtype == (torch.bfloat16 if level == "O3" else torch.float32)


def test_an_orthogonal_parametrization_trains_at_o2_as_under_torch_autocast():
    """orthogonal() computes its weight with the matrix exponential, whose bf16 kernel returns
    NaN for a small skew-symmetric matrix: at O2 (its parameter stored in bf16) the loss was NaN
    from the second step on, where torch.autocast (fp32 parameter) trains. The matrix
    exponential is kept in fp32."""
    from torch.nn.utils.parametrizations import orthogonal

    def run(level):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), orthogonal(nn.Linear(6, 6)))
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        if level is not None:
            net, opt = mp.prepare(net, opt, level=level, dtype="bf16")
        gen, losses = torch.Generator().manual_seed(1), []
        for _ in range(5):
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
            with torch.autocast("cpu", torch.bfloat16, enabled=level is None):
                loss = nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    reference, o2 = run(None), run("O2")
    assert all(abs(a - b) < 2e-3 for a, b in zip(reference, o2)), (reference, o2)
