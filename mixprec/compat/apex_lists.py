"""apex's O1 op lists as data, in mixprec's op names.

apex O1 patched torch functions by name, after three tables (``apex/amp/lists``): a low-precision
list (GEMMs, convolutions, recurrent cells and layers), an fp32 list (precision-sensitive
pointwise ops, reductions, norms, losses) and a promote list (multi-input ops that run in the
widest input dtype). mixprec runs the same three lists through :class:`mixprec.autocast`
(``low_precision_ops``, ``fp32_ops``, ``promote_ops``, ``extend_defaults=False``), inside the
forward of the models ``initialize`` returned, without patching torch. A name covers the torch
function, the ``Tensor`` method and the operator (``"mul"``: ``torch.mul``, ``x.mul(y)``,
``x * y``), as apex's torch and tensor lists did together.

Ops on none of these lists follow torch.autocast's own table for the device (apex left them in
their input dtype; torch's tables agree for the common ops and also cover ops apex never knew).
"""

from __future__ import annotations

__all__ = ["APEX_O1_LISTS", "LOW_PRECISION", "FP32", "PROMOTE"]

#: Tensor Core ops: cast to the low-precision dtype. bmm/addbmm/baddbmm are listed as apex did
#: for CUDA >= 9.1; the recurrent layers and cells as apex's RNN wrappers cast them.
LOW_PRECISION: tuple[str, ...] = tuple("""
conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d conv_tbc linear prelu
addmm addmv addr matmul mm mv bmm addbmm baddbmm
rnn_tanh rnn_relu lstm gru rnn_tanh_cell rnn_relu_cell lstm_cell gru_cell
""".split())

#: Precision-sensitive ops: cast to fp32. ``binary_cross_entropy`` runs in fp32 as apex's
#: ``allow_banned=True`` made it (apex raised on fp16 inputs by default); ``cpu`` is apex's
#: "cast to fp32 before the transfer to the host".
FP32: tuple[str, ...] = tuple("""
interpolate grid_sample softplus softmin log_softmax softmax gelu
layer_norm group_norm local_response_norm normalize cosine_similarity
poisson_nll_loss cosine_embedding_loss cross_entropy hinge_embedding_loss kl_div l1_loss mse_loss
margin_ranking_loss multilabel_margin_loss multilabel_soft_margin_loss multi_margin_loss nll_loss
binary_cross_entropy_with_logits smooth_l1_loss soft_margin_loss triplet_margin_loss ctc_loss
binary_cross_entropy
acos asin cosh erfinv exp expm1 log log10 log2 reciprocal rsqrt sinh tan pow
cumprod cumsum dist norm prod std sum var renorm cpu
""".split())

#: Multi-input ops run in the widest input dtype (apex's CASTS and SEQUENCE_CASTS).
PROMOTE: tuple[str, ...] = tuple("""
addcdiv addcmul atan2 cross bilinear dot add sub mul div eq equal ge gt le lt ne cat stack
""".split())

#: The three lists keyed by mixprec's cast policies.
APEX_O1_LISTS: dict[str, tuple[str, ...]] = {
    "low_precision": LOW_PRECISION, "fp32": FP32, "promote": PROMOTE,
}
