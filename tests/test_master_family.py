"""One optimizer arithmetic, torch's, for fp32 and compact masters (the compact step a bounded
piece at a time: mixprec/optim/family.py), the rounding of the bf16 forward weights, and the
compiled-kernel guard (mixprec/optim/guard.py).

Tolerances: none. From the same fp32 state and the same gradients ``master="split"`` steps its
masters bit for bit as ``master="fp32"`` on the default path, with tensors cut into slices too;
a tensor cut into slices steps bit for bit as a whole one (every method, rounding bits
included); the forward weights are torch's cast of the masters (fp32 masters) and equal it
except at exact ties (split: away from zero); a split model loaded from plain ``state_dict``s,
in either order, holds the saved masters and weights bit for bit and continues as the
uninterrupted run; a compiled kernel that disagrees with its eager twin is replaced by it, so
the numbers are bit for bit the eager ones. The transient memory of a compact step: under 40
bytes per piece element, whatever the size of the tensor.
"""

import copy
import gc
import io
import logging
import subprocess
import sys
import textwrap
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec as mp
from mixprec import kernel_table
from mixprec.masters.split_bits import split_of
from mixprec.optim import (
    CompactMasterOptimizer,
    MasterWeightOptimizer,
    compact_lists,
    family,
    guard,
)

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.SlowDtypeWarning")


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64),
                         nn.GELU(), nn.Linear(64, 4))


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)


def train(net, opt, steps):
    losses = []
    for i in steps:
        x, y = batch(i)
        loss = nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def prepared(master, make_opt, seed=0):
    net = mlp(seed)
    return mp.prepare(net, make_opt(net.parameters()), level="O2", dtype="bf16", master=master)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=3e-3, weight_decay=0.01),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=3e-2, momentum=0.9, nesterov=True,
                                               weight_decay=1e-4),
}


def ties(master: torch.Tensor) -> torch.Tensor:
    """Where an fp32 master lies exactly half a bf16 ulp between two bf16 weights."""
    return (master.detach().view(torch.int32) & 0xFFFF) == 0x8000


def assert_weights_of(fp32_net, split_net, masters) -> int:
    """fp32 masters' weights are torch's cast of the masters; the split's equal them except at
    exact ties, where they lie one ulp further from zero. Returns the number of ties."""
    count = 0
    for w32, w, m in zip(fp32_net.parameters(), split_net.parameters(), masters):
        m = m.detach()
        if w.dtype == torch.float32:  # kept in fp32 (a norm layer): its own master
            assert torch.equal(w, w32) and torch.equal(w32, m)
            continue
        assert torch.equal(w32.view(torch.int16), m.to(torch.bfloat16).view(torch.int16))
        tie = ties(m)
        assert torch.equal(w[~tie].view(torch.int16), w32[~tie].view(torch.int16))
        assert torch.equal(w[tie].view(torch.int16), split_of(m[tie])[0].view(torch.int16))
        assert (w[tie].float().abs() > m[tie].abs()).all()
        count += int(tie.sum())
    return count


def step_in_lockstep(nets, opts, i, scalers=None, clip=None):
    """One step of each run with the gradients of the first (bf16, so the same bits); with
    ``clip``, each scaler clips its optimizer's true gradients to that norm first."""
    x, y = batch(i)
    loss = nn.functional.mse_loss(nets[0](x).float(), y)
    (loss if scalers is None else scalers[0].scale(loss)).backward()
    for scaler in (scalers or [])[1:]:  # the copied gradients carry the same scale
        scaler.scale(loss)
    for net in nets[1:]:
        for p, q in zip(nets[0].parameters(), net.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
    for k, opt in enumerate(opts):
        if scalers is None:
            opt.step()
        else:
            if clip is not None:
                scalers[k].clip_grad_norm_(opt, clip)
            scalers[k].step(opt)
            scalers[k].update()
        opt.zero_grad()


def masters_of(net, opt):
    """Each parameter's fp32 master (an fp32 parameter is its own)."""
    held = opt.masters_by_param()
    return [held.get(p, p).detach() for p in net.parameters()]


@pytest.mark.parametrize("piece", [None, 64])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_split_steps_its_masters_bit_for_bit_as_fp32_masters_on_the_default_path(name, piece,
                                                                                   monkeypatch):
    """30 steps with the same gradients: masters bitwise equal after every step, weights equal
    except at exact ties; also with pieces of 64 elements (every tensor of the MLP cut)."""
    if piece is not None:
        monkeypatch.setitem(kernel_table.STEP_PIECE, "cpu", piece)
    (net32, opt32), (net, opt) = (prepared(m, OPTIMIZERS[name]) for m in ("fp32", "split"))
    for i in range(30):
        step_in_lockstep([net32, net], [opt32, opt], i)
        ref = masters_of(net32, opt32)
        for a, b in zip(masters_of(net, opt), ref):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert_weights_of(net32, net, ref)


@pytest.mark.parametrize("layout", ["strided gradient", "transposed weight"])
def test_a_strided_tensor_cut_into_row_slices_steps_bit_for_bit_as_fp32_masters(layout,
                                                                                monkeypatch):
    """A tensor larger than a piece whose gradient or weight is not contiguous is cut into row
    ranges: of multiples of 64 elements, torch's fused CPU kernel groups its vector loop as for
    the whole tensor (slices of 59 rows of 1100 elements: masters 1-6 ulps off fp32 masters'
    at a few elements)."""
    monkeypatch.setitem(kernel_table.STEP_PIECE, "cpu", 2 ** 16)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(100, 1100, generator=gen) * 0.1
    grads = [torch.randn(100, 1100, generator=gen).bfloat16() * 0.01 for _ in range(8)]
    runs = []
    for master in ("fp32", "split"):  # (torch's fused kernel as the default path steps)
        weight = (nn.Parameter(start.bfloat16()) if layout == "strided gradient"
                  else nn.Parameter(start.t().contiguous().bfloat16().t()))
        opt = mp.optim.wrap_optimizer(mp.masters.resolve(master),
                                       torch.optim.AdamW([weight], lr=1e-2),
                                       state_dtype=torch.float32, initial_values=None)
        for g in grads:
            weight.grad = g.t().contiguous().t() if layout == "strided gradient" else g.clone()
            opt.step()
        runs.append(opt.masters_by_param()[weight].detach())
    assert torch.equal(runs[0].view(torch.int32), runs[1].view(torch.int32))


def plant_ties(value: torch.Tensor, every: int = 3) -> torch.Tensor:
    """``value`` with the low 16 bits of every ``every``-th element set to ``0x8000``."""
    bits = value.detach().reshape(-1).view(torch.int32).clone()
    bits[::every] = (bits[::every] & ~0xFFFF) | 0x8000
    return bits.view(torch.float32).view(value.shape)


ONE_STEP = {**OPTIMIZERS, "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=3e-2, momentum=0.9)}


@pytest.mark.parametrize("name", ONE_STEP)
def test_one_step_from_the_same_state_with_ties_planted(name):
    """The same fp32 start (a third of it exact ties) and the same gradients (zero on every
    fifth element: SGD without weight decay leaves those masters on their ties): masters
    bitwise equal, weights differing only at ties."""
    gen = torch.Generator().manual_seed(0)
    start = [plant_ties(torch.randn(24, 16, generator=gen) * 0.1) for _ in range(3)]
    grads = [torch.randn(24, 16, generator=gen).bfloat16() for _ in start]
    for g in grads:
        g.view(-1)[::5] = 0
    runs = []
    for master in ("fp32", "split"):
        params = [nn.Parameter(s.bfloat16()) for s in start]
        opt = mp.optim.wrap_optimizer(mp.masters.resolve(master),
                                       ONE_STEP[name](params), state_dtype=torch.float32,
                                       initial_values={p: s.clone()
                                                       for p, s in zip(params, start)})
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        runs.append((nn.ParameterList(params), [opt.masters_by_param()[p] for p in params]))
    (net32, masters32), (net, masters) = runs
    for a, b in zip(masters, masters32):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    planted = assert_weights_of(net32, net, masters32)
    if name == "sgd-momentum":  # the planted ties under a zero gradient stayed ties
        assert planted >= sum(s.numel() // 15 for s in start)


def test_fp32_masters_write_bf16_weights_with_torchs_cast():
    """Exact ties go to even (torch's cast), at prepare and at every write-back, and the values
    written from are left as they were."""
    value = torch.tensor([1.0 + 2 ** -8, -(1.0 + 2 ** -8), 1.0 + 3 * 2 ** -8, 0.3, float("nan")])
    w = nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=0.1), initial_masters={w: value.clone()})
    assert w[:4].tolist() == [1.0, -1.0, 1.015625, value[3].bfloat16().item()] and w[4].isnan()
    assert torch.equal(opt.master_param(w).view(torch.int32)[:4], value.view(torch.int32)[:4])
    opt.master_param(w).data.copy_(value.flip(0).nan_to_num(0.5))
    opt.write_back()
    assert torch.equal(w, value.flip(0).nan_to_num(0.5).bfloat16())
    # at prepare: the weights are torch's cast of the fp32 originals
    net = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        net.weight.copy_(value[:4].view(1, 4))
    net, _ = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2",
                        dtype="bf16")
    assert net.weight[0, :2].tolist() == [1.0, -1.0]


def test_split_resumes_bit_for_bit_from_state_dicts():
    make = OPTIMIZERS["adamw"]
    net, opt = prepared("split", make)
    train(net, opt, range(20))
    half, half_opt = prepared("split", make)
    train(half, half_opt, range(10))
    buffer = io.BytesIO()
    torch.save({"model": half.state_dict(), "opt": half_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed, resumed_opt = prepared("split", make, seed=5)  # another initialisation
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    for p, q in zip(half_opt.fp32_values().values(), resumed_opt.fp32_values().values()):
        assert torch.equal(p, q)
    train(resumed, resumed_opt, range(10, 20))
    for p, q in zip(net.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(opt.fp32_values().values(), resumed_opt.fp32_values().values()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("master", ["split", "kahan"])
@pytest.mark.parametrize("order", ["model first", "optimizer first"])
def test_loads_from_plain_state_dicts_in_either_order_with_ties(order, master):
    """``model.state_dict()`` + ``optimizer.state_dict()`` saved with exact ties in the masters
    (a third of every weight), loaded into a freshly prepared model in either order: masters
    and weights bit for bit the saved ones, and 5 more steps bit for bit the uninterrupted
    run's. (Kahan's model state holds weight + compensation; loaded after the optimizer it was
    split again, to the other neighbour at a tie, and the run went 8e-5 apart.)"""
    make = OPTIMIZERS["adamw"]
    net, opt = prepared(master, make)
    train(net, opt, range(5))
    for p, value in opt.fp32_values().items():
        opt.load_fp32_(p, plant_ties(value))
    assert sum(int(ties(v).sum()) for v in opt.fp32_values().values()) > 1000
    if master == "kahan":  # each tie's weight on the other neighbour, as a compensation rounded
        with torch.no_grad():  # up to half an ulp leaves it: the same values
            for p, value in opt.fp32_values().items():
                comp = opt.compensation(p)
                at = ties(value) & (comp != 0)
                p.copy_(torch.where(at, p + 2 * comp, p))
                comp.copy_(torch.where(at, -comp, comp))
                assert torch.equal(opt.fp32_values()[p], value)
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed, resumed_opt = prepared(master, make, seed=5)  # another initialisation
    loads = [lambda: resumed.load_state_dict(saved["model"]),
             lambda: resumed_opt.load_state_dict(saved["opt"])]
    for load in (loads if order == "model first" else loads[::-1]):
        load()
    for steps in (None, range(5, 10)):
        if steps is not None:
            train(net, opt, steps)
            train(resumed, resumed_opt, steps)
        for p, q in zip(net.parameters(), resumed.parameters()):
            assert torch.equal(p.view(torch.int16) if p.dtype == torch.bfloat16 else p,
                               q.view(torch.int16) if q.dtype == torch.bfloat16 else q)
        for p, q in zip(opt.fp32_values().values(), resumed_opt.fp32_values().values()):
            assert torch.equal(p.view(torch.int32), q.view(torch.int32))


@pytest.mark.parametrize("master", ["split", "kahan"])
def test_a_plain_optimizer_state_dict_loaded_after_steps_keeps_the_buffers(master):
    """A plain torch AdamW's state dict (moments, no buffers) loaded after a step dropped the
    remainder/compensation: ``model.state_dict()`` then failed, and the next step (lr 0)
    moved the masters by half a bf16 ulp. torch's load sets the moments only: the masters
    keep their values, as fp32 masters' do, and continue as the loaded moments say."""
    make = OPTIMIZERS["adamw"]
    net, opt = prepared(master, make)
    train(net, opt, range(3))
    plain = mlp(1)
    plain_opt = make(plain.parameters())
    train(plain, plain_opt, range(2))
    saved = plain_opt.state_dict()
    saved["param_groups"][0]["lr"] = 0.0  # the next step changes nothing but the moments
    before = {p: v.clone() for p, v in opt.fp32_values().items()}
    opt.load_state_dict(saved)
    assert all(opt.compensation(p) is not None for p in before)
    net.state_dict()  # (failed on the missing buffer)
    train(net, opt, range(3, 4))
    for p, value in opt.fp32_values().items():
        assert torch.equal(value, before[p])
    for p in before:
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][key].shape == p.shape


@pytest.mark.parametrize("master", ["fp32", "split"])
@pytest.mark.parametrize("bucket_mb", [None, 1e-4])
def test_parameters_that_are_views_into_a_larger_tensor_step_as_the_reference(master,
                                                                              bucket_mb):
    """fp32 masters of parameters that are views into a larger tensor (``buf[2:7, 3:11]``,
    ``flat[10:150:2]``) kept the views' strides while their gradients are dense: torch's fused
    kernel pairs elements by their place in memory, and 27 of 40 elements stepped with other
    elements' gradients (0.02 off at lr 1e-2). Bit for bit the fp32-master reference now."""
    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Parameter(torch.randn(10, 20)[2:7, 3:11])
            self.b = nn.Parameter(torch.randn(200)[10:150:2])

        def forward(self, x):
            return x @ self.a.t() + self.b[:5]

    net = Views()
    masters = [p.detach().clone() for p in net.parameters()]
    reference = torch.optim.AdamW([nn.Parameter(m) for m in masters], lr=1e-2, fused=True)
    model, opt = mp.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2), level="O2",
                            dtype="bf16", master=master)
    opt.bucket_mb = bucket_mb  # (1e-4: a bucket, or piece, per tensor)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, 8, generator=gen)).float().square().sum().backward()
        for ref, p in zip(reference.param_groups[0]["params"], model.parameters()):
            ref.grad = p.grad.float()
        opt.step()
        reference.step()
        opt.zero_grad()
        got = mp.fp32_state_dict(model, opt)
        for name, ref in zip(("a", "b"), reference.param_groups[0]["params"]):
            assert torch.equal(got[name], ref), name
            assert torch.equal(getattr(model, name), ref.to(torch.bfloat16))


@pytest.mark.parametrize("clip", [False, True])
def test_split_steps_sparse_gradients_with_repeated_rows_as_fp32_masters(clip):
    """An embedding's sparse gradient repeats a row once per lookup; split stepped the
    uncoalesced gradient (SGD applied -lr * 1 three times, not -lr * 3 once: 1 ulp off fp32
    masters), and its unscale (a clip) summed the rows in bf16. Both sum them in fp32, as fp32
    masters do: bit for bit."""
    nets, opts, engines = [], [], []
    for master in ("fp32", "split"):
        torch.manual_seed(0)
        net = nn.Embedding(16, 8, sparse=True)
        engine = mp.MixedPrecision(level="O2", dtype="bf16", master=master)
        net, opt = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        nets.append(net), opts.append(opt), engines.append(engine)
    for rows in ([1, 1, 1, 3], [3, 7, 7, 0, 1], [5, 5, 5, 5, 5, 5, 2]):
        for net, opt, engine in zip(nets, opts, engines):
            engine.backward(net(torch.tensor(rows)).float().square().sum() * 0.37)
            if clip:  # (unscales the gradients first)
                engine.clip_grad_norm_(opt, 0.5)
            engine.step(opt)
            opt.zero_grad()
        fp32, split = (mp.fp32_state_dict(n, o)["weight"] for n, o in zip(nets, opts))
        assert torch.equal(fp32, split)


VIEW_OPS = {"aten::slice", "aten::narrow", "aten::view", "aten::as_strided", "aten::select",
            "aten::alias", "aten::split_with_sizes", "aten::split", "aten::unbind"}


def count_ops(opt, model, n_steps=1):
    gc.collect()  # (an optimizer of an earlier test finalized inside the profile hands its fp32
    gc.disable()  # values to its model with ops of its own: counted here, they were not ours)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(n_steps):
                opt.step()
    finally:
        gc.enable()
    def outer(e):  # torch's CPU foreach ops call one op per tensor inside themselves
        return e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")
    # a view is no launch (the rounding reads a slice of its noise table per tensor)
    names = [e.name for e in prof.events() if e.name.startswith("aten::") and outer(e)
             and e.name not in VIEW_OPS]
    return len(names), names.count("aten::_fused_adamw_")


@pytest.mark.parametrize("master", ["split", "kahan", "stochastic"])
def test_a_group_is_stepped_with_a_fixed_number_of_operations(master):
    """8 or 64 tensors: the same operations (one fused AdamW call), no launch per tensor."""
    counts = []
    for n in (8, 64):
        params = [nn.Parameter(torch.randn(3, 5).bfloat16()) for _ in range(n)]
        opt = CompactMasterOptimizer(torch.optim.AdamW(params, lr=1e-3), master, fused="auto",
                                     state_dtype="bf16")
        for p in params:
            p.grad = torch.randn(3, 5).bfloat16()
        opt.step()  # states made, kernels compiled and checked
        counts.append(count_ops(opt, params))
    assert counts[0] == counts[1]
    assert counts[0][1] == 1


# -- the guard ------------------------------------------------------------------------------------
def kahan_store(weight, comp, new):
    """An eager Kahan store (weight to nearest, the compensation what that lost)."""
    hi = new.to(weight.dtype)
    return hi, (new - hi.float()).to(comp.dtype)


def wrong_compiler(fn):
    """A "compiled" store that writes 4.73 times too far (what one torch's Kahan kernel did)."""
    def wrong(weight, comp, new):
        before = weight.float() + comp.float()
        return fn(weight, comp, before + (new - before) * -4.73)
    return wrong


@pytest.fixture
def fresh_verdicts():
    guard.forget_verdicts()
    yield
    guard.forget_verdicts()


def test_a_compiled_kernel_that_disagrees_falls_back_to_eager_with_one_warning(fresh_verdicts):
    weight = torch.randn(40, 30).bfloat16()
    comp = torch.zeros(40, 30, dtype=torch.bfloat16)
    news = [torch.randn(40, 30, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    expected = [kahan_store(weight, comp, new) for new in news]
    bad = guard.GuardedKernel("group store (kahan)", kahan_store, compiler=wrong_compiler)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [bad(weight, comp, new) for new in news]
    ours = [w for w in seen if issubclass(w.category, guard.CompiledKernelWarning)]
    assert len(ours) == 1
    assert "group store" in str(ours[0].message) and torch.__version__ in str(ours[0].message)
    for (w0, c0), (w1, c1) in zip(expected, got):
        assert torch.equal(w0, w1) and torch.equal(c0, c1)
    assert list(guard.verdicts().values()) == [False]


def test_a_compiled_kernel_that_agrees_is_trusted(fresh_verdicts):
    calls = []

    def counting(fn):
        def run(*args):
            calls.append(1)
            return fn(*args)
        return run

    ok = guard.GuardedKernel("double", lambda x: x.mul_(2), compiler=counting)
    x = torch.arange(1000.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ok(x)
        ok(x)
    assert torch.equal(x, torch.arange(1000.0) * 4)
    assert len(calls) == 3  # the check on a copy of the first 256 elements, then both calls
    assert list(guard.verdicts().values()) == [True]


@pytest.mark.slow  # a fresh process: imports torch, compiles a kernel
def test_the_first_compiled_step_raises_no_deprecation_warning_under_W_error():
    """torch's compiler emits its own ``torch.jit.script_method`` DeprecationWarning at the first
    compiled step; run in a fresh process with ``-W error::DeprecationWarning``."""
    code = textwrap.dedent("""
        import torch
        from torch import nn
        from mixprec.optim import MasterWeightOptimizer, compiled
        w = nn.Parameter(torch.randn(64).bfloat16())
        opt = MasterWeightOptimizer(torch.optim.AdamW([w], lr=1e-3), fused="compile")
        calls = []
        run = compiled._run
        compiled._run = lambda *a: calls.append(1) or run(*a)
        for _ in range(2):
            w.grad = torch.randn(64).bfloat16()
            opt.step()
        print("stepped", len(calls))
    """)
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stepped" in done.stdout and "stepped 0" not in done.stdout  # a compiled kernel ran


@pytest.mark.parametrize("clip", [None, 0.05])
def test_fp32_masters_and_split_agree_through_a_loss_scale_and_a_clip(clip):
    """A static loss scale of 2**10 (the step reads gradients x 2**-10), and a clip to a norm
    of 0.05 folded into it (what ``amp.step(max_grad_norm=)`` does), the same gradients: torch's
    fused kernel divides by the scale for both, so the masters are bitwise equal and the
    weights equal except at exact ties."""
    (net32, opt32), (net, opt) = (prepared(m, OPTIMIZERS["adamw"]) for m in ("fp32", "split"))
    scalers = [mp.StaticLossScaler(2.0 ** 10) for _ in range(2)]
    for i in range(5):
        step_in_lockstep([net32, net], [opt32, opt], i, scalers, clip)
    ref = masters_of(net32, opt32)
    for a, b in zip(masters_of(net, opt), ref):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert_weights_of(net32, net, ref)


@pytest.mark.parametrize("fused", ["auto", "compile", False])
@pytest.mark.parametrize("master", ["split", "kahan", "stochastic"])
def test_a_compact_step_compiles_nothing(master, fused, fresh_verdicts, monkeypatch):
    """torch's step between eager load and store passes, whatever ``fused`` says (a first step
    costs what a later one does, not seconds of compilation)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a compact step compiled something")

    monkeypatch.setattr(torch, "compile", refuse)
    params = [nn.Parameter(torch.randn(6, 5).bfloat16()) for _ in range(3)]
    opt = CompactMasterOptimizer(torch.optim.AdamW(params, lr=1e-3), master, fused=fused)
    for p in params:
        p.grad = torch.randn(6, 5).bfloat16()
    opt.step()
    assert guard.verdicts() == {}


def test_a_compile_is_logged_once_with_what_and_how_long(fresh_verdicts, caplog):
    kernel = guard.GuardedKernel("double", lambda x: x.mul_(2), compiler=lambda fn: fn)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        kernel(torch.ones(8))
        kernel(torch.ones(8))
        kernel(torch.ones(8, dtype=torch.float64))
    said = [r.getMessage() for r in caplog.records
            if "compiled the 'double' kernel" in r.getMessage()]
    assert len(said) == 2  # once per signature
    assert "cpu" in said[0] and "torch.float32" in said[0] and " s (once per process)" in said[0]


SIZES = [(40, 30), (7,), (64, 64), (3, 3), (101,), (5, 300), (64, 40), (128, 3)]


def cut_run(master, dtype, state_dtype, make, piece, monkeypatch):
    """3 steps of 8 tensors (the last two transposed: cut by rows, and by ranges of a row) with
    pieces of ``piece`` elements; a NaN planted in a weight before the last. Returns the 16-bit
    weights, buffers, moments and step counts (as int16 / fp32 bits), and the elements of each piece
    stepped."""
    monkeypatch.setitem(kernel_table.STEP_PIECE, "cpu", piece)
    stepped = []
    real = family._step_piece
    monkeypatch.setattr(family, "_step_piece", lambda opt, piece, *a, **k: (
        piece and stepped.append(sum(s.numel for s in piece))) or real(opt, piece, *a, **k))
    listed = compact_lists._Piece.step  # the steps after the first: on the cached lists
    monkeypatch.setattr(compact_lists._Piece, "step", lambda self, *a: stepped.append(
        sum(s.numel for s in self.slices)) or listed(self, *a))
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SIZES]
    params[-2:] = [nn.Parameter(p.detach().t()) for p in params[-2:]]  # not contiguous
    opt = CompactMasterOptimizer(make(params), master, state_dtype=state_dtype)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        if step == 2:
            params[1].data[3] = float("nan")
        opt.step()
    monkeypatch.undo()
    held = [p.detach().clone() for p in params]
    for p in params:
        held += [v.clone() for v in opt.state[p].values() if torch.is_tensor(v)]
    return held, stepped


CUT = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
       "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
       "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True, momentum=0.5)}


@pytest.mark.parametrize("name", CUT)
@pytest.mark.parametrize("master,dtype,state_dtype", [
    ("split", torch.bfloat16, "fp32"), ("kahan", torch.bfloat16, "bf16"),
    ("kahan", torch.float16, "bf16"), ("stochastic", torch.bfloat16, "bf16")])
def test_tensors_larger_than_a_piece_step_bit_for_bit_as_whole_ones(master, dtype, state_dtype,
                                                                     name, monkeypatch):
    """Pieces of 64 elements (tensors cut into slices: ranges of the flat tensor, strided rows,
    ranges of a strided row) against one piece: weights, buffers, moments and step counts bit for
    bit (each element draws its own rounding bits wherever it lies; a NaN weight stays NaN)."""
    whole, one = cut_run(master, dtype, state_dtype, CUT[name], 1 << 20, monkeypatch)
    cut, many = cut_run(master, dtype, state_dtype, CUT[name], 64, monkeypatch)
    assert len(one) == 3 and max(many) <= 64 and len(many) > 3 * 100
    assert len(whole) == len(cut)
    assert whole[1][3].isnan()
    for a, b in zip(whole, cut):
        assert a.dtype == b.dtype and a.shape == b.shape
        nan = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
        assert torch.equal(nan, b.isnan() if b.is_floating_point() else nan)
        assert torch.equal(a[~nan], b[~nan])


class TransientPeak(TorchDispatchMode):
    """The most bytes of storages made by ops inside the block alive at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _freed(self, size):
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(t, torch.Tensor) and func._schema.returns[0].alias_info is None:
                    storage = t.untyped_storage()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, storage.nbytes())
        return out


@pytest.mark.parametrize("master,state_dtype", [("split", "fp32"), ("kahan", "bf16"),
                                                ("stochastic", "bf16")])
def test_the_transient_memory_of_a_step_is_bounded_by_the_piece(master, state_dtype,
                                                                 monkeypatch):
    """One big tensor (16 or 64 pieces of 1024 elements) beside a small one, AdamW, the third
    step: the storages the step makes and frees peak at under 40 bytes per piece element
    (rounding bits, temporaries), whatever the tensor's size, and the scratch the optimizer keeps
    (fp32 values, gradients, widened moments) is one piece's, whatever the tensor's size."""
    monkeypatch.setitem(kernel_table.STEP_PIECE, "cpu", 1024)
    peaks, kept = [], []
    for rows in (16, 64):
        params = [nn.Parameter(torch.randn(rows, 1024).bfloat16()),
                  nn.Parameter(torch.randn(10).bfloat16())]
        opt = CompactMasterOptimizer(torch.optim.AdamW(params, lr=1e-3), master,
                                     state_dtype=state_dtype)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape).bfloat16()
            if step < 2:
                opt.step()
        with TransientPeak() as counted:
            opt.step()
        peaks.append(counted.peak)
        kept.append(sum(t.numel() for t in opt.held_tensors()["scratch"]))
    assert max(peaks) < 40 * 1024
    assert peaks[1] <= peaks[0] + 1024  # no part that grows with the tensor
    # the step scratch: values, gradients (and two widened bf16 moments), a piece each
    assert kept[0] == kept[1] == (2 if state_dtype == "fp32" else 4) * 1024


def test_copies_of_the_inputs_are_checked_not_the_inputs(fresh_verdicts):
    kernel = guard.GuardedKernel("add one", lambda x: x.add_(1), compiler=lambda fn: fn)
    x = torch.zeros(300)
    kernel(x)
    assert torch.equal(x, torch.ones(300))
    assert copy.copy(guard.verdicts()) == {("add one", "cpu", (torch.float32,)): True}


def test_masters_optimizer_is_unchanged_for_fp16():
    """fp16 weights: torch's cast too (the split holds bf16 only)."""
    value = torch.tensor([1.0 + 2 ** -11])  # an exact fp16 tie
    w = nn.Parameter(torch.ones(1, dtype=torch.float16))
    opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=1.0), initial_masters={w: value})
    assert w.item() == 1.0 and opt.master_param(w).item() == value.item()


@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_kahan_and_stochastic_group_updates_track_an_fp32_reference(master):
    """The default (group) path against torch's AdamW on fp32 weights, 30 steps with the same
    gradients, 12 tensors of values around 0.1 (the steps move them by up to 0.09), each
    element within, relative to the tensor's largest value m: Kahan 2^-14 m (its pair holds about
    16 bits), stochastic 4 sqrt(30) bf16 eps m (a random walk of one-ulp roundings); a kernel
    applying -4.73 times the update would be 0.5 off."""
    steps, lr = 30, 3e-3
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(16, 8, generator=gen) * 0.1 for _ in range(12)]
    low = [nn.Parameter(s.bfloat16()) for s in start]
    opt = CompactMasterOptimizer(torch.optim.AdamW(low, lr=lr), master,
                                 initial_values=dict(zip(low, start)))
    ref = [nn.Parameter(opt.fp32_values()[p].clone()) for p in low]
    ref_opt = torch.optim.AdamW(ref, lr=lr, foreach=False)
    for _ in range(steps):
        grads = [torch.randn(16, 8, generator=gen).bfloat16() for _ in low]
        for p, r, g in zip(low, ref, grads):
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
    eps = torch.finfo(torch.bfloat16).eps
    factor = 2.0 ** -14 if master == "kahan" else 4 * steps ** 0.5 * eps
    values = opt.fp32_values()
    for p, r in zip(low, ref):
        scale = r.detach().abs().max().item()
        torch.testing.assert_close(values[p], r.detach(), rtol=0, atol=factor * scale)


class _NoneMarked(torch.optim.Optimizer):
    """SGD with momentum marking its state made with a None entry (as optimi's optimizers keep
    ``"kahan_comp": None`` for fp32 parameters, and make their moments again where it lacks)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "made" not in state:
                    state["buf"], state["made"] = torch.zeros_like(p), None
                state["buf"].mul_(0.9).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


def test_a_state_entry_of_none_survives_the_compact_step():
    """The compact step dropped a state entry whose value is None (it compared the value with
    the entry it had not swapped in, None): optimi's AdamW made its moments afresh every step
    under split (7.7e-3 off fp32 masters after 3 steps)."""
    runs = {}
    for master in ("fp32", "split"):
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        model, opt = mp.prepare(model, _NoneMarked(model.parameters()), level="O2",
                                dtype="bf16", master=master)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert "made" in opt.state[model.weight]
        runs[master] = mp.fp32_state_dict(model)
    assert all(torch.equal(v, runs["fp32"][k]) for k, v in runs["split"].items())


def test_lbfgs_under_split_resumes_from_its_state_dict_bitwise():
    """torch's load cast LBFGS's history lists (old_dirs, old_stps, ...) to the 16-bit
    weights' dtype, and the next step failed ("expected both vectors to have same dtype")."""
    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        opt = torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=4, history_size=3)
        return mp.prepare(net, opt, level="O2", dtype="bf16", master="split")

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    def step(net, opt):
        def closure():
            opt.zero_grad()
            loss = net(x).float().square().mean()
            loss.backward()
            return loss
        opt.step(closure)

    net, opt = build()
    for _ in range(2):
        step(net, opt)
    saved = copy.deepcopy((net.state_dict(), opt.state_dict()))
    step(net, opt)
    again, again_opt = build()
    again.load_state_dict(saved[0])
    again_opt.load_state_dict(saved[1])
    step(again, again_opt)
    assert all(torch.equal(v, mp.fp32_state_dict(net)[k])
               for k, v in mp.fp32_state_dict(again).items())
