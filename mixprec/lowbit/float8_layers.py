"""FP8 layers on torchao: ``nn.Linear`` through torchao's ``Float8Linear``, Hugging Face
``Conv1D`` through :class:`Float8Conv1D`, one forward for both.

This module imports torchao; :meth:`mixprec.lowbit.Float8.convert` loads it only when a model is
converted.

The forward (:func:`fp8_linear`) runs torchao's FP8 matmul (its autograd function: dynamic
scales, ``torch._scaled_mm`` for the forward GEMM and both backward GEMMs) in the precision the
layer's region computes in: under autocast the input is cast to the autocast dtype first (what
``F.linear`` under autocast does), the weight is cast to FP8 from its stored dtype (fp32 at O1,
16-bit at O2/O3), and the output comes out in the input's dtype (with the rowwise recipes
rounded to bf16 first: torch's rowwise FP8 GEMM writes only bf16, so an fp32 or fp16 layer's
outputs and gradients carry bf16's precision). The GEMM runs with autocast and
torch-function modes off, so neither autocast nor mixprec's op lists or fp16 emulation touch its
FP8 operands. The bias is added in the output's dtype.

Parameters are never replaced: a converted layer holds the very ``weight`` and ``bias`` objects
of the layer it replaces (an optimizer built before conversion keeps working), under the same
names and in the same layout, so ``state_dict()`` keys, shapes and values are those of the
original model.
"""

from __future__ import annotations

import torch
from torch import nn
from torchao.float8 import convert_to_float8_training
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from ..forwards import ForwardWrapper
from . import stats
from .base import FP8_ATTR, is_conv1d

__all__ = ["fp8_linear", "record", "probe", "FP8Forward", "Float8Conv1D", "convert",
           "cast_weights_for_all_gather"]


def record(recorders: tuple[stats.LayerStats, ...], role: str, tensor: torch.Tensor) -> None:
    """``tensor``'s measurements for ``role``, into every recorder (a few reductions and one
    in-place write per recorder: under ``torch.compile`` they are part of the graph)."""
    for r in recorders:
        r.record(role, tensor)


def probe(output: torch.Tensor, recorders: tuple[stats.LayerStats, ...]) -> torch.Tensor:
    """``output``, recording its gradient into ``recorders`` when the backward pass reaches
    it (a tensor hook)."""
    if output.requires_grad and recorders:
        output.register_hook(lambda grad: record(recorders, "grad_output", grad))
    return output


def fp8_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
               mm_config, config, recorders: tuple = ()) -> torch.Tensor:
    """``x @ weight_t + bias`` with the GEMMs in FP8 (see the module docstring).

    Args:
        x: the input, ``(..., in_features)``.
        weight_t: the weight as ``(in_features, out_features)`` (a Linear's ``weight.t()``, a
            Conv1D's ``weight``), in high precision or already cast to FP8 by an all-gather.
        bias: ``(out_features,)`` or None.
        mm_config: torchao's ``LinearMMConfig``; config: its ``Float8LinearConfig``.
        recorders: the layer's statistics while it records (see :mod:`mixprec.lowbit.stats`).
    """
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        x = x.to(torch.get_autocast_dtype(device))
    if recorders:
        record(recorders, "input", x)
        record(recorders, "weight", weight_t.to_original_precision()
               if tensor_already_casted_to_fp8(weight_t) else weight_t)
    with torch.autocast(device, enabled=False), torch._C.DisableTorchFunction():
        out = matmul_with_hp_or_float8_args.apply(x, weight_t, mm_config, config)
    out = probe(out, recorders)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


class FP8Forward(ForwardWrapper):
    """The forward of a torchao ``Float8Linear`` converted by mixprec (an instance attribute,
    picklable, like mixprec's other forward wrappers)."""

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        m = self.module
        if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            # torchao's rowwise (axiswise) casts fail on inference tensors ("aten.reshape.
            # default with axiswise scaling is not supported yet"): computed as under no_grad
            with torch.inference_mode(False), torch.no_grad():
                return self(input)
        return fp8_linear(input, m.weight.t(), m.bias, m.linear_mm_config, m.config,
                          stats.stats_of(m))


def _mm_config(config) -> LinearMMConfig:
    """The ``LinearMMConfig`` of the forward, grad-input and grad-weight GEMMs (as torchao
    derives it for a Float8Linear)."""
    gemms = (config.gemm_config_output, config.gemm_config_grad_input,
             config.gemm_config_grad_weight)
    return LinearMMConfig(*(ScaledMMConfig(config.emulate, g.use_fast_accum, False,
                                           config.pad_inner_dim) for g in gemms))


class Float8Conv1D(nn.Module):
    """A Hugging Face ``Conv1D`` (``x @ weight + bias``, ``weight`` of shape ``(nx, nf)``) with
    its GEMMs in FP8.

    It holds the converted layer's own ``weight`` and ``bias`` parameters, in their layout, so
    its ``state_dict()`` is the Conv1D's.

    Args:
        source: the ``Conv1D`` to convert.
        config: torchao's ``Float8LinearConfig``.
    """

    def __init__(self, source: nn.Module, config):
        super().__init__()
        self.nf, self.nx = source.nf, source.nx
        self.weight = source.weight
        self.bias = source.bias
        self.config = config
        self.linear_mm_config = _mm_config(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.linear_mm_config, self.config,
                          stats.stats_of(self))

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"


def convert(model: nn.Module, names: tuple[str, ...], fmt) -> None:
    """Swap the named Linear/Conv1D layers of ``model`` for FP8 ones of the
    :class:`mixprec.lowbit.Float8` format ``fmt``, in place.

    Raises:
        RuntimeError: a named layer was not converted (it is not where its name says).
    """
    config = fmt.config()
    modules = dict(model.named_modules())
    linears = {n for n in names if not is_conv1d(modules[n])}
    aliases: dict[int, list[str]] = {}  # a layer registered under several names is one layer
    for alias, mod in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(mod), []).append(alias)
    # torchao's entry point: it swaps the named Linears (keeping their parameters) and applies
    # torchao's compile-time settings for FP8 kernels
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn in linears,
                               config=config)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, child)
        if name not in linears:
            layer = Float8Conv1D(layer, config)
            setattr(parent, child, layer)
        elif not isinstance(layer, Float8Linear):
            raise RuntimeError(f"torchao did not convert {name!r} ({type(layer).__name__})")
        else:
            layer.forward = FP8Forward(layer)
        setattr(layer, FP8_ATTR, fmt)
        for alias in aliases[id(modules[name])]:  # torchao swapped it under its first name
            if alias != name:                    # only: the others kept the 16-bit layer
                owner, _, attr = alias.rpartition(".")
                setattr(model.get_submodule(owner), attr, layer)


def cast_weights_for_all_gather(model: nn.Module, names, config) -> list[str]:
    """Give the named FP8 layers' weights torchao's FSDP2 hooks (``config``: a tensorwise
    ``Float8LinearConfig`` with the float8 all-gather on), so that FSDP2 all-gathers them in FP8
    (one byte per value) rather than in 16 bits. Call before ``fully_shard``; each weight
    becomes a new ``Parameter`` (rebind optimizers by name). Returns the layers' names.
    """
    for name in names:
        mod = model.get_submodule(name)
        mod.config = config
        weight = mod.weight
        mod.weight = nn.Parameter(
            WeightWithDynamicFloat8CastTensor(weight, mod.linear_mm_config,
                                              config.cast_config_weight.target_dtype),
            requires_grad=weight.requires_grad)
    return list(names)
