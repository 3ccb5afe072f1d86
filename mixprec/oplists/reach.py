"""What op lists can reach: op-list names that a model's code never calls at the Python level.

Custom op lists act where the named Python-level functions are called. An ATen op that runs
beneath such a function (``addmm`` beneath ``F.linear``, ``native_layer_norm`` beneath
``F.layer_norm``) is out of their reach: :data:`~mixprec.oplists.MODULE_FUNCTIONS` and
:data:`~mixprec.oplists.OPS_BENEATH` record which functions common modules call and which ATen ops
sit beneath them, and :func:`unreachable_names` uses them to say what to name instead.
"""

from __future__ import annotations

import inspect
import re
import warnings

from torch import nn

from .names import OPERATOR_SYMBOLS, normalize_op_name, resolve_op
from .tables import MODULE_FUNCTIONS, OPS_BENEATH

__all__ = ["OpListWarning", "unreachable_names", "warn_unreachable"]


class OpListWarning(UserWarning):
    """An op-list name that the model's code never calls at the Python level (see
    :func:`unreachable_names`), so listing it changes nothing."""


def _table_entry(cls: type):
    """(functions, overrides_forward) from the nearest base in MODULE_FUNCTIONS, or None."""
    for base in cls.__mro__:
        if base in MODULE_FUNCTIONS:
            return MODULE_FUNCTIONS[base], cls.forward is not base.forward
    return None


def _class_source(cls: type) -> str | None:
    """The source of ``cls`` and of its bases up to torch's own classes (None if unreadable)."""
    parts = []
    for base in cls.__mro__:
        if base is nn.Module or base in MODULE_FUNCTIONS or base is object:
            break
        try:
            parts.append(inspect.getsource(base))
        except (OSError, TypeError):
            return None
    return "\n".join(parts)


def _model_calls(model: nn.Module) -> tuple[set[str], list[str]] | None:
    """Functions the model's known modules call, and the sources of its other modules' code;
    None when some module's code cannot be read (then nothing can be ruled out)."""
    called: set[str] = set()
    sources: list[str] = []
    seen: set[type] = set()
    for mod in model.modules():
        cls = type(mod)
        if cls in seen:
            continue
        seen.add(cls)
        entry = _table_entry(cls)
        if entry is not None:
            called.update(entry[0])
            if not entry[1]:
                continue
        source = _class_source(cls)
        if source is None:
            return None
        sources.append(source)
    return called, sources


def _mentioned(name: str, sources: list[str]) -> bool:
    """Could code in ``sources`` call ``name`` (by name, or by its operator)?"""
    word = re.compile(rf"\b{re.escape(name)}\b")
    symbol = OPERATOR_SYMBOLS.get(name)
    return any(word.search(src) or (symbol and symbol in src) for src in sources)


def unreachable_names(model: nn.Module, names) -> dict[str, tuple[str, ...]]:
    """Op-list names that the model's code never calls, with the names to use instead.

    Op lists act on Python-level calls. A name is reported when it is an ATen op beneath a
    function the model's modules call (:data:`OPS_BENEATH`), and neither a module type of
    :data:`MODULE_FUNCTIONS` nor the source of the model's other modules (custom ``forward``
    code, read with ``inspect``) calls it: ``"addmm"`` in a model of ``nn.Linear`` layers (which
    call ``F.linear``) maps to ``("linear",)``. Names about which nothing is known, and every
    name when some module's source cannot be read, are not reported.

    Args:
        model: the model whose modules are examined.
        names: op-list names (any spelling :func:`resolve_op` accepts).

    Returns:
        ``{name as given: (names to use instead, sorted)}``; empty when nothing is unreachable.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: an unknown op name.

    Example:
        >>> unreachable_names(nn.Sequential(nn.Linear(4, 4)), ["addmm", "linear"])
        {'addmm': ('linear',)}
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        resolve_op(name)
    if not names:
        return {}
    calls = _model_calls(model)
    if calls is None:
        return {}
    called, sources = calls
    # functions the custom code calls (by name, or ``@`` for matmul) count as called too
    called = called | {f for f in OPS_BENEATH if f not in called and _mentioned(f, sources)}
    result = {}
    for name in names:
        flat = normalize_op_name(name)
        above = sorted(f for f in called if flat in OPS_BENEATH.get(f, ()))
        if flat in called or not above or _mentioned(flat, sources):
            continue
        result[name] = tuple(above)
    return result


def warn_unreachable(model: nn.Module, low_precision_ops=(), fp32_ops=(), *,
                     stacklevel: int = 2) -> dict[str, tuple[str, ...]]:
    """Warn (:class:`OpListWarning`) for each op-list name the model's code cannot reach.

    Args:
        model: the model the lists will apply to.
        low_precision_ops, fp32_ops: the custom op lists.
        stacklevel: as for ``warnings.warn`` (2: the line that called this function).

    Returns:
        What :func:`unreachable_names` found, for both lists together.
    """
    found = {}
    for what, ops in (("low_precision_ops", low_precision_ops), ("fp32_ops", fp32_ops)):
        if isinstance(ops, str):
            ops = (ops,)
        for name, instead in unreachable_names(model, tuple(ops)).items():
            found[name] = instead
            use = " or ".join(repr(n) for n in instead)
            warnings.warn(
                f"{what} names {name!r}, which this model never calls: {name!r} is an ATen op that "
                f"runs beneath {', '.join(instead)}, and op lists act on Python-level calls. "
                f"Use {use} (mp.debug.op_stats() shows the op-list name of every op that ran).",
                OpListWarning, stacklevel=stacklevel)
    return found
