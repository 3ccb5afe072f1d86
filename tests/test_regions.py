"""Precision regions: island outputs, to_float storage, recomputation, signatures, zoo norms."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import mixprec as mp

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


# -- islands return their own dtype ----------------------------------------------------------------
def test_an_fp32_head_inside_a_bf16_net_returns_fp32_logits_exactly():
    """0.2 rounded the head's fp32 logits to bf16 (0.2% off); MindSpore's rule: fp32 out."""
    net = mlp()
    mp.to_float(net, "bf16")
    mp.to_float(net[-1], "fp32")
    x = torch.randn(4, 8)
    out = net(x)
    assert out.dtype == FP32
    with torch.no_grad():
        h = x.to(BF16)
        for layer in list(net)[:-1]:
            h = F.relu(h) if isinstance(layer, nn.ReLU) else F.linear(
                h, layer.weight.to(BF16), layer.bias.to(BF16))
        expected = F.linear(h.float(), net[-1].weight, net[-1].bias)  # fp32 head, fp32 out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fp32_module_in_the_middle_hands_fp32_to_consumers_that_compute_in_their_dtype(level):
    net = mlp()
    mp.to_float(net[2], "fp32")
    mp.prepare(net, level=level, dtype="bf16")
    seen = {}
    for name, mod in net.named_children():
        mod.register_forward_hook(lambda m, a, o, name=name: seen.update({name: o.dtype}))
    with mp.debug.op_stats() as stats:
        out = net(torch.randn(4, 8))
    assert seen["2"] == FP32  # the fp32 island's output
    assert stats.count(op="addmm", dtype="bf16") == 2 and stats.count(op="addmm", dtype="fp32") == 1
    assert out.dtype == (BF16 if level == "O3" else FP32) and torch.isfinite(out).all()


def test_o3_with_an_fp32_head_returns_its_fp32_logits():
    net = mlp()
    mp.to_float(net[-1], "fp32")
    mp.prepare(net, level="O3", dtype="bf16")
    assert net(torch.randn(4, 8)).dtype == FP32  # O3's outputs come as computed


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_16_bit_island_in_a_plain_fp32_model_hands_its_fp32_neighbours_fp32(dtype):
    """0.3 crashed here ("mat1 and mat2 must have the same dtype, but got Half and Float"): the
    island's output is widened (losslessly) to the plain model's fp32."""
    net = mlp()
    mp.to_float(net[0], dtype)
    seen = {}
    net[0].register_forward_hook(lambda m, a, o: seen.update(out=o))
    x = torch.randn(4, 8)
    out = net(x)
    low = BF16 if dtype == "bf16" else FP16
    assert seen["out"].dtype == FP32 and out.dtype == FP32
    assert torch.equal(seen["out"], seen["out"].to(low).float())  # computed in 16 bits
    mp.to_float(net[0], "fp32")  # re-marked: nothing to widen, computed in fp32
    assert torch.equal(net[0](x), F.linear(x, net[0].weight, net[0].bias))
    mp.to_float(net[0], dtype)
    assert mp.prepare(net, level="O0")(x).dtype == FP32  # O0 adds no region: still widened


def test_an_island_widens_only_to_wider_code_around_it():
    x = torch.randn(4, 8)
    inner = mlp()
    mp.to_float(inner[0], "bf16")
    mp.prepare(inner, level="O1", dtype="bf16")  # autocast around it: consumers cast
    seen = {}
    inner[0].register_forward_hook(lambda m, a, o: seen.update(o1=o.dtype))
    inner(x)
    assert seen["o1"] == BF16
    nested = mlp()
    mp.to_float(nested, "fp16")
    mp.to_float(nested[2], "bf16")  # in a 16-bit region of the same width: its hooks cast
    nested[2].register_forward_hook(lambda m, a, o: seen.update(nested=o.dtype))
    assert nested(x).dtype == FP32 and seen["nested"] == BF16  # the root island: plain code
    o3 = mlp()
    mp.to_float(o3, "bf16")
    assert mp.prepare(o3, level="O3", dtype="bf16")(x).dtype == BF16  # O3: as computed


# -- to_float keeps the storage --------------------------------------------------------------------
def test_to_float_alone_keeps_fp32_weights_so_small_updates_accumulate():
    """0.2 stored the weights in fp16, where 20 steps at lr 1e-5 moved nothing."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    ref = nn.Linear(8, 8)
    ref.load_state_dict(layer.state_dict())
    mp.to_float(layer, "fp16")
    assert layer.weight.dtype == FP32
    opts = [torch.optim.SGD(m.parameters(), lr=1e-5) for m in (layer, ref)]
    x = torch.randn(4, 8)
    w0 = layer.weight.detach().clone()
    for _ in range(20):
        for m, opt in zip((layer, ref), opts):
            opt.zero_grad()
            m(x if m is ref else x).float().square().mean().backward()
            opt.step()
    moved, ref_moved = (layer.weight - w0).abs().max(), (ref.weight - w0).abs().max()
    assert moved > 0.5 * ref_moved > 0
    # computed in fp16: the gradient is the fp16 computation's, applied to fp32 weights
    torch.testing.assert_close(layer.weight, ref.weight, rtol=0, atol=1e-3 * ref_moved.item())
    bf16_layer = mp.to_float(nn.Linear(8, 8), "bf16")
    with mp.debug.op_stats() as stats:
        bf16_layer(x)
    assert stats.count(op="addmm", dtype="bf16") == 1  # stored fp32, computed in bf16
    assert bf16_layer.weight.dtype == FP32


# -- parameters stored in another dtype than their region's --------------------------------------
class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.body(self.emb(ids))))


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_o3_head_tied_to_an_fp32_embedding_computes_with_its_weight_cast(dtype):
    """Its forward died ("expected m1 and m2 to have the same dtype"): the tied weight is
    stored fp32 (the embedding is kept fp32) and nothing cast it for the O3 head."""
    model = mp.prepare(TiedLM(), level="O3", dtype=mp.dtypes.dtype_name(dtype), keep_fp32=["emb"])
    assert model.head.weight is model.emb.weight and model.emb.weight.dtype == FP32
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    out = model(ids)
    w = model.emb.weight
    with torch.no_grad():
        h = torch.relu(F.linear(F.embedding(ids, w).to(dtype), model.body.weight,
                                model.body.bias))
        expected = F.linear(h, w.to(dtype))
    assert out.dtype == dtype and torch.equal(out, expected)
    out.float().square().mean().backward()
    assert w.grad.dtype == FP32
    # both uses reach the stored weight: the head's rows that no id looks up get gradient too
    unused = torch.ones(50, dtype=torch.bool)
    unused[ids.flatten()] = False
    assert w.grad[unused].abs().sum() > 0 and w.grad[~unused].abs().sum() > 0


def test_a_frozen_fp32_layer_computes_in_16_bits_under_a_master_policy_without_autocast():
    """A master-weight Policy with autocast=False (the custom-policy example of the levels
    docs) died at a frozen layer: its weight keeps fp32 (no master holds it) and the inputs
    were cast to bf16 with no autocast to meet them. It computes with its weight cast per
    call, as autocast would, and keeps its fp32 value."""
    policy = mp.Policy(param_dtype="bf16", compute_dtype="bf16", output_dtype=None,
                       keep_fp32=(nn.LayerNorm,), master_weights=True, autocast=False,
                       cast_inputs=True)
    for frozen in (True, False):  # frozen, or trained but not in the optimizer given
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
        if frozen:
            net[0].requires_grad_(False)
        kept = net[0].weight.detach().clone()
        net, opt = mp.prepare(net, torch.optim.SGD([p for p in net[1:].parameters()], lr=0.1),
                              policy=policy)
        assert net[0].weight.dtype == FP32 and net[3].weight.dtype == BF16
        x = torch.randn(8, 16)
        out = net(x)
        with torch.no_grad():
            h = F.linear(x.to(BF16), kept.to(BF16), net[0].bias.to(BF16))
            h = F.layer_norm(h.float(), (64,), net[1].weight, net[1].bias)
            expected = F.linear(F.gelu(h.to(BF16)), net[3].weight, net[3].bias)
        assert out.dtype == BF16 and torch.equal(out, expected)
        before = net[3].weight.detach().clone()
        out.float().square().mean().backward()
        opt.step()
        assert torch.equal(net[0].weight, kept)  # never rounded
        assert not torch.equal(net[3].weight, before)


# -- recomputation ---------------------------------------------------------------------------------
class Blocks(nn.Module):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU())
                                    for _ in range(2))
        self.head = nn.Linear(16, 4)
        self.mode = mode

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            if self.mode is None:
                h = h + torch.softmax(block(h), dim=-1)
            else:
                h = h + torch.softmax(checkpoint(block, h, use_reentrant=self.mode == "r"), -1)
        return self.head(h)


@pytest.mark.parametrize("ops", [{}, {"fp32_ops": ["gelu"]}, {"low_precision_ops": ["softmax"]}])
@pytest.mark.parametrize("mode", ["r", "nr"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_recomputed_forward_runs_under_the_same_op_lists(level, mode, ops):
    grads = []
    for m in (None, mode):
        model = mp.prepare(Blocks(m), level=level, dtype="bf16", **ops)
        model(torch.randn(4, 8)).float().square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for g, h in zip(*grads):
        assert torch.equal(g, h)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("mode", ["r", "nr"])
def test_a_checkpointed_module_recomputes_under_the_same_op_lists_when_compiled(mode):
    # (that warning: torch.compile's own look at a tensor's .grad, which it hides itself
    # unless warnings are errors, as in this suite)
    """Traced, the region wrappers re-entered nothing (the lists were taken as inlined), but
    torch.compile traces a checkpointed call in a subgraph of its own: its softmax and layer
    norms ran in bf16 (the output 9e-4 off, gradients 0.6%). As eager now."""
    out, grads = [], []
    for m, compiled in ((None, False), (mode, True)):
        model = mp.prepare(Blocks(m), level="O1", dtype="bf16")
        run = torch.compile(model, backend="aot_eager") if compiled else model
        torch._dynamo.reset()
        y = run(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
        y.float().square().mean().backward()
        out.append(y)
        grads.append([p.grad for p in model.parameters()])
    assert torch.equal(out[0], out[1])
    for g, h in zip(*grads):
        assert torch.equal(g, h)


class OffBlock(nn.Module):
    """A part the forward keeps out of autocast (``torch.autocast(enabled=False)``, apex's
    ``disable_casts``), checkpointed or not."""

    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.mode = mode

    def forward(self, x):
        h = self.stem(x)
        with torch.autocast("cpu", enabled=False):
            h = h.float()
            h = (self.block(h) if self.mode is None
                 else checkpoint(self.block, h, use_reentrant=self.mode == "r"))
        return self.head(h)


@pytest.mark.parametrize("mode", ["r", "nr"])
def test_a_module_checkpointed_with_autocast_off_recomputes_with_autocast_off(mode):
    """The recomputation re-entered the region's whole context, autocast included: the block
    computed in bf16 where its first forward ran in fp32 (gradients 0.35% off; without
    reentrance torch's checkpoint refused the mismatch). torch restores the autocast state of
    the checkpoint's call; the recomputation keeps it."""
    grads = []
    for m in (None, mode):
        model = mp.prepare(OffBlock(m), level="O1", dtype="bf16")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        model(x).float().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for g, h in zip(*grads):
        assert torch.equal(g, h)


def _attend(h):  # a function, not a module: no region wrapper re-enters anything for it
    return torch.softmax(h, -1) * h


class Checkpointed(nn.Module):
    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out, self.how = nn.Linear(8, 16), nn.Linear(16, 4), how

    def forward(self, x):
        h = self.inp(x)
        if self.how is None:
            h = _attend(h)
        elif self.how[0] == "mixprec":
            h = mp.activation_checkpoint(_attend, h, use_reentrant=self.how[1])
        else:
            h = checkpoint(_attend, h, use_reentrant=self.how[1])
        return self.out(h)


@pytest.mark.parametrize("ops", [{}, {"fp32_ops": ["gelu"]}, {"dtype": "fp16"}])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_checkpointed_function_recomputes_under_the_same_op_lists(level, reentrant, ops):
    """torch's checkpoint of a function (not a module) recomputed without the op lists: the
    non-reentrant one refused the recomputed softmax's dtype, the reentrant one made gradients
    1.9e-3 off. mp.activation_checkpoint re-enters them: bitwise the uncheckpointed gradients."""
    kw = {"dtype": "bf16", **ops}
    grads = []
    for how in (None, ("mixprec", reentrant)):
        model = mp.prepare(Checkpointed(how), level=level, **kw)
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
              ).float().square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for g, h in zip(*grads):
        assert torch.equal(g, h)


def test_torchs_checkpoint_of_a_function_is_refused_with_what_to_write_instead():
    amp = mp.MixedPrecision(level="O2", dtype="bf16")
    model = Checkpointed(("torch", False))
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = model(torch.randn(4, 8)).float().square().mean()
    with pytest.raises(torch.utils.checkpoint.CheckpointError,
                       match=r"(?s)dtype.*mp\.activation_checkpoint\(fn"):
        amp.backward(loss)
    with pytest.raises(TypeError, match="callable"):
        mp.activation_checkpoint(None)
    x = torch.randn(3, requires_grad=True)  # outside any mixprec block: torch's
    torch.testing.assert_close(mp.activation_checkpoint(torch.sin, x, use_reentrant=False),
                               torch.sin(x), rtol=0, atol=0)


def test_checkpoint_sequential_and_hugging_face_gradient_checkpointing():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64,
                                     n_positions=16, attn_implementation="eager")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        model.train()
        if ckpt:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        mp.prepare(model, level="O2", dtype="bf16")
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    seq = mp.prepare(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8),
                                   nn.Softmax(-1)), level="O1", dtype="bf16")
    x = torch.randn(4, 8, requires_grad=True)
    out = seq.forward.context.run(checkpoint_sequential, (seq, 2, x),
                                  {"use_reentrant": False})
    out.sum().backward()
    assert out.dtype == FP32  # the softmax ran in fp32, as the op lists say, both times


# -- the forward's signature -----------------------------------------------------------------------
class HFStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = None if labels is None else F.cross_entropy(logits.float().flatten(0, 1),
                                                           labels.flatten())
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_prepared_forward_keeps_its_signature(level):
    model = HFStyle()
    before = inspect.signature(model.forward)
    mp.prepare(model, level=level, dtype="bf16")
    assert inspect.signature(model.forward) == before
    mp.to_float(layer := nn.Linear(2, 2), "bf16")
    assert list(inspect.signature(layer.forward).parameters) == ["input"]


def test_hugging_face_trainer_keeps_the_input_columns(tmp_path):
    """transformers.Trainer drops the columns forward's signature does not name: 0.2's
    (*args, **kwargs) made it drop all of them ('You have to specify input_ids')."""
    transformers = pytest.importorskip("transformers")
    model = mp.prepare(HFStyle(), level="O1", dtype="bf16")
    ids = torch.randint(0, 16, (8, 6), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": i, "labels": i, "extra": torch.tensor(0)} for i in ids]
    args = transformers.TrainingArguments(tmp_path, per_device_train_batch_size=4, max_steps=2,
                                          report_to=[], use_cpu=True, save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    assert trainer.train().training_loss > 0


# -- norm layers of model zoos ---------------------------------------------------------------------
class ZooRMSNorm(nn.Module):  # Hugging Face's LlamaRMSNorm / T5LayerNorm shape
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype)


class AdaLayerNorm(nn.Module):  # a module that holds layers is not a norm layer itself
    def __init__(self, n):
        super().__init__()
        self.proj = nn.Linear(n, n)
        self.norm = nn.LayerNorm(n)

    def forward(self, x):
        return self.norm(x) * self.proj(x)


def test_norm_layers_of_model_zoos_are_recognised_by_their_documented_rule():
    for layer in (nn.LayerNorm(4), nn.BatchNorm2d(4), nn.GroupNorm(2, 4), ZooRMSNorm(4)):
        assert mp.is_norm_layer(layer) and isinstance(layer, mp.NormLayer)
    for layer in (nn.Linear(4, 4), AdaLayerNorm(4), nn.Identity()):
        assert not mp.is_norm_layer(layer)
    with pytest.raises(TypeError, match="marker"):
        mp.NormLayer()
    model = nn.Sequential(nn.Linear(4, 4), ZooRMSNorm(4), AdaLayerNorm(4))
    mp.prepare(model, level="O2", dtype="bf16")
    assert model[1].weight.dtype == FP32  # kept fp32, as torch's norms
    assert model[2].proj.weight.dtype == BF16 and model[2].norm.weight.dtype == FP32


@pytest.mark.parametrize("name", ["LlamaRMSNorm", "T5LayerNorm"])
def test_hugging_face_norms_stay_fp32_at_o2(name):
    transformers = pytest.importorskip("transformers")
    if name == "LlamaRMSNorm":
        norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(8)
    else:
        norm = transformers.models.t5.modeling_t5.T5LayerNorm(8)
    model = nn.Sequential(nn.Linear(8, 8), norm, nn.Linear(8, 8))
    mp.prepare(model, level="O2", dtype="bf16")
    assert model[1].weight.dtype == FP32 and model[0].weight.dtype == BF16
    assert torch.isfinite(model(torch.randn(2, 8))).all()


@pytest.mark.parametrize("policy", [
    lambda: mp.Policy.from_level("O0").replace(modules={"0": "bf16"}),
    lambda: mp.Policy(overrides={nn.Linear: "bf16"}),
])
def test_a_16_bit_module_entry_in_an_fp32_policy_computes_in_16_bits(policy):
    """An fp32 policy counted as "not mixed", so prepare left the model as it was: the entry was
    recorded (``policy_of`` showed it) and ignored, while the same entry written by ``to_float``
    (an equal policy) computed in bf16."""
    net = mlp()
    model = mp.prepare(net, policy=policy())
    with mp.debug.op_stats() as stats:
        out = model(torch.randn(4, 8))
    assert stats.count(op="addmm", dtype="bf16") >= 1 and out.dtype == FP32
    marked = mlp()
    mp.to_float(marked[0], "bf16")
    marked = mp.prepare(marked, level="O0")
    x = torch.randn(4, 8)
    if mp.policy_of(model) == mp.policy_of(marked):
        assert torch.equal(model(x), marked(x))


@pytest.mark.parametrize("make,policy", [
    (lambda: nn.Sequential(nn.Linear(4, 2)),
     lambda: mp.Policy("bf16", "fp32", master_weights=True, autocast=True, cast_inputs=True)),
    (lambda: nn.Sequential(nn.Linear(4, 2)),
     lambda: mp.Policy("bf16", "fp32", master_weights=True, cast_inputs=True)),
    (lambda: nn.Linear(4, 2),  # the root's own parameters
     lambda: mp.Policy("fp16", "bf16", master_weights=True, cast_inputs=True)),
    (lambda: nn.Linear(4, 2).requires_grad_(False),  # frozen fp32 weights on the root
     lambda: mp.Policy("bf16", "bf16", master_weights=True, cast_inputs=True)),
])
def test_parameters_stored_apart_from_the_compute_dtype_are_cast_for_the_call(make, policy):
    """Policies whose storage and compute dtypes differ died at the first GEMM ("mat1 and mat2
    must have the same dtype"): nothing cast bf16 weights for fp32 compute, nor the root
    module's own parameters. Each computes in its compute dtype from its weights' values."""
    torch.manual_seed(0)
    net = make()
    pol = policy()
    trained = [p for p in net.parameters() if p.requires_grad]
    model = (mp.prepare(net, torch.optim.SGD(trained, lr=0.1), policy=pol)[0] if trained
             else mp.prepare(net, policy=pol))
    x = torch.randn(3, 4)
    out = model(x)
    assert out.dtype == FP32
    layer = model if isinstance(model, nn.Linear) else model[0]
    with torch.no_grad():
        expected = F.linear(x.to(pol.compute_dtype), layer.weight.to(pol.compute_dtype),
                            layer.bias.to(pol.compute_dtype)).float()
    assert torch.equal(out, expected)


def test_an_fp32_policy_casts_its_outputs_to_its_output_dtype():
    """``Policy(output_dtype="bf16")`` with fp32 storage and compute returned fp32: nothing
    was installed on a policy that changes no parameter."""
    model = mp.prepare(mlp(), policy=mp.Policy(output_dtype="bf16"))
    assert model(torch.randn(2, 8)).dtype == BF16


class _Frozen(nn.Module):
    """A block whose method reads its own frozen fp32 weight (cast per call under a master
    policy without autocast)."""

    def __init__(self, checkpointed, reentrant=False):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.out = nn.Linear(8, 4)
        self.checkpointed, self.reentrant = checkpointed, reentrant

    def mix(self, h):
        return torch.tanh(h @ self.w)

    def forward(self, x):
        h = self.inp(x)
        h = (mp.activation_checkpoint(self.mix, h, use_reentrant=self.reentrant)
             if self.checkpointed else self.mix(h))
        return self.out(h)


_NO_AUTOCAST = dict(param_dtype="bf16", compute_dtype="bf16", output_dtype=None,
                    master_weights=True, autocast=False, cast_inputs=True)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_method_reads_its_parameters_cast_again(reentrant):
    """Recomputed after its module's call returned, the method read the stored fp32 weight
    (its per-call bf16 cast undone): "expected m1 and m2 to have the same dtype"."""
    grads = []
    for checkpointed in (False, True):
        net = _Frozen(checkpointed, reentrant)
        model, _ = mp.prepare(net, torch.optim.SGD([p for p in net.parameters()
                                                    if p.requires_grad], lr=0.1),
                              policy=mp.Policy(**_NO_AUTOCAST))
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
              ).float().square().mean().backward()
        grads.append([p.grad for p in model.parameters() if p.requires_grad])
        assert model.w.dtype == FP32
    for g, h in zip(*grads):
        assert torch.equal(g, h)


def test_a_forward_that_writes_or_replaces_a_cast_parameter_keeps_the_change():
    """A max-norm clamp of a per-call-cast weight inside forward went to the temporary copy
    (lost); a parameter the forward replaced was put back after the call."""
    class Writes(_Frozen):
        def forward(self, x):
            with torch.no_grad():
                self.w.clamp_(max=0.5)
            return super().forward(x)

    class Replaces(_Frozen):
        def forward(self, x):
            out = super().forward(x)
            self.w = nn.Parameter(torch.full((8, 8), 0.25), requires_grad=False)  # (after use)
            return out

    for cls, check in ((Writes, lambda w: w.max().item() == 0.5),
                       (Replaces, lambda w: torch.equal(w, torch.full((8, 8), 0.25)))):
        net = cls(False)
        model, _ = mp.prepare(net, torch.optim.SGD([p for p in net.parameters()
                                                    if p.requires_grad], lr=0.1),
                              policy=mp.Policy(**_NO_AUTOCAST))
        model(torch.randn(4, 8))
        assert check(model.w) and model.w.dtype == FP32, cls.__name__


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_forward_writes_into_its_list_and_dict_arguments_as_in_fp32(level):
    """The entry cast of O2/O3 (and an island's) rebuilt every list and dict argument: a forward
    appending to a feature list or setting a key in a dict got copies, the caller saw nothing.
    A container with nothing to cast is passed as it is (one holding a cast tensor is new, as
    the tensor is)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, feats, info):
            y = self.lin(x)
            feats.append(y)
            info["steps"] = info.get("steps", 0) + 1
            return y

    model = mp.prepare(Net(), level=level, dtype="bf16")
    feats, info = [], {"name": "run"}
    model(torch.randn(2, 4), feats, info)
    assert len(feats) == 1 and info == {"name": "run", "steps": 1}
    island = mp.to_float(Net(), "bf16")
    island(torch.randn(2, 4), feats, info)
    assert len(feats) == 2 and info["steps"] == 2
