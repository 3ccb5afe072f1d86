"""A prepared model's outputs: fp32 where read, and no copy of a field nobody reads when the model
computed its own loss."""

import dataclasses
import pickle

import pytest
import torch

import mixprec as mp
from mixprec.autocast import cast_floating
from mixprec.outputs import cast_outputs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def test_logits_stay_uncast_until_read_and_read_as_fp32():
    model = mp.prepare(_gpt2(), level="O2", dtype="bf16")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    assert out.loss.dtype == torch.float32
    assert out.__dict__["logits"].dtype == torch.bfloat16  # not copied yet
    logits = out.logits
    assert logits.dtype == torch.float32 and out.logits is logits  # cast once
    assert out["logits"] is logits and out[1] is logits and out.to_tuple()[1] is logits
    assert out.get("logits") is logits and dict(out.items())["logits"] is logits
    assert all(v.dtype == torch.float32 for v in out.values() if isinstance(v, torch.Tensor))
    torch.testing.assert_close(logits, out.__dict__["logits"].float(), rtol=0, atol=0)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
    loaded = pickle.loads(pickle.dumps(out))
    assert type(loaded) is transformers.modeling_outputs.CausalLMOutputWithCrossAttentions
    assert loaded.logits.dtype == torch.float32
    out.loss.backward()  # the loss is the model's own, unchanged


def test_the_loss_and_logits_match_the_eager_cast():
    model = mp.prepare(_gpt2(), level="O2", dtype="bf16")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    raw = transformers.modeling_outputs.CausalLMOutputWithCrossAttentions(
        loss=out.__dict__["loss"], logits=out.__dict__["logits"])
    eager = cast_floating(raw, torch.float32)
    torch.testing.assert_close(out.loss, eager.loss, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, eager.logits, rtol=0, atol=0)


def test_outputs_without_a_loss_are_cast_at_once():
    model = mp.prepare(_gpt2(), level="O2", dtype="bf16")
    out = model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert out.__dict__["logits"].dtype == torch.float32
    plain = cast_outputs((torch.ones(2, dtype=torch.bfloat16),), torch.float32)
    assert plain[0].dtype == torch.float32


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    hidden: tuple
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class _Frozen:
    logits: torch.Tensor


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_plain_dataclass_output_is_cast_to_the_output_dtype(level):
    """A model returning a plain ``@dataclass`` (not a pytree node): its fields are cast as a
    tuple's are (its logits came back bf16 under an fp32 output policy, and an fp16 loss made
    from them overflowed)."""
    class Net(torch.nn.Module):
        def __init__(self, frozen):
            super().__init__()
            self.lin, self.frozen = torch.nn.Linear(4, 4), frozen

        def forward(self, x):
            y = self.lin(x)
            return _Frozen(y) if self.frozen else _Out(y, (y, 3))

    for frozen in (False, True):
        model = mp.prepare(Net(frozen), level=level, dtype="bf16")
        out = model(torch.randn(2, 4))
        assert out.logits.dtype == torch.float32
        if not frozen:
            assert out.hidden[0].dtype == torch.float32 and out.hidden[1] == 3
            assert out.note == "kept"
    assert cast_floating(_Out(torch.ones(1), ()), torch.bfloat16).logits.dtype == torch.bfloat16


@dataclasses.dataclass
class _Late:
    logits: torch.Tensor
    aux: torch.Tensor | None = dataclasses.field(init=False, default=None)

    def __post_init__(self):
        self.made = getattr(self, "made", 0) + 1


def test_a_dataclass_field_set_after_init_is_cast_not_dropped():
    """A field declared ``init=False`` and set by the forward came back as its default (None):
    the cast rebuilt the object through ``__init__``; it is a shallow copy with cast fields now,
    ``__post_init__`` not run again."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            out = _Late(self.lin(x))
            out.aux = out.logits.sum()
            return out

    out = mp.prepare(Net(), level="O2", dtype="bf16")(torch.randn(2, 4))
    assert out.logits.dtype == out.aux.dtype == torch.float32
    assert torch.allclose(out.aux, out.logits.sum(), rtol=1e-2, atol=1e-2)  # (bf16's sum)
    assert out.made == 1
