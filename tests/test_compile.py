"""A prepared model compiles to one graph (no break caused by mixprec), gives the eager results,
and mixprec's code warns nothing under torch.compile."""

import functools
import os
import warnings

import pytest
import torch

import mixprec as mp
from mixprec.benchmodels import TinyGPT

pytestmark = [pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")]

MIXPREC_DIR = os.path.dirname(mp.__file__)


def tiny_gpt(level):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, depth=2, heads=2, seq_len=16)
    return model if level is None else mp.prepare(model, level=level, dtype="bf16")


def tokens():
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def mixprec_warnings(record):
    return [w for w in record if os.path.dirname(w.filename).startswith(MIXPREC_DIR)]


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_prepared_model_traces_to_one_graph_without_breaks(level):
    model = tiny_gpt(level)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(model)(tokens())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        [str(b.reason) for b in explained.break_reasons]
    assert mixprec_warnings(record) == []


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_compiled_prepared_model_gives_the_eager_results(level):
    model = tiny_gpt(level)
    x = tokens()
    eager = model(x)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = torch.compile(model)(x)
    assert compiled.dtype == eager.dtype == torch.float32
    # inductor keeps fused intermediates in fp32 where eager rounds them to bf16: bf16 tolerance
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    assert mixprec_warnings(record) == []


@pytest.mark.slow
# dynamo itself reads .grad of non-leaf tensors while it traces transformers' loss
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_hugging_face_gpt2_gets_no_more_graphs_than_under_torch_autocast():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    ids = tokens()[:, :8]

    def explain(level):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        if level is not None:
            fn = mp.prepare(model, level=level, dtype="bf16")
        else:
            def fn(**kw):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return model(**kw)
        torch._dynamo.reset()
        return torch._dynamo.explain(fn)(input_ids=ids, labels=ids).graph_count

    reference = explain(None)  # transformers' own logging calls break its graph too
    assert explain("O1") == reference and explain("O2") == reference


# -- compile once: counters against torch.autocast over three training steps ----------------------
RECIPES = {"O1": {"level": "O1"}, "O2": {"level": "O2"}, "O3": {"level": "O3"},
           "split": {"level": "O2", "master": "split"},
           "kahan": {"level": "O2", "master": "kahan"},
           "fp8": {"level": "O2", "fp8": "tensorwise"}}


def _compile_counts(build, steps=3):
    """dynamo's counters over the forward and backward of ``steps`` training steps of the model
    ``build()`` returns (``(forward, optimizer)``) compiled with the eager backend (what dynamo
    traces does not depend on the backend); the optimizer steps between are not counted (a
    compact master's own compiled kernels are not the model's graph)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    fn, opt = build()
    compiled = torch.compile(fn, backend="eager")
    x = tokens()
    seen = {"graphs": 0, "frames": 0, "breaks": 0}
    per_step = []
    for _ in range(steps):
        counters.clear()
        compiled(x).float().square().mean().backward()
        step = {"graphs": counters["stats"]["unique_graphs"],
                "frames": counters["frames"]["total"],
                "breaks": sum(counters["graph_break"].values())}
        per_step.append(step)
        for k in seen:
            seen[k] += step[k]
        opt.step()
        opt.zero_grad()
    return seen, per_step


@functools.lru_cache(maxsize=1)
def _autocast_counts():
    def build():
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, dim=32, depth=1, heads=2, seq_len=16)

        def fn(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(x)
        return fn, torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _compile_counts(build)[0]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_compiles_once_like_torch_autocast(recipe):
    """No more graphs, frames or breaks than torch.autocast on the same model, and nothing
    traced again on the second and third steps (a guard on mixprec's own Python state -- the
    island's slot cache counter, a forward pre-hook traced as its own frame -- did that)."""
    if recipe == "fp8":
        pytest.importorskip("torchao")

    def build():
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, dim=32, depth=1, heads=2, seq_len=16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = mp.prepare(model, opt, dtype="bf16", **RECIPES[recipe])
        opt.fused = False  # the optimizer step's own kernels are not under test: no compiling
        return model, opt
    reference = _autocast_counts()
    seen, per_step = _compile_counts(build)
    assert seen == reference, (seen, reference)
    assert reference == {"graphs": 1, "frames": 1, "breaks": 0}
    assert per_step[1:] == [{"graphs": 0, "frames": 0, "breaks": 0}] * 2, per_step


def test_fp8_statistics_record_inside_the_compiled_graph():
    """Recording FP8 statistics (mp.debug.fp8_stats) adds no graph break and no recompile, and
    the compiled steps record what the eager ones do (input, weight and the output gradient,
    through the backward hook)."""
    pytest.importorskip("torchao")
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, depth=1, heads=2, seq_len=16)
    model = mp.prepare(model, dtype="bf16", level="O2", fp8="tensorwise")
    x = tokens()
    with mp.debug.fp8_stats(model) as eager:
        for _ in range(3):
            model(x).float().square().mean().backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with mp.debug.fp8_stats(model) as stats:
        counts = []
        for _ in range(3):
            counters.clear()
            compiled(x).float().square().mean().backward()
            counts.append((counters["stats"]["unique_graphs"], counters["frames"]["total"],
                           sum(counters["graph_break"].values())))
    assert counts == [(1, 1, 0), (0, 0, 0), (0, 0, 0)]
    got, want = stats.summary(), eager.summary()
    assert set(got) == set(want) and len(got) == 3
    for name in want:
        for role in ("input", "weight", "grad_output"):
            assert got[name][role]["calls"] == want[name][role]["calls"] == 3
            # gradients accumulate over the steps (no zero_grad): the same values either way
            assert got[name][role]["amax_max"] == pytest.approx(want[name][role]["amax_max"],
                                                                rel=1e-2)


def _compiled_loop_run(method, how, compiled):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    amp = mp.MixedPrecision(level="O2", dtype="bf16", master=method)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    def step(loss):
        if how == "amp":
            amp.backward(loss)
            amp.clip_grad_norm_(opt, 0.1)
            amp.step(opt)
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()

    step = torch.compile(step) if compiled else step
    x = torch.randn(8, 16)
    for _ in range(3):
        step(model(x).float().pow(2).mean())
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize("method", [None, "split"])
@pytest.mark.parametrize("how", ["opt", "amp"])
def test_a_compiled_function_that_steps_gives_the_eager_steps_bits(method, how):
    """``torch.compile`` of the user's step function (torch's own recipe for compiling an
    optimizer step): the master optimizer's step, zero_grad and the engine's clip and step run
    eagerly inside it (torch._dynamo recursed into a master's ``.grad`` and raised
    RecursionError), with the eager loop's bits."""
    torch._dynamo.reset()
    eager = _compiled_loop_run(method, how, compiled=False)
    compiled = _compiled_loop_run(method, how, compiled=True)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_floating_inputs_in_containers_trace_to_one_graph(level):
    """fp32 inputs in a list and a dict (the entry casts them, rebuilding only what holds a
    cast tensor) compile to one graph with ``fullgraph=True`` (an identity test of the rebuilt
    containers broke the graph at O2 and O3)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

        def forward(self, xs, extra):
            return self.norm(self.lin(xs[0]) + extra["bias"])

    torch.manual_seed(0)
    model = mp.prepare(Net(), level=level, dtype="bf16")
    xs, extra = [torch.randn(2, 8)], {"bias": torch.randn(8), "name": "b"}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(xs, extra), model(xs, extra))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_eager_forward_or_another_thread_does_not_recompile_the_compiled_model(level):
    """A prepared model compiled, called eagerly once (an evaluation, ``mp.Trainer``'s between
    epochs), then compiled again, and called from a new thread: one frame, as under
    ``torch.autocast`` (the trace guarded on a per-thread attribute an eager forward made)."""
    import threading

    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch.manual_seed(0)
    model = mp.prepare(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)),
                       level=level, dtype="bf16")
    compiled = torch.compile(model, backend=counter)
    x = torch.randn(4, 8)
    compiled(x)
    model(x)
    compiled(x)
    thread = threading.Thread(target=compiled, args=(x,))
    thread.start()
    thread.join(timeout=60)
    compiled(x)
    assert counter.frame_count == 1


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_a_compiled_fp16_step_function_compiles_once():
    """``amp.backward`` inside a compiled step function at fp16: the scale runs eagerly, as
    ``GradScaler.scale`` (dynamo traced it, guarding on the engine's backward counter, and
    compiled it again at the second step)."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    amp = mp.MixedPrecision(level="O2", dtype="fp16", emulate_fp16=False)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(x):
        amp.backward(model(x).float().square().mean())
        amp.step(opt)
        opt.zero_grad()

    compiled = torch.compile(step, backend=counter)
    x = torch.randn(4, 8)
    compiled(x)
    frames = counter.frame_count
    for _ in range(3):
        compiled(x)
    assert counter.frame_count == frames
