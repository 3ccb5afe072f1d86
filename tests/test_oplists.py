"""Op-list names: qualified spellings, what op_stats shows next to ATen names, and names a
model's code never reaches (with what to use instead)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec import debug, oplists

# bf16 on a CPU without native bf16 kernels warns that it is emulated; not what these test
pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

# ----------------------------------------------------------------------------- spellings


@pytest.mark.parametrize("qualified, flat", [
    ("torch.add", "add"), ("Tensor.add", "add"), ("torch.Tensor.add", "add"),
    ("torch.nn.functional.gelu", "gelu"), ("F.gelu", "gelu"), ("nn.functional.gelu", "gelu"),
    ("torch.linalg.vector_norm", "linalg_vector_norm"), ("torch.special.erf", "special_erf"),
    (" softmax ", "softmax"), ("add", "add"),
])
def test_qualified_names_are_accepted_as_the_flat_name(qualified, flat):
    assert oplists.normalize_op_name(qualified) == flat
    assert oplists.resolve_op(qualified) == oplists.resolve_op(flat)


def test_lists_store_flat_names_and_catch_conflicts_across_spellings():
    assert oplists.validate_custom_lists(["torch.add", "add"], ["torch.nn.functional.gelu"]) == (
        ("add",), ("gelu",), ())
    lists = mp.op_lists("cpu", "bf16", fp32_ops=["torch.mm"], low_precision_ops=["F.gelu"])
    assert "mm" in lists["fp32"] and "mm" not in lists["low_precision"]
    assert "gelu" in lists["low_precision"] and "F.gelu" not in lists["low_precision"]
    with pytest.raises(ValueError, match="'add' named in both"):
        mp.autocast("bf16", device_type="cpu", low_precision_ops=["torch.add"], fp32_ops=["add"])
    with pytest.raises(ValueError, match="unknown op name 'torch.nope'"):
        oplists.resolve_op("torch.nope")
    with pytest.raises(ValueError, match="unknown op name 'torch.nn.init.normal_'"):
        oplists.resolve_op("torch.nn.init.normal_")
    with pytest.raises(ValueError, match="non-empty string"):
        oplists.normalize_op_name("  ")


@pytest.mark.parametrize("spelling", ["add", "torch.add", "Tensor.add"])
def test_qualified_name_moves_the_op_and_its_reflected_operator(spelling):
    x = torch.randn(4)
    with mp.autocast("bf16", device_type="cpu", low_precision_ops=[spelling]):
        assert torch.add(x, x).dtype == torch.bfloat16
        assert (x + x).dtype == torch.bfloat16
        assert (1.0 + x).dtype == torch.bfloat16  # Tensor.__radd__
    assert (1.0 + x).dtype == torch.float32


def test_qualified_functional_name_runs_gelu_in_fp32():
    h = torch.randn(4, 8)
    with mp.autocast("bf16", device_type="cpu", low_precision_ops=["torch.nn.functional.gelu"]):
        assert F.gelu(h).dtype == torch.bfloat16
    with mp.autocast("bf16", device_type="cpu", fp32_ops=["F.gelu"]):
        assert F.gelu(h.bfloat16()).dtype == torch.float32


_LISTED = sorted({n for tables in oplists.TORCH_DEFAULTS.values() for names in tables.values()
                  for n in names} | set(oplists.MIXPREC_FP32_ADDITIONS))


def test_every_listed_name_stands_for_its_c_bindings_too():
    """``F.mse_loss`` wraps ``torch._C._nn.mse_loss``, which torch's code calls directly: a
    moved name moved only the wrapper. Every listed name that names a Python function stands
    for its ``torch._C._nn`` / ``torch._C._VariableFunctions`` binding as well."""
    twins = 0
    for name in _LISTED:
        try:
            found = oplists.resolve_op(name)
        except ValueError:  # an ATen-only name of torch's tables (say upsample_nearest2d)
            continue
        for ns in (torch._C._nn, torch._C._VariableFunctions):
            fn = getattr(ns, name, None)
            if callable(fn):
                assert fn in found, (name, ns.__name__)
                assert oplists.op_list_name(fn) == name
                twins += fn is not getattr(torch, name, None)
    assert twins >= 15  # mse_loss, l1_loss, nll_loss, ..., einsum, cdist, norm, stft, ...


@pytest.mark.parametrize("op, args", [
    ("mse_loss", (torch.randn(4), torch.randn(4))),
    ("l1_loss", (torch.randn(4), torch.randn(4))),
    ("smooth_l1_loss", (torch.randn(4), torch.randn(4))),
])
def test_a_moved_op_moves_at_both_entry_points(op, args):
    python_level = getattr(F, op, None) or getattr(torch, op)
    binding = getattr(torch._C._nn, op, None) or getattr(torch._C._VariableFunctions, op)
    assert python_level is not binding
    for call in (python_level, binding):  # fp32 in torch's CPU list; moved to bf16
        with mp.autocast("bf16", device_type="cpu", low_precision_ops=[op]):
            assert call(*args).dtype == torch.bfloat16, call
        with mp.autocast("bf16", device_type="cpu"):
            assert call(*args).dtype == torch.float32, call


def test_a_binding_moved_to_fp32_inside_a_prepared_model():
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            out = torch._C._VariableFunctions.einsum("ij,ij->i", [h, h])
            self.seen = out.dtype
            return out

    x = torch.randn(2, 4)
    plain = mp.prepare(Loss(), level="O1", dtype="bf16")
    plain(x)
    assert plain.seen == torch.bfloat16  # einsum follows its inputs on the CPU
    model = mp.prepare(Loss(), level="O1", dtype="bf16", fp32_ops=["einsum"])
    model(x)
    assert model.seen == torch.float32


@pytest.mark.parametrize("func, name", [
    (F.linear, "linear"), (torch.Tensor.__add__, "add"), (torch.Tensor.__radd__, "add"),
    (torch.Tensor.__rtruediv__, "div"), (torch.Tensor.__matmul__, "matmul"),
    (torch.linalg.vector_norm, "linalg_vector_norm"), (F.layer_norm, "layer_norm"),
    (torch.Tensor.to, "to"), (len, None), ("not callable", None),
])
def test_op_list_name_of_python_callables(func, name):
    assert oplists.op_list_name(func) == name


# ----------------------------------------------------------------------------- op_stats


def test_op_stats_names_what_op_lists_accept_forward_and_backward():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with debug.op_stats() as stats:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(4, 8))
        out.float().sum().backward()
    names = stats.list_names()
    assert names["addmm"] == ["linear"] and names["mm"] == ["linear"]  # backward too
    assert names["relu"] == ["relu"]
    assert stats.count(op="addmm", list_name="linear") == 2
    assert stats.count(op="mm", phase="backward", list_name="linear") == 3
    assert stats.count(list_name="addmm") == 0
    # the casts autocast inserts (input, weight and bias of the first layer, weight and bias
    # of the second) ran beneath linear; out.float() is a cast of its own
    assert stats.inputs("_to_copy", phase="forward") == {"fp32 -> bf16": 5, "bf16 -> fp32": 1}
    assert stats.count(op="_to_copy", phase="forward", list_name="linear") == 5
    assert stats.count(op="_to_copy", phase="forward", list_name="float") == 1


# O2 keeps LayerNorm's parameters in fp32 and (on CPU) feeds it bf16 activations: its kernel
# reads both, so "bf16" alone would hide the fp32 parameters.
@pytest.mark.parametrize("level, inputs", [("O0", "fp32"), ("O1", "fp32"),
                                           ("O2", "bf16 in, fp32 params"), ("O3", "bf16")])
def test_op_stats_say_what_layer_norm_read(level, inputs):
    model = mp.prepare(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2)),
                       level=level, dtype="bf16")
    with debug.op_stats() as stats:
        model(torch.randn(4, 8))
    assert stats.inputs("native_layer_norm") == {inputs: 1}, stats.table()
    row = next(line for line in stats.table().splitlines() if line.startswith("native_layer_norm"))
    assert "layer_norm" in row.split() and row.endswith(inputs)


@pytest.mark.parametrize("args, out, label", [
    ((torch.ones(2),), torch.float32, "fp32"),
    ((torch.ones(2),), torch.bfloat16, "fp32 -> bf16"),
    ((torch.ones(2, dtype=torch.bfloat16), nn.Parameter(torch.ones(2))), torch.bfloat16,
     "bf16 in, fp32 params"),
    ((torch.ones(2, dtype=torch.bfloat16), nn.Parameter(torch.ones(2))), torch.float32,
     "bf16 in, fp32 params -> fp32"),
    ((torch.ones(2, dtype=torch.bfloat16), torch.ones(2)), torch.bfloat16, "mixed bf16+fp32"),
    ((torch.ones(2, dtype=torch.long),), torch.float32, None),
])
def test_inputs_label(args, out, label):
    assert debug.opstats.inputs_label(args, {}, out) == label


# Which list names each module type's ops run beneath, and which ATen ops sit beneath those
# names: checked against what really runs, so MODULE_FUNCTIONS and OPS_BENEATH stay true.
MODULE_CASES = {
    "Linear": (lambda: nn.Linear(4, 4), lambda: torch.randn(2, 3, 4)),
    "Conv1d": (lambda: nn.Conv1d(2, 2, 3), lambda: torch.randn(1, 2, 8)),
    "Conv2d": (lambda: nn.Conv2d(2, 2, 3), lambda: torch.randn(1, 2, 6, 6)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(2, 2, 3), lambda: torch.randn(1, 2, 6, 6)),
    "LayerNorm": (lambda: nn.LayerNorm(4), lambda: torch.randn(2, 4)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), lambda: torch.randn(2, 4, 3)),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(4), lambda: torch.randn(3, 4)),
    "RMSNorm": (lambda: nn.RMSNorm(4), lambda: torch.randn(2, 4)),
    "Softmax": (lambda: nn.Softmax(-1), lambda: torch.randn(2, 4)),
    "LogSoftmax": (lambda: nn.LogSoftmax(-1), lambda: torch.randn(2, 4)),
    "GELU": (lambda: nn.GELU(), lambda: torch.randn(2, 4)),
    "Dropout": (lambda: nn.Dropout(0.5), lambda: torch.randn(2, 4)),
    "Embedding": (lambda: nn.Embedding(5, 4), lambda: torch.tensor([1, 2])),
    "MultiheadAttention": (lambda: nn.MultiheadAttention(4, 2, batch_first=True),
                           lambda: torch.randn(2, 3, 4)),
    "LSTM": (lambda: nn.LSTM(4, 4, batch_first=True), lambda: torch.randn(2, 3, 4)),
    "GRU": (lambda: nn.GRU(4, 4), lambda: torch.randn(3, 2, 4)),
    "RNN": (lambda: nn.RNN(4, 4), lambda: torch.randn(3, 2, 4)),
    "Bilinear": (lambda: nn.Bilinear(3, 3, 2), lambda: torch.randn(2, 3)),
    "EmbeddingBag": (lambda: nn.EmbeddingBag(5, 4), lambda: torch.tensor([[1, 2], [0, 3]])),
    "InstanceNorm1d": (lambda: nn.InstanceNorm1d(4, affine=True), lambda: torch.randn(2, 4, 5)),
}


def _accepted(name: str) -> bool:
    try:
        oplists.resolve_op(name)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_module_tables_match_what_runs(case):
    make, make_input = MODULE_CASES[case]
    module, x = make(), make_input()
    args = {nn.MultiheadAttention: (x, x, x), nn.Bilinear: (x, x)}.get(type(module), (x,))
    with debug.op_stats() as stats:
        module(*args)
    seen = stats.list_names(phase="forward")
    expected = set(oplists.MODULE_FUNCTIONS[next(c for c in type(module).__mro__
                                                 if c in oplists.MODULE_FUNCTIONS)])
    if isinstance(module, nn.RNN):  # one of its two functions, by nonlinearity
        expected = {f"rnn_{module.nonlinearity}"}
    by_name: dict[str, set[str]] = {}
    for op, names in seen.items():
        for name in names:
            by_name.setdefault(name, set()).add(op)
    assert expected <= set(by_name), stats.table()
    for name in expected:
        beneath = {op for op in by_name[name] if op != name and _accepted(op)}
        assert beneath <= oplists.OPS_BENEATH.get(name, frozenset()), (name, beneath)


def test_ops_beneath_are_names_op_lists_accept():
    for name, beneath in oplists.OPS_BENEATH.items():
        assert _accepted(name), name
        assert all(_accepted(op) for op in beneath), (name, sorted(op for op in beneath
                                                                   if not _accepted(op)))


# ----------------------------------------------------------------------------- unreachable


class CustomAddmm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.addmm(self.fc.bias, x, self.fc.weight.t())


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)


class Attention(nn.Module):
    """Attention products written with ``@`` (the batched GEMM beneath is matmul's: the
    warning named linear alone, and following it left them in bf16). The source is read:
    this docstring names no ATen op."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


@pytest.mark.parametrize("model, names, expected", [
    (nn.Linear(4, 4), ["addmm"], {"addmm": ("linear",)}),
    (nn.Linear(4, 4), ["torch.mm", "matmul"], {"torch.mm": ("linear",), "matmul": ("linear",)}),
    (nn.Linear(4, 4), ["linear", "F.linear"], {}),
    (nn.Conv2d(2, 2, 3), ["convolution", "_convolution"],
     {"convolution": ("conv2d",), "_convolution": ("conv2d",)}),
    (nn.Conv2d(2, 2, 3), ["conv2d"], {}),
    (nn.Sequential(nn.Conv1d(2, 2, 3), nn.Conv2d(2, 2, 3)), ["convolution"],
     {"convolution": ("conv1d", "conv2d")}),
    (nn.Sequential(nn.LayerNorm(4), nn.Softmax(-1)), ["native_layer_norm", "_softmax"],
     {"native_layer_norm": ("layer_norm",), "_softmax": ("softmax",)}),
    (Wrapper(), ["addmm", "linear"], {"addmm": ("linear",)}),
    (CustomAddmm(), ["addmm"], {}),             # its own forward calls torch.addmm
    (Attention(), ["bmm", "matmul"], {"bmm": ("linear", "matmul")}),
    (nn.Linear(4, 4), ["softmax", "add"], {}),  # nothing known: no claim
])
def test_unreachable_names(model, names, expected):
    assert oplists.unreachable_names(model, names) == expected


def test_unreachable_names_bad_input():
    with pytest.raises(TypeError, match="nn.Module"):
        oplists.unreachable_names("model", ["addmm"])
    with pytest.raises(ValueError, match="unknown op name 'admm'"):
        oplists.unreachable_names(nn.Linear(2, 2), ["admm"])


def test_prepare_warns_for_an_aten_name_and_says_what_to_use():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.warns(mp.OpListWarning, match="fp32_ops names 'addmm'.*Use 'linear'") as record:
        mp.prepare(model, level="O1", dtype="bf16", fp32_ops=["addmm"])
    assert len(record) == 1 and record[0].filename == __file__
    # the warning is true: the addmm of the Linear layers still ran in bf16
    with debug.op_stats() as stats:
        model(torch.randn(2, 8))
    assert stats.count(op="addmm", dtype="bf16") == 2


def test_prepare_conv_names_warn_and_the_suggested_name_works():
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU())
    with pytest.warns(mp.OpListWarning, match="'_convolution'.*conv2d"):
        mp.prepare(net, level="O1", dtype="bf16", low_precision_ops=["_convolution"])
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.prepare(net, level="O1", dtype="bf16", fp32_ops=["conv2d"])
    with debug.op_stats() as stats:
        net(torch.randn(1, 2, 6, 6))
    assert stats.count(op="convolution", dtype="fp32", list_name="conv2d") == 1, stats.table()


def test_prepare_does_not_warn_for_reachable_names():
    model = Wrapper()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.prepare(model, level="O2", dtype="bf16", fp32_ops=["linear", "torch.softmax"])
    with debug.op_stats() as stats:
        model(torch.randn(2, 4))
    assert stats.count(op="addmm", dtype="fp32", list_name="linear") == 2, stats.table()
