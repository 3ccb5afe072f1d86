"""What a master method is to mixprec: :class:`MasterMethod`, and the registry of methods.

A method is a frozen dataclass (equal methods give equal policies) owning everything that
depends on which method it is: the 16-bit dtypes it can hold, whether it keeps an fp32 copy or
steps the weights in place (:attr:`~MasterMethod.compact`) with a per-parameter buffer, how a
compact method's fp32 values are read and written (:meth:`~MasterMethod.load_lists`,
:meth:`~MasterMethod.store_lists`, :meth:`~MasterMethod.assign`), its size, and what FSDP2
needs. It is data and arithmetic on tensors: :mod:`mixprec.optim` imports this package, never
the reverse. :func:`register` adds a method class and its shorthands; :func:`resolve` turns what
a user passes as ``master=`` into a method, once, where it enters mixprec. How to add one:
docs/extending.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from ..components import Component, Registry
from ..dtypes import dtype_name

__all__ = ["MasterMethod", "register", "resolve", "shorthands", "methods"]

_REGISTRY = Registry("master method", "method")


@dataclasses.dataclass(frozen=True, eq=False)
class MasterMethod(Component):
    """How 16-bit parameters keep fp32-quality updates (subclass it and :func:`register` it).

    Class attributes a subclass sets:
        name: the registered name (a policy's ``state_dict`` carries it).
        dtypes: the 16-bit parameter dtypes it can hold (empty: any).
        compact: True when there is no fp32 copy: the optimizer steps the 16-bit weights in
            place (:class:`mixprec.optim.CompactMasterOptimizer`).
        buffer_key: the optimizer ``state`` key of its per-parameter buffer, or None.
        uses_spare: True when :meth:`load_lists` and :meth:`store_lists` take the keyword
            ``spare`` (a flat fp32 scratch they may overwrite; methods written without it are
            called without it).
        draws_bits: True when :meth:`store_lists` rounds with random bits (it gets a key per
            tensor); False when it is exact.
    """

    registry: ClassVar[Registry] = _REGISTRY
    dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    compact: ClassVar[bool] = True
    buffer_key: ClassVar[str | None] = None
    draws_bits: ClassVar[bool] = True
    uses_spare: ClassVar[bool] = False

    # -- validation ------------------------------------------------------------------------
    def check_dtype(self, dtype: torch.dtype, what: str = "parameters") -> None:
        """Refuse 16-bit ``what`` of a ``dtype`` the method cannot hold (``ValueError`` naming
        the methods that can)."""
        if self.dtypes and dtype not in self.dtypes:
            held = " or ".join(dtype_name(d) for d in self.dtypes)
            able = [s for s, (cls, _) in _REGISTRY.shorthands.items()
                    if not cls.dtypes or dtype in cls.dtypes]
            raise ValueError(
                f"master={str(self)!r} {self.holds()} {held} weights; got {dtype_name(dtype)} "
                f"{what}. Use master={' or '.join(map(repr, able))} for {dtype_name(dtype)}")

    def holds(self) -> str:
        """A few words for messages: what the method does to the weights."""
        return "holds"

    # -- what it costs ---------------------------------------------------------------------
    def master_bytes(self, param_bytes: int) -> int:
        """Bytes it keeps per 16-bit parameter of ``param_bytes`` bytes, besides the weight."""
        return 0

    @property
    def needs_initial_values(self) -> bool:
        """True when the wrapped optimizer starts from the fp32 values before the cast."""
        return self.buffer_key is not None

    # -- the optimizer ---------------------------------------------------------------------
    def buffer_dtype(self, param_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype of the per-parameter buffer (None: the method keeps none)."""
        return None

    def make_buffer(self, param: torch.Tensor, initial: torch.Tensor | None
                    ) -> torch.Tensor | None:
        """A new buffer for the 16-bit ``param``, set so that the pair holds ``initial`` (its
        fp32 value before the cast; None: the weight as it is); may rewrite ``param``."""
        return None

    def register_load_hooks(self, optimizer) -> None:
        """Install the method's own ``load_state_dict`` hooks on a compact optimizer (after
        its others); default: none."""

    # -- load and store (compact methods) --------------------------------------------------
    # Static functions of plain tensors (this rank's part of an FSDP2 shard), eager.
    @staticmethod
    def load(weight: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
        """The fp32 value a 16-bit ``weight`` and its buffer (None: the method keeps none)
        stand for (a new tensor): what :meth:`load_lists` writes, for one tensor (the
        optimizer's ``fp32_values``)."""
        raise NotImplementedError("a compact master method defines load()")

    @staticmethod
    def load_lists(out: torch.Tensor, weights: list[torch.Tensor],
                   bufs: list[torch.Tensor] | None, spare: torch.Tensor | None = None) -> None:
        """Write the fp32 values of the ``weights`` (and buffers; any strides: their elements in
        order), one after the other, into the flat fp32 ``out`` (:meth:`load`'s values).
        ``spare``: a flat fp32 scratch of at least ``out``'s size the method may overwrite, or
        None (a mixed-dtype op on the CPU would make a temporary fp32 copy of its 16-bit input;
        the spare holds it instead)."""
        raise NotImplementedError("a compact master method defines load_lists()")

    @staticmethod
    def store_lists(values: torch.Tensor, weights: list[torch.Tensor],
                    bufs: list[torch.Tensor] | None, keys: torch.Tensor | None,
                    spare: torch.Tensor | None = None) -> None:
        """Write the flat fp32 ``values`` into the ``weights`` and buffers (any strides; ``values``
        may be overwritten). ``keys``: the int32 rounding key of each tensor, shifted so that
        flat element ``i`` of the run reads the noise table at ``i + keys[t]``
        (:mod:`mixprec.masters.rounding`; None when :attr:`draws_bits` is False). ``spare``: as
        :meth:`load_lists`."""
        raise NotImplementedError("a compact master method defines store_lists()")

    def assign(self, weight: torch.Tensor, buf: torch.Tensor | None,
               value: torch.Tensor) -> None:
        """Set ``weight`` (and its buffer) to the fp32 ``value``, exactly where they can hold
        it, drawing no random bits (eager; ``weight`` may be an FSDP2 shard)."""
        raise NotImplementedError("a compact master method defines assign()")


def register(cls: type, shorthands: dict[str, dict] | None = None) -> type:
    """Register a method class under ``cls.name``, with its string shorthands (shorthand ->
    the options it stands for).

    Raises:
        TypeError: not a named :class:`MasterMethod` subclass.
        ValueError: the name or a shorthand is taken by another class.
    """
    return _REGISTRY.register(cls, MasterMethod, shorthands)


def shorthands() -> tuple[str, ...]:
    """The strings ``master=`` accepts, in registration order."""
    return tuple(_REGISTRY.shorthands)


def methods() -> dict[str, type]:
    """Registered name -> method class."""
    return dict(_REGISTRY.classes)


def resolve(spec: Any) -> MasterMethod:
    """The master method ``spec`` stands for.

    Args:
        spec: a method, a shorthand ("fp32", "split", "kahan", "stochastic"), or a method's
            :meth:`~mixprec.components.Component.state_dict`.

    Raises:
        ValueError: an unknown shorthand or method name.
        TypeError: anything else.
    """
    if isinstance(spec, MasterMethod):
        return spec
    if isinstance(spec, str):
        method = _REGISTRY.from_shorthand(spec)
        if method is None:
            raise ValueError(f"master must be one of {_REGISTRY.choices()} (or a "
                             f"mixprec.masters method); got {spec!r}")
        return method
    if isinstance(spec, dict) and "method" in spec:
        return _REGISTRY.from_state(spec)
    raise TypeError(f"master must be a mixprec.masters method (FP32, Split, Kahan, Stochastic) "
                    f"or one of {_REGISTRY.choices()}; got {type(spec).__name__} {spec!r}")
