"""Tests for MasterWeightOptimizer(fused="compile"): torch's own single-tensor SGD/Adam/AdamW,
compiled into one pass per parameter (widen the gradient, step the master, cast it into the
weight).

The compiled step is compared with the fp32 reference: the unfused step (gradient copy, torch's
own optimizer step on the fp32 masters, torch's cast) on the same gradients. Both compute in fp32
from the same values, but the compiled kernel may round differently (it may fuse a multiply-add),
so masters and state agree to
rtol 1e-6 / atol 1e-6 (observed: at most 2.4e-7 apart after five steps), not bit for bit; model
parameters are checked to be exactly their master rounded. Gradients come from a fixed sequence,
not from backward, so a 1-ulp rounding flip cannot feed back into the trajectory.

The kernels compile once per (kernel, parameter dtype, gradient dtype) in a process; the tests
reuse few such combinations to keep compile time down.
"""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.optim import MasterWeightOptimizer
from mixprec.optim.params import valid_grad


def written(master, dtype):
    """A master as the optimizer writes it into a ``dtype`` weight: torch's cast (round to
    nearest, ties to even)."""
    return master.detach().to(dtype)


# The first torch.compile imports torch._inductor, which imports torch.utils.mkldnn, which uses
# the deprecated torch.jit.script_method at import time (torch's code, not ours).
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")

TOL = {"rtol": 1e-6, "atol": 1e-6}

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum_wd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                           weight_decay=1e-2, nesterov=True),
    "sgd_momentum_dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6,
                                           weight_decay=1e-2),
}
DTYPE_MIXES = {
    "bf16": [torch.bfloat16] * 2,
    "fp16": [torch.float16] * 2,
    "bf16+fp16+fp32": [torch.bfloat16, torch.float16, torch.float32],
}


def model_of(dtypes, width=8):
    """Linear layers in the given dtypes, then an fp32 LayerNorm (as O2 keeps norms)."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width).to(dt) for dt in dtypes), nn.LayerNorm(width))


def wrapped(model, name, fused):
    """Two param groups (the second at half the lr), wrapped in a MasterWeightOptimizer."""
    params = list(model.parameters())
    inner = OPTIMIZERS[name](params[:2])
    inner.add_param_group({"params": params[2:], "lr": inner.defaults["lr"] / 2})
    return MasterWeightOptimizer(inner, fused=fused)


def grad_sequence(model, steps, seed=1):
    """Per step, one gradient per parameter (in its dtype); step 0 leaves the last Linear's
    bias without a gradient, as a parameter outside the loss would."""
    gen = torch.Generator().manual_seed(seed)
    seq = [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in model.parameters()]
           for _ in range(steps)]
    seq[0][-3] = None
    return seq


def set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = None if g is None else g.clone()


def assert_same_training_state(opt_a, model_a, opt_b, model_b):
    """Masters and optimizer state close; each model parameter exactly its master rounded."""
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        ma, mb = opt_a.master_param(pa), opt_b.master_param(pb)
        torch.testing.assert_close(mb, ma, **TOL)
        assert opt_a.state[ma].keys() == opt_b.state[mb].keys()
        for key, va in opt_a.state[ma].items():
            torch.testing.assert_close(opt_b.state[mb][key], va, **TOL)
        for opt, p, m in ((opt_a, pa, ma), (opt_b, pb, mb)):
            assert torch.equal(p, written(m, p.dtype))


def run(opt, model, grads_seq):
    for grads in grads_seq:
        set_grads(model, grads)
        opt.step()
        opt.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("mix", list(DTYPE_MIXES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_matches_unfused_over_steps(name, mix):
    ref_model, fused_model = model_of(DTYPE_MIXES[mix]), model_of(DTYPE_MIXES[mix])
    ref, fused = wrapped(ref_model, name, False), wrapped(fused_model, name, "compile")
    seq = grad_sequence(ref_model, steps=5)
    run(ref, ref_model, seq)
    run(fused, fused_model, seq)
    assert_same_training_state(ref, ref_model, fused, fused_model)
    moved = fused_model[0].weight.float() - model_of(DTYPE_MIXES[mix])[0].weight.float()
    assert moved.abs().max() > 1e-3  # the fused step did update the low-precision weights


def test_scheduler_changes_lr_without_recompiling():
    counters = torch._dynamo.utils.counters
    models = [model_of(DTYPE_MIXES["bf16"]) for _ in range(2)]
    opts = [wrapped(m, "sgd_momentum_wd_nesterov", f) for m, f in zip(models, (False, "compile"))]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    seq = grad_sequence(models[0], steps=5)
    for i, grads in enumerate(seq):
        if i == 2:  # the first step (eager: torch makes the buffers) and the steady state
            graphs = counters["stats"]["unique_graphs"]  # (compiled at the second) are done
            assert graphs > 0
        for model, opt, sched in zip(models, opts, scheds):
            set_grads(model, grads)
            opt.step()
            opt.zero_grad()
            sched.step()
    assert opts[1].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 5)
    assert counters["stats"]["unique_graphs"] == graphs
    assert_same_training_state(opts[0], models[0], opts[1], models[1])


def test_a_scheduler_cycling_the_momentum_turns_the_compiled_step_off_once(caplog):
    """OneCycleLR cycles SGD's momentum (AdamW's beta1) every step; each new value recompiled
    the master step (about a second each) until torch's recompile limit, after which it ran
    eagerly without a word. After two changes the optimizer steps with torch's fused kernel,
    said once; its numbers stay those of the eager step."""
    from mixprec.optim.steps import HYPER_CHANGES
    counters = torch._dynamo.utils.counters
    models = [model_of(DTYPE_MIXES["bf16"]) for _ in range(2)]
    opts = [wrapped(m, "sgd_momentum_wd_nesterov", f) for m, f in zip(models, (False, "compile"))]
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10) for o in opts]
    seq = grad_sequence(models[0], steps=8)
    with caplog.at_level("WARNING", logger="mixprec"):
        for i, grads in enumerate(seq):
            for model, opt, sched in zip(models, opts, scheds):
                set_grads(model, grads)
                opt.step()
                opt.zero_grad()
                sched.step()
            if i == HYPER_CHANGES + 1:
                graphs = counters["stats"]["unique_graphs"]
    assert opts[1].fused == "auto"
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after it
    said = [r.getMessage() for r in caplog.records if "cycle_momentum" in r.getMessage()]
    assert len(said) == 1 and "fused='auto'" in said[0]
    assert_same_training_state(opts[0], models[0], opts[1], models[1])


def test_only_changes_on_steps_in_a_row_turn_the_compiled_step_off():
    """Three groups added (layers unfrozen one at a time) turned the compiled step off, saying
    a scheduler cycled the momentum; so did any three changes over a run, and setting
    ``fused="compile"`` again lasted one change. Only changes on steps in a row count, a new
    group is no change, and setting the option again starts afresh."""
    from mixprec.optim.steps import HYPER_CHANGES, keeps_compiling
    model = model_of(DTYPE_MIXES["bf16"] * 4)
    params = list(model.parameters())
    opt = MasterWeightOptimizer(torch.optim.SGD(params[:2], lr=0.1, momentum=0.9),
                                fused="compile")
    assert keeps_compiling(opt)
    for i in range(3):  # layers unfrozen one at a time
        opt.add_param_group({"params": params[2 + 2 * i: 4 + 2 * i]})
        assert keeps_compiling(opt)
    for _ in range(3):  # a change now and then: each followed by a step without one
        opt.param_groups[0]["momentum"] -= 0.01
        assert keeps_compiling(opt) and keeps_compiling(opt)
    for _ in range(HYPER_CHANGES + 1):  # changes on steps in a row
        opt.param_groups[0]["momentum"] -= 0.01
        result = keeps_compiling(opt)
    assert not result and opt.fused == "auto"
    opt.fused = "compile"
    opt.param_groups[0]["momentum"] -= 0.01
    assert keeps_compiling(opt) and opt.fused == "compile"


def test_a_one_element_master_steps_eagerly_and_adds_no_graph(tmp_path):
    """A learned scalar (CLIP's logit_scale) first in the groups: compiled, size 1 was
    specialised, and the next size's guard failed inside torch: three graphs, not one (counted
    in a fresh process: compiled kernels are shared by the process)."""
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from mixprec.optim import MasterWeightOptimizer
        torch.manual_seed(0)
        model = nn.Module()
        model.scale = nn.Parameter(torch.tensor(1.5))
        model.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        model = model.to(torch.bfloat16)
        opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    fused="compile")
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
        print(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    assert out.stdout.split()[-1] == "1", out.stdout + out.stderr


def test_no_loss_scaler_step_reads_model_grads_without_syncing():
    model, ref_model = model_of(DTYPE_MIXES["bf16"]), model_of(DTYPE_MIXES["bf16"])
    opt, ref = wrapped(model, "sgd", "compile"), wrapped(ref_model, "sgd", False)
    grads = grad_sequence(model, steps=2)[1]
    for m, o in ((model, opt), (ref_model, ref)):
        set_grads(m, grads)
        assert mp.NoLossScaler().step(o) is True
    assert valid_grad(opt.master_param(model[0].weight)) is None  # no fp32 gradient written
    assert valid_grad(ref.master_param(ref_model[0].weight)) is None  # unfused: transient
    assert_same_training_state(ref, ref_model, opt, model)


def scaled_step(model, opt, scaler, grads, clip=None):
    """Gradients as a scaled backward would leave them, then unscale_, clip, step, update."""
    scale = scaler.get_scale()
    scaler.scale(torch.zeros(()))  # the loss the gradients stand for, scaled
    set_grads(model, [None if g is None else (g.float() * scale).to(g.dtype) for g in grads])
    scaler.unscale_(opt)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
    stepped = scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return stepped


def test_after_unscale_and_clipping_the_fused_step_uses_master_grads():
    models = [model_of(DTYPE_MIXES["fp16"]) for _ in range(2)]
    opts = [wrapped(m, "sgd_momentum_wd_nesterov", f) for m, f in zip(models, (False, "compile"))]
    scalers = [mp.StaticLossScaler(1024.0) for _ in range(2)]
    for grads in grad_sequence(models[0], steps=3):
        for model, opt, scaler in zip(models, opts, scalers):
            assert scaled_step(model, opt, scaler, grads, clip=0.5)
    # reading the model's fp16 gradients would apply them 1024x too large and unclipped
    assert_same_training_state(opts[0], models[0], opts[1], models[1])


def test_skipped_step_leaves_masters_params_and_state_untouched():
    model = model_of(DTYPE_MIXES["fp16"])
    opt = wrapped(model, "sgd_momentum_wd_nesterov", "compile")
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    first, second = grad_sequence(model, steps=2)
    assert scaled_step(model, opt, scaler, first)
    before = copy.deepcopy((opt.state_dict(), [p.detach().clone() for p in model.parameters()]))
    second[0] = torch.full_like(second[0], float("inf"))
    assert not scaled_step(model, opt, scaler, second)
    assert scaler.skipped_steps == 1
    state, params = opt.state_dict(), list(model.parameters())
    for p, q in zip(params, before[1]):
        assert torch.equal(p, q)
    for i, m in state["master_weights"].items():
        assert torch.equal(m, before[0]["master_weights"][i])
    for i, s in state["state"].items():
        assert torch.equal(s["momentum_buffer"], before[0]["state"][i]["momentum_buffer"])


@pytest.mark.parametrize("first_fused", [False, "compile"],
                         ids=["unfused-then-fused", "fused-then-unfused"])
def test_state_dict_round_trip_between_fused_and_unfused(first_fused):
    ref_model = model_of(DTYPE_MIXES["bf16"])
    ref = wrapped(ref_model, "adamw", False)
    model = model_of(DTYPE_MIXES["bf16"])
    opt = wrapped(model, "adamw", first_fused)
    seq = grad_sequence(model, steps=4)
    run(ref, ref_model, seq)
    run(opt, model, seq[:2])
    resumed_model = model_of(DTYPE_MIXES["bf16"])
    resumed_model.load_state_dict(model.state_dict())  # a checkpoint has the fp32 LayerNorm too
    resumed = wrapped(resumed_model, "adamw", "compile" if first_fused is False else False)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    run(resumed, resumed_model, seq[2:])
    steps = {float(s["step"]) for s in resumed.state_dict()["state"].values()}
    assert steps == {3.0, 4.0}  # the bias without a gradient at step 0 took one step less
    assert_same_training_state(ref, ref_model, resumed, resumed_model)


def test_closure_is_evaluated_once_and_its_loss_returned():
    model = model_of(DTYPE_MIXES["bf16"])
    opt = wrapped(model, "sgd", "compile")
    x = torch.randn(4, 8)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        hidden = torch.tanh(model[1](torch.tanh(model[0](x.bfloat16()))))
        loss = (model[2](hidden.float()) - 0.5).pow(2).mean()
        loss.backward()
        return loss

    master = opt.master_param(model[0].weight)
    before = master.detach().clone()
    loss = opt.step(closure)
    assert len(calls) == 1 and loss.dim() == 0
    assert not torch.equal(master, before)  # updated from the closure's gradients
    assert torch.equal(model[0].weight, written(master, torch.bfloat16))


@pytest.mark.parametrize("make, what", [
    (lambda ps: torch.optim.Adagrad(ps), "Adagrad"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize"),
    (lambda ps: torch.optim.Adam(ps, amsgrad=True), "amsgrad"),
    (lambda ps: torch.optim.AdamW(ps, capturable=True), "capturable"),
], ids=["adagrad", "sgd-maximize", "adam-amsgrad", "adamw-capturable"])
def test_unsupported_optimizer_or_option_is_rejected(make, what):
    model = model_of(DTYPE_MIXES["bf16"])
    with pytest.raises(ValueError, match=what) as err:
        MasterWeightOptimizer(make(model.parameters()), fused="compile")
    assert what in str(err.value) and "torch.optim.SGD" in str(err.value)
    opt = MasterWeightOptimizer(make(model.parameters()))  # the eager kernels still wrap it
    with pytest.raises(ValueError, match=what):
        opt.fused = "compile"
    assert opt.fused == "auto"


def test_option_turned_on_after_wrapping_is_rejected_at_step():
    model = model_of(DTYPE_MIXES["bf16"])
    opt = wrapped(model, "sgd", "compile")
    opt.param_groups[1]["maximize"] = True
    set_grads(model, grad_sequence(model, steps=1)[0])
    with pytest.raises(ValueError, match=r"param_groups\[1\].*maximize"):
        opt.step()


@pytest.mark.parametrize("bad", ["yes", True, None])
def test_fused_must_be_one_of_the_kernels(bad):
    model = model_of(DTYPE_MIXES["bf16"])
    with pytest.raises(ValueError, match=f"fused must be 'auto', 'compile' or False; got {bad!r}"):
        MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), fused=bad)


@pytest.mark.slow
# dynamo reads .grad while tracing mixprec.autocast's tree_map over the inputs (as in test_trainer)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_trainer_compile_turns_the_fused_step_on_at_o2_only_when_supported():
    data = [(torch.randn(4, 8), torch.randn(4, 8))] * 2
    for make, expected in ((lambda ps: torch.optim.SGD(ps, lr=0.1), "compile"),
                           (lambda ps: torch.optim.Adagrad(ps), "auto")):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        trainer = mp.Trainer(model, nn.functional.mse_loss, make(model.parameters()), level="O2",
                             dtype="bf16", compile=True, progress=False)
        assert trainer.optimizer.fused == expected
        history = trainer.fit(data, epochs=1)
        assert history.steps == 2 and all(map(torch.isfinite, map(torch.tensor, history.loss)))
