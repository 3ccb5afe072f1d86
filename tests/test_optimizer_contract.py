"""torch.optim.Optimizer's contract, held by the optimizer ``mp.prepare`` returns at O2.

The cases are ported from PyTorch's own optimizer tests (test/test_optim.py, TestOptimRenewed:
step hooks, state_dict and load_state_dict hooks, load_state_dict errors, state round trips,
param groups with LR schedulers; common_optimizers' param-group errors) and run against every
master method: fp32 masters (MasterWeightOptimizer, stepped a bucket at a time), the split
remainder, Kahan compensation and stochastic rounding (CompactMasterOptimizer); the cases that
save or load the state run with fp32 and with bf16 moments. Hooks are registered on the
optimizer ``prepare`` returned (``after``) and on the user's optimizer before ``prepare``
(``before``): both must run exactly as torch runs them.
"""

import copy
import io
import itertools

import pytest
import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import mixprec as mp
from mixprec import kernel_table

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

MASTERS = ["fp32", "split", "kahan", "stochastic"]
# (master, state dtype): each master method once, with fp32 moments, where the case checks
# hooks, groups or the step (the moments' dtype changes nothing there); both moment dtypes where
# the case saves or loads the state (bf16 moments are converted and checked on the way) or
# steps parameters that have no moments
KINDS, KIND_IDS = [(m, "fp32") for m in MASTERS], MASTERS
STATE_KINDS = list(itertools.product(MASTERS, ["fp32", "bf16"]))
STATE_KIND_IDS = [f"{m}-{s}" for m, s in STATE_KINDS]
WHEN = ["after", "before"]  # hooks on the returned optimizer, or on the user's before prepare
NEW_FLAGS = ("foreach", "fused", "maximize", "capturable", "differentiable",
             "decoupled_weight_decay")


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def make(kind, cls=torch.optim.AdamW, groups=False, register=None, **kwargs):
    """A prepared model and its optimizer; ``register(user_optimizer)`` runs before prepare."""
    master, state_dtype = kind
    model = net()
    params = ([{"params": model[0].parameters()},
               {"params": [*model[1].parameters(), *model[3].parameters()], "lr": 5e-3}]
              if groups else model.parameters())
    user = cls(params, lr=1e-2, **kwargs)
    if register is not None:
        register(user)
    model, opt = mp.prepare(model, user, level="O2", dtype="bf16", master=master,
                            state_dtype=state_dtype)
    if isinstance(opt, mp.MasterWeightOptimizer):
        opt.bucket_mb = 1e-4  # a bucket per tensor: several inner steps per step()
    else:
        opt.fused = False  # eager kernels (the compiled ones are checked in test_compact.py)
    return model, opt, user


def batch(i=0):
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def loss_of(model, i=0):
    x, y = batch(i)
    return torch.nn.functional.mse_loss(model(x).float(), y)


def train(model, opt, steps=3, start=0):
    for i in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, i).backward()
        opt.step()


def hooked(kind, when, hook_kind, hook, **kwargs):
    """A prepared model and optimizer with ``hook`` registered ``when``; and the handle."""
    handles = []

    def register(o):
        handles.append(getattr(o, f"register_{hook_kind}")(hook, **kwargs))

    model, opt, _ = make(kind, register=register if when == "before" else None)
    if when == "after":
        register(opt)
    return model, opt, handles[0]


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_a_weight_given_new_storage_steps_there_and_one_resized_is_refused(kind, monkeypatch):
    """``p.data = ...`` of the same shape (a device move does this) is stepped in its new
    storage, as torch steps it (a compact step's cached views of a tensor cut into slices kept
    writing the old storage); of another shape (``resize_token_embeddings``) it is refused, at
    the step and at ``state_dict()``, saying what to do (a split step stepped the old shape)."""
    monkeypatch.setitem(kernel_table.STEP_PIECE, "cpu", 64)  # every weight cut into slices
    runs = [make(kind) for _ in range(2)]
    for model, opt, _ in runs:
        opt.bucket_mb, opt.fused = None, "auto"  # the default path, cached lists included
        train(model, opt, 2)
    runs[0][0][0].weight.data = runs[0][0][0].weight.data.clone()
    for model, opt, _ in runs:
        train(model, opt, 2, start=2)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0].parameters(),
                                                 runs[1][0].parameters()))
    model, opt, _ = runs[0]
    head = model[3].weight
    head.data = torch.cat([head.data, head.data[:2]])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    refusal = r"changed shape after the optimizer was made.*shape \(6, 16\).*Resize the model"
    with pytest.raises(RuntimeError, match=refusal):
        opt.step()
    with pytest.raises(RuntimeError, match=refusal):
        model.state_dict()
    with pytest.raises(RuntimeError, match=refusal):
        opt.state_dict()


# -- step hooks (test_step_pre_hook, test_step_post_hook, test_step_all_hooks) ------------------
@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("hook_kind", ["step_pre_hook", "step_post_hook"])
def test_step_hooks_run_once_per_step_until_removed(kind, when, hook_kind):
    data = [5]
    seen = []

    def hook(o, args, kwargs):
        data[0] += 2
        seen.append((o, sum(len(g["params"]) for g in o.param_groups)))

    model, opt, handle = hooked(kind, when, hook_kind, hook)
    train(model, opt, steps=2)
    assert data[0] == 9
    assert all(o is opt and n == 6 for o, n in seen)  # the optimizer held, every parameter
    handle.remove()
    train(model, opt, steps=1)
    assert data[0] == 9


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_global_and_local_step_hooks_run_in_torch_order(kind, when):
    data = []
    model, opt, local_pre = hooked(kind, when, "step_pre_hook", lambda o, a, k: data.append(1))
    local_post = opt.register_step_post_hook(lambda o, a, k: data.append(2))
    other = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    handles = [other.register_step_pre_hook(lambda o, a, k: data.append(1)),
               other.register_step_post_hook(lambda o, a, k: data.append(2)),
               register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
               register_optimizer_step_post_hook(lambda o, a, k: data.append(5))]
    try:
        train(model, opt, steps=1)
        assert data == [0, 1, 2, 5]
        other.step()
        assert data == [0, 1, 2, 5] * 2
        train(model, opt, steps=1)
        assert data == [0, 1, 2, 5] * 3
    finally:
        for h in handles:
            h.remove()
    local_pre.remove()
    local_post.remove()
    train(model, opt, steps=1)
    other.step()
    assert data == [0, 1, 2, 5] * 3


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_a_pre_hook_may_replace_the_step_arguments(kind):
    """torch: a pre-hook returning (args, kwargs) replaces them; anything else is an error."""
    model, opt, _ = make(kind)
    opt.register_step_pre_hook(lambda o, args, kwargs: (args, kwargs))
    train(model, opt, steps=1)
    opt.register_step_pre_hook(lambda o, args, kwargs: "nonsense")
    with pytest.raises(RuntimeError, match="must return None or a tuple"):
        train(model, opt, steps=1)


GLOBAL_NORM = 1e-3


def clip_global(o, args, kwargs):
    torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], GLOBAL_NORM)


def _fp32(model, companions):
    return {n: companions.get(p, p).detach().float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("when", WHEN)
def test_a_global_norm_clip_in_a_pre_hook_clips_all_parameters_once(when):
    """A pre-hook clipping the global gradient norm (what training libraries install), on an
    SGD whose update is lr * grad: the update's norm is lr * max_norm, as in fp32 (a hook run
    once per bucket over that bucket would give sqrt(buckets) times that)."""
    torch.manual_seed(0)
    fp32 = net()
    opt = torch.optim.SGD(fp32.parameters(), lr=1.0)
    opt.register_step_pre_hook(clip_global)
    before = [p.detach().clone() for p in fp32.parameters()]
    (loss_of(fp32) * 100).backward()
    opt.step()
    reference = float(torch.linalg.vector_norm(torch.stack(
        [(p.detach() - b).norm() for p, b in zip(fp32.parameters(), before)])))
    assert reference == pytest.approx(GLOBAL_NORM, rel=1e-4)
    # stochastic rounding moves a weight by a whole ulp with the right probability: at this
    # size its update norm is rounding noise (its hooks' once-per-step is checked above)
    for kind in [k for k in KINDS if k[0] != "stochastic"]:
        norm = _update_norm_sgd(kind, when)
        assert norm == pytest.approx(GLOBAL_NORM, rel=2e-2), kind  # bf16 rounding of lr*grad


def _update_norm_sgd(kind, when):
    master, state_dtype = kind
    model = net()
    user = torch.optim.SGD(model.parameters(), lr=1.0)
    if when == "before":
        user.register_step_pre_hook(clip_global)
    model, opt = mp.prepare(model, user, level="O2", dtype="bf16", master=master,
                            state_dtype=state_dtype)
    if when == "after":
        opt.register_step_pre_hook(clip_global)
    if isinstance(opt, mp.MasterWeightOptimizer):
        opt.bucket_mb = 1e-4
    else:
        opt.fused = False
    values = getattr(opt, "fp32_values", opt.masters_by_param)
    before = [v.clone() for v in _fp32(model, values()).values()]
    (loss_of(model) * 100).backward()
    opt.step()
    after = list(_fp32(model, values()).values())
    return float(torch.linalg.vector_norm(torch.stack(
        [(a - b).norm() for a, b in zip(after, before)])))


# -- state_dict hooks ---------------------------------------------------------------------------
def state_dict_pre_hook(optimizer):
    optimizer.state["test"] = 1


def state_dict_post_hook(optimizer, state_dict):
    state_dict["ran_state_dict_pre_hook"] = "test" in state_dict["state"]
    state_dict["state"].pop("test", None)
    return state_dict


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_state_dict_pre_and_post_hooks(kind, when):
    model, opt, _ = hooked(kind, when, "state_dict_pre_hook", state_dict_pre_hook)
    train(model, opt, steps=1)
    assert opt.state_dict()["state"]["test"] == 1
    opt.register_state_dict_post_hook(state_dict_post_hook)
    sd = opt.state_dict()
    assert sd["ran_state_dict_pre_hook"] is True and "test" not in sd["state"]
    model, opt, _ = hooked(kind, when, "state_dict_post_hook", state_dict_post_hook)
    assert opt.state_dict()["ran_state_dict_pre_hook"] is False


def load_pre_hook1(optimizer, state_dict):
    state_dict["param_groups"][0]["lr"] = 0.002


def load_pre_hook2(optimizer, state_dict):
    mine = copy.deepcopy(state_dict)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def load_post_hook(optimizer):
    optimizer.ran = (optimizer.param_groups[0]["lr"] == 0.003, True)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_load_state_dict_pre_hook_and_prepend(kind, when):
    model, opt, _ = hooked(kind, when, "load_state_dict_pre_hook", load_pre_hook1)
    train(model, opt, steps=1)
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_pre_hook(load_pre_hook2, prepend=True)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002  # hook1 runs last and wins
    train(model, opt, steps=1)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_load_state_dict_post_hook_and_pre_post(kind, when):
    model, opt, _ = hooked(kind, when, "load_state_dict_post_hook", load_post_hook)
    train(model, opt, steps=1)
    opt.load_state_dict(opt.state_dict())
    assert opt.ran == (False, True)
    opt.register_load_state_dict_pre_hook(load_pre_hook2)
    opt.load_state_dict(opt.state_dict())
    assert opt.ran == (True, True)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_the_wrapped_optimizer_refuses_direct_calls(kind):
    """The user's optimizer, once wrapped, refuses step/state_dict/load_state_dict with a
    message naming the optimizer to call instead (its groups hold what only the wrapper may
    step); hooks on it are the wrapper's."""
    model, opt, user = make(kind)
    sd = opt.state_dict()
    for call in (user.step, user.state_dict, lambda: user.load_state_dict(sd)):
        with pytest.raises(RuntimeError, match="prepare returned"):
            call()
    calls = []
    handle = user.register_step_post_hook(lambda o, a, k: calls.append(o))
    train(model, opt, steps=1)
    assert calls == [opt]
    handle.remove()
    train(model, opt, steps=1)
    assert calls == [opt]


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_hooks_survive_a_deep_copy(kind):
    calls = []
    model, opt, user = make(kind, register=lambda o: o.register_step_post_hook(
        lambda o, a, k: calls.append(1)))
    clone = copy.deepcopy(opt)
    with pytest.raises(RuntimeError, match="prepare returned"):
        clone.inner.step()
    train(model, opt, steps=1)
    assert calls == [1]


# -- load_state_dict errors ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_load_state_dict_errors_of_torch(kind):
    """torch's own checks: the number of groups and of parameters per group."""
    model, opt, _ = make(kind, groups=True)
    train(model, opt, steps=1)
    sd = opt.state_dict()
    fewer = {**sd, "param_groups": sd["param_groups"][:1]}
    with pytest.raises(ValueError, match="different number of parameter groups"):
        opt.load_state_dict(fewer)
    short = copy.deepcopy(sd)
    short["param_groups"][1]["params"] = short["param_groups"][1]["params"][:-1]
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        opt.load_state_dict(short)


@pytest.mark.parametrize("cls,kwargs,key", [(torch.optim.AdamW, {}, "exp_avg"),
                                            (torch.optim.SGD, {"momentum": 0.9},
                                             "momentum_buffer")])
@pytest.mark.parametrize("kind", STATE_KINDS, ids=STATE_KIND_IDS)
def test_another_models_state_is_refused_naming_the_parameter(kind, cls, kwargs, key):
    """Refused at load, before anything changes: torch's fused CPU kernel does not check shapes
    (it would step a (48, 16) moment on a (32, 16) parameter silently), and the compiled compact
    kernels would fail at step with a long tracing error."""
    other = nn.Sequential(nn.Linear(8, 48), nn.LayerNorm(48), nn.ReLU(), nn.Linear(48, 4))
    theirs = cls(other.parameters(), lr=1e-2, **kwargs)
    other(batch()[0]).sum().backward()
    theirs.step()
    model, opt, _ = make(kind, cls, **kwargs)
    opt.fused = "auto" if isinstance(opt, mp.MasterWeightOptimizer) else False
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"'{key}' of parameter '0\.weight' .*\(48, 8\).*"
                                         rf"\(16, 8\)"):
        opt.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(opt.state_dict(), before, rtol=0, atol=0)
    train(model, opt, steps=1)


def test_an_unnamed_optimizer_names_the_group_and_index():
    model = net().to(torch.bfloat16)
    opt = mp.MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sd = opt.state_dict()
    sd["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3),
                       "exp_avg_sq": torch.zeros(3)}}
    with pytest.raises(ValueError, match=r"parameter param_groups\[0\]\['params'\]\[0\] has "
                                         r"shape \(3,\)"):
        opt.load_state_dict(sd)


def test_a_kahan_compensation_of_another_dtype_is_refused():
    model, opt, _ = make(("kahan", "fp32"))
    train(model, opt, steps=1)
    sd = opt.state_dict()
    for entry in sd["state"].values():
        if "compensation" in entry:
            entry["compensation"] = entry["compensation"].to(torch.float16)
    with pytest.raises(ValueError, match="float16 Kahan compensation for parameter '0.weight'"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("master", ["fp32", "split", "kahan", "stochastic"])
def test_moments_saved_in_the_other_state_dtype_load_in_this_ones(master):
    for saved, wanted in (("fp32", "bf16"), ("bf16", "fp32")):
        model, opt, _ = make((master, saved))
        train(model, opt, steps=2)
        model2, opt2, _ = make((master, wanted))
        opt2.load_state_dict(opt.state_dict())
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[wanted]
        moments = [v for s in opt2.state.values() if isinstance(s, dict)
                   for k, v in s.items() if k.startswith("exp_avg")]
        assert moments and all(v.dtype == dtype for v in moments)
        train(model2, opt2, steps=1)


# -- state round trips (test_state_dict_deterministic, test_load_nontensor_step, ...) ----------
@pytest.mark.parametrize("kind", STATE_KINDS, ids=STATE_KIND_IDS)
def test_state_dict_round_trip_continues_bitwise(kind):
    model, opt, _ = make(kind, groups=True)
    train(model, opt, steps=3)
    model_c, opt_c, _ = make(kind, groups=True)
    model_c.load_state_dict(model.state_dict())
    sd = copy.deepcopy(opt.state_dict())
    opt_c.load_state_dict(copy.deepcopy(sd))
    train(model, opt, steps=3, start=3)
    train(model_c, opt_c, steps=3, start=3)
    for p, q in zip(model.parameters(), model_c.parameters()):
        assert torch.equal(p, q)
    torch.testing.assert_close(opt.state_dict(), opt_c.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(model.state_dict(), model_c.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("kind", STATE_KINDS, ids=STATE_KIND_IDS)
def test_older_and_nontensor_step_state_dicts_load(kind):
    model, opt, _ = make(kind)
    train(model, opt, steps=2)
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:
        for flag in NEW_FLAGS:
            group.pop(flag, None)
    for entry in sd["state"].values():
        if torch.is_tensor(entry.get("step")):
            entry["step"] = entry["step"].item()
    opt.load_state_dict(sd)
    train(model, opt, steps=1, start=2)


@pytest.mark.parametrize("kind", STATE_KINDS, ids=STATE_KIND_IDS)
def test_save_load_equality_with_weights_only(kind):
    model, opt, _ = make(kind)
    train(model, opt, steps=2)
    sd = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=True), sd, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_deepcopy_copies_all_public_attrs_and_can_be_printed(kind):
    model, opt, _ = make(kind)
    train(model, opt, steps=2)
    public = {k for k in opt.__dict__ if not k.startswith("_")}
    assert public == {k for k in copy.deepcopy(opt).__dict__ if not k.startswith("_")}
    assert type(opt).__name__ in repr(opt)


# -- param groups, zero_grad, no-op steps -------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_add_param_group_trains_the_new_group_and_checks_like_torch(kind):
    master, state_dtype = kind
    model = net()
    user = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    model, opt = mp.prepare(model, user, level="O2", dtype="bf16", master=master,
                            state_dtype=state_dtype)
    if not isinstance(opt, mp.MasterWeightOptimizer):
        opt.fused = False
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[0].weight]})
    with pytest.raises(TypeError, match="not a set"):
        opt.add_param_group({"params": {model[3].weight}})
    with pytest.raises(ValueError, match="'params' entry"):
        opt.add_param_group({"lr": 1.0})
    opt.add_param_group({"params": model[3].parameters(), "lr": 5e-3})
    assert opt.param_groups[1]["lr"] == 5e-3 and opt.param_groups[1]["weight_decay"] == 1e-2
    before = model[3].weight.detach().clone()
    train(model, opt, steps=1)
    assert not torch.equal(before, model[3].weight)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_zero_grad(kind, set_to_none):
    model, opt, _ = make(kind)
    loss_of(model).backward()
    opt.zero_grad(set_to_none=set_to_none)
    for p in model.parameters():
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.requires_grad and not p.grad.any()
    for g in opt.param_groups:
        for p in g["params"]:
            assert p.grad is None if set_to_none else not p.grad.any()


@pytest.mark.parametrize("kind", STATE_KINDS, ids=STATE_KIND_IDS)  # bf16 moments: cast around
def test_step_is_noop_when_params_have_no_grad(kind):  # the step, none made for no gradient
    model, opt, _ = make(kind)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# -- LR schedulers ------------------------------------------------------------------------------
SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=3),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
}


SCHEDULER_CELLS = [(name, "returned") for name in SCHEDULERS] + [("StepLR", "user's, before")]


@pytest.mark.parametrize("name,on", SCHEDULER_CELLS)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_param_groups_with_lr_scheduler_go_the_right_direction(kind, name, on):
    """A scheduler on the returned optimizer or on the user's one (built before prepare) sees
    each step (torch warns, an error here, if it steps before its optimizer did) and moves the
    lr of both groups; the loss goes down."""
    holder = {}

    def register(o):
        holder["s"] = SCHEDULERS[name](o)

    model, opt, _ = make(kind, groups=True, register=register if on != "returned" else None)
    scheduler = holder["s"] if on != "returned" else SCHEDULERS[name](opt)
    initial = loss_of(model).item()
    lrs = []
    for i in range(6):
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        opt.step()
        scheduler.step(loss.item()) if name == "ReduceLROnPlateau" else scheduler.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    assert loss_of(model).item() < initial
    if name in ("StepLR", "ExponentialLR"):
        assert lrs[-1][0] != 1e-2 and lrs[-1][1] != 5e-3
        assert lrs[-1][0] / lrs[-1][1] == pytest.approx(2.0)


@pytest.mark.parametrize("cls", [torch.optim.ASGD, torch.optim.NAdam, torch.optim.RMSprop,
                                 torch.optim.Adagrad, torch.optim.Rprop, torch.optim.Adadelta,
                                 torch.optim.Adamax, torch.optim.RAdam])
def test_every_elementwise_optimizers_state_round_trips(cls):
    """Scalar state (ASGD's eta, NAdam's mu_product) is not held to the parameter's shape."""
    model, opt, _ = make(("fp32", "fp32"), cls)
    train(model, opt, steps=2)
    model_c, opt_c, _ = make(("fp32", "fp32"), cls)
    model_c.load_state_dict(model.state_dict())
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(model, opt, steps=1, start=2)
    train(model_c, opt_c, steps=1, start=2)
    for p, q in zip(model.parameters(), model_c.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_tensor_lr_steps_as_a_float_lr(kind):
    """test_tensor_lr: an lr given as a 0-d tensor gives the float lr's weights."""
    runs = []
    for lr in (1e-2, torch.tensor(1e-2)):
        model = net()
        master, state_dtype = kind
        model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr),
                                level="O2", dtype="bf16", master=master,
                                state_dtype=state_dtype)
        if not isinstance(opt, mp.MasterWeightOptimizer):
            opt.fused = False
        train(model, opt, steps=2)
        runs.append(mp.fp32_state_dict(model))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", STATE_KINDS, ids=STATE_KIND_IDS)
def test_can_load_from_and_to_a_named_state_dict(kind):
    """test_can_load_from_to_named_state_dict: an optimizer over named_parameters() keeps the
    names in its state_dict, and either form loads into the other."""
    master, state_dtype = kind
    saved = {}
    for named in (True, False):
        model = net()
        params = model.named_parameters() if named else model.parameters()
        model, opt = mp.prepare(model, torch.optim.AdamW(params, lr=1e-2), level="O2",
                                dtype="bf16", master=master, state_dtype=state_dtype)
        if not isinstance(opt, mp.MasterWeightOptimizer):
            opt.fused = False
        train(model, opt, steps=2)
        saved[named] = (model, opt, copy.deepcopy(opt.state_dict()))
    assert saved[True][2]["param_groups"][0]["param_names"][:2] == ["0.weight", "0.bias"]
    for named in (True, False):
        model, opt, _ = saved[named]
        opt.load_state_dict(saved[not named][2])
        train(model, opt, steps=1, start=2)


# -- writes made outside the step ------------------------------------------------------------------
def _stepped(master, dtype="bf16"):
    model = net()
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5), level="O2",
                            dtype=dtype, master=master)
    g = torch.Generator().manual_seed(3)
    for p in model.parameters():  # large weights: a compensation as large as theirs
        p.grad = (torch.randn(p.shape, generator=g) * 4).to(p.dtype)
    opt.step()
    opt.zero_grad()
    return model, opt


def _zero_step(model, opt):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # SGD without momentum: a step that changes nothing
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("read_first", [False, True])
@pytest.mark.parametrize("master,dtype", [("fp32", "bf16"), ("fp32", "fp16"), ("split", "bf16"),
                                          ("kahan", "bf16"), ("kahan", "fp16"),
                                          ("stochastic", "bf16")])
def test_a_clamp_of_the_model_weights_is_kept_by_the_next_step(master, dtype, read_first):
    """A Lipschitz clamp written as in plain torch (``p.clamp_`` over model.parameters()):
    fp32 masters' next step wrote the old masters back (the clamp undone: weights up to 1.9
    after clamping to 1/16), and Kahan's pair kept a compensation as large as the old weight's
    (values 8% over the bound). Each master now takes the weight where their rounding
    disagrees, before the step reads it and before ``state_dict()`` does."""
    c = 2.0 ** -4  # exact in bf16 and fp16
    model, opt = _stepped(master, dtype)
    assert max(p.abs().max().item() for p in model.parameters()) > 1
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-c, c)
    if read_first:
        model.state_dict()
    _zero_step(model, opt)
    values = mp.fp32_state_dict(model, opt)
    ulp = 2.0 ** -4 * torch.finfo({"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]).eps
    # fp32 masters take the weight exactly where it disagrees; a pair's value rounds to it:
    # within half an ulp of the bound
    bound = c if master in ("fp32", "stochastic") else c + ulp / 2
    for name, p in model.named_parameters():
        assert p.abs().max().item() <= c, name
        assert values[name].abs().max().item() <= bound, name


def test_fp32_masters_edited_in_place_through_param_groups_are_kept():
    """fp32 masters hold ``param_groups``: a projection written there was undone by
    ``state_dict()`` (the weight, now off the master's rounding, taken as written) and by the
    next step; it now gives its rounding to the weight."""
    model, opt = _stepped("fp32")
    c = 2.0 ** -4
    with torch.no_grad():
        for group in opt.param_groups:
            for t in group["params"]:
                t.clamp_(-c, c)
    sd = model.state_dict()
    assert max(v.abs().max().item() for v in sd.values()) <= c
    assert all(torch.equal(p, opt.master_param(p).to(p.dtype)) for p in model.parameters())
    _zero_step(model, opt)
    assert max(v.abs().max().item() for v in mp.fp32_state_dict(model, opt).values()) <= c


@pytest.mark.parametrize("master", ["fp32", "split", "kahan"])
def test_a_model_load_between_steps_is_followed_exactly(master):
    """A load writes weights and masters (or buffers) together: the check that follows writes
    keeps what was loaded, bit for bit."""
    model, opt = _stepped(master)
    g = torch.Generator().manual_seed(7)
    other = {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    model.load_state_dict(other)
    loaded = {k: v.clone() for k, v in mp.fp32_state_dict(model, opt).items()}
    _zero_step(model, opt)
    torch.testing.assert_close(dict(mp.fp32_state_dict(model, opt)), loaded, rtol=0, atol=0)


def _adamw_run(master, clear_at=2, steps=4):
    model = net()
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level="O2",
                            dtype="bf16", master=master)
    g = torch.Generator().manual_seed(11)
    seen = None
    for i in range(steps):
        if i == clear_at:
            before = {k: v.clone() for k, v in mp.fp32_state_dict(model, opt).items()}
            opt.state.clear()  # torch's idiom to reset the moments
            seen = (before, dict(mp.fp32_state_dict(model, opt)), opt.state_dict())
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return mp.fp32_state_dict(model, opt), seen


@pytest.mark.parametrize("master", ["split", "kahan"])
def test_a_cleared_state_resets_the_moments_and_keeps_the_pairs(master):
    """``optimizer.state.clear()`` dropped the remainders and compensations with the moments:
    ``state_dict()`` then crashed (a pair without its buffer) and the next step started from
    the bare 16-bit weights. The buffers are kept (and saved) until the next step puts them
    back; split then steps bit for bit as fp32 masters with their state cleared alike."""
    final, (before, after, saved) = _adamw_run(master)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    key = {"split": "remainder", "kahan": "compensation"}[master]
    assert sum(key in entry for entry in saved["state"].values()) == 4  # the 16-bit weights
    assert not any("exp_avg" in entry for entry in saved["state"].values())
    reference, _ = _adamw_run("fp32")
    if master == "split":
        torch.testing.assert_close(dict(final), dict(reference), rtol=0, atol=0)
    else:
        torch.testing.assert_close(dict(final), dict(reference), rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_step_pre_hooks_see_true_gradients_when_the_step_clips(master):
    """fp16, ``amp.step(opt, max_grad_norm=...)``: the clip was folded into the step, so a step
    pre-hook read the loss-scaled gradients (norm 8.9e4 instead of 1.36) and a clip inside it
    changed the update. With pre-hooks the scaler unscales first, as it does without a clip."""
    runs = {}
    for max_norm in (None, 1e6):  # a clip that never binds: the same updates
        amp = mp.MixedPrecision(level="O2", dtype="fp16", master=master)
        model = net()
        model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        seen = []
        opt.register_step_pre_hook(lambda o, a, k: seen.append(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad.float()) for g in o.param_groups
                         for p in g["params"] if p.grad is not None])).item()))
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            amp.backward(torch.nn.functional.mse_loss(model(x).float(), y))
            amp.step(opt, max_grad_norm=max_norm)
            opt.zero_grad()
        runs[max_norm] = (seen, mp.fp32_state_dict(model, opt))
    assert max(runs[1e6][0]) < 100  # true gradients, not 2^16 times them
    torch.testing.assert_close(runs[1e6][0], runs[None][0], rtol=1e-3, atol=0)
    torch.testing.assert_close(dict(runs[1e6][1]), dict(runs[None][1]), rtol=0, atol=0)


@pytest.mark.parametrize("master,dtype", [("fp32", "fp16"), ("fp32", "bf16"), ("split", "bf16")])
def test_gradscaler_unscales_before_step_pre_hooks_as_for_torchs_optimizers(master, dtype):
    """torch.amp.GradScaler handed the loss scale to the step (the fused-optimizer protocol),
    so a step pre-hook saw gradients 2^16 times too large (a clip in it changed the update);
    with pre-hooks registered it now unscales first, as for torch's unfused optimizers."""
    def run(prepare):
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if prepare:
            model, opt = mp.prepare(model, opt, level="O2", dtype=dtype, master=master)
        seen = []
        opt.register_step_pre_hook(lambda o, a, k: seen.append(torch.nn.utils.clip_grad_norm_(
            [p for g in o.param_groups for p in g["params"] if p.grad is not None], 1.0).item()))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return seen
    torch.testing.assert_close(run(True), run(False), rtol=2e-2, atol=0)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_add_param_group_takes_named_parameters_as_torch_does(kind):
    """``add_param_group({"params": list(m.named_parameters())})`` (torch >= 2.6 keeps the
    names) crashed: fp32 masters refused a tuple, the compact ones read it as a tensor."""
    model = net()
    model, opt = mp.prepare(model, torch.optim.SGD(model.named_parameters(), lr=1e-2),
                            level="O2", dtype="bf16", master=kind[0])
    torch.manual_seed(1)
    new = nn.Linear(4, 4).to(torch.bfloat16)
    before = new.weight.detach().clone()
    opt.add_param_group({"params": list(new.named_parameters()), "lr": 0.5})
    assert opt.param_groups[-1]["param_names"] == ["weight", "bias"]
    new(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    expected = before.float() - 0.5 * torch.full((4, 4), 2.0)  # SGD: d(sum)/dW = 2 per entry
    torch.testing.assert_close(new.weight.float(), expected, rtol=0, atol=2e-2)
    with pytest.raises(ValueError, match="names are missing"):
        opt.add_param_group({"params": [("a", nn.Parameter(torch.ones(1))),
                                        nn.Parameter(torch.ones(1))]})


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_a_copy_of_an_optimizer_with_a_scheduler_steps_itself(kind):
    """An LR scheduler sets a wrapper of ``step`` bound to its optimizer on the instance: a
    deep copy kept it, so the copy's ``step()`` stepped the original (and pickle refused the
    optimizer). torch's pickling drops it; so does the wrapper's."""
    import pickle

    model, opt, _ = make(kind)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    model2, opt2 = copy.deepcopy((model, opt))
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model2).backward()
    opt2.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert any(not torch.equal(p, b) for p, b in zip(model2.parameters(), before))
    assert len(opt2.state) > 0 and len(opt.state) == 0
    pickle.loads(pickle.dumps((model, opt)))


@pytest.mark.parametrize("where", ["before step", "in a pre-hook"])
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_a_gradient_set_to_none_in_param_groups_is_not_stepped(kind, where):
    """torch steps only the parameters with a gradient: ``p.grad = None`` on a tensor of
    ``param_groups`` (a master, with fp32 masters) was ignored, the master's gradient read again
    from its model parameter's, and the weight moved. The master's gradient is the model's:
    setting it to None clears both (so the user's optimizer's own ``zero_grad()`` clears the
    model's gradients too)."""
    model, opt, user = make(kind, cls=torch.optim.SGD)
    first = opt.param_groups[0]["params"][0]

    def drop(o, args, kwargs):
        o.param_groups[0]["params"][0].grad = None

    if where == "in a pre-hook":
        opt.register_step_pre_hook(drop)
    weight = model[0].weight.detach().clone()
    other = model[3].weight.detach().clone()
    loss_of(model).backward()
    if where == "before step":
        first.grad = None
        assert first.grad is None and model[0].weight.grad is None
    opt.step()
    assert torch.equal(model[0].weight, weight)
    assert not torch.equal(model[3].weight, other)
    loss_of(model).backward()
    user.zero_grad()  # the optimizer given to prepare: its groups hold the same tensors
    assert all(p.grad is None for p in model.parameters() if p.dtype == torch.bfloat16)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_state_is_read_by_the_model_parameter_as_on_a_torch_optimizer(kind):
    """``optimizer.state[model_param]`` (logging a moment, as for any torch optimizer) gave
    ``{}`` with fp32 masters, whose state is keyed by the masters, and left that empty entry
    behind: the next ``state_dict()`` failed with a bare ``KeyError``. The model parameter now
    reads its master's entry, after a load, a deep copy and pickle too."""
    import pickle

    model, opt, _ = make(kind)
    loss_of(model).backward()
    opt.step()
    expected = {"exp_avg", "exp_avg_sq", "step"}
    assert expected <= set(opt.state[model[0].weight])
    opt.load_state_dict(opt.state_dict())
    for m, o in [(model, opt), copy.deepcopy((model, opt)),
                 pickle.loads(pickle.dumps((model, opt)))]:
        entry = o.state[m[0].weight]
        assert expected <= set(entry) and entry["exp_avg"].shape == m[0].weight.shape
        o.state_dict()
    assert len(opt.state) == 6  # one entry a parameter: no empty one keyed by a model weight



def _sgd_prepared(master):
    model = net()
    return mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level="O2",
                      dtype="bf16", master=master)


def _train(model, opt, steps):
    for i in steps:
        loss_of(model, i).backward()
        opt.step()
        opt.zero_grad()

def test_stochastic_rounding_with_sgd_saves_its_generator():
    """Stochastic rounding with SGD without momentum: torch keeps no state, and the rounding
    generator's state had no entry to travel in (``state_dict()["state"]`` was empty), so a
    resumed run rounded from the default seed again (weights 4e-3 apart after 2 steps)."""
    def fresh():
        return _sgd_prepared("stochastic")

    train = _train
    model, opt = fresh()
    train(model, opt, range(3))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert any("rounding_generator" in entry for entry in saved[1]["state"].values())
    train(model, opt, range(3, 5))
    resumed, ropt = fresh()
    resumed.load_state_dict(saved[0])
    ropt.load_state_dict(saved[1])
    train(resumed, ropt, range(3, 5))
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("how", ["state", "param_groups"])
@pytest.mark.parametrize("master", ["fp32", "split", "kahan"])
def test_state_and_param_groups_assigned_anew_are_stepped(master, how):
    """``opt.state = defaultdict(dict)`` (resetting the moments) and ``opt.param_groups = [...]``
    were ignored: the inner optimizer kept stepping its own objects (the run equalled one
    without the reassignment). Compared with torch's AdamW on the fp32 weights, fed the same
    (bf16-exact) gradients."""
    from collections import defaultdict

    def run(prepared):
        model = net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if prepared:
            model, opt = mp.prepare(model, opt, level="O2", dtype="bf16", master=master)
        g = torch.Generator().manual_seed(9)
        for i in range(6):
            if i == 3 and how == "state":
                opt.state = defaultdict(dict)
            elif i == 3:
                opt.param_groups = [dict(group, lr=group["lr"] * 10) for group in opt.param_groups]
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16).to(p.dtype)
            opt.step()
            opt.zero_grad()
        return dict(mp.fp32_state_dict(model, opt) if prepared else model.state_dict())

    tol = {"fp32": 1e-6, "split": 1e-6, "kahan": 1e-4}[master]
    torch.testing.assert_close(run(True), run(False), rtol=0, atol=tol)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("master", ["fp32", "split", "kahan"])
def test_a_model_copied_with_its_optimizer_saves_the_copied_masters(master, how):
    """After ``copy.deepcopy((model, opt))`` (or pickle) and training the copies, the copied
    model's ``state_dict()`` held its fp32 shadows from copy time, the weights' upcasts since
    (1e-3 from the copied optimizer's masters). Its parameters are stepped by the copied
    optimizer: its masters are the companions again. A model copied alone keeps its shadows."""
    import pickle

    model, opt, _ = make((master, "fp32"), cls=torch.optim.AdamW)
    loss_of(model).backward()
    opt.step()
    opt.zero_grad()
    ema = copy.deepcopy(model)  # alone: a snapshot, nothing steps it
    snapshot = {k: v.clone() for k, v in ema.state_dict().items()}
    model2, opt2 = (copy.deepcopy((model, opt)) if how == "deepcopy"
                    else pickle.loads(pickle.dumps((model, opt))))
    for i in (1, 2):
        loss_of(model2, i).backward()
        opt2.step()
        opt2.zero_grad()
    torch.testing.assert_close(model2.state_dict(), dict(mp.fp32_state_dict(model2, opt2)),
                               rtol=0, atol=0)
    torch.testing.assert_close(ema.state_dict(), snapshot, rtol=0, atol=0)


def test_fp32_masters_hold_no_fp32_gradient_after_the_step():
    """bf16 moments with SGD without momentum: the step placed the rounding generator's state
    by reading the first master's ``.grad``, which made (and kept) an fp32 copy of it until
    ``zero_grad``: 5.4 instead of 2 B/param of gradients after the step."""
    from mixprec.optim.params import held_grad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3), level="O2",
                            dtype="bf16", master="fp32", state_dtype="bf16")
    model(torch.randn(8, 32)).float().pow(2).mean().backward()
    opt.step()
    assert all(held_grad(m) is None for m in opt.masters_by_param().values())
    assert mp.bytes_per_parameter(model, opt)["gradients"] == pytest.approx(2.0)


@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_only_the_weights_written_since_the_last_step_are_checked(master, monkeypatch):
    """The check that follows writes made outside the step reads version counters; the
    elementwise comparison runs for a weight written since, not for every weight, and not on
    the first step (a 42M-parameter model's first step took 3.0 s instead of 1.3 s when it
    compared every weight with its master)."""
    import mixprec.optim.writes as writes_module
    from mixprec.optim.writes import rounds_to

    compared = []

    def counting(value, low):
        compared.append(tuple(low.shape))
        return rounds_to(value, low)

    monkeypatch.setattr(writes_module, "rounds_to", counting)
    model, opt = _stepped(master)  # (the first step)
    assert compared == []
    with torch.no_grad():
        model[3].weight.clamp_(-0.1, 0.1)
    _zero_step(model, opt)
    assert compared == [(4, 16)]
    _zero_step(model, opt)
    assert compared == [(4, 16)]


@pytest.mark.parametrize("master", ["split", "kahan", "stochastic"])
def test_a_learned_scalar_steps_with_bf16_moments(master):
    """A 0-d bf16 parameter (a learned temperature) with bf16 moments and AdamW crashed in
    torch's fused kernel ("expected scalar type Float but found BFloat16"): its 0-d moments were
    taken for scalars, not widened. Its update is AdamW's on fp32 (to rounding)."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.temp = nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.lin(x) * self.temp

    torch.manual_seed(0)
    model = Scaled()
    reference = torch.tensor(1.5, requires_grad=True)
    ref_opt = torch.optim.AdamW([reference], lr=1e-2)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level="O2",
                            dtype="bf16", master=master, state_dtype="bf16")
    for _ in range(3):
        model.temp.grad = torch.tensor(0.5, dtype=torch.bfloat16)
        reference.grad = torch.tensor(0.5)
        for p in model.lin.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        ref_opt.step()
    ulps = 3 if master == "stochastic" else 1  # (each step rounds stochastically: a walk)
    torch.testing.assert_close(model.temp.float(), reference.detach(), rtol=0,
                               atol=ulps * 2 ** -7)
    assert model.temp.float().item() < 1.5 - 2e-2


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
def test_fp32_masters_with_bf16_moments_step_a_strided_tensor_alone(optimizer):
    """A channels_last conv weight alone in its bucket (``bucket_mb`` small) with bf16 moments
    crashed the cached lists ("expected scalar type Float but found BFloat16"): its moments are
    not widened there, and the check that sends such a bucket through the inner step read no
    widened moment as "all fp32"."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    kwargs = {"momentum": 0.9} if optimizer is torch.optim.SGD else {}
    conv, opt = mp.prepare(conv, optimizer(conv.parameters(), lr=1e-2, **kwargs), level="O2",
                           dtype="bf16", state_dtype="bf16")
    opt.bucket_mb = 1e-4
    before = conv.weight.detach().clone()
    for _ in range(3):
        conv(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).float().sum(
        ).backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(conv.weight, before) and torch.isfinite(conv.weight).all()


@pytest.mark.parametrize("master", ["split", "kahan"])
def test_an_fp32_masters_state_dict_is_refused_by_a_compact_optimizer(master):
    """It loaded and dropped the saved fp32 masters (the values fell back to the 16-bit
    weights, 6e-3 off); the reverse load was refused already."""
    model, opt, _ = make(("fp32", "fp32"))
    loss_of(model).backward()
    opt.step()
    saved = opt.state_dict()
    other, other_opt, _ = make((master, "fp32"))
    before = copy.deepcopy(other_opt.state_dict())
    with pytest.raises(ValueError, match="holds fp32 masters"):
        other_opt.load_state_dict(saved)
    assert other_opt.state_dict().keys() == before.keys()


@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_a_write_through_data_is_taken_at_state_dict(master):
    """``w.data.clamp_()`` moves no version counter: with fp32 masters ``state_dict()`` took the
    weight for an edited master and wrote the old master over it (the clamp lost); Kahan kept a
    compensation as large as the old weight's. ``state_dict()`` compares every pair."""
    model, opt = _stepped(master)
    c = 2.0 ** -4
    for p in model.parameters():
        p.data.clamp_(-c, c)
    values = model.state_dict()
    assert max(p.abs().max().item() for p in model.parameters()) <= c
    ulp_half = c * torch.finfo(torch.bfloat16).eps / 2
    assert max(v.abs().max().item() for v in values.values()) <= c + (
        ulp_half if master == "kahan" else 0)


def test_a_weight_written_in_the_closure_is_kept_by_fp32_masters():
    """The step looked for written weights before running its closure: one the closure wrote
    was overwritten by the old master."""
    model, opt = _stepped("fp32")
    for group in opt.param_groups:
        group["lr"] = 0.0

    def closure():
        with torch.no_grad():
            model[0].weight.fill_(0.25)
        loss = loss_of(model)
        loss.backward()
        return loss

    opt.step(closure)
    assert torch.equal(model[0].weight, torch.full_like(model[0].weight, 0.25))


@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_torch_save_of_an_optimizer_after_a_step_loads(master, tmp_path):
    """``torch.save(opt)`` after a step wrote the step's scratch, views of a storage released
    to 0 bytes: loading raised "Trying to resize storage that is not resizable". And the copied
    model's shadows were the copied masters themselves (a detached master shares its storage):
    a shadow taking its stepped weight wrote the 16-bit value into the master."""
    model, opt = _stepped(master)
    torch.save((model, opt), tmp_path / "both.pt")
    model2, opt2 = torch.load(tmp_path / "both.pt", weights_only=False)
    _zero_step(model2, opt2)
    torch.testing.assert_close(dict(mp.fp32_state_dict(model2, opt2)),
                               dict(mp.fp32_state_dict(model, opt)), rtol=0, atol=0)


@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_a_checkpoint_taken_after_a_cleared_state_keeps_the_rounding_generator(master):
    """The rounding generator's state lives in the optimizer state: after ``state.clear()`` a
    checkpoint taken before the next step held none, and the resumed run rounded otherwise."""
    def fresh():
        return _sgd_prepared(master)

    train = _train
    model, opt = fresh()
    train(model, opt, range(2))
    opt.state.clear()
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    train(model, opt, range(2, 4))
    resumed, ropt = fresh()
    resumed.load_state_dict(saved[0])
    ropt.load_state_dict(saved[1])
    train(resumed, ropt, range(2, 4))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))


def test_state_set_deleted_or_popped_by_the_model_parameter():
    """``opt.state[w] = {}`` (resetting one layer's moments, as on a torch optimizer) made an
    entry keyed by the model parameter that broke ``state_dict()``; ``del``/``pop`` raised."""
    model, opt = _stepped("fp32")
    w = model[0].weight
    opt.state[w] = {}
    assert opt.state[w] == {}
    opt.state_dict()
    del opt.state[w]
    opt.state[w]["x"] = torch.zeros(1)
    assert opt.state.pop(w) == {"x": torch.zeros(1)}
    opt.state_dict()


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_state_is_a_mapping_by_the_model_parameter(kind):
    """``p in opt.state``, ``get``, ``setdefault`` and ``update`` by a model parameter read and
    write its entry, as on a torch optimizer (with fp32 masters, ``in`` was False, ``get``
    None, ``setdefault`` made a stray entry that broke ``state_dict()`` with a bare
    ``KeyError``, and ``update`` a moment reset that the step never saw)."""
    model, opt, _ = make(kind)
    train(model, opt, steps=1)
    w = model[0].weight
    assert w in opt.state and opt.state.get(w) is opt.state[w]
    assert opt.state.setdefault(w, {}) is opt.state[w]
    assert len(opt.state) == 6
    opt.state.update({w: {k: torch.zeros_like(v) if k.startswith("exp_avg") else v
                          for k, v in opt.state[w].items()}})
    assert float(opt.state[w]["exp_avg"].abs().sum()) == 0.0 and len(opt.state) == 6
    opt.state_dict()
    train(model, opt, steps=1, start=1)
    assert opt.state[w]["exp_avg"].abs().sum() > 0


@pytest.mark.parametrize("kind", STATE_KINDS, ids=STATE_KIND_IDS)
def test_a_load_pre_hook_registered_after_prepare_may_return_a_new_state_dict(kind):
    """torch loads the state dict a pre-hook returns: mixprec's own pre-hooks read that one
    (they ran before a hook registered after ``prepare`` and restored the moments it had
    replaced)."""
    model, opt, _ = make(kind)
    train(model, opt, steps=2)
    sd = opt.state_dict()

    def zero_moments(optimizer, state_dict):
        new = copy.deepcopy(state_dict)
        for entry in new["state"].values():
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = torch.zeros_like(entry[key])
        return new
    fresh_model, fresh, _ = make(kind)
    fresh.register_load_state_dict_pre_hook(zero_moments)
    fresh.load_state_dict(sd)
    for p in fresh_model.parameters():
        assert float(fresh.state[p]["exp_avg"].abs().sum()) == 0.0
        assert float(fresh.state[p]["exp_avg_sq"].abs().sum()) == 0.0
    assert float(sd["state"][0]["exp_avg"].abs().sum()) > 0  # the caller's dict is untouched


@pytest.mark.parametrize("master", MASTERS)
def test_a_parameter_removed_from_its_group_is_no_longer_stepped(master):
    """``opt.param_groups[0]["params"].pop(0)`` (as on a torch optimizer): the next step leaves
    that weight alone (it stepped it from the layout cached before; with split's step on the
    device it raised that it could not take the overflow flag), the others step."""
    amp = mp.MixedPrecision(level="O2", dtype="bf16", master=master)
    model = net()
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for i in range(2):
        amp.backward(loss_of(model, i))
        amp.step(opt)
        opt.zero_grad()
    opt.param_groups[0]["params"].pop(0)
    before = [p.detach().clone() for p in model.parameters()]
    amp.backward(loss_of(model, 2))
    assert amp.step(opt) is True
    after = list(model.parameters())
    assert torch.equal(before[0], after[0])
    assert not torch.equal(before[-1], after[-1])


@pytest.mark.parametrize("master", MASTERS)
def test_a_state_dict_through_a_plain_torch_optimizer_resumes_bitwise(master):
    """bf16 moments saved, loaded into torch's own AdamW over an fp32 copy of the model (which
    casts the moments and the rounding generator's bytes to float32), saved again and loaded
    into a prepared optimizer: the run resumes bit for bit (with fp32 masters the moments'
    conversion drew rounding bits after the generator was restored: 9e-5 off)."""
    kind = (master, "bf16")
    model, opt, _ = make(kind)
    train(model, opt, steps=2)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    plain = torch.optim.AdamW(net().parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(saved))
    through_torch = copy.deepcopy(plain.state_dict())
    if master in ("split", "kahan"):  # (their buffers come back float32: refused, said so)
        with pytest.raises(ValueError):
            make(kind)[1].load_state_dict(through_torch)
        return
    resumed_model, resumed, _ = make(kind)
    resumed_model.load_state_dict(saved_model)
    resumed.load_state_dict(through_torch)
    train(model, opt, steps=2, start=2)
    train(resumed_model, resumed, steps=2, start=2)
    a, b = mp.fp32_state_dict(model, opt), mp.fp32_state_dict(resumed_model, resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_state_read_before_add_param_group_moves_to_the_new_masters():
    """``opt.state[p]`` read for parameters the optimizer does not hold yet (a callback, before
    unfreezing them) makes empty entries keyed by them, as on a torch optimizer; the
    ``add_param_group`` that adds them moves those entries to their masters, and
    ``state_dict()`` holds one entry a parameter (two stray keys broke it with a bare
    ``KeyError``)."""
    model = net().to(torch.bfloat16)
    opt = mp.MasterWeightOptimizer(torch.optim.AdamW(model[0].parameters(), lr=1e-2))
    x = batch()[0].to(torch.bfloat16)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    assert [opt.state[p].get("step") for p in model[3].parameters()] == [None, None]
    opt.add_param_group({"params": list(model[3].parameters())})
    model(x).float().square().mean().backward()
    opt.step()
    assert len(opt.state) == 4 and all(isinstance(k, mp.optim.MasterParameter)
                                       for k in opt.state)
    assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3]


def test_zero_grad_is_named_in_a_profile_as_torch_names_it():
    model, opt, _ = make(("fp32", "fp32"))
    loss_of(model).backward()
    with torch.profiler.profile() as prof:
        opt.zero_grad()
    names = {e.name for e in prof.events()}
    assert "Optimizer.zero_grad#MasterWeightOptimizer.zero_grad" in names


def test_a_prepared_model_loads_under_torchs_swap_tensors_mode():
    """With ``set_swap_module_params_on_conversion(True)`` a load swaps each parameter, which
    torch refuses for a tensor with a weak reference: the owner table held one per parameter."""
    model, opt = _stepped("fp32")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(saved)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    torch.testing.assert_close(model.state_dict(), saved, rtol=0, atol=0)


@pytest.mark.parametrize("master", ["fp32", "split"])
def test_torchs_distributed_state_dict_functions_take_or_refuse_the_optimizer(master):
    """torch's get_optimizer_state_dict maps an optimizer's parameters to the model's by
    identity: fp32 masters failed inside torch with a bare ``KeyError: 0``; they are refused,
    naming what to save instead. split's optimizer steps the model's parameters: it works."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            level="O2", dtype="bf16", master=master)
    model(torch.randn(4, 8)).float().sum().backward()
    opt.step()
    if master == "fp32":
        with pytest.raises(RuntimeError, match="get_optimizer_state_dict.*optimizer.state_dict"):
            get_optimizer_state_dict(model, opt)
        assert "master_weights" in opt.state_dict()  # a plain call still saves
    else:
        saved = get_optimizer_state_dict(model, opt)
        assert sorted(saved["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
