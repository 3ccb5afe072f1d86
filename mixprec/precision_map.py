"""Per-module precision as one map: :class:`Precision` (what one module computes in) and
:class:`PrecisionMap` (qualified module name or module type -> :class:`Precision`).

Keras' ``DTypePolicyMap`` is the model (layer path -> dtype policy). A map's entries are
ordered; a key is a qualified module name (as ``named_modules()`` gives it) or an ``nn.Module``
subclass. The lookup rule, for a module of the model:

1. an entry for its exact qualified name wins;
2. else the entry of the most specific type it is an instance of: the class that comes first in
   the module's MRO (``nn.Linear`` beats ``nn.Module``). A marker class that matches by
   ``isinstance`` without being in the MRO (:class:`mixprec.NormLayer`) ranks just above
   ``nn.Module``: any real class it matches beats it (``nn.LayerNorm`` beats ``NormLayer``);
3. between entries of equal rank, the earlier entry;
4. no entry: the module inherits (its region's dtype; the policy's default low-bit choice).

One entry decides a module: its fields left None are inherited, never filled from another
entry. The ``keep_fp32=``, ``overrides=`` and ``fp8_modules=`` arguments of
:class:`mixprec.Policy` and ``prepare``, and :func:`mixprec.to_float` marks, are entries of a
policy's map (``Policy.modules``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .dtypes import TRAINING_DTYPES, to_dtype
from .precision import (
    OFF,
    Precision,
    check_key,
    described,
    key_name,
    type_from_path,
    type_path,
)

_FP32 = torch.float32

__all__ = ["PrecisionMap", "keep_fp32_entries", "override_pairs", "with_legacy", "with_names",
           "one_format"]


class PrecisionMap:
    """Ordered, immutable map: qualified module name or ``nn.Module`` subclass -> the module's
    :class:`Precision` (see the module docstring for the lookup rule).

    Args:
        entries: a mapping or an iterable of ``(key, value)`` pairs (a later pair replaces an
            earlier one with the same key), or another map. A value is a :class:`Precision`,
            a dtype ("fp32": compute), a low-bit format or its shorthand ("mxfp8": gemm) or
            ``"off"``.

    Raises:
        TypeError: a key that is neither a name nor a module type (a module instance...), a
            value of the wrong kind, or ``entries`` of the wrong shape.
        ValueError: an invalid dtype or format.

    Example:
        >>> m = PrecisionMap({nn.Linear: "bf16", "head": "fp32"})
        >>> m["head"], m[nn.Linear], m.lookup(nn.Linear(2, 2), "head")
        (Precision('fp32'), Precision('bf16'), Precision('fp32'))
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: Any = None):
        if isinstance(entries, PrecisionMap):
            pairs = entries.items()
        elif entries is None:
            pairs = ()
        elif isinstance(entries, Mapping):
            pairs = entries.items()
        elif isinstance(entries, Iterable) and not isinstance(entries, (str, bytes, nn.Module)):
            pairs = list(entries)
            for item in pairs:
                if not (isinstance(item, (tuple, list)) and len(item) == 2):
                    raise TypeError(f"precision map entries must be (key, precision) pairs; "
                                    f"got {described(item)}")
        else:
            raise TypeError(f"PrecisionMap takes a dict (or pairs) of qualified module name / "
                            f"module type -> precision; got {described(entries)}")
        merged: dict = {}
        for key, value in pairs:
            merged[check_key(key)] = Precision.of(value)
        object.__setattr__(self, "_entries", tuple(merged.items()))

    def __setattr__(self, name, value):
        raise AttributeError("a PrecisionMap is immutable: use updated() or without()")

    def __reduce__(self):
        return PrecisionMap, (list(self._entries),)

    # -- the mapping -------------------------------------------------------------------------
    def items(self) -> tuple:
        return self._entries

    def keys(self) -> tuple:
        return tuple(k for k, _ in self._entries)

    def values(self) -> tuple:
        return tuple(v for _, v in self._entries)

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return any(k == key for k, _ in self._entries)

    def __getitem__(self, key) -> Precision:
        """The entry for a qualified name (exactly that name), or the entry that applies to
        instances of a module type (itself, else its most specific base with an entry).

        Raises:
            KeyError: no entry applies.
            TypeError: ``key`` is neither a name nor a module type.
        """
        check_key(key, "a precision map lookup")
        if isinstance(key, str):
            for k, v in self._entries:
                if k == key:
                    return v
            raise KeyError(key)
        best = self._by_type(key.__mro__, lambda k: issubclass(key, k))
        if best is None:
            raise KeyError(key)
        return best

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def lookup(self, module: nn.Module, name: str) -> Precision | None:
        """The entry that decides ``module`` (qualified ``name``), or None (it inherits)."""
        for k, v in self._entries:
            if k == name:
                return v
        return self._by_type(type(module).__mro__, lambda k: isinstance(module, k))

    def _by_type(self, mro: tuple, matches) -> Precision | None:
        floor = mro.index(nn.Module) - 0.5 if nn.Module in mro else len(mro)
        best, best_rank = None, None
        for k, v in self._entries:
            if isinstance(k, str) or not matches(k):
                continue
            rank = mro.index(k) if k in mro else floor
            if best_rank is None or rank < best_rank:
                best, best_rank = v, rank
        return best

    def resolve(self, model: nn.Module) -> dict[str, Precision]:
        """``{qualified name: Precision}`` for every module of ``model`` (``""``: the model
        itself), by the lookup rule; ``Precision()`` where no entry applies.

        Raises:
            ValueError: an entry names no module of ``model`` (close names are suggested).
        """
        self.check_names(model)
        return {name: self.lookup(mod, name) or Precision()
                for name, mod in model.named_modules()}

    def check_names(self, model: nn.Module, what: str = "the precision map") -> None:
        """Raise ``ValueError`` for name entries that match no module of ``model``."""
        names = {n for n, _ in model.named_modules()}
        unknown = [k for k in self.names() if k not in names]
        first = {id(m): n for n, m in model.named_modules()}
        aliases = {n: first[id(m)] for n, m in model.named_modules(remove_duplicate=False)
                   if n not in names}
        if any(k in aliases for k in unknown):  # a shared module, listed once by torch
            k = next(k for k in unknown if k in aliases)
            raise ValueError(f"{what} names {k!r}, a module also registered as {aliases[k]!r}; "
                             f"named_modules() lists a shared module once, under its first "
                             f"name: use {aliases[k]!r}")
        if unknown:
            hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(
                k, names - {""}, n=1)) else "") for k in unknown]
            raise ValueError(f"{what} name no module of the model: {', '.join(hints)}; "
                             f"qualified names look like {sorted(names - {''})[:4]}")

    # -- derived -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The qualified module names the map has entries for."""
        return [k for k in self.keys() if isinstance(k, str)]

    @property
    def sets_gemm(self) -> bool:
        """True when an entry gives a GEMM format (or ``"off"``): the map then decides which
        layers run low-bit (each layer it gives a format), instead of ``prepare``'s default
        choice."""
        return any(v.gemm is not None for v in self.values())

    def gemm_names(self) -> tuple[str, ...]:
        """Qualified names the map gives a low-bit format, in entry order."""
        return tuple(k for k, v in self._entries if isinstance(k, str) and v.lowbit)

    def lowbit_formats(self) -> list:
        """The distinct low-bit formats of the entries."""
        seen = []
        for v in self.values():
            if v.lowbit is not None and v.lowbit not in seen:
                seen.append(v.lowbit)
        return seen

    # -- new maps ----------------------------------------------------------------------------
    def updated(self, entries: Any) -> "PrecisionMap":
        """A map with ``entries`` set: an existing key keeps its place, a new one is appended."""
        return PrecisionMap([*self.items(), *PrecisionMap(entries).items()])

    def without(self, keep) -> "PrecisionMap":
        """A map of the entries for which ``keep(key, precision)`` is false."""
        return PrecisionMap([(k, v) for k, v in self._entries if not keep(k, v)])

    # -- identity ----------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        if isinstance(other, (Mapping, list, tuple)) and not isinstance(other, PrecisionMap):
            try:
                other = PrecisionMap(other)
            except (TypeError, ValueError):
                return False
        return isinstance(other, PrecisionMap) and self._entries == other._entries

    def __hash__(self) -> int:
        return hash(self._entries)

    def __repr__(self) -> str:
        body = ", ".join(f"{k!r}: {v!r}" if isinstance(k, str) else f"{_type_repr(k)}: {v!r}"
                         for k, v in self._entries)
        return f"PrecisionMap({{{body}}})"

    def __str__(self) -> str:
        return "[" + ",".join(f"{key_name(k)}:{v}" for k, v in self._entries) + "]"

    def state_dict(self) -> list:
        """Plain data: ``[[key, precision], ...]``, a type key as ``{"type": "module:Qual"}``."""
        return [[k if isinstance(k, str) else {"type": type_path(k)}, v.to_data()]
                for k, v in self._entries]

    @classmethod
    def from_state_dict(cls, state: list) -> "PrecisionMap":
        """Rebuild a map from :meth:`state_dict`.

        Raises:
            ValueError: a module type that can't be imported.
            TypeError: ``state`` of the wrong shape.
        """
        if not isinstance(state, (list, tuple)):
            raise TypeError(f"a precision map state_dict is a list of [key, precision]; got "
                            f"{described(state)}")
        for i, entry in enumerate(state):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise TypeError(f"a precision map state_dict is a list of [key, precision]; "
                                f"entry {i} is {described(entry)}")
        return cls([(type_from_path(k["type"]) if isinstance(k, dict) else k, v)
                    for k, v in state])


def _type_repr(t: type) -> str:
    r = repr(t)
    return r if not r.startswith("<class '") else f"{t.__module__}.{t.__qualname__}"


# -- the older keyword arguments (keep_fp32=, overrides=, fp8_modules=) as entries ------------
def override_pairs(value) -> list:
    """``overrides=`` as (key, dtype) pairs."""
    items = value.items() if isinstance(value, Mapping) else value
    if not isinstance(items, (tuple, list, type({}.items()))):
        raise TypeError(f"overrides must be a dict (or pairs) of module type / qualified module "
                        f"name -> dtype; got {described(value)}")
    out = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"overrides entries must be (module type or name, dtype) pairs; "
                            f"got {item!r}")
        key, dt = check_key(item[0], "an overrides key"), to_dtype(item[1],
                                                                  what="an override dtype")
        if dt not in TRAINING_DTYPES:
            raise ValueError(f"an override dtype must be 'fp32', 'fp16' or 'bf16'; got "
                             f"{item[1]!r} for {key!r}")
        out.append((key, dt))
    return out


_KEEP_FP32_VALID = ("an nn.Module subclass (e.g. nn.LayerNorm), a qualified module name "
                    "(e.g. 'encoder.norm'), or an iterable of them")


def keep_fp32_entries(keep: Any) -> tuple:
    """``keep_fp32`` as a tuple of module types and qualified module names.

    Args:
        keep: an ``nn.Module`` subclass, a qualified module name, or an iterable of them.

    Raises:
        TypeError: anything else (a number, a mapping, a module instance...), naming it.
    """
    if isinstance(keep, (type, str)):
        keep = (keep,)
    elif isinstance(keep, (bytes, Mapping, nn.Module)) or not isinstance(keep, Iterable):
        raise TypeError(f"keep_fp32 must be {_KEEP_FP32_VALID}; got {described(keep)}")
    keep = tuple(keep)
    for k in keep:
        if not (isinstance(k, str) or (isinstance(k, type) and issubclass(k, nn.Module))):
            raise TypeError(f"keep_fp32 entries must be nn.Module subclasses or qualified module "
                            f"names; got {described(k)}")
    return keep


def with_legacy(pmap: PrecisionMap, keep_fp32, overrides) -> PrecisionMap:
    """``pmap`` with the ``overrides=`` and ``keep_fp32=`` entries (an override replaces a
    keep_fp32 entry of the same key)."""
    pairs = override_pairs(overrides)
    given = {k for k, _ in pairs}
    keep = [(k, Precision(_FP32)) for k in keep_fp32_entries(keep_fp32) if k not in given]
    return pmap.updated([(k, Precision(dt)) for k, dt in pairs] + keep) if pairs or keep else pmap


def with_names(pmap: PrecisionMap, names, fmt) -> PrecisionMap:
    """``pmap`` whose low-bit choice is exactly the layers ``names`` (``fp8_modules=``)."""
    if isinstance(names, str):
        names = (names,)
    if not (isinstance(names, (tuple, list)) and all(isinstance(n, str) for n in names)):
        raise TypeError(f"fp8_modules in a Policy must be qualified module names; got "
                        f"{described(names)}")
    if names and fmt is None:
        raise ValueError(f"fp8_modules={list(names)} names the layers that run in the low-bit "
                         f"format fp8=, which this policy does not set")
    own = [n for n in names if pmap.get(n) is not None and pmap[n].compute is not None]
    if own:
        raise ValueError(f"fp8_modules names {own}, which the policy's modules map gives a "
                         f"compute dtype of their own ({', '.join(str(pmap[n]) for n in own)}): "
                         f"a low-bit layer computes in the dtype of the code around it")
    pmap = pmap.without(lambda k, v: v.gemm is not None and v.compute is None)
    if not names:  # no layer: every module's GEMMs stay in its compute dtype
        return pmap.updated({nn.Module: Precision(gemm=OFF)})
    return pmap.updated({n: Precision(gemm=fmt) for n in names})


def one_format(pmap: PrecisionMap, fmt):
    """The policy's low-bit format: ``fmt``, or the one the map's entries give."""
    found = pmap.lowbit_formats()
    if len(found) > 1 or (found and fmt is not None and found[0] != fmt):
        given = ", ".join(str(f) for f in ([fmt] if fmt is not None else []) + found)
        raise ValueError(f"one model runs one low-bit format; this policy gives {given} "
                         f"(fp8= and the modules map must agree)")
    return fmt if fmt is not None else (found[0] if found else None)
