"""Autocast op lists as data: torch's default cast policies and mixprec's additions.

The tables name ATen ops as torch's autocast registers them (``aten/src/ATen/autocast_mode.*``,
torch 2.4-2.13). Three cast policies: ``low_precision`` (inputs cast to the autocast dtype),
``fp32`` (inputs cast to fp32) and ``promote`` (inputs cast to the widest input dtype).

Custom op lists (``mp.autocast(low_precision_ops=..., fp32_ops=...)``) name Python-level torch
functions ("linear", "softmax", "add"; "torch.add" and "F.gelu" are accepted too) and act where
those functions are called. An ATen op that runs beneath such a function (``addmm`` beneath
``F.linear``, ``native_layer_norm`` beneath ``F.layer_norm``) is out of their reach:
:data:`MODULE_FUNCTIONS` and :data:`OPS_BENEATH` record which functions common modules call and
which ATen ops sit beneath them, and :func:`unreachable_names` uses them to say what to name
instead.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .dtypes import to_dtype

__all__ = ["op_lists", "TORCH_DEFAULTS", "MIXPREC_FP32_ADDITIONS", "resolve_op", "POLICIES",
           "normalize_op_name", "op_list_name", "validate_custom_lists", "MODULE_FUNCTIONS",
           "OPS_BENEATH", "unreachable_names", "warn_unreachable", "OpListWarning"]

POLICIES = ("low_precision", "fp32", "promote")

_CPU_LOW = """conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm _addmm_activation addbmm
linear _convolution matmul conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d
conv_transpose3d prelu scaled_dot_product_attention _native_multi_head_attention"""
_CPU_FP32 = """avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft
cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex cholesky
cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d
max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d
replication_pad2d replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d
hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss huber_loss
margin_ranking_loss soft_margin_loss triplet_margin_loss multi_margin_loss ctc_loss kl_div
multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2
fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft
linalg_cond linalg_matrix_rank linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals
linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv linalg_tensorsolve
fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve fractional_max_pool2d
fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr
linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex"""
_CPU_PROMOTE = "stack cat index_copy"

_CUDA_LOW = """_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
conv_transpose3d convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm
baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell
gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
scaled_dot_product_attention"""
_CUDA_FP32 = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow
softplus layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity
poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss
smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
logsumexp upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_linear1d
upsample_bilinear2d upsample_trilinear3d upsample_bicubic2d prod softmax log_softmax cumprod cumsum
linalg_vector_norm linalg_matrix_norm sum norm"""
_CUDA_PROMOTE = """addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
scatter_add"""


def _table(low: str, fp32: str, promote: str) -> dict[str, frozenset[str]]:
    return {"low_precision": frozenset(low.split()), "fp32": frozenset(fp32.split()),
            "promote": frozenset(promote.split())}


#: torch.autocast's own cast policies per device type.
TORCH_DEFAULTS: dict[str, dict[str, frozenset[str]]] = {
    "cpu": _table(_CPU_LOW, _CPU_FP32, _CPU_PROMOTE),
    "cuda": _table(_CUDA_LOW, _CUDA_FP32, _CUDA_PROMOTE),
}

#: Precision-sensitive ops mixprec keeps in fp32 where torch's list for the device does not:
#: torch's CPU list leaves softmax, logsumexp and the layer/group/RMS norms in low precision
#: where CUDA's list keeps them in fp32. batch_norm is in neither list on purpose: its kernels
#: take low-precision activations with fp32 statistics and parameters and accumulate in fp32.
MIXPREC_FP32_ADDITIONS: frozenset[str] = frozenset(
    "softmax log_softmax logsumexp layer_norm group_norm rms_norm".split())

#: Operators a name also stands for: ``"add"`` catches ``x + y`` and ``1 + x``.
_OPERATOR_NAMES = {"add": ("__add__", "__radd__"), "sub": ("__sub__", "__rsub__"),
                   "mul": ("__mul__", "__rmul__"), "div": ("__truediv__", "__rtruediv__"),
                   "true_divide": ("__truediv__", "__rtruediv__"),
                   "matmul": ("__matmul__", "__rmatmul__"), "pow": ("__pow__", "__rpow__")}
_OPERATOR_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "true_divide": "/",
                     "matmul": "@", "pow": "**"}
_NAMESPACES = (("", torch), ("", F), ("", torch.Tensor), ("linalg_", torch.linalg),
               ("fft_", torch.fft), ("special_", torch.special))
# Qualified spellings -> the flat name (longest prefix first).
_QUALIFIERS = (("torch.nn.functional.", ""), ("nn.functional.", ""), ("F.", ""),
               ("torch.Tensor.", ""), ("Tensor.", ""), ("torch.linalg.", "linalg_"),
               ("torch.fft.", "fft_"), ("torch.special.", "special_"), ("torch.", ""))


def normalize_op_name(name: str) -> str:
    """The flat op-list name of a qualified spelling.

    ``"torch.add"``, ``"Tensor.add"`` -> ``"add"``; ``"torch.nn.functional.gelu"``, ``"F.gelu"``
    -> ``"gelu"``; ``"torch.linalg.vector_norm"`` -> ``"linalg_vector_norm"``. A flat name is
    returned as is (stripped). The name is not checked; :func:`resolve_op` does that.

    Raises:
        ValueError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"an op name must be a non-empty string such as 'add' or 'softmax'; "
                         f"got {name!r}")
    name = name.strip()
    for prefix, replacement in _QUALIFIERS:
        if name.startswith(prefix) and len(name) > len(prefix):
            return replacement + name[len(prefix):]
    return name


@functools.lru_cache(maxsize=None)
def resolve_op(name: str) -> tuple:
    """The Python callables that a user-facing op name stands for (function, method, operator).

    ``"add"`` -> ``(torch.add, torch.Tensor.add, Tensor.__add__, Tensor.__radd__)`` (``x + y``
    reaches ``Tensor.__add__``). Qualified spellings are accepted: ``"torch.add"``,
    ``"F.gelu"``, ``"torch.nn.functional.gelu"``, ``"Tensor.add"`` (see
    :func:`normalize_op_name`).

    Raises:
        ValueError: no function of that name in torch, torch.nn.functional, torch.Tensor,
            torch.linalg, torch.fft or torch.special.
    """
    flat = normalize_op_name(name)
    found = []
    if "." not in flat:
        for prefix, ns in _NAMESPACES:
            if prefix and not flat.startswith(prefix):
                continue
            fn = getattr(ns, flat[len(prefix):], None)
            if callable(fn) and not isinstance(fn, type) and fn not in found:
                found.append(fn)
        for dunder in _OPERATOR_NAMES.get(flat, ()):
            found.append(getattr(torch.Tensor, dunder))
    if not found:
        close = difflib.get_close_matches(flat, _known_names(), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown op name {name!r}: not a function of torch, torch.nn.functional, "
                         f"torch.Tensor, torch.linalg, torch.fft or torch.special{hint}")
    return tuple(found)


_DUNDER_TO_NAME = {dunder: name for name, dunders in _OPERATOR_NAMES.items() for dunder in dunders
                   if name != "true_divide"}
_DUNDER_TO_NAME["__rdiv__"] = "div"  # Tensor.__rtruediv__ is named __rdiv__
_LIST_NAMES: dict = {}


def op_list_name(func) -> str | None:
    """The name op lists know a Python-level torch callable by, or None.

    ``F.linear`` -> ``"linear"``, ``Tensor.__add__`` -> ``"add"``, ``torch.linalg.vector_norm``
    -> ``"linalg_vector_norm"``; None for a callable no op-list name stands for.
    """
    try:
        return _LIST_NAMES[func]
    except KeyError:
        pass
    except TypeError:  # unhashable
        return None
    name = getattr(func, "__name__", None)
    result = None
    if isinstance(name, str) and name:
        name = _DUNDER_TO_NAME.get(name, name)
        try:
            result = name if func in resolve_op(name) else None
        except ValueError:
            result = None
    _LIST_NAMES[func] = result
    return result


@functools.lru_cache(maxsize=1)
def _known_names() -> tuple[str, ...]:
    names = set()
    for _, ns in _NAMESPACES[:3]:
        names.update(n for n in dir(ns) if not n.startswith("_"))
    return tuple(sorted(names))


def check_device_type(device_type: str) -> str:
    """Return ``device_type`` if the op lists know it, else raise ValueError."""
    if not isinstance(device_type, str) or device_type not in TORCH_DEFAULTS:
        raise ValueError(f"device_type must be one of {sorted(TORCH_DEFAULTS)}; "
                         f"got {device_type!r}")
    return device_type


def op_lists(device_type: str = "cpu", dtype="bf16", *, extend_defaults: bool = True,
             low_precision_ops=(), fp32_ops=(), promote_ops=()) -> dict[str, list[str]]:
    """The effective cast policy lists of :func:`mixprec.autocast`.

    Args:
        device_type: "cpu" or "cuda".
        dtype: the low-precision dtype (validated; the lists are the same for fp16 and bf16).
        extend_defaults: include mixprec's fp32 additions (softmax, norms) on top of torch's list.
        low_precision_ops: op names moved to the low-precision list.
        fp32_ops: op names moved to the fp32 list.
        promote_ops: op names moved to the promote list (inputs cast to the widest input dtype).

    Returns:
        ``{"low_precision": [...], "fp32": [...], "promote": [...]}``, each sorted.

    Example:
        >>> "mm" in op_lists("cpu", "bf16")["low_precision"]
        True
    """
    check_device_type(device_type)
    to_dtype(dtype)
    low, fp32, promote = validate_custom_lists(low_precision_ops, fp32_ops, promote_ops)
    table = {k: set(v) for k, v in TORCH_DEFAULTS[device_type].items()}
    if extend_defaults:
        table["fp32"] |= MIXPREC_FP32_ADDITIONS
    for moved, target in ((low, "low_precision"), (fp32, "fp32"), (promote, "promote")):
        for name in moved:
            for key in table:
                table[key].discard(name)
            table[target].add(name)
    return {k: sorted(v) for k, v in table.items()}


def validate_custom_lists(low_precision_ops, fp32_ops,
                          promote_ops=()) -> tuple[tuple[str, ...], ...]:
    """Check the custom op lists: known names, no name in two lists.

    Returns:
        The three lists (low precision, fp32, promote) as tuples of flat names (``"torch.add"``
        becomes ``"add"``), duplicates dropped.

    Raises:
        TypeError: a list that is not an iterable of names.
        ValueError: an unknown name, or a name in two lists (in any spelling).
    """
    lists: dict[str, tuple[str, ...]] = {}
    for what, ops in (("low_precision_ops", low_precision_ops), ("fp32_ops", fp32_ops),
                      ("promote_ops", promote_ops)):
        if isinstance(ops, str):
            ops = (ops,)
        try:
            ops = tuple(ops)
        except TypeError:
            raise TypeError(f"{what} must be an iterable of op names; "
                            f"got {type(ops).__name__}") from None
        flat = []
        for name in ops:
            resolve_op(name)
            name = normalize_op_name(name)
            if name not in flat:
                flat.append(name)
        lists[what] = tuple(flat)
    names = list(lists)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            both = sorted(set(lists[first]) & set(lists[second]))
            if both:
                raise ValueError(f"op(s) {', '.join(map(repr, both))} named in both {first} and "
                                 f"{second}; an op can be moved to one list only")
    return tuple(lists.values())


# ----------------------------------------------------------------- what op lists can reach
class OpListWarning(UserWarning):
    """An op-list name that the model's code never calls at the Python level (see
    :func:`unreachable_names`), so listing it changes nothing."""


_CONV = {nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d",
         nn.ConvTranspose1d: "conv_transpose1d", nn.ConvTranspose2d: "conv_transpose2d",
         nn.ConvTranspose3d: "conv_transpose3d"}

#: Module type -> the Python-level torch functions its own ``forward`` calls (op-list names).
#: A subclass that overrides ``forward`` is read from its source instead (see
#: :func:`unreachable_names`); containers call nothing themselves.
MODULE_FUNCTIONS: dict[type, tuple[str, ...]] = {
    nn.Linear: ("linear",), nn.Bilinear: ("bilinear",),
    **{cls: (name,) for cls, name in _CONV.items()},
    nn.LayerNorm: ("layer_norm",), nn.GroupNorm: ("group_norm",),
    nn.modules.batchnorm._BatchNorm: ("batch_norm",),
    nn.modules.instancenorm._InstanceNorm: ("instance_norm",),
    nn.Embedding: ("embedding",), nn.EmbeddingBag: ("embedding_bag",),
    nn.MultiheadAttention: ("multi_head_attention_forward",),
    nn.LSTM: ("lstm",), nn.GRU: ("gru",), nn.RNN: ("rnn_tanh", "rnn_relu"),
    nn.Softmax: ("softmax",), nn.LogSoftmax: ("log_softmax",), nn.GELU: ("gelu",),
    nn.ReLU: ("relu",), nn.SiLU: ("silu",), nn.Tanh: ("tanh",), nn.Sigmoid: ("sigmoid",),
    nn.Dropout: ("dropout",), nn.Flatten: ("flatten",), nn.Identity: (),
    nn.MSELoss: ("mse_loss",), nn.L1Loss: ("l1_loss",), nn.CrossEntropyLoss: ("cross_entropy",),
    nn.NLLLoss: ("nll_loss",), nn.BCEWithLogitsLoss: ("binary_cross_entropy_with_logits",),
    nn.RMSNorm: ("rms_norm",),
    nn.Sequential: (), nn.ModuleList: (), nn.ModuleDict: (),
}

_LINEAR_GEMMS = frozenset({"addmm", "mm", "bmm", "matmul", "_addmm_activation"})
_CONVOLUTIONS = frozenset({"convolution", "_convolution", "mkldnn_convolution",
                           "cudnn_convolution", "conv_tbc"})
_BATCH_NORMS = frozenset({"native_batch_norm", "_native_batch_norm_legit",
                          "_native_batch_norm_legit_no_training", "cudnn_batch_norm",
                          "miopen_batch_norm", "empty"})
_ATTENTION = frozenset({"_scaled_dot_product_flash_attention",
                        "_scaled_dot_product_flash_attention_for_cpu",
                        "_scaled_dot_product_efficient_attention",
                        "_scaled_dot_product_cudnn_attention"})

#: Python-level function -> the ATen ops (those that are also torch function names) running
#: beneath it on CPU and CUDA, elementwise helpers included. Op lists catch the function, never
#: these: ``fp32_ops=["addmm"]`` does not reach the ``addmm`` that ``F.linear`` runs;
#: ``fp32_ops=["linear"]`` does. (tests/test_oplists.py checks it against what really runs.)
OPS_BENEATH: dict[str, frozenset[str]] = {
    "linear": _LINEAR_GEMMS,
    "bilinear": frozenset({"_trilinear", "add"}),
    **{name: _CONVOLUTIONS | {"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"} - {name}
       for name in _CONV.values()},
    "layer_norm": frozenset({"native_layer_norm"}),
    "group_norm": frozenset({"native_group_norm"}),
    "batch_norm": _BATCH_NORMS,
    "instance_norm": _BATCH_NORMS | {"batch_norm", "repeat"},
    "rms_norm": frozenset({"_fused_rms_norm", "rsqrt", "pow", "mean", "mul", "add", "add_"}),
    "softmax": frozenset({"_softmax"}),
    "log_softmax": frozenset({"_log_softmax"}),
    "cross_entropy": frozenset({"log_softmax", "_log_softmax", "nll_loss"}),
    "embedding_bag": frozenset({"_embedding_bag", "arange"}),
    "dropout": frozenset({"native_dropout", "bernoulli", "bernoulli_", "empty_like", "mul",
                          "div_"}),
    "scaled_dot_product_attention": _ATTENTION,
    "multi_head_attention_forward": _LINEAR_GEMMS | _ATTENTION | {
        "linear", "baddbmm", "softmax", "_softmax", "scaled_dot_product_attention",
        "_native_multi_head_attention", "add", "mul", "mean", "clone"},
    "lstm": frozenset({"mkldnn_rnn_layer", "lstm_cell", "linear", "clone", "stack"}),
    "gru": _LINEAR_GEMMS | {"gru_cell", "linear", "add", "add_", "clone", "mul_", "sigmoid_",
                            "stack", "sub", "tanh_", "unsafe_split"},
    **{name: _LINEAR_GEMMS | {f"{name}_cell", "linear", "add_", "stack", "tanh", "relu"}
       for name in ("rnn_tanh", "rnn_relu")},
}


def _table_entry(cls: type):
    """(functions, overrides_forward) from the nearest base in MODULE_FUNCTIONS, or None."""
    for base in cls.__mro__:
        if base in MODULE_FUNCTIONS:
            return MODULE_FUNCTIONS[base], cls.forward is not base.forward
    return None


def _class_source(cls: type) -> str | None:
    """The source of ``cls`` and of its bases up to torch's own classes (None if unreadable)."""
    parts = []
    for base in cls.__mro__:
        if base is nn.Module or base in MODULE_FUNCTIONS or base is object:
            break
        try:
            parts.append(inspect.getsource(base))
        except (OSError, TypeError):
            return None
    return "\n".join(parts)


def _model_calls(model: nn.Module) -> tuple[set[str], list[str]] | None:
    """Functions the model's known modules call, and the sources of its other modules' code;
    None when some module's code cannot be read (then nothing can be ruled out)."""
    called: set[str] = set()
    sources: list[str] = []
    seen: set[type] = set()
    for mod in model.modules():
        cls = type(mod)
        if cls in seen:
            continue
        seen.add(cls)
        entry = _table_entry(cls)
        if entry is not None:
            called.update(entry[0])
            if not entry[1]:
                continue
        source = _class_source(cls)
        if source is None:
            return None
        sources.append(source)
    return called, sources


def _mentioned(name: str, sources: list[str]) -> bool:
    """Could code in ``sources`` call ``name`` (by name, or by its operator)?"""
    word = re.compile(rf"\b{re.escape(name)}\b")
    symbol = _OPERATOR_SYMBOLS.get(name)
    return any(word.search(src) or (symbol and symbol in src) for src in sources)


def unreachable_names(model: nn.Module, names) -> dict[str, tuple[str, ...]]:
    """Op-list names that the model's code never calls, with the names to use instead.

    Op lists act on Python-level calls. A name is reported when it is an ATen op beneath a
    function the model's modules call (:data:`OPS_BENEATH`), and neither a module type of
    :data:`MODULE_FUNCTIONS` nor the source of the model's other modules (custom ``forward``
    code, read with ``inspect``) calls it: ``"addmm"`` in a model of ``nn.Linear`` layers (which
    call ``F.linear``) maps to ``("linear",)``. Names about which nothing is known, and every
    name when some module's source cannot be read, are not reported.

    Args:
        model: the model whose modules are examined.
        names: op-list names (any spelling :func:`resolve_op` accepts).

    Returns:
        ``{name as given: (names to use instead, sorted)}``; empty when nothing is unreachable.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: an unknown op name.

    Example:
        >>> unreachable_names(nn.Sequential(nn.Linear(4, 4)), ["addmm", "linear"])
        {'addmm': ('linear',)}
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        resolve_op(name)
    if not names:
        return {}
    calls = _model_calls(model)
    if calls is None:
        return {}
    called, sources = calls
    result = {}
    for name in names:
        flat = normalize_op_name(name)
        above = sorted(f for f in called if flat in OPS_BENEATH.get(f, ()))
        if flat in called or not above or _mentioned(flat, sources):
            continue
        result[name] = tuple(above)
    return result


def warn_unreachable(model: nn.Module, low_precision_ops=(), fp32_ops=(), *,
                     stacklevel: int = 2) -> dict[str, tuple[str, ...]]:
    """Warn (:class:`OpListWarning`) for each op-list name the model's code cannot reach.

    Args:
        model: the model the lists will apply to.
        low_precision_ops, fp32_ops: the custom op lists.
        stacklevel: as for ``warnings.warn`` (2: the line that called this function).

    Returns:
        What :func:`unreachable_names` found, for both lists together.
    """
    found = {}
    for what, ops in (("low_precision_ops", low_precision_ops), ("fp32_ops", fp32_ops)):
        if isinstance(ops, str):
            ops = (ops,)
        for name, instead in unreachable_names(model, tuple(ops)).items():
            found[name] = instead
            use = " or ".join(repr(n) for n in instead)
            warnings.warn(
                f"{what} names {name!r}, which this model never calls: {name!r} is an ATen op that "
                f"runs beneath {', '.join(instead)}, and op lists act on Python-level calls. "
                f"Use {use} (mp.debug.op_stats() shows the op-list name of every op that ran).",
                OpListWarning, stacklevel=stacklevel)
    return found
