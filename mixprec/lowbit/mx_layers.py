"""MXFP8 layers on torchao: a Linear or Hugging Face Conv1D whose forward runs torchao's MXFP8
GEMMs (``mx_mm``: the forward GEMM and both backward GEMMs on MXFP8-cast operands).

This module imports torchao; :class:`mixprec.lowbit.MXFP8` loads it only when a model is
converted. A converted layer keeps its class, its ``weight`` and ``bias`` objects and its
``state_dict``: only its ``forward`` is replaced (an instance attribute, picklable), as
mixprec's other forward wrappers are. The forward runs in the precision of the layer's region:
under autocast the input is cast to the autocast dtype, the weight to the input's dtype (what
``F.linear`` under autocast does), and the output comes out in it; the GEMMs run with autocast
and torch-function modes off, so neither touches the MXFP8 operands. The token count is padded
with zero rows to a multiple of 32 (torchao casts the weight gradient's operands along the
tokens; zero rows change no block's scale and no gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

from ..forwards import ForwardWrapper
from .base import FP8_ATTR, is_conv1d
from .float8_layers import probe, record
from .stats import stats_of

__all__ = ["mx_linear", "MXForward", "convert"]


def mx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fmt,
              recorders: tuple = ()) -> torch.Tensor:
    """``x @ weight.t() + bias`` with the GEMMs in MXFP8 (see the module docstring).

    Args:
        x: ``(..., in_features)``.
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
        fmt: the :class:`mixprec.lowbit.MXFP8` format.
        recorders: the layer's statistics while it records.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        x = x.to(torch.get_autocast_dtype(device))
    weight = weight.to(x.dtype)
    if recorders:
        record(recorders, "input", x)
        record(recorders, "weight", weight.t())
    x2 = x.reshape(-1, x.shape[-1])
    tokens = x2.shape[0]
    pad = -tokens % fmt.block
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    kernels = KernelPreference.AUTO if fmt.native(x.device) else KernelPreference.EMULATED
    with torch.autocast(device, enabled=False), torch._C.DisableTorchFunction():
        out = _to_mxfp8_then_scaled_mm(x2, weight.contiguous(), kernels,
                                       ScaleCalculationMode.RCEIL, fmt.wgrad_hp)
    # the native sm100 GEMM returns bf16: the output comes out in the input's dtype
    out = probe(out[:tokens].reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype), recorders)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


class MXForward(ForwardWrapper):
    """The forward of a Linear or Conv1D converted to MXFP8."""

    def __init__(self, module: nn.Module, fmt):
        super().__init__(module)
        self.fmt = fmt
        self.conv1d = is_conv1d(module)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        m = self.module
        weight = m.weight.t() if self.conv1d else m.weight
        return mx_linear(input, weight, m.bias, self.fmt, stats_of(m))


def convert(model: nn.Module, names: tuple[str, ...], fmt) -> None:
    """Give the named Linear/Conv1D layers of ``model`` MXFP8 forwards, in place."""
    for name in names:
        layer = model.get_submodule(name)
        layer.forward = MXForward(layer, fmt)
        setattr(layer, FP8_ATTR, fmt)
