"""Normalisation layers: which modules count as one (O1/O2 keep them in fp32), and the
:class:`NormLayer` marker that stands for all of them in ``keep_fp32``."""

from __future__ import annotations

import re

from torch import nn

__all__ = ["NORM_LAYERS", "NormLayer", "is_norm_layer"]

# Layers whose statistics and affine parameters stay fp32 at O1/O2 (the MindSpore and PaddlePaddle
# guides: BatchNorm and the loss are precision sensitive).
NORM_LAYERS: tuple[type[nn.Module], ...] = tuple(
    t for t in (
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
        nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
        nn.LocalResponseNorm, getattr(nn, "RMSNorm", None),
    ) if t is not None
)

_ZOO_NORM_NAME = re.compile(r"Norm([123]d)?$")


def is_norm_layer(module: nn.Module) -> bool:
    """True for a normalisation layer (the rule :class:`NormLayer` matches).

    A norm layer is an instance of one of torch's norm classes (:data:`NORM_LAYERS`), or a
    module without sub-modules whose class name ends in ``Norm``, ``Norm1d``, ``Norm2d`` or
    ``Norm3d``: the norm layers of model zoos (Hugging Face's ``LlamaRMSNorm``,
    ``T5LayerNorm``, ``MistralRMSNorm``; ``FrozenBatchNorm2d``; timm's ``LayerNorm2d``; apex's
    ``FusedLayerNorm``). A module that holds other layers (``AdaLayerNorm`` with its
    ``Linear``) is not one; its own norm layers are.
    """
    if isinstance(module, NORM_LAYERS):
        return True
    return (isinstance(module, nn.Module) and bool(_ZOO_NORM_NAME.search(type(module).__name__))
            and next(module.children(), None) is None)


class _NormLayerMeta(type):
    def __instancecheck__(cls, instance) -> bool:
        return is_norm_layer(instance)

    def __subclasscheck__(cls, sub) -> bool:
        """A norm class (what a precision map's ``[module type]`` looks up): torch's, or one
        named as the zoo's are (its instances are norm layers when they hold no sub-module)."""
        return sub is cls or (isinstance(sub, type) and (
            issubclass(sub, NORM_LAYERS) or (issubclass(sub, nn.Module)
                                             and bool(_ZOO_NORM_NAME.search(sub.__name__)))))

    def __repr__(cls) -> str:
        return "mixprec.NormLayer"


class NormLayer(nn.Module, metaclass=_NormLayerMeta):
    """Stands for every normalisation layer in ``keep_fp32`` (O2 keeps these in fp32).

    ``isinstance(module, NormLayer)`` follows :func:`is_norm_layer`: torch's norm classes, and
    any module without sub-modules whose class name ends in ``Norm`` or ``Norm1d/2d/3d``
    (``LlamaRMSNorm``, ``T5LayerNorm``, ``FrozenBatchNorm2d``, ...). It is a marker, not a
    layer: it cannot be built.

    Example:
        >>> isinstance(nn.LayerNorm(4), NormLayer), isinstance(nn.Linear(4, 4), NormLayer)
        (True, False)
    """

    def __new__(cls, *args, **kwargs):
        raise TypeError("mixprec.NormLayer is a marker for keep_fp32 (it matches norm layers), "
                        "not a layer to build")
