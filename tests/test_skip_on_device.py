"""fp16 O2 hands the overflow flag to torch's fused kernels (found_inf) with the loss scale
(grad_scale), as torch.amp.GradScaler does for a fused optimizer: a skipped step leaves weights,
masters and optimizer state (step counts included) untouched on the device, and the flag is read
once, after the step and the scale update are queued. Where the device path does not apply (a
first step, step hooks, bf16 moments, no fused kernel) the flag is read before the step."""

import warnings

import pytest
import torch
from test_kernel_table import CudaAmpKernel
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec as mp
from mixprec import kernel_table
from mixprec.scaling import unscale
from mixprec.scaling.state import DynamicConfig, ScaleState, adjust_scale

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

F16 = torch.float16
INF = float("inf")


class OpOrder(TorchDispatchMode):
    """The aten ops dispatched while active, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def setup(optimizer="adamw", scaler=None, dtype="fp16"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    inner = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
             else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    amp = mp.MixedPrecision(level="O2", dtype=dtype, emulate_fp16=False,
                            loss_scale=scaler or "dynamic")
    model, opt = amp.setup(model, inner)
    return amp, model, opt


def backward(amp, model, i, overflow=False):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(4, 8, generator=g).to(next(model.parameters()).dtype)
    amp.backward(model(x).float().pow(2).mean())
    if overflow:  # one inf in one 16-bit gradient, one in an fp32 (norm) gradient
        model[0].weight.grad[0, 0] = INF
        model[1].weight.grad[0] = INF


def snapshot(model, opt):
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    masters = [m.detach().clone() for m in opt.masters_by_param().values()]
    state = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    return weights, masters, state


def assert_same(a, b):
    (wa, ma, sa), (wb, mb, sb) = a, b
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(torch.equal(x, y) for x, y in zip(ma, mb))
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_overflow_skips_on_the_device_and_leaves_everything_untouched(optimizer):
    amp, model, opt = setup(optimizer)
    for i in range(2):
        backward(amp, model, i)
        assert amp.step(opt) is True
        opt.zero_grad()
    assert opt.skips_on_device()
    scale = amp.scaler.get_scale()
    before = snapshot(model, opt)
    backward(amp, model, 2, overflow=True)
    with OpOrder() as order:
        assert amp.step(opt) is False
    assert_same(before, snapshot(model, opt))  # step counts too: the kernel took its back
    fused = "aten._fused_adamw_" if optimizer == "adamw" else "aten._fused_sgd_"
    assert fused in order.ops  # skipped by the kernel, on the device
    assert amp.scaler.get_scale() == scale / 2 and amp.scaler.skipped_steps == 1
    opt.zero_grad()
    backward(amp, model, 3)
    assert amp.step(opt) is True
    assert not all(torch.equal(x, y) for x, y in zip(before[1], snapshot(model, opt)[1]))


def test_the_flag_is_read_once_after_the_step_and_the_scale_update_are_queued():
    amp, model, opt = setup()
    backward(amp, model, 0)
    amp.step(opt)
    opt.zero_grad()
    backward(amp, model, 1)
    with OpOrder() as order:
        amp.step(opt)
    reads = [i for i, op in enumerate(order.ops) if op == "aten._local_scalar_dense"]
    assert len(reads) == 1
    assert reads[0] > order.ops.index("aten._fused_adamw_")
    assert reads[0] > order.ops.index("aten._amp_update_scale_")
    assert "aten._foreach_mul_" not in order.ops  # the scale went to the kernel (grad_scale)


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_the_device_path_trains_bitwise_as_the_host_path_through_overflows(hysteresis):
    """The same run, once skipping on the device and once reading the flag before the step:
    weights, masters, state and the scaler's state agree bit for bit, across overflows (two in
    a row: with hysteresis 2 the first keeps the scale) and the steps after them."""
    runs = []
    for device_path in (True, False):
        amp, model, opt = setup(scaler=mp.DynamicLossScaler(init_scale=2.0 ** 10,
                                                            hysteresis=hysteresis))
        if not device_path:
            opt.skips_on_device = lambda: False  # this instance reads the flag first
        applied, scales = [], []
        for i in range(8):
            backward(amp, model, i, overflow=i in (3, 4))
            applied.append(amp.step(opt))
            scales.append(amp.scaler.get_scale())
            opt.zero_grad()
        runs.append((snapshot(model, opt), applied, scales, amp.scaler.state_dict()))
    (device, applied, scales, sd), (host, applied_h, scales_h, sd_h) = runs
    assert_same(device, host)
    assert applied == applied_h == [True] * 3 + [False] * 2 + [True] * 3
    assert scales == scales_h
    expected = 2.0 ** 10 / 2 if hysteresis == 1 else 2.0 ** 10
    assert scales[3] == (expected if hysteresis == 1 else 2.0 ** 10)
    assert scales[4] == 2.0 ** 10 / (4 if hysteresis == 1 else 2)
    assert sd == sd_h


def test_a_first_step_overflow_reads_the_flag_first_and_makes_no_state():
    """torch's fused SGD starts momentum buffers as ``empty_like`` on a skipped first step, and
    Adam would make its state: the first step takes the host path."""
    for optimizer in ("sgd", "adamw"):
        amp, model, opt = setup(optimizer)
        backward(amp, model, 0, overflow=True)
        assert not opt.skips_on_device()
        assert amp.step(opt) is False
        assert all(not s for s in opt.state.values())


def test_step_hooks_keep_the_host_path_and_do_not_run_on_a_skipped_step():
    amp, model, opt = setup()
    backward(amp, model, 0)
    amp.step(opt)
    opt.zero_grad()
    ran = []
    handle = opt.register_step_post_hook(lambda *a: ran.append(1))
    assert not opt.skips_on_device()
    backward(amp, model, 1, overflow=True)
    assert amp.step(opt) is False and ran == []
    handle.remove()
    assert opt.skips_on_device()


def test_bf16_moments_keep_the_host_path():
    torch.manual_seed(0)
    model = nn.Linear(4, 4).to(F16)
    opt = mp.MasterWeightOptimizer(torch.optim.AdamW(model.parameters()), state_dtype="bf16")
    model(torch.ones(1, 4, dtype=F16)).float().sum().backward()
    opt.step()
    assert not opt.skips_on_device()
    with pytest.raises(RuntimeError, match="skips_on_device"):
        opt.step(found_inf=torch.zeros(()))


def test_overflow_flags_are_exactly_one_over_several_dtype_groups(monkeypatch):
    """torch's fused kernels skip at found_inf == 1 exactly: a 2 from two groups would step."""
    grads = [torch.tensor([INF], dtype=F16), torch.tensor([INF, 1.0])]
    assert unscale.found_nonfinite(grads).item() == 1.0
    assert unscale.check_and_unscale_([g.clone() for g in grads], torch.tensor(0.5)).item() == 1.0
    monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing("mps"))  # inf-norm
    assert unscale.found_nonfinite(grads).item() == 1.0
    assert unscale.check_and_unscale_([g.clone() for g in grads], torch.tensor(0.5)).item() == 1.0


def test_under_cudas_limits_fp16_o2_skips_on_the_device(monkeypatch):
    fake = CudaAmpKernel()
    monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing(
        "cuda", kernels={"amp_check_and_unscale": fake}))
    amp, model, opt = setup()
    backward(amp, model, 0)
    amp.step(opt)
    opt.zero_grad()
    before = snapshot(model, opt)
    backward(amp, model, 1, overflow=True)
    fake.calls.clear()
    with OpOrder() as order:
        assert amp.step(opt) is False
    # one fused check per dtype group: the fp16 weights and biases, the fp32 norm parameters
    assert sorted(str(set(call)) for call in fake.calls) == ["{torch.float16}", "{torch.float32}"]
    assert "aten._fused_adamw_" in order.ops
    assert_same(before, snapshot(model, opt))


def test_without_a_fused_kernel_the_flag_is_read_first(monkeypatch):
    """A device with no fused optimizer in the table ("other": MPS, XPU): the foreach step,
    the flag read before it, and a skipped step untouched all the same."""
    monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing("mps"))
    amp, model, opt = setup()
    backward(amp, model, 0)
    amp.step(opt)
    opt.zero_grad()
    assert not opt.skips_on_device()
    before = snapshot(model, opt)
    backward(amp, model, 1, overflow=True)
    with OpOrder() as order:
        assert amp.step(opt) is False
    assert "aten._fused_adamw_" not in order.ops
    assert_same(before, snapshot(model, opt))


def test_the_device_plan_follows_the_table_the_groups_and_the_gradients(monkeypatch):
    """What the plan keeps per layout is worked out again when the kernel table or the param
    groups change; a sparse gradient, a tensor without state and a held fp32 gradient are seen
    at the step they appear."""
    amp, model, opt = setup()
    for i in range(2):
        backward(amp, model, i)
        amp.step(opt)
        opt.zero_grad()
    backward(amp, model, 2)
    assert opt.skips_on_device()
    with monkeypatch.context() as m:  # no fused kernel on this table: the host path
        m.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing("mps"))
        assert not opt.skips_on_device()
    assert opt.skips_on_device()
    extra = nn.Parameter(torch.ones(3, dtype=F16))
    opt.add_param_group({"params": [extra]})
    assert opt.skips_on_device()  # no gradient: not stepped
    extra.grad = torch.ones(3, dtype=F16)
    assert not opt.skips_on_device()  # stepped, no state yet
    extra.grad = None
    model[2].bias.grad = model[2].bias.grad.to_sparse()
    assert not opt.skips_on_device()
    model[2].bias.grad = model[2].bias.grad.to_dense()
    assert opt.skips_on_device()
    master = opt.master_param(extra)
    master.grad = torch.ones(3)  # held fp32 gradient of a tensor without state
    assert opt.held_grads() and not opt.skips_on_device()


def test_the_device_plan_calls_nothing_per_tensor_once_the_layout_is_known(monkeypatch):
    """A step's check of the plan walks the gradients and the state only: no function of
    mixprec's runs per tensor (it took 0.85 ms a step for 400 tensors when it did)."""
    from mixprec.optim import steps
    amp, model, opt = setup()
    backward(amp, model, 0)
    amp.step(opt)
    opt.zero_grad()
    backward(amp, model, 1)
    calls = []
    for name in ("step_grad", "is_dtensor", "is_master"):
        real = getattr(steps, name)
        monkeypatch.setattr(steps, name, lambda *a, real=real, name=name: (calls.append(name),
                                                                            real(*a))[1])
    assert opt.skips_on_device() and calls == []
    opt.add_param_group({"params": [nn.Parameter(torch.ones(3, dtype=F16))]})
    assert opt.skips_on_device() and "is_dtensor" in calls  # a new layout, worked out once


class CountingUpdate:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        torch._amp_update_scale_(*args)


@pytest.mark.parametrize("config", [
    DynamicConfig(growth_interval=3, min_scale=2.0, max_scale=64.0),
    DynamicConfig(growth_interval=1, backoff_factor=0.25, growth_factor=3.0, min_scale=0.5,
                  max_scale=100.0),
    DynamicConfig(growth_interval=2, hysteresis=3, min_scale=1.0, max_scale=32.0),
    DynamicConfig(growth_interval=1, min_scale=2.0 ** 120, max_scale=torch.finfo().max),
])
def test_the_scale_update_paths_agree(monkeypatch, config):
    """torch's _amp_update_scale_ (CPU and CUDA rows, no hysteresis) against the element-wise
    update (the "other" row), over 200 random flags hitting both bounds; CUDA's row imposed with
    a counting kernel takes torch's kernel exactly when there is no hysteresis."""
    gen = torch.Generator().manual_seed(0)
    flags = (torch.rand(200, generator=gen) < 0.4).float()
    fake = CountingUpdate()
    cuda = kernel_table.TABLE.imposing("cuda", kernels={"amp_update_scale": fake})
    other = kernel_table.TABLE.imposing("mps")
    a = b = ScaleState.initial(config.min_scale * 4, config.hysteresis)
    for flag in flags:
        monkeypatch.setattr(kernel_table, "TABLE", cuda)
        a = adjust_scale(a, flag, config)
        monkeypatch.setattr(kernel_table, "TABLE", other)
        b = adjust_scale(b, flag, config)
        assert a.to_numbers() == b.to_numbers()
    # torch's kernel keeps the scale where a growth overflows fp32: bounded by max_scale instead
    torch_kernel = config.hysteresis == 1 and config.max_scale < torch.finfo().max
    assert fake.calls == (200 if torch_kernel else 0)
    assert {a.scale.dtype, a.growth_tracker.dtype} == {torch.float32, torch.int32}


def compact_setup(master, state_dtype="fp32", optimizer="adamw"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    inner = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
             else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    amp = mp.MixedPrecision(level="O2", dtype="bf16", master=master, state_dtype=state_dtype)
    model, opt = amp.setup(model, inner)
    return amp, model, opt


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("piece", [None, 64])
def test_split_skips_on_the_device_and_leaves_everything_untouched(optimizer, piece,
                                                                   monkeypatch):
    """split's store gives back what its load read and draws no bits: with fp32 moments its
    step takes the flag as fp32 masters' does (torch's kernel skips; no read before the step),
    and a skipped step leaves weights, remainders, moments, step counts (the bf16 weights' and
    the fp32 norm's) and the rounding generator bitwise as they were; with pieces of 64
    elements too (a weight of 128 cut into slices, each stepping a copy of its step count)."""
    if piece:
        monkeypatch.setitem(kernel_table.STEP_PIECE, "cpu", piece)
    amp, model, opt = compact_setup("split", optimizer=optimizer)
    for i in range(2):
        backward(amp, model, i)
        assert opt.skips_on_device() is (i == 1)  # the first step makes state and lists
        assert amp.step(opt) is True
        opt.zero_grad()
    before, generator = snapshot(model, opt), opt.rounding.state_dict().clone()
    backward(amp, model, 2, overflow=True)
    assert opt.skips_on_device()
    with OpOrder() as order, pytest.warns(RuntimeWarning, match="skipped a step"):
        assert amp.step(opt) is False
    assert "aten._fused_adamw_" in order.ops or "aten._fused_sgd_" in order.ops
    assert_same(before, snapshot(model, opt))
    assert torch.equal(generator, opt.rounding.state_dict())
    opt.zero_grad()
    backward(amp, model, 3)
    assert amp.step(opt) is True


@pytest.mark.parametrize("master, state_dtype", [("kahan", "fp32"), ("stochastic", "fp32"),
                                                 ("split", "bf16")])
def test_methods_that_round_stochastically_keep_the_host_path(master, state_dtype):
    """A skipped step must draw no rounding bits and round nothing: Kahan and stochastic
    rounding round the weights, bf16 moments are rounded too, so their flag is read first."""
    amp, model, opt = compact_setup(master, state_dtype)
    for i in range(3):
        backward(amp, model, i)
        if i < 2:
            amp.step(opt)
            opt.zero_grad()
    assert not opt.skips_on_device()
    with pytest.raises(RuntimeError, match="skips_on_device"):
        opt.step(found_inf=torch.zeros(()))


@pytest.mark.parametrize("dropped", [False, True])
def test_split_skipping_on_the_device_steps_as_skipping_on_the_host(dropped):
    """The same run with the flag read before each step (the host path) ends bitwise equal:
    weights, remainders, moments and step counts. ``dropped``: a parameter left without a
    gradient at the skipped step changes the layout the lists were made for, so that step reads
    the flag (and leaves everything untouched)."""
    runs = []
    for on_device in (True, False):
        amp, model, opt = compact_setup("split")
        opt.skip_on_device = on_device
        for i in range(5):
            backward(amp, model, i, overflow=i == 3)
            if dropped and i == 3:
                model[2].bias.grad = None
            before = snapshot(model, opt)
            with warnings.catch_warnings():  # the first skip's warning
                warnings.simplefilter("ignore", RuntimeWarning)
                assert amp.step(opt) is (i != 3)
            if i == 3:
                assert_same(before, snapshot(model, opt))
            opt.zero_grad()
        runs.append(snapshot(model, opt))
    assert_same(*runs)


def _torch_fused(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)
    return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind](params, lr=1e-2,
                                                                         fused=True)



def _torch_state(opt):
    return [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]


@pytest.mark.parametrize("level,dtype", [("O1", "fp16"), ("O1", "bf16"), ("O3", "bf16")])
@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_a_torch_fused_optimizer_skips_on_the_device_as_under_gradscaler(level, dtype, kind):
    """O1/O3 keep the user's optimizer: one built with ``fused=True`` gets the overflow flag with
    its step (``optimizer.found_inf``, as ``torch.amp.GradScaler`` hands it): no read before
    the kernel; weights and state (step counts included) bitwise untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    amp = mp.MixedPrecision(level=level, dtype=dtype, emulate_fp16=False)
    model, opt = amp.setup(model, _torch_fused(kind, model.parameters()))
    for i in range(2):
        backward(amp, model, i)
        assert amp.step(opt) is True
        opt.zero_grad()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = _torch_state(opt)
    backward(amp, model, 2, overflow=True)
    with warnings.catch_warnings(), OpOrder() as order:
        warnings.simplefilter("ignore", RuntimeWarning)  # (bf16's first skip warns)
        assert amp.step(opt) is False
    kernel = next(i for i, op in enumerate(order.ops) if op.startswith("aten._fused_"))
    reads = [i for i, op in enumerate(order.ops) if op == "aten._local_scalar_dense"]
    assert reads and reads[0] > kernel  # (a skip reads once more: the skip-limit check)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
               for a, b in zip(state, _torch_state(opt)))
    assert not hasattr(opt, "found_inf")
    opt.zero_grad()
    backward(amp, model, 3)
    assert amp.step(opt) is True
    assert not all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_a_torch_fused_optimizer_reads_first_before_its_state_or_with_hooks():
    """A first step (fused SGD would start its momentum buffers as ``empty_like``), or a step
    hook (it must not run on a skipped step): the flag is read before the step, as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    amp = mp.MixedPrecision(level="O1", dtype="fp16", emulate_fp16=False)
    model, opt = amp.setup(model, _torch_fused("sgd", model.parameters()))
    backward(amp, model, 0, overflow=True)
    with OpOrder() as order:
        assert amp.step(opt) is False
    assert "aten._fused_sgd_" not in order.ops and not any(opt.state.values())
    amp.update() if hasattr(amp, "update") else None
    opt.zero_grad()
    backward(amp, model, 1)
    assert amp.step(opt) is True
    opt.zero_grad()
    ran = []
    handle = opt.register_step_post_hook(lambda *a: ran.append(1))
    backward(amp, model, 2, overflow=True)
    with OpOrder() as order:
        assert amp.step(opt) is False
    assert "aten._fused_sgd_" not in order.ops and ran == []
    handle.remove()
