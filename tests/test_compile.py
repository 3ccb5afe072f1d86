"""A prepared model compiles to one graph (no break caused by mixprec), gives the eager results,
and mixprec's code warns nothing under torch.compile."""

import os
import warnings

import pytest
import torch

import mixprec as mp
from mixprec.benchmodels import TinyGPT

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")

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
