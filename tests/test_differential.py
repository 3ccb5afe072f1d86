"""The differential matrix: every training path against a short, obviously correct fp32 step.

The reference step takes the true gradients (what the backward left in the model, upcast to
fp32 and divided by the loss scale, a power of two: exact), clips them in fp32 when the cell
clips, and calls a fresh instance of the user's optimizer class exactly once, on fp32 copies of
the weights (the masters at O2). mixprec runs the same iteration its own way (loss scaling,
unscale, the master step, buckets, fused kernels) and must land on the same weights, or raise.

Tolerances, per level:

* O1 (fp32 parameters) and O2 (fp32 masters): rtol 1e-5, atol 1e-7 (the same fp32 arithmetic up
  to the order of additions in a norm and the fused kernels' reassociation); the 16-bit model
  weights equal their masters rounded, exactly. Clipping the model's own bf16 gradients in
  place rounds the clipped values to bf16: atol lr * 4 * eps(bf16) there. In fp16 that clip is
  refused at step (the unscaled fp16 gradients lose what lies below 6.1e-05).
* O3 (16-bit parameters and optimizer state, no masters): each step rounds a weight to 16 bits
  twice (weight decay, update), so within rtol 2 * steps * eps (eps: the 16-bit unit roundoff)
  plus lr * 8 * eps absolute (the update computed in 16-bit arithmetic).

An injected overflow (one gradient element set to inf) must skip the step on every path and
leave weights and optimizer state bitwise untouched.

``make test`` runs the cells of the large matrices that cover every pair of factor values;
``make test-slow`` adds a seeded random sample of the others (tests/covering.py: the seed is
printed, ``MIXPREC_DIFF_SAMPLE=all`` runs every cell, a cell named by its id always runs).
"""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import mixprec as mp
from mixprec.optim.params import valid_grad

pytestmark = pytest.mark.filterwarnings(
    "ignore::mixprec.hardware.SlowDtypeWarning",
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")

LR = 1e-2
MAX_NORM = 0.05  # the gradients' norm is ~0.5: the clip bites
STEPS = 3
OVERFLOW_AT = 1
EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Lamb(torch.optim.Optimizer):
    """A third-party-style optimizer with global state (timm's LAMB shape): one global gradient
    norm clip over all parameters, a per-group step counter, a per-parameter trust ratio. Its
    numbers change if it is stepped on a subset of its parameters, or more than once a step."""

    def __init__(self, params, lr=LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 max_grad_norm=0.1):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = max_grad_norm
        self.calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        divide = torch.clamp(norm / self.max_grad_norm, min=1.0)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            b1, b2 = group["betas"]
            bc1, bc2 = 1 - b1 ** group["step"], 1 - b2 ** group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad / divide
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].mul_(b1).add_(g, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                update = (state["m"] / bc1) / ((state["v"] / bc2).sqrt() + group["eps"])
                update = update + group["weight_decay"] * p
                w, u = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
                trust = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
                p.sub_(group["lr"] * trust * update)


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=LR, momentum=0.9, weight_decay=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=LR, weight_decay=0.1)),
    "adamw_fused": (torch.optim.AdamW, dict(lr=LR, weight_decay=0.1, fused=True)),
    "lamb": (Lamb, dict(lr=LR)),
}


def make_optimizer(name, params, reference=False):
    cls, kwargs = OPTIMIZERS[name]
    if reference and cls is not Lamb:  # the plainest implementation: a for loop per parameter
        kwargs = {**kwargs, "foreach": False, "fused": False}
    return cls(params, **kwargs)


class Net(nn.Module):
    """stem conv -> [conv, GroupNorm, ReLU, conv] (optionally checkpointed) -> mean -> head."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Linear(8, 4)
        self.ckpt = ckpt

    def forward(self, x):
        h = torch.relu(self.stem(x))
        if self.ckpt is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.ckpt == "reentrant")
        return self.head(h.mean(dim=(2, 3)))


def build(layout="contiguous", ckpt=None, device="cpu"):
    torch.manual_seed(0)
    net = Net(ckpt).to(device)
    return net.to(memory_format=torch.channels_last) if layout == "channels_last" else net


def batch(i, layout="contiguous", device="cpu"):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(4, 3, 6, 6, generator=g)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    return x.to(device), torch.randint(0, 4, (4,), generator=g).to(device)


def loss_of(model, i, layout="contiguous", device="cpu"):
    x, y = batch(i, layout, device)
    return F.cross_entropy(model(x).float(), y)


# -- the four ways to clip ------------------------------------------------------------------------
def clip_none(scaler, opt, model):
    return scaler.step(opt)


def clip_scaler(scaler, opt, model):
    scaler.clip_grad_norm_(opt, MAX_NORM)
    return scaler.step(opt)


def clip_optimizer_params(scaler, opt, model):
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], MAX_NORM)
    return scaler.step(opt)


def clip_model_params(scaler, opt, model):
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return scaler.step(opt)


CLIPS = {"no clip": clip_none, "scaler.clip_grad_norm_": clip_scaler,
         "unscale_ + optimizer params": clip_optimizer_params,
         "unscale_ + model params": clip_model_params}


# -- the reference --------------------------------------------------------------------------------
class Reference:
    """fp32 copies of the weights the optimizer steps (the masters at O2), a fresh optimizer."""

    def __init__(self, model, opt, name):
        self.params = list(model.parameters())
        trained = [p for p in self.params if p.requires_grad]
        self.weights = [self._weight(opt, p).detach().clone().requires_grad_() for p in trained]
        self.of = {id(p): w for p, w in zip(trained, self.weights)}
        self.opt = make_optimizer(name, self.weights, reference=True)

    @staticmethod
    def _weight(opt, p):
        return opt.master_param(p) if isinstance(opt, mp.MasterWeightOptimizer) else p.float()

    def step(self, true_grads, clip):
        for p, g in zip(self.params, true_grads):
            if id(p) in self.of:
                self.of[id(p)].grad = g
        if clip:
            torch.nn.utils.clip_grad_norm_(self.weights, MAX_NORM)
        self.opt.step()

    def check(self, model, opt, level, dtype, tol):
        for p in model.parameters():
            if not p.requires_grad:
                continue
            ref = self.of[id(p)]
            if level == "O3":
                eps = EPS[dtype]
                torch.testing.assert_close(p.float(), ref, rtol=2 * STEPS * eps,
                                           atol=LR * 8 * eps)
                continue
            got = opt.master_param(p) if level == "O2" else p
            torch.testing.assert_close(got, ref, **tol)
            # the 16-bit weights are torch's cast of the masters (ties to even)
            assert torch.equal(p, got.to(p.dtype))


def snapshot(model, opt):
    return (copy.deepcopy([p.detach() for p in model.parameters()]),
            copy.deepcopy(opt.state_dict()))


def assert_untouched(before, model, opt):
    params, state = before
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    torch.testing.assert_close(opt.state_dict(), state, rtol=0, atol=0)


def refused(level, dtype, opt_name):
    """Pure fp16 with Adam-style state (O3 fp16 + AdamW/LAMB) is refused at prepare: its fp16
    moments underflow and the weights turn inf/NaN (see mp.prepare)."""
    return level == "O3" and dtype == "fp16" and opt_name != "sgd"


def fp16_model_clip(level, dtype, clip):
    """O2 fp16, clipping the model's gradients after unscale_: refused at step (unscaled fp16
    gradients lose what lies below 6.1e-05; see MasterWeightOptimizer.step)."""
    return level == "O2" and dtype == "fp16" and clip == "unscale_ + model params"


def adam_unless_refused(level, dtype):
    return "sgd" if refused(level, dtype, "adamw") else "adamw"


def run(level, dtype, scaling, layout, opt_name, clip, ckpt=None, device="cpu"):
    model = build(layout, ckpt, device)
    opt = make_optimizer(opt_name, model.parameters())
    if refused(level, dtype, opt_name):
        with pytest.raises(ValueError, match="keeps its second-moment estimates in fp16"):
            mp.prepare(model, opt, level=level, dtype=dtype)
        return None, None
    model, opt = mp.prepare(model, opt, level=level, dtype=dtype)
    if isinstance(opt, mp.MasterWeightOptimizer):
        opt.bucket_mb = 1e-4  # a bucket per tensor: what a large model gets, on a tiny one
    reference = Reference(model, opt, opt_name)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8) if scaling != "none" \
        else mp.NoLossScaler()
    calls = 0
    tol = ({"rtol": 1e-5, "atol": LR * 4 * EPS[DTYPES[dtype]]} if clip == "unscale_ + model params"
           and level == "O2" else {"rtol": 1e-5, "atol": 1e-7})
    for i in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss_of(model, i, layout, device)).backward()
        inject = scaling == "overflow" and i == OVERFLOW_AT
        if inject:
            with torch.no_grad():
                model.head.weight.grad[0, 0] = float("inf")
        scale = scaler.get_scale()
        true_grads = [None if p.grad is None else p.grad.float() / scale
                      for p in model.parameters()]
        before = snapshot(model, opt)
        if fp16_model_clip(level, dtype, clip) and not inject:
            with pytest.raises(RuntimeError, match=r"fp16 gradients of \d+ model parameter"):
                CLIPS[clip](scaler, opt, model)
            assert_untouched(before, model, opt)
            return model, opt
        applied = CLIPS[clip](scaler, opt, model)
        scaler.update()
        if inject:
            assert applied is False
            assert_untouched(before, model, opt)
            continue
        calls += 1
        assert applied is True
        reference.step(true_grads, clip != "no clip")
        reference.check(model, opt, level, DTYPES[dtype], tol)
    if opt_name == "lamb":  # stepped once per step over all its parameters, never per bucket
        inner = opt.inner if isinstance(opt, mp.MasterWeightOptimizer) else opt
        assert inner.calls == calls
        assert all(g["step"] == calls for g in inner.param_groups)
    return model, opt


# the refused cells (O3 fp16 with Adam-style state) are refused at prepare, before the loss
# scaling, the layout or the clip enter: one cell per optimizer class checks the refusal
MATRIX = [cell for cell in itertools.product(["O1", "O2", "O3"], DTYPES,
                                             ["none", "dynamic", "overflow"],
                                             ["contiguous", "channels_last"], OPTIMIZERS, CLIPS)
          if not refused(cell[0], cell[1], cell[4])]


@pytest.mark.matrix("level,dtype,scaling,layout,opt_name,clip", MATRIX)
def test_matrix_cell_matches_the_fp32_reference(level, dtype, scaling, layout, opt_name, clip):
    run(level, dtype, scaling, layout, opt_name, clip)


@pytest.mark.parametrize("opt_name", [name for name in OPTIMIZERS if refused("O3", "fp16", name)])
def test_pure_fp16_with_adam_style_state_is_refused_at_prepare(opt_name):
    """AdamW (foreach and fused) and a third-party LAMB at O3 fp16: refused at prepare."""
    assert run("O3", "fp16", "dynamic", "contiguous", opt_name, "no clip") == (None, None)


CUDA_MATRIX = [cell for cell in itertools.product(["O1", "O2", "O3"], DTYPES,
                                                  ["dynamic", "overflow"],
                                                  ["contiguous", "channels_last"],
                                                  ["sgd", "adamw_fused", "lamb"], CLIPS)
               if not refused(cell[0], cell[1], cell[4])]  # refused at prepare, on any device


@pytest.mark.cuda
@pytest.mark.matrix("level,dtype,scaling,layout,opt_name,clip", CUDA_MATRIX)
def test_matrix_cell_matches_the_fp32_reference_on_cuda(level, dtype, scaling, layout, opt_name,
                                                        clip):
    run(level, dtype, scaling, layout, opt_name, clip, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_checkpointed_model_computes_exactly_as_the_plain_one_on_cuda(level, ckpt):
    runs = [run(level, "bf16", "dynamic", "channels_last", "adamw_fused", "no clip", ckpt=c,
                device="cuda")[0] for c in (None, ckpt)]
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert torch.equal(p, q)


# -- gradient checkpointing, frozen layers, copies ------------------------------------------------
@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_checkpointed_model_computes_exactly_as_the_plain_one(level, dtype, ckpt):
    """The recomputation runs under the same op lists as the forward (0.2: ~0.5% off, or a
    CheckpointError), so gradients and weights are bitwise those of the plain model."""
    name = adam_unless_refused(level, dtype)
    plain, _ = run(level, dtype, "dynamic", "contiguous", name, "scaler.clip_grad_norm_")
    ckpted, _ = run(level, dtype, "dynamic", "contiguous", name, "scaler.clip_grad_norm_",
                    ckpt=ckpt)
    for p, q in zip(plain.parameters(), ckpted.parameters()):
        assert torch.equal(p, q)
    loss_of(plain, 9).backward()
    loss_of(ckpted, 9).backward()
    for p, q in zip(plain.parameters(), ckpted.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_frozen_layers_train_the_rest_and_keep_their_values(level, dtype):
    model = build()
    pretrained = {k: v.clone() for k, v in model.state_dict().items()}
    for p in model.stem.parameters():
        p.requires_grad_(False)
    name = adam_unless_refused(level, dtype)
    opt = make_optimizer(name, [p for p in model.parameters() if p.requires_grad])
    model, opt = mp.prepare(model, opt, level=level, dtype=dtype)
    reference = Reference(model, opt, name)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    for i in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss_of(model, i)).backward()
        true_grads = [None if p.grad is None else p.grad.float() / scaler.get_scale()
                      for p in model.parameters()]
        assert scaler.step(opt)
        scaler.update()
        reference.step(true_grads, False)
        reference.check(model, opt, level, DTYPES[dtype], {"rtol": 1e-5, "atol": 1e-7})
    state = model.state_dict()
    for key in ("stem.weight", "stem.bias"):
        if level == "O3":  # pure 16-bit: every weight is stored rounded, frozen or not
            assert torch.equal(state[key], pretrained[key].to(DTYPES[dtype]).float())
        else:  # no master keeps a frozen weight: it keeps its fp32 storage, exact
            assert state[key].dtype == torch.float32 and torch.equal(state[key], pretrained[key])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_deep_copy_or_pickle_keeps_the_fp32_weights(level, dtype, tmp_path):
    model, opt = run(level, dtype, "dynamic", "contiguous", adam_unless_refused(level, dtype),
                     "no clip")
    state = model.state_dict()
    torch.save(model, tmp_path / "model.pt")
    with torch.inference_mode():  # a best-model snapshot taken while evaluating (O2 raised)
        snapshot = copy.deepcopy(model)
    copies = [copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False),
              snapshot]
    model.eval()
    expected = model(batch(0)[0])
    for clone in copies:
        torch.testing.assert_close(clone.state_dict(), state, rtol=0, atol=0)
        clone.eval()
        with torch.no_grad():  # (an inference-mode copy takes no part in autograd)
            torch.testing.assert_close(clone(batch(0)[0]), expected, rtol=0, atol=0)
    if level == "O2":  # the masters, not their rounding
        assert any(not torch.equal(v, v.to(DTYPES[dtype]).float()) for v in state.values())


class _Syncs(TorchDispatchMode):
    """Counts host reads (``.item()``, ``bool(t)``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_an_ema_copy_updated_through_state_dict_values_updates_its_weights():
    """timm's ModelEmaV2 updates `ema.state_dict()` values in place: on an O2 copy they are fp32
    shadows, and the copy's 16-bit weights follow them. The copy's state_dict(), which each
    update calls, reads nothing back to the host (version counters only)."""
    model, opt = run("O2", "bf16", "none", "contiguous", "adamw", "no clip")
    ema = copy.deepcopy(model)
    for i in range(3):
        opt.zero_grad()
        loss_of(model, i).backward()
        opt.step()
        with torch.no_grad(), _Syncs() as syncs:
            values = list(ema.state_dict().values())
        assert syncs.count == 0
        with torch.no_grad():
            for e, v in zip(values, model.state_dict().values()):
                if e.is_floating_point():
                    e.copy_(e * 0.9 + v * 0.1)
    expected = {k: v.clone() for k, v in ema.state_dict().items()}
    ema(batch(0)[0])  # the next forward sees the shadows, rounded
    for name, p in ema.named_parameters():
        assert torch.equal(p, expected[name].to(p.dtype)), name
    assert not torch.equal(ema.head.weight, model.head.weight)


def test_master_gradients_are_readable_where_torch_code_looks():
    """Reading .grad of the optimizer's parameters (Lightning's clipping, grad-norm logging)
    gives the model's gradients in fp32, in the master's layout; nothing is held after."""
    model = build("channels_last")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), level="O2",
                            dtype="bf16")
    loss_of(model, 0, "channels_last").backward()
    for p in model.parameters():
        master = opt.master_param(p)
        if master is p:
            continue
        assert torch.equal(master.grad, p.grad.float())
        assert master.grad.stride() == master.stride()
    norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]],
                                          1e-3)
    assert norm > 1e-3  # 0.2 returned 0.0 here: the masters had no gradient
    opt.step()
    assert all(valid_grad(m) is None for m in opt.masters_by_param().values())


# -- compact masters: split remainder, Kahan compensation and stochastic rounding -----------------
# The same cells for master="split"/"kahan"/"stochastic" (fp32 or bf16 moments), against the same
# fp32 reference started from the compact value (split: the exact master; kahan: weight +
# compensation; stochastic: the weight). Tolerances over STEPS steps (eps: the 16-bit unit
# roundoff):
# * split, fp32 moments: an exact fp32 master, so as O2's fp32 masters: rtol 1e-5, atol 1e-7;
# * kahan, fp32 moments: the weight + compensation pair holds ~16 significant bits in bf16
#   (~22 in fp16): rtol STEPS * 2**-15, atol 1e-7;
# * stochastic: each step may move a weight by one ulp either way: rtol 2 * STEPS * eps,
#   atol LR * 8 * eps (as O3, whose rounding is to nearest);
# * bf16 moments, rounded stochastically: the update carries their ~2**-8 relative noise: atol
#   LR * 2**-6 more.
def compact_tolerance(master, state_dtype, dtype):
    eps = EPS[dtype]
    # kahan's atol: a weight+compensation pair rounded at a larger magnitude keeps an error of a
    # few 2^-24 when the weight later nears zero; measured 1.24e-7 (a weight of 4e-5 after the
    # clipped AdamW cells) on an AVX2-only CPU, below 1e-7 on AVX512 ones
    tol = {"split": {"rtol": 1e-5, "atol": 1e-7},
           "kahan": {"rtol": STEPS * 2.0 ** -15, "atol": 2.0 ** -22}}.get(
        master, {"rtol": 2 * STEPS * eps, "atol": LR * 8 * eps})
    if state_dtype == "bf16":
        tol["atol"] += LR * 2.0 ** -6
    return tol


COMPACT_MATRIX = [cell for cell in itertools.product(
    ["split", "kahan", "stochastic"], ["fp32", "bf16"], DTYPES, ["dynamic", "overflow"],
    ["sgd", "adamw", "adamw_fused", "lamb"], ["no clip", "scaler.clip_grad_norm_"])
    if not (cell[0] in ("split", "stochastic") and cell[2] == "fp16")]  # bf16 weights only


@pytest.mark.matrix("master,state_dtype,dtype,scaling,opt_name,clip", COMPACT_MATRIX)
def test_compact_master_cell_matches_the_fp32_reference(master, state_dtype, dtype, scaling,
                                                        opt_name, clip):
    model = build()
    model, opt = mp.prepare(model, make_optimizer(opt_name, model.parameters()), level="O2",
                            dtype=dtype, master=master, state_dtype=state_dtype)
    assert isinstance(opt, mp.CompactMasterOptimizer)
    opt.fused = False  # the eager kernels: the compiled ones are checked in test_compact.py
    values = opt.fp32_values()
    trained = [p for p in model.parameters() if p.requires_grad]
    weights = [values.get(p, p.detach().float()).clone().requires_grad_() for p in trained]
    ref_opt = make_optimizer(opt_name, weights, reference=True)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    tol = compact_tolerance(master, state_dtype, DTYPES[dtype])
    for i in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss_of(model, i)).backward()
        inject = scaling == "overflow" and i == OVERFLOW_AT
        if inject:
            with torch.no_grad():
                model.head.weight.grad[0, 0] = float("inf")
        scale = scaler.get_scale()
        true_grads = [p.grad.float() / scale for p in trained]
        before = snapshot(model, opt)
        generator = opt.rounding.state_dict().clone()
        applied = CLIPS[clip](scaler, opt, model)
        scaler.update()
        if inject:
            assert applied is False
            assert_untouched(before, model, opt)
            assert torch.equal(generator, opt.rounding.state_dict())
            continue
        assert applied is True
        for w, g in zip(weights, true_grads):
            w.grad = g
        if clip != "no clip":
            torch.nn.utils.clip_grad_norm_(weights, MAX_NORM)
        ref_opt.step()
        values = opt.fp32_values()
        for p, ref in zip(trained, weights):
            got = values.get(p, p.detach().float())
            torch.testing.assert_close(got, ref.detach(), **tol)


@pytest.mark.parametrize("master, dtype", [("fp32", "bf16"), ("split", "bf16"), ("kahan", "bf16"),
                                           ("stochastic", "bf16"), ("fp32", "fp16"),
                                           ("kahan", "fp16")])
@pytest.mark.parametrize("dampening", [0.0, 0.1])
def test_sgd_momentum_for_parameters_whose_first_gradient_comes_later(master, dtype, dampening):
    """A 16-bit conv weight and the fp32 GroupNorm weight get their first gradient at the second
    step (unfrozen then): torch's fused SGD makes momentum buffers only for a call where none
    exists, so the step makes theirs (zeros: the kernel's update of one is the gradient, as
    torch's first step; with dampening, the step without the fused kernel). Against torch's
    plain SGD on fp32 copies fed the same true gradients."""
    model = build()
    late = [model.block[0].weight, model.block[1].weight]
    for p in late:
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, dampening=dampening)
    model, opt = mp.prepare(model, opt, level="O2", dtype=dtype, master=master)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)  # fp16: the scale folded into the step
    values = mp.fp32_state_dict(model, opt)
    names = [n for n, _ in model.named_parameters()]
    weights = [values[n].clone().requires_grad_() for n in names]
    ref_opt = torch.optim.SGD(weights, lr=LR, momentum=0.9, dampening=dampening, foreach=False)
    tol = {"rtol": 1e-5, "atol": 1e-7} if master in ("fp32", "split") else compact_tolerance(
        master, "fp32", DTYPES[dtype])
    for i in range(STEPS + 1):
        if i == 1:
            for p in late:
                p.requires_grad_(True)
        opt.zero_grad()
        scaler.scale(loss_of(model, i)).backward()
        for w, (_, p) in zip(weights, model.named_parameters()):
            w.grad = None if p.grad is None else p.grad.float() / scaler.get_scale()
        assert scaler.step(opt) is True
        scaler.update()
        ref_opt.step()
        values = mp.fp32_state_dict(model, opt)
        for n, ref in zip(names, weights):
            torch.testing.assert_close(values[n], ref.detach(), **tol)


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8, sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.embed(x).mean(dim=1))


def sparse_optimizers(opt_name, embed, rest, reference=False):
    one = {"foreach": False} if reference else {}
    if opt_name == "sgd-momentum":
        return [torch.optim.SGD([*embed, *rest], lr=0.1, momentum=0.9, **one)]
    return [torch.optim.SparseAdam(embed, lr=1e-2), torch.optim.Adam(rest, lr=1e-2, **one)]


@pytest.mark.parametrize("master", ["fp32", "split", "kahan", "stochastic"])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("opt_name", ["sgd-momentum", "sparse-adam"])
def test_sparse_embedding_gradients_match_the_fp32_reference(master, state_dtype, opt_name):
    """An ``nn.Embedding(sparse=True)``: SGD with momentum over everything (torch makes a sparse
    momentum buffer for a sparse gradient: kept as torch makes it, fp32, whatever the state
    dtype), or ``SparseAdam`` for the embedding beside Adam for the rest (a piece whose every
    gradient is sparse). Every compact method crashed on both, fp32 masters with bf16 moments
    on the first."""
    torch.manual_seed(0)
    model = SparseNet()
    amp = mp.MixedPrecision(level="O2", dtype="bf16", master=master, state_dtype=state_dtype)
    model, *opts = amp.setup(model, *sparse_optimizers(
        opt_name, list(model.embed.parameters()), list(model.head.parameters())))
    def kept():  # each weight from the optimizer that steps it (SparseAdam: the embedding)
        return {**mp.fp32_state_dict(model, opts[-1]),
                "embed.weight": mp.fp32_state_dict(model, opts[0])["embed.weight"]}

    weights = {n: v.clone().requires_grad_() for n, v in kept().items()}
    refs = sparse_optimizers(opt_name, [weights["embed.weight"]],
                             [weights["head.weight"], weights["head.bias"]], reference=True)
    tol = ({"rtol": 1e-5, "atol": 1e-7} if master in ("fp32", "split") else
           compact_tolerance(master, "fp32", torch.bfloat16))
    if state_dtype == "bf16":
        tol = {**tol, "atol": tol["atol"] + 0.1 * 2.0 ** -6}
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        model(torch.randint(0, 16, (4, 3), generator=gen)).float().pow(2).mean().backward()
        for n, p in model.named_parameters():
            weights[n].grad = p.grad.float()
        for opt in (*opts, *refs):
            opt.step()
        values = kept()
        for n, ref in weights.items():
            torch.testing.assert_close(values[n], ref.detach(), **tol)


# -- islands: a 16-bit one in a plain fp32 model, an fp32 head in a 16-bit model ------------------
class ByHand(nn.Module):
    """A module computing in ``dtype``, written out: its input and parameters cast to
    ``dtype``, run with autocast off (fp16 GEMMs emulated where fp16 is not fast, as mixprec
    runs them), the output widened to fp32."""

    def __init__(self, inner, dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x):
        params = {n: p.to(self.dtype) for n, p in self.inner.named_parameters()}
        with torch.autocast(x.device.type, enabled=False), \
                mp.emulate_fp16(self.dtype == torch.float16 and "auto"):
            out = torch.func.functional_call(self.inner, params, (x.to(self.dtype),))
        return out.float()


ISLAND_CELLS = list(itertools.product(DTYPES, ["stem", "block", "head"], ["sgd", "adamw"]))


@pytest.mark.parametrize("dtype,where,opt_name", ISLAND_CELLS)
def test_a_16_bit_island_in_a_plain_fp32_model_trains_like_its_written_out_reference(
        dtype, where, opt_name):
    """``to_float(net.<where>, dtype)`` on an unprepared model: the fp32 layers after the island
    consume its output, widened to fp32; loss and gradients are those of the fp32 model with
    the island written out by hand, and the user's optimizer steps exactly the reference step
    on fp32 weights."""
    low = DTYPES[dtype]
    model, by_hand = build(), build()
    mp.to_float(getattr(model, where), dtype)
    setattr(by_hand, where, ByHand(getattr(by_hand, where), low))
    opt = make_optimizer(opt_name, model.parameters())
    reference = Reference(model, opt, opt_name)
    for i in range(STEPS):
        opt.zero_grad()
        x, y = batch(i)
        out = model(x)
        assert out.dtype == torch.float32
        loss = F.cross_entropy(out, y)
        loss.backward()
        with torch.no_grad():  # the written-out model at this step's weights
            for p, q in zip(by_hand.parameters(), model.parameters()):
                p.copy_(q)
                p.grad = None
        expected = loss_of(by_hand, i)
        expected.backward()
        assert torch.equal(loss, expected)
        true_grads = [p.grad.clone() for p in model.parameters()]
        for g, r in zip(true_grads, by_hand.parameters()):
            assert g.dtype == torch.float32 and torch.equal(g, r.grad)
        opt.step()
        reference.step(true_grads, clip=False)
        reference.check(model, opt, "O1", low, {"rtol": 1e-5, "atol": 1e-7})
        assert all(p.dtype == torch.float32 for p in model.parameters())  # storage kept


HEAD_CELLS = list(itertools.product(["O1", "O2", "O3"], DTYPES, ["sgd", "adamw"]))


@pytest.mark.parametrize("level,dtype,opt_name", HEAD_CELLS)
def test_an_fp32_head_in_a_16_bit_model_returns_unrounded_logits_and_steps_exactly(
        level, dtype, opt_name):
    """``to_float(net.head, "fp32")`` then ``prepare``: the head's logits are its fp32 GEMM of
    the 16-bit features, bitwise (never rounded to 16 bits), and every step lands on the
    reference step's weights."""
    if refused(level, dtype, opt_name):
        opt_name = "sgd"
    model = build()
    mp.to_float(model.head, "fp32")
    model, opt = mp.prepare(model, make_optimizer(opt_name, model.parameters()), level=level,
                            dtype=dtype)
    assert model.head.weight.dtype == torch.float32
    reference = Reference(model, opt, opt_name)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    seen = {}
    model.head.register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach(), out=o))
    for i in range(STEPS):
        opt.zero_grad()
        x, y = batch(i)
        out = model(x)
        expected = F.linear(seen["x"].float(), model.head.weight, model.head.bias)
        assert seen["out"].dtype == torch.float32 and torch.equal(seen["out"], expected)
        assert torch.equal(out.float(), expected)  # O3 returns it as computed: fp32 too
        scaler.scale(F.cross_entropy(out.float(), y)).backward()
        scale = scaler.get_scale()
        true_grads = [None if p.grad is None else p.grad.float() / scale
                      for p in model.parameters()]
        assert scaler.step(opt) is True
        scaler.update()
        reference.step(true_grads, clip=False)
        reference.check(model, opt, level, DTYPES[dtype], {"rtol": 1e-5, "atol": 1e-7})


# -- load, hook and cast cells --------------------------------------------------------------------
# torch's contract around the optimizer and model prepare returns, on every master kind, against
# the same fp32 reference:
# * load: a state_dict saved mid-run (model and optimizer) loads into a freshly prepared pair,
#   which continues bitwise as the uninterrupted run; another model's state is refused, naming
#   the parameter, and leaves the pair untouched;
# * hook: a step pre-hook registered on the user's optimizer before prepare clips the global
#   gradient norm over param_groups once per step, on the true gradients (under a loss scale
#   too): the reference clips all its weights once. A compact optimizer's param_groups hold the
#   16-bit parameters, so the hook clips their 16-bit gradients in place: in bf16 the clipped
#   values are rounded (atol lr * 4 * eps more, as clipping the model's gradients at O2); in
#   fp16 the step refuses, as it refuses any change to unscaled fp16 gradients;
# * cast: model.float() mid-run stores the exact fp32 values and training continues on them;
#   model.half() / .bfloat16() are refused and change nothing.
# A Kahan pair loaded from a model state_dict is split again, then the optimizer's saved
# compensation arrives: the pair is split the saved way even where the value lies exactly half an
# ulp between two weights (0.3 resumed an ulp off there), so every kind resumes bitwise.
CONTRACT_MATRIX = [cell for cell in itertools.product(
    ["fp32", "split", "kahan", "stochastic"], DTYPES, ["sgd", "adamw"])
    if not (cell[0] in ("split", "stochastic") and cell[1] == "fp16")]  # bf16 weights only


def prepared(master, dtype, opt_name, register=None):
    model = build()
    user = make_optimizer(opt_name, model.parameters())
    if register is not None:
        register(user)
    model, opt = mp.prepare(model, user, level="O2", dtype=dtype, master=master)
    if isinstance(opt, mp.MasterWeightOptimizer):
        opt.bucket_mb = 1e-4  # a bucket per tensor: hooks and load over several inner steps
    else:
        opt.fused = False
    return model, opt


def fp32_values(model, opt):
    """The fp32 value of each trained weight: master, weight + compensation, or the weight."""
    values = opt.masters_by_param()
    return [values.get(p, p).detach().float() for p in model.parameters() if p.requires_grad]


def contract_tolerance(master, dtype, cell=None):
    tol = ({"rtol": 1e-5, "atol": 1e-7} if master == "fp32"
           else compact_tolerance(master, "fp32", DTYPES[dtype]))
    if cell == "hook" and master != "fp32":  # the hook clipped 16-bit gradients in place
        tol["atol"] += LR * 4 * EPS[DTYPES[dtype]]
    return tol


def clip_global_norm(optimizer, args, kwargs):
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]],
                                   MAX_NORM)


def contract_run(master, dtype, opt_name, cell, steps=STEPS):
    hooked = cell == "hook"
    model, opt = prepared(master, dtype, opt_name,
                          register=(lambda o: o.register_step_pre_hook(clip_global_norm))
                          if hooked else None)
    weights = [w.clone().requires_grad_() for w in fp32_values(model, opt)]
    ref_opt = make_optimizer(opt_name, weights, reference=True)
    scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    tol = contract_tolerance(master, dtype, cell)
    for i in range(steps):
        if cell == "cast" and i == 1:
            before = (copy.deepcopy([p.detach() for p in model.parameters()]),
                      fp32_values(model, opt))
            for cast in (lambda m: m.half(), lambda m: m.bfloat16()):
                with pytest.raises(RuntimeError, match="would round"):
                    cast(model)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before[0]))
            model.float()
            assert all(p.dtype == torch.float32 for p in model.parameters())
            for p, value in zip(model.parameters(), before[1]):
                assert torch.equal(p.detach(), value)
        opt.zero_grad()
        scaler.scale(loss_of(model, i)).backward()
        true_grads = [p.grad.float() / scaler.get_scale() for p in model.parameters()]
        if hooked and master != "fp32" and dtype == "fp16":
            with pytest.raises(RuntimeError, match=r"fp16 gradients of \d+ model parameter"):
                scaler.step(opt)
            return model, opt, scaler
        assert scaler.step(opt)
        scaler.update()
        for w, g in zip(weights, true_grads):
            w.grad = g
        if hooked:
            torch.nn.utils.clip_grad_norm_(weights, MAX_NORM)
        ref_opt.step()
        for got, ref in zip(fp32_values(model, opt), weights):
            torch.testing.assert_close(got, ref.detach(), **tol)
    return model, opt, scaler


@pytest.mark.parametrize("cell", ["hook", "cast"])
@pytest.mark.parametrize("master,dtype,opt_name", CONTRACT_MATRIX)
def test_contract_cell_matches_the_fp32_reference(master, dtype, opt_name, cell):
    contract_run(master, dtype, opt_name, cell)


@pytest.mark.parametrize("master,dtype,opt_name", CONTRACT_MATRIX)
def test_load_cell_resumes_bitwise_and_refuses_another_models_state(master, dtype, opt_name):
    model, opt, scaler = contract_run(master, dtype, opt_name, "load", steps=2)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
             scaler.state_dict())
    other = nn.Linear(8, 5)  # the head of another model: (5, 8) where this one is (4, 8)
    theirs = make_optimizer(opt_name, other.parameters())
    other(torch.randn(2, 8)).sum().backward()
    theirs.step()
    resumed, resumed_opt = prepared(master, dtype, opt_name)
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    untouched = copy.deepcopy(resumed_opt.state_dict())
    foreign = copy.deepcopy(saved[1])
    head = len(foreign["param_groups"][0]["params"]) - 2  # head.weight's index
    foreign["state"][head] = {**foreign["state"].get(head, {}),
                              **{k: v for k, v in theirs.state_dict()["state"][0].items()
                                 if k != "step"}}
    with pytest.raises(ValueError, match=r"parameter 'head\.weight' .*\(5, 8\).*\(4, 8\)"):
        resumed_opt.load_state_dict(foreign)
    torch.testing.assert_close(resumed_opt.state_dict(), untouched, rtol=0, atol=0)
    resumed_scaler = mp.DynamicLossScaler(init_scale=2.0 ** 8)
    resumed_scaler.load_state_dict(saved[2])
    for run_model, run_opt, run_scaler in ((model, opt, scaler),
                                           (resumed, resumed_opt, resumed_scaler)):
        for i in range(2, STEPS + 1):
            run_opt.zero_grad()
            run_scaler.scale(loss_of(run_model, i)).backward()
            assert run_scaler.step(run_opt)
            run_scaler.update()
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    torch.testing.assert_close(opt.state_dict(), resumed_opt.state_dict(), rtol=0, atol=0)
