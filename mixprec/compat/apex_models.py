"""What ``amp.initialize`` does to models: apex's checks, the storage policy they are prepared
with through :class:`mixprec.MixedPrecision`, and the forward entry of O1 and the output casts.

A level that casts the model (O0 to fp32, O2 and O3 to the low-precision dtype) prepares it with
a :class:`mixprec.Policy` of that dtype: parameters, buffers, inputs and compute in it, affine
BatchNorm layers in fp32 when ``keep_batchnorm_fp32`` (they read the low-precision activations
and return them in the model's dtype), no autocast (every op in the dtype of its inputs), an
fp32 ``state_dict()``. O1 leaves the model in fp32 (an all-fp32 policy, nothing to cast). Then a
:class:`mixprec.regions.Entry` runs the forward under apex's O1 lists
(:class:`~mixprec.compat.apex_casts.O1Casts`) and casts the floating outputs to fp32 (or
``cast_model_outputs``). apex's fp32 master weights are made by the optimizers ``initialize``
returns (an optimizer may span several models), not by the engine.
"""

from __future__ import annotations

import torch
from torch import nn

from ..casting import module_device
from ..dtypes import LOW_PRECISION_DTYPES
from ..engine import MixedPrecision
from ..policy import Policy
from ..prepare import policy_of
from ..regions import Entry
from .apex_casts import O1Casts
from .apex_options import AmpProperties

__all__ = ["AffineBatchNorm", "storage_policy", "check_models", "set_up_models",
           "fp32_originals"]


class _AffineBatchNormMeta(type):
    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, nn.modules.batchnorm._BatchNorm) and instance.affine

    def __repr__(cls) -> str:
        return "mixprec.compat.apex_models.AffineBatchNorm"


class AffineBatchNorm(nn.Module, metaclass=_AffineBatchNormMeta):
    """Stands for apex's ``keep_batchnorm_fp32`` layers in ``keep_fp32``: BatchNorm layers with
    affine parameters (``isinstance(module, AffineBatchNorm)``). A marker, not a layer."""

    def __new__(cls, *args, **kwargs):
        raise TypeError("AffineBatchNorm is a marker for keep_fp32 (it matches affine "
                        "BatchNorm layers), not a layer to build")


def storage_policy(props: AmpProperties) -> Policy:
    """The policy apex's properties cast models with (outputs are cast by the entry)."""
    cast = props.cast_model_type or None
    if cast is None:
        return Policy(output_dtype=None)
    keep = (AffineBatchNorm,) if props.keep_batchnorm_fp32 else ()
    return Policy(param_dtype=cast, compute_dtype=cast, output_dtype=None, keep_fp32=keep,
                  autocast=False, cast_inputs=True)


def check_models(models: list[nn.Module]) -> None:
    """apex's checks: fresh fp32 models, not wrapped in (Distributed)DataParallel.

    Raises:
        RuntimeError: a wrapped model, one already set up, or one with 16-bit tensors.
    """
    for model in models:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            raise RuntimeError(f"the model is wrapped in {type(model).__name__}; wrap the model "
                               f"returned by amp.initialize, not the one passed to it")
        if policy_of(model) is not None:
            raise RuntimeError("this model was already set up (by amp.initialize or "
                               "mixprec.prepare); pass a fresh fp32 model")
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        for name, t in tensors:
            if t.dtype in LOW_PRECISION_DTYPES:
                raise RuntimeError(f"found {name} with dtype {t.dtype}; amp.initialize expects "
                                   f"an fp32 model and casts it itself at every opt_level (do "
                                   f"not call .half() on the model first)")


def fp32_originals(models: list[nn.Module]) -> dict[torch.Tensor, torch.Tensor]:
    """Exact fp32 copies of the parameters, taken before casting (the masters start from them)."""
    return {p: p.detach().clone() for m in models for p in m.parameters()
            if p.dtype == torch.float32}


def set_up_models(models: list[nn.Module], props: AmpProperties,
                  cast_model_outputs: torch.dtype | None) -> MixedPrecision:
    """Prepare ``models`` through one engine of the :func:`storage_policy`, then give each the
    entry that runs O1's lists and casts its outputs (where either applies).

    Returns:
        The engine (its ``policy``; ``models``: the models in order).
    """
    engine = MixedPrecision(policy=storage_policy(props), loss_scale=None)
    cast = props.cast_model_type or None
    out_dtype = cast_model_outputs or (torch.float32 if cast is not None else None)
    for model in models:
        engine.setup(model)
        o1 = (O1Casts(module_device(model).type, props.low_dtype)
              if props.patch_torch_functions else None)
        if out_dtype is not None or o1 is not None:
            model.forward = Entry(model, None, out_dtype, o1)
    return engine
