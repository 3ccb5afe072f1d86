"""Op-list names: the qualified spellings of a name, the Python callables it stands for, the
name of a callable, and the checks of custom op lists.

Custom op lists (``mp.autocast(low_precision_ops=..., fp32_ops=...)``) name Python-level torch
functions ("linear", "softmax", "add"; "torch.add" and "F.gelu" are accepted too) and act where
those functions are called: as functions, ``Tensor`` methods and operators alike.
"""

from __future__ import annotations

import difflib
import functools

import torch
import torch.nn.functional as F

__all__ = ["normalize_op_name", "resolve_op", "op_list_name", "validate_custom_lists",
           "OPERATOR_SYMBOLS"]

#: Operators a name also stands for: ``"add"`` catches ``x + y`` and ``1 + x``.
_OPERATOR_NAMES = {"add": ("__add__", "__radd__"), "sub": ("__sub__", "__rsub__"),
                   "mul": ("__mul__", "__rmul__"), "div": ("__truediv__", "__rtruediv__"),
                   "true_divide": ("__truediv__", "__rtruediv__"),
                   "matmul": ("__matmul__", "__rmatmul__"), "pow": ("__pow__", "__rpow__")}
OPERATOR_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "true_divide": "/",
                     "matmul": "@", "pow": "**"}
_NAMESPACES = (("", torch), ("", F), ("", torch.Tensor), ("linalg_", torch.linalg),
               ("fft_", torch.fft), ("special_", torch.special))
# The C bindings behind Python-level functions: ``F.mse_loss`` calls ``torch._C._nn.mse_loss``,
# ``torch.einsum`` calls ``torch._C._VariableFunctions.einsum``; torch's own code (and tests)
# call those directly, so a name stands for them too.
_TWINS = (torch._C._nn, torch._C._VariableFunctions)
# Qualified spellings -> the flat name (longest prefix first).
_QUALIFIERS = (("torch.nn.functional.", ""), ("nn.functional.", ""), ("F.", ""),
               ("torch.Tensor.", ""), ("Tensor.", ""), ("torch.linalg.", "linalg_"),
               ("torch.fft.", "fft_"), ("torch.special.", "special_"), ("torch.", ""))


def normalize_op_name(name: str) -> str:
    """The flat op-list name of a qualified spelling.

    ``"torch.add"``, ``"Tensor.add"``, ``"__add__"``, ``"Tensor.__add__"`` -> ``"add"`` (an
    operator's method names its op, which covers the operator); ``"torch.nn.functional.gelu"``,
    ``"F.gelu"`` -> ``"gelu"``; ``"torch.linalg.vector_norm"`` -> ``"linalg_vector_norm"``. A
    flat name is returned as is (stripped). The name is not checked; :func:`resolve_op` does
    that.

    Raises:
        ValueError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"an op name must be a non-empty string such as 'add' or 'softmax'; "
                         f"got {name!r}")
    name = name.strip()
    for prefix, replacement in _QUALIFIERS:
        if name.startswith(prefix) and len(name) > len(prefix):
            name = replacement + name[len(prefix):]
            break
    return _DUNDER_TO_NAME.get(name, name)  # an operator's method: its op (x + y: "add")


#: PaddlePaddle's AMP op names (its kernels') that torch names otherwise -> torch's name, for
#: the error an unknown name gets (docs/migrating.md has the same table).
PADDLE_NAMES: dict[str, str] = {
    "elementwise_add": "add", "elementwise_sub": "sub", "elementwise_mul": "mul",
    "elementwise_div": "div", "elementwise_pow": "pow", "matmul_v2": "matmul",
    "depthwise_conv2d": "conv2d", "conv2d_transpose": "conv_transpose2d",
    "softmax_with_cross_entropy": "cross_entropy", "cross_entropy2": "cross_entropy",
    "sigmoid_cross_entropy_with_logits": "binary_cross_entropy_with_logits",
    "reduce_sum": "sum", "reduce_mean": "mean", "lookup_table": "embedding",
    "lookup_table_v2": "embedding", "fused_attention": "scaled_dot_product_attention",
}


@functools.lru_cache(maxsize=None)
def resolve_op(name: str) -> tuple:
    """The Python callables that a user-facing op name stands for (function, method, operator).

    ``"add"`` -> ``(torch.add, torch.Tensor.add, Tensor.__add__, Tensor.__radd__)`` (``x + y``
    reaches ``Tensor.__add__``); ``"mse_loss"`` -> ``(F.mse_loss, torch._C._nn.mse_loss)``: the
    C binding a Python-level function wraps is the same op when called directly. Qualified
    spellings are accepted: ``"torch.add"``, ``"F.gelu"``, ``"torch.nn.functional.gelu"``,
    ``"Tensor.add"`` (see :func:`normalize_op_name`).

    Raises:
        ValueError: no function of that name in torch, torch.nn.functional, torch.Tensor,
            torch.linalg, torch.fft or torch.special.
    """
    flat = normalize_op_name(name)
    found = []
    if "." not in flat:
        for prefix, ns in _NAMESPACES:
            if prefix and not flat.startswith(prefix):
                continue
            fn = getattr(ns, flat[len(prefix):], None)
            if callable(fn) and not isinstance(fn, type) and fn not in found:
                found.append(fn)
        for dunder in _OPERATOR_NAMES.get(flat, ()):
            found.append(getattr(torch.Tensor, dunder))
        if found:  # the bindings a Python-level function wraps, called directly by torch's code
            for ns in _TWINS:
                fn = getattr(ns, flat, None)
                if callable(fn) and fn not in found:
                    found.append(fn)
    if not found:
        close = difflib.get_close_matches(flat, _known_names(), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        if flat in PADDLE_NAMES:  # (close spellings of a Paddle kernel name are other ops)
            hint = f"; {flat!r} is a PaddlePaddle kernel name: torch's is {PADDLE_NAMES[flat]!r}"
        raise ValueError(f"unknown op name {name!r}: not a function of torch, torch.nn.functional, "
                         f"torch.Tensor, torch.linalg, torch.fft or torch.special{hint}")
    return tuple(found)


_DUNDER_TO_NAME = {dunder: name for name, dunders in _OPERATOR_NAMES.items() for dunder in dunders
                   if name != "true_divide"}
_DUNDER_TO_NAME["__rdiv__"] = "div"  # Tensor.__rtruediv__ is named __rdiv__
_LIST_NAMES: dict = {}


def op_list_name(func) -> str | None:
    """The name op lists know a Python-level torch callable by, or None.

    ``F.linear`` -> ``"linear"``, ``Tensor.__add__`` -> ``"add"``, ``torch.linalg.vector_norm``
    -> ``"linalg_vector_norm"``; None for a callable no op-list name stands for.
    """
    try:
        return _LIST_NAMES[func]
    except KeyError:
        pass
    except TypeError:  # unhashable
        return None
    name = getattr(func, "__name__", None)
    result = None
    if isinstance(name, str) and name:
        name = _DUNDER_TO_NAME.get(name, name)
        try:
            result = name if func in resolve_op(name) else None
        except ValueError:
            result = None
    _LIST_NAMES[func] = result
    return result


@functools.lru_cache(maxsize=1)
def _known_names() -> tuple[str, ...]:
    names = set()
    for _, ns in _NAMESPACES[:3]:
        names.update(n for n in dir(ns) if not n.startswith("_"))
    return tuple(sorted(names))



def validate_custom_lists(low_precision_ops, fp32_ops,
                          promote_ops=()) -> tuple[tuple[str, ...], ...]:
    """Check the custom op lists: known names, no name in two lists.

    A list given as one string is that one name (``"softmax"`` is ``["softmax"]``), as for
    ``keep_fp32``.

    Returns:
        The three lists (low precision, fp32, promote) as tuples of flat names (``"torch.add"``
        becomes ``"add"``), duplicates dropped.

    Raises:
        TypeError: a list that is neither a name nor an iterable of names (strings).
        ValueError: an unknown name, or a name in two lists (in any spelling).
    """
    lists: dict[str, tuple[str, ...]] = {}
    for what, ops in (("low_precision_ops", low_precision_ops), ("fp32_ops", fp32_ops),
                      ("promote_ops", promote_ops)):
        if isinstance(ops, str):
            ops = (ops,)
        try:
            ops = tuple(ops)
        except TypeError:
            raise TypeError(f"{what} must be an op name or a list of op names (e.g. "
                            f"['softmax']); got {type(ops).__name__}") from None
        flat = []
        for name in ops:
            if not isinstance(name, str):
                raise TypeError(f"{what} must hold op names (strings such as 'softmax'), or be "
                                f"one; got {name!r} ({type(name).__name__}) in it")
            resolve_op(name)
            name = normalize_op_name(name)
            if name not in flat:
                flat.append(name)
        lists[what] = tuple(flat)
    names = list(lists)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            both = sorted(set(lists[first]) & set(lists[second]))
            if both:
                raise ValueError(f"op(s) {', '.join(map(repr, both))} named in both {first} and "
                                 f"{second}; an op can be moved to one list only")
    return tuple(lists.values())
