"""The fp32-master step from lists made once: torch's fused kernel over the masters, read from
the model's gradients, bitwise as torch's own fused step on fp32 copies fed the same gradients,
through everything that changes between steps (learning rates, missing gradients, replaced
state, loaded state dicts, gradients read through ``param_groups``)."""

import contextlib
import copy

import pytest
import torch
from testmodels import KernelOps
from torch import nn

from mixprec import kernel_table
from mixprec.optim import MasterWeightOptimizer

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
}


def pair(name, seed=0):
    """A bf16 model (two groups, one holding an fp32 norm) in a master optimizer, and fp32
    copies of its values in torch's fused optimizer: the reference."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    model[:2].to(torch.bfloat16)
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5e-2}]  # noqa: E731
    opt = MasterWeightOptimizer(OPTIMIZERS[name](groups(list(model.parameters()))))
    ref_opt = OPTIMIZERS[name](groups(ref))
    for g in ref_opt.param_groups:
        g["fused"], g["foreach"] = True, False
    return model, opt, ref, ref_opt


def give_grads(model, ref, seed, skip=()):
    """The same gradients on both sides: bf16 (fp32 for the norm) on the model, their fp32
    values on the reference; parameters at ``skip`` get none."""
    g = torch.Generator().manual_seed(seed)
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        if i in skip:
            p.grad = r.grad = None
            continue
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        r.grad = p.grad.float().clone()  # its own tensor, also for the fp32 norm


def assert_bitwise(model, opt, ref):
    for p, r in zip(model.parameters(), ref):
        assert torch.equal(opt.master_param(p), r.detach())
        assert torch.equal(p.detach(), r.detach().to(p.dtype))  # torch's cast


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_steps_are_torchs_fused_step_on_fp32_copies_bitwise(name):
    model, opt, ref, ref_opt = pair(name)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for step in range(6):
        give_grads(model, ref, step, skip=(1,) if step == 3 else ())  # a bias sits one out
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        assert_bitwise(model, opt, ref)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_state_replaced_or_loaded_between_steps_is_the_state_stepped():
    model, opt, ref, ref_opt = pair("adamw")
    for step in range(2):
        give_grads(model, ref, step)
        opt.step()
        ref_opt.step()
    w = model[0].weight
    fresh = torch.full_like(opt.master_param(w), 0.01)
    opt.state[opt.master_param(w)]["exp_avg"] = fresh
    ref_opt.state[ref[0]]["exp_avg"] = fresh.clone()
    give_grads(model, ref, 2)
    opt.step()
    ref_opt.step()
    assert_bitwise(model, opt, ref)
    # a state dict from before (another object's tensors) loaded into both
    saved, ref_saved = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref_opt.state_dict())
    give_grads(model, ref, 3)
    opt.step()
    ref_opt.step()
    opt.load_state_dict(saved)
    ref_opt.load_state_dict(ref_saved)
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref):
            r.copy_(opt.master_param(p))
    for step in (4, 5):
        give_grads(model, ref, step)
        opt.step()
        ref_opt.step()
        assert_bitwise(model, opt, ref)


def test_a_schedule_after_load_state_dict_reaches_the_step():
    """load_state_dict makes new param-group dicts: the learning rate a scheduler sets in them
    afterwards is the one stepped (a cached group would keep stepping the old one)."""
    model, opt, ref, ref_opt = pair("sgd_momentum")
    for step in range(2):
        give_grads(model, ref, step)
        opt.step()
        ref_opt.step()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    ref_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.25)
    for step in range(2, 6):
        give_grads(model, ref, step)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        assert_bitwise(model, opt, ref)


def test_gradients_read_and_clipped_through_param_groups_are_what_the_step_uses():
    model, opt, ref, ref_opt = pair("adamw")
    for step in range(3):
        give_grads(model, ref, step)
        if step == 1:  # clip over the optimizer's parameters: the masters' fp32 gradients
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]],
                                           0.5)
            torch.nn.utils.clip_grad_norm_(ref, 0.5)
        opt.step()
        ref_opt.step()
        assert_bitwise(model, opt, ref)


def test_bf16_moments_are_widened_and_rounded_a_list_at_a_time():
    """With ``state_dtype="bf16"`` the moments are widened into fp32 and rounded back
    stochastically a list at a time: a step over 16 tensors runs no more ops than over 4, and
    the moments stay bf16."""
    ops = {}
    for layers in (2, 8):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]).to(torch.bfloat16)
        opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    state_dtype="bf16")
        for step in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape).to(torch.bfloat16)
            counter = KernelOps()
            with counter:
                opt.step()
        ops[layers] = counter.count
        moments = [v for s in opt.state.values() for k, v in s.items() if k.startswith("exp_avg")]
        assert len(moments) == 4 * layers and all(m.dtype == torch.bfloat16 for m in moments)
    assert ops[8] <= ops[2], ops


@contextlib.contextmanager
def lists_or_inner(monkeypatch, lists, recorded, results):
    """Inside the block the step takes the cached lists where they apply (``lists``) or never
    (the inner optimizer's step), and what ``mixprec.optim.master_lists.<recorded>`` returns is
    appended to ``results``."""
    from mixprec.optim import master_lists

    with monkeypatch.context() as m:
        if not lists:
            m.setattr(master_lists, "cached_lists_apply", lambda opt: False)
        real = getattr(master_lists, recorded)
        m.setattr(master_lists, recorded, lambda *a: results.append(real(*a)) or results[-1])
        yield


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_fp32_gradients_a_master_holds_step_on_the_lists_as_through_the_inner_step(
        state_dtype, monkeypatch):
    """Gradients unscaled into the masters (``unscale_grads_``: a scaler's unscale before a
    clip) and gradients read and clipped through the param groups (one master's only: the
    others read the model's) step on the cached lists, bitwise as through the inner step, the
    big weight (2048 elements, 256-element pieces) a slice at a time."""
    monkeypatch.setitem(kernel_table.STEP_PIECE, "cpu", 256)

    def run(lists):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 2)).to(torch.bfloat16)
        opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    state_dtype=state_dtype, bucket_mb=256 * 4 / 2 ** 20)
        ran = []
        with lists_or_inner(monkeypatch, lists, "fused_bucket", ran):
            for step in range(4):
                g = torch.Generator().manual_seed(step)
                for p in model.parameters():
                    p.grad = (torch.randn(p.shape, generator=g) * 64).to(p.dtype)
                if step % 2:  # every master holds its unscaled fp32 gradient
                    opt.unscale_grads_(torch.tensor(1 / 64))
                    masters = [p for grp in opt.param_groups for p in grp["params"]]
                    torch.nn.utils.clip_grad_norm_(masters, 1.0)
                else:  # one master's gradient read and scaled; the others read the model's
                    opt.master_param(model[1].weight).grad.mul_(0.5)
                opt.step()
        return model, opt, ran

    (fm, fo, fran), (gm, go, gran) = run(True), run(False)
    assert fran and all(fran) and not gran  # every bucket on the lists; never without them
    for p, q in zip(fm.parameters(), gm.parameters()):
        assert torch.equal(p, q) and torch.equal(fo.master_param(p), go.master_param(q))
        for key, value in fo.state[fo.master_param(p)].items():
            assert torch.equal(value, go.state[go.master_param(q)][key]), key


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_bf16_moments_step_on_the_lists_as_through_the_inner_step(name, monkeypatch):
    """``state_dtype="bf16"``: steps run on the cached lists (the bucket's moments widened into
    fp32, torch's fused kernel, rounded back with the inner step's keys; from the first step),
    bitwise as the inner optimizer's own step does them (missing gradients and a scheduler
    between steps), and they do run there."""
    def run(lists):
        model, _, ref, _ = pair(name)
        opt = MasterWeightOptimizer(OPTIMIZERS[name]([{"params": list(model.parameters())[:2]},
                                                      {"params": list(model.parameters())[2:],
                                                       "lr": 0.5e-2}]), state_dtype="bf16")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        ran = []
        with lists_or_inner(monkeypatch, lists, "fused_bucket", ran):
            for step in range(5):
                give_grads(model, ref, step, skip=(1,) if step == 3 else ())
                opt.step()
                sched.step()
        return model, opt, ran

    (fm, fo, fran), (gm, go, gran) = run(True), run(False)
    # Adam's state is made before its first step, which runs on the lists; SGD's first step
    # makes its momentum buffers there as torch's fused step makes them
    assert fran == [True] * 5 and not gran
    for p, q in zip(fm.parameters(), gm.parameters()):
        assert torch.equal(p, q) and torch.equal(fo.master_param(p), go.master_param(q))
        for key, value in fo.state[fo.master_param(p)].items():
            other = go.state[go.master_param(q)][key]
            assert value.dtype == other.dtype and torch.equal(value, other), key
        assert fo.state[fo.master_param(p)]["exp_avg" if name == "adamw"
                                            else "momentum_buffer"].dtype == torch.bfloat16


class _Made(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtypes of the tensors made by ``zeros_like`` inside the block."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.zeros_like.default:
            self.dtypes.append(out.dtype)
        return out


@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_first_step_makes_bf16_moments_once_in_bf16(amsgrad):
    """``state_dtype="bf16"`` with Adam/AdamW on torch's fused kernel: the first step makes each
    moment once, in bf16, laid out as its master (torch's step would make it in fp32 for every
    tensor, to be rounded into a new bf16 tensor), with torch's fused-step ``step`` (a float32
    zero on the device before the step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=amsgrad),
                                state_dtype="bf16")
    for p in model.parameters():
        p.grad = torch.randn(p.shape).to(torch.bfloat16)
    with _Made() as made:
        opt.step()
    assert made.dtypes == [torch.bfloat16] * (3 if amsgrad else 2) * 4
    for p in model.parameters():
        state = opt.state[opt.master_param(p)]
        assert state["step"].dtype == torch.float32 and float(state["step"]) == 1.0
        assert list(state)[:3] == ["step", "exp_avg", "exp_avg_sq"]
        assert all(state[k].dtype == torch.bfloat16 for k in state if k.endswith("avg_sq"))


@pytest.mark.parametrize("name,state_dtype", [("adamw", "fp32"), ("adamw", "bf16"),
                                              ("sgd_momentum", "fp32"), ("sgd_momentum", "bf16")])
def test_a_tensor_larger_than_a_piece_steps_a_slice_at_a_time_bitwise(name, state_dtype,
                                                                      monkeypatch):
    """A master of 2048 elements with 256-element pieces: on the lists it steps a slice at a
    time through scratch of one slice (and its widened moments), bitwise as the inner step
    steps it whole (a scheduler, a step with a loss scale folded into the kernel)."""
    monkeypatch.setitem(kernel_table.STEP_PIECE, "cpu", 256)

    def run(lists):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 2)).to(torch.bfloat16)
        opt = MasterWeightOptimizer(OPTIMIZERS[name](model.parameters()),
                                    state_dtype=state_dtype, bucket_mb=256 * 4 / 2 ** 20)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        sliced = []
        with lists_or_inner(monkeypatch, lists, "_sliced_bucket", sliced):
            for step in range(4):
                g = torch.Generator().manual_seed(step)
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
                # loss scales folded into the kernel; 3 makes the first step's quotients (SGD's
                # first momentum buffers) round
                scale = {0: torch.tensor(3.0), 2: torch.tensor(8.0)}.get(step)
                if scale is not None:
                    for p in model.parameters():
                        p.grad.mul_(scale)
                opt.step(grad_scale=scale)
                sched.step()
        return model, opt, sliced

    (fm, fo, fs), (gm, go, gs) = run(True), run(False)
    # the big weight's bucket stepped in slices on the lists, SGD's first step (which makes the
    # momentum buffers) too
    assert [r for r in fs if r is not None] == [True] * 4 and not gs
    held = sorted(t.numel() for t in fo.scratch.tensors())
    # a slice's gradient (and moments), not 2048; with bf16 moments, the small bucket's (98
    # elements) widened into the scratch too
    moments = 2 if name == "adamw" else 1
    assert held == ([98] * moments + [256 * (1 + moments)] if state_dtype == "bf16" else [256])
    for p, q in zip(fm.parameters(), gm.parameters()):
        assert torch.equal(p, q) and torch.equal(fo.master_param(p), go.master_param(q))
        for key, value in fo.state[fo.master_param(p)].items():
            assert torch.equal(value, go.state[go.master_param(q)][key]), key


def test_scratch_for_a_view_into_a_larger_tensor_has_its_strides():
    """torch's fused kernel pairs a parameter's and a gradient's elements by their place in
    memory: the fp32 scratch of a tensor laid out as a view into a larger one must have its
    strides (``empty_like`` gave it contiguous ones)."""
    from mixprec.optim.buckets import Scratch
    for view in (torch.randn(10, 20)[2:7, 3:11], torch.randn(200)[10:150:2],
                 torch.randn(4, 6).t()):
        [out] = Scratch().views([view])
        assert out.shape == view.shape and out.stride() == view.stride()
        assert out.dtype == torch.float32


def _lists(kind, n, seed, momentum=True):
    """Params, grads and state lists (per key) for ``n`` tensors of one device and dtype."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (7,), (2, 2, 4), (1,)][:n]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e-2 for s in shapes]
    if kind is torch.optim.SGD:
        return params, grads, {"momentum_buffer": [torch.randn(s, generator=g) if momentum
                                                   else None for s in shapes]}, []
    state = {k: [torch.rand(s, generator=g) for s in shapes]
             for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
    return params, grads, state, [torch.tensor(float(i + 3)) for i in range(len(shapes))]


@pytest.mark.parametrize("kind, options", [
    (torch.optim.SGD, {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "maximize": True}),
    (torch.optim.SGD, {"momentum": 0.0, "weight_decay": 1e-2}),
    (torch.optim.Adam, {"weight_decay": 1e-2, "amsgrad": True}),
    (torch.optim.AdamW, {"weight_decay": 0.1, "maximize": True}),
    (torch.optim.AdamW, {"lr": torch.tensor(2e-3)}),
])
@pytest.mark.parametrize("scaled", ["none", "scale", "scale+inf", "scale+finite"])
@pytest.mark.parametrize("first", [False, True])
def test_a_call_over_one_device_and_dtype_is_torchs_functional_step_bit_for_bit(
        kind, options, scaled, first):
    """kernels.fused_call(uniform=True) skips torch's grouping by device and dtype: from the same
    lists it gives torch's functional fused step's params, moments and step counts bitwise (an
    SGD first step makes the same buffers into the list; a found_inf takes the counts back)."""
    from mixprec.optim import kernels
    if first and kind is not torch.optim.SGD:
        pytest.skip("a first step is SGD's (Adam's state is made before its first step)")
    lr = options.get("lr", 1e-2)
    group = torch.optim.SGD([torch.zeros(1)], lr=lr) if kind is torch.optim.SGD else kind(
        [torch.zeros(1)], lr=lr)
    group = {**group.param_groups[0], **options}
    kwargs = {}
    if scaled != "none":
        kwargs["grad_scale"] = torch.tensor(64.0)
    if scaled.endswith("inf"):
        kwargs["found_inf"] = torch.tensor(1.0)
    elif scaled.endswith("finite"):
        kwargs["found_inf"] = torch.tensor(0.0)
    results = []
    for uniform in (False, True):
        params, grads, state, steps = _lists(kind, 4, seed=3, momentum=not first)
        keys = kernels.functional_keys(kind, group)
        call = kernels.fused_call(kind, group, params, grads, {k: state[k] for k in keys},
                                  steps, uniform)
        call(**kwargs)
        kept = [] if first and scaled.endswith("inf") else [t for k in keys for t in state[k]]
        results.append(params + steps + kept)  # (torch's skipped first SGD step leaves its
        # buffers empty_like: a master optimizer never skips a first step on the device)
    assert len(results[0]) == len(results[1]) > 0
    for a, b in zip(*results):
        assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["fp32", "split", "kahan"])
@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_an_fp64_parameter_beside_16_bit_ones_steps_as_torchs_adam_steps_it(kind, method,
                                                                            state_dtype):
    """An fp64 parameter held with bf16 ones: its Adam moments were made in the state dtype
    (fp32), and torch's fused kernel refused the first step ("expected scalar type Double but
    found Float"). Its moments are fp64, as torch makes them, and it steps as torch's fused Adam
    steps an fp64 parameter, bit for bit."""
    from mixprec.optim import CompactMasterOptimizer
    torch.manual_seed(0)
    low, wide = nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 4).double()
    ref = [p.detach().clone().requires_grad_() for p in wide.parameters()]
    inner = kind(list(low.parameters()) + list(wide.parameters()), lr=0.1, weight_decay=0.01)
    opt = (MasterWeightOptimizer(inner, state_dtype=state_dtype) if method == "fp32" else
           CompactMasterOptimizer(inner, method, state_dtype=state_dtype))
    ref_opt = kind(ref, lr=0.1, weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in low.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        for p, r in zip(wide.parameters(), ref):
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(wide.parameters(), ref):
        assert torch.equal(p, r)
        assert opt.state[p]["exp_avg"].dtype == torch.float64
