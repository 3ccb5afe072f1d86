"""Autocast op lists as data: torch's default cast policies and mixprec's additions.

The tables name ATen ops as torch's autocast registers them (``aten/src/ATen/autocast_mode.*``,
torch 2.4-2.13). Three cast policies: ``low_precision`` (inputs cast to the autocast dtype),
``fp32`` (inputs cast to fp32) and ``promote`` (inputs cast to the widest input dtype).
"""

from __future__ import annotations

import difflib
import functools

import torch
import torch.nn.functional as F

from .dtypes import to_dtype

__all__ = ["op_lists", "TORCH_DEFAULTS", "MIXPREC_FP32_ADDITIONS", "resolve_op", "POLICIES"]

POLICIES = ("low_precision", "fp32", "promote")

_CPU_LOW = """conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm _addmm_activation addbmm linear
_convolution matmul conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d conv_transpose3d
prelu scaled_dot_product_attention _native_multi_head_attention"""
_CPU_FP32 = """avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft cdist
grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex cholesky
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
_CUDA_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"


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

_OPERATOR_NAMES = {"add": "__add__", "sub": "__sub__", "mul": "__mul__", "div": "__truediv__",
                   "true_divide": "__truediv__", "matmul": "__matmul__", "pow": "__pow__"}
_NAMESPACES = (("", torch), ("", F), ("", torch.Tensor), ("linalg_", torch.linalg),
               ("fft_", torch.fft), ("special_", torch.special))


@functools.lru_cache(maxsize=None)
def resolve_op(name: str) -> tuple:
    """The Python callables that a user-facing op name stands for (function, method, operator).

    ``"add"`` -> ``(torch.add, torch.Tensor.add)`` (``x + y`` reaches ``Tensor.add`` too).

    Raises:
        ValueError: no function of that name in torch, torch.nn.functional, torch.Tensor,
            torch.linalg, torch.fft or torch.special.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an op name must be a non-empty string such as 'add' or 'softmax'; got {name!r}")
    found = []
    for prefix, ns in _NAMESPACES:
        if prefix and not name.startswith(prefix):
            continue
        fn = getattr(ns, name[len(prefix):], None)
        if callable(fn) and not isinstance(fn, type) and fn not in found:
            found.append(fn)
    dunder = _OPERATOR_NAMES.get(name)
    if dunder:
        found.append(getattr(torch.Tensor, dunder))
    if not found:
        close = difflib.get_close_matches(name, _known_names(), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown op name {name!r}: not a function of torch, torch.nn.functional, "
                         f"torch.Tensor, torch.linalg, torch.fft or torch.special{hint}")
    return tuple(found)


@functools.lru_cache(maxsize=1)
def _known_names() -> tuple[str, ...]:
    names = set()
    for _, ns in _NAMESPACES[:3]:
        names.update(n for n in dir(ns) if not n.startswith("_"))
    return tuple(sorted(names))


def check_device_type(device_type: str) -> str:
    """Return ``device_type`` if the op lists know it, else raise ValueError."""
    if not isinstance(device_type, str) or device_type not in TORCH_DEFAULTS:
        raise ValueError(f"device_type must be one of {sorted(TORCH_DEFAULTS)}; got {device_type!r}")
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
    """Check custom op lists: known names, no name in two lists. Returns them as tuples."""
    lists = {}
    for what, ops in (("low_precision_ops", low_precision_ops), ("fp32_ops", fp32_ops),
                      ("promote_ops", promote_ops)):
        if isinstance(ops, str):
            ops = (ops,)
        try:
            ops = tuple(ops)
        except TypeError:
            raise TypeError(f"{what} must be an iterable of op names; "
                            f"got {type(ops).__name__}") from None
        for name in ops:
            resolve_op(name)
        lists[what] = ops
    names = list(lists)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            both = sorted(set(lists[first]) & set(lists[second]))
            if both:
                raise ValueError(f"op(s) {', '.join(map(repr, both))} named in both {first} and "
                                 f"{second}; an op can be moved to one list only")
    return tuple(lists.values())
