"""The op-list tables, as data: torch's default cast policies per device, mixprec's fp32
additions, and what common modules call (with the ATen ops beneath each call).

The cast-policy tables name ATen ops as torch's autocast registers them
(``aten/src/ATen/autocast_mode.*``, torch 2.4-2.13). Three cast policies: ``low_precision``
(inputs cast to the autocast dtype), ``fp32`` (inputs cast to fp32) and ``promote`` (inputs cast
to the widest input dtype).
"""

from __future__ import annotations

from torch import nn

__all__ = ["POLICIES", "TORCH_DEFAULTS", "MIXPREC_FP32_ADDITIONS", "MODULE_FUNCTIONS",
           "OPS_BENEATH", "check_device_type"]

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
#: where CUDA's list keeps them in fp32; neither list has the matrix exponential, whose bf16
#: kernel returns NaN for a small skew-symmetric matrix (an ``orthogonal`` parametrization's
#: weight at O2). batch_norm is in neither list on purpose: its kernels take low-precision
#: activations with fp32 statistics and parameters and accumulate in fp32.
MIXPREC_FP32_ADDITIONS: frozenset[str] = frozenset(
    "softmax log_softmax logsumexp layer_norm group_norm rms_norm matrix_exp linalg_matrix_exp"
    .split())


_CONV = {nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d",
         nn.ConvTranspose1d: "conv_transpose1d", nn.ConvTranspose2d: "conv_transpose2d",
         nn.ConvTranspose3d: "conv_transpose3d"}

#: Module type -> the Python-level torch functions its own ``forward`` calls (op-list names).
#: A subclass that overrides ``forward`` is read from its source instead (see
#: :func:`~mixprec.oplists.unreachable_names`); containers call nothing themselves.
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
    "matmul": frozenset({"mm", "bmm", "dot", "mv"}),  # ``a @ b`` in a custom forward
    "einsum": frozenset({"mm", "bmm"}),
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



def check_device_type(device_type: str) -> str:
    """Return ``device_type`` if the op lists know it, else raise ValueError."""
    if not isinstance(device_type, str) or device_type not in TORCH_DEFAULTS:
        raise ValueError(f"device_type must be one of {sorted(TORCH_DEFAULTS)}; "
                         f"got {device_type!r}")
    return device_type
