"""What a low-bit GEMM format is to mixprec: :class:`LowBitFormat`, and the registry of formats.

A format (FP8 with torchao's per-tensor or per-row scales, MXFP8, NVFP4, ...) is a frozen
dataclass: its fields are its options, so equal options give equal formats and equal
policies. It owns everything that depends on which format it is:

* its validation (``__post_init__``: a clear ``ValueError`` naming what is valid);
* its eligibility rule (:meth:`LowBitFormat.why_ineligible`: GEMM dimensions that are
  multiples of its block, or of what its tensor cores need);
* what ``prepare`` does with it (:meth:`~LowBitFormat.require`,
  :meth:`~LowBitFormat.check_device`, :meth:`~LowBitFormat.convert`, and FSDP2's
  :meth:`~LowBitFormat.before_sharding`);
* its statistics while training (:meth:`~LowBitFormat.recorder`), and its simulation for the
  advisor (:meth:`~LowBitFormat.simulate`, :meth:`~LowBitFormat.ranges`);
* its size: :attr:`~LowBitFormat.bits_per_value` (element and scale bits, per GEMM operand
  value; parameters themselves are stored in their policy's dtype).

:func:`register` adds a format class and its string shorthands; :func:`resolve` turns what a
user passes as ``fp8=`` (None, a shorthand, a format, or a policy's ``state_dict`` entry) into a
format, once, where it enters mixprec.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, ClassVar

from ..components import Component, Registry

__all__ = ["LowBitFormat", "register", "resolve", "shorthands", "formats", "FP8_ATTR",
           "is_conv1d"]

_REGISTRY = Registry("low-bit format", "format")
FP8_ATTR = "_mixprec_fp8"  # set on a converted layer: its low-bit format


def is_conv1d(module) -> bool:
    """True for a Hugging Face ``Conv1D`` (checked without importing transformers: a model that
    holds one has imported it)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(utils, "Conv1D", None)
    return cls is not None and isinstance(module, cls)


@dataclasses.dataclass(frozen=True, eq=False)
class LowBitFormat(Component):
    """A low-bit GEMM format for Linear layers (subclass it and :func:`register` the class).

    Class attributes a subclass sets:
        name: the registered name (``state_dict`` entries carry it).
        block: GEMM dimensions must be multiples of it.
        advisor_format: the name :func:`mixprec.advise` measures it under.
        bits_per_value: bits a GEMM operand takes per value, scales included.
    """

    registry: ClassVar[Registry] = _REGISTRY
    name: ClassVar[str] = ""
    block: ClassVar[int] = 16
    advisor_format: ClassVar[str] = ""
    bits_per_value: ClassVar[float] = 8.0
    #: the advisor's limits on a layer's relative output and weight-gradient errors
    advisor_limits: ClassVar[tuple[float, float]] = (0.15, 0.25)
    #: the 16-bit compute dtypes the format's GEMMs run around (names: "bf16", "fp16")
    compute_dtypes: ClassVar[tuple[str, ...]] = ("bf16", "fp16")

    def check_compute_dtype(self, dtype_name: str) -> None:
        """Refuse a 16-bit compute dtype the format's kernels don't take (``ValueError``
        naming what does); fp32 compute is the level's business, not checked here."""
        if dtype_name in ("bf16", "fp16") and dtype_name not in self.compute_dtypes:
            taking = [repr(n) for n, c in _compute_by_name().items() if dtype_name in c]
            raise ValueError(
                f"fp8={self.name!r} runs its GEMMs with {' or '.join(self.compute_dtypes)} "
                f"compute, not {dtype_name} (its kernels don't take it); use "
                f"dtype={self.compute_dtypes[0]!r}, or with {dtype_name} a format that takes "
                f"it: {', '.join(taking)}")

    # -- eligibility -----------------------------------------------------------------------
    def why_ineligible(self, in_features: int, out_features: int) -> str | None:
        """Why a GEMM layer of these dimensions cannot take the format, or None."""
        if in_features % self.block or out_features % self.block:
            return (f"has dimensions {in_features} x {out_features}: {self.describe()} need "
                    f"both to be multiples of {self.block}")
        return None

    def describe(self) -> str:
        """A few words for messages ("FP8 GEMMs", "MXFP8 GEMMs (blocks of 32)")."""
        return f"{type(self).__name__} GEMMs"

    # -- preparing a model -----------------------------------------------------------------
    def require(self) -> None:
        """Import the engine the format runs on (``ImportError`` naming the extra)."""
        raise NotImplementedError

    def check_device(self, device) -> None:
        """Refuse a device the format's GEMMs cannot run on (``RuntimeError``)."""

    def shape_filter(self):
        """``(nn.Linear, name) -> bool`` keeping the layers worth converting on CUDA, or None
        (no filter)."""
        return None

    def convert(self, model, names: tuple[str, ...]) -> None:
        """Swap the named layers of ``model`` for layers running the format, in place; each is
        marked with the format (:data:`FP8_ATTR`)."""
        raise NotImplementedError

    def before_sharding(self, model, names: list[str]) -> list[str]:
        """Adjust the named converted layers before FSDP2 shards ``model``; returns the names
        of the layers whose weights FSDP2 then all-gathers in the low-bit format (default:
        none: weights are gathered in their stored dtype, and the layers quantize after)."""
        return []

    # -- measuring -------------------------------------------------------------------------
    @classmethod
    def for_advisor(cls, fp8_recipe: str) -> "LowBitFormat":
        """The format :func:`mixprec.advise` measures under :attr:`advisor_format` (its
        ``fp8_recipe`` argument picks among Float8's recipes; other formats ignore it)."""
        return cls()

    def measured_by(self, measured: "LowBitFormat") -> bool:
        """Whether the advisor's measurement of ``measured`` covers this format (default: the
        same class: options that make a GEMM more exact, not less)."""
        return type(measured) is type(self)

    def unmeasured(self, measured: "LowBitFormat") -> str:
        """Why a policy in this format cannot follow an advice that measured ``measured``."""
        return (f"fp8={str(self)!r}, but this advice measured {str(measured)!r}: its verdicts "
                f"do not carry over. Measure {type(self).__name__} with mp.advise")

    def recorder(self, module):
        """A :class:`mixprec.lowbit.stats.LayerStats` for a converted layer."""
        raise NotImplementedError

    def simulate(self, x, w_t):
        """``x @ w_t`` as the format's GEMMs compute it, in fp32, with autograd (all three
        GEMMs of a Linear layer); ``x``: ``(M, K)``, ``w_t``: ``(K, N)``."""
        raise NotImplementedError

    def ranges(self, x, w_t, grad) -> dict[str, tuple]:
        """``{role: (amax, saturated fraction, flushed fraction)}`` of the GEMM operands the
        format casts (input, weight, grad_output), as 0-d tensors."""
        raise NotImplementedError


def _compute_by_name() -> dict[str, tuple[str, ...]]:
    """Shorthand -> the compute dtypes of the format it names."""
    return {name: resolve(name).compute_dtypes for name in shorthands()}


def register(cls: type, shorthands: dict[str, dict] | None = None) -> type:
    """Register a format class under ``cls.name``, with its string shorthands (shorthand ->
    the options it stands for).

    Raises:
        ValueError: the name or a shorthand is taken by another class.
    """
    return _REGISTRY.register(cls, LowBitFormat, shorthands)


def shorthands() -> tuple[str, ...]:
    """The strings ``fp8=`` accepts, in registration order."""
    return tuple(_REGISTRY.shorthands)


def formats() -> dict[str, type]:
    """Registered name -> format class."""
    return dict(_REGISTRY.classes)


def resolve(spec: Any) -> LowBitFormat | None:
    """The format ``spec`` stands for.

    Args:
        spec: None, a format, a shorthand ("tensorwise", "mxfp8", ...), or a format's
            :meth:`~LowBitFormat.state_dict`.

    Raises:
        ValueError: an unknown shorthand or format name.
        TypeError: anything else.
    """
    if spec is None or isinstance(spec, LowBitFormat):
        return spec
    if isinstance(spec, str):
        fmt = _REGISTRY.from_shorthand(spec)
        if fmt is None:
            raise ValueError(f"fp8 must be None or one of {_REGISTRY.choices()} "
                             f"(or a mixprec.lowbit format); got {spec!r}")
        return fmt
    if isinstance(spec, dict) and "format" in spec:
        return _REGISTRY.from_state(spec)
    raise TypeError(f"fp8 must be None, a mixprec.lowbit format (Float8, MXFP8, NVFP4) or one "
                    f"of {_REGISTRY.choices()}; got {type(spec).__name__} {spec!r}")
