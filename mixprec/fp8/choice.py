"""Which layers of a model run their GEMMs in a low-bit format: eligibility, the default choice,
user choices.

A layer can take the policy's format (:mod:`mixprec.lowbit`) when it is an ``nn.Linear`` or a
Hugging Face ``Conv1D`` (GPT-2's Linear with a transposed weight) whose dimensions the format
accepts (:meth:`~mixprec.lowbit.LowBitFormat.why_ineligible`: multiples of 16 for FP8, whose
tensor cores need it, of 32 for MXFP8's blocks, of 16 for NVFP4's; a CPU does not enforce it,
so mixprec checks it everywhere), that calls its own ``forward`` (not the
projections of ``nn.MultiheadAttention``, which reads their weights directly), and that the
policy's modules map does not give a dtype of its own (``keep_fp32``, ``overrides``,
``to_float``), nor a module around it.

The default choice (``fp8_modules=None``) takes every such layer except the first and the last
GEMM layer of the model (Linear or Conv1D layers that run their own forward, in the order
``named_modules()`` lists them, which is the order they were registered in): Accelerate and
Megatron keep those in 16 bits for stability. On CUDA it also applies the format's shape
filter (FP8: torchao's, which skips layers too small to run faster in FP8). When the policy's
modules map gives layers a GEMM format (``fp8_modules=`` names, the advisor's map, or entries
such as ``{nn.Linear: "mxfp8"}``) or ``"off"``, the map decides instead: the layers it names
with a format are taken as given (each must be eligible), and the eligible layers of the types
it gives one; a callable ``(module, name) -> bool`` picks among the eligible layers. Either way
the choice is resolved into qualified names, the names ``named_modules()`` gives, recorded in
the prepared model's policy (entries ``name: Precision(gemm=format)`` of its modules map). When
the default choice or a callable leaves no layer, ``prepare`` warns once, naming why each GEMM
layer was left out, and the policy records ``fp8_modules=0``.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from typing import Callable

import torch
from torch import nn

from ..casting import marks_map, module_device, module_dtypes
from ..lowbit import Float8, shorthands
from ..lowbit.base import is_conv1d
from ..policy import Policy
from ..precision import Precision

__all__ = ["gemm_dims", "ineligible", "eligible_layers",
           "default_choice", "choose", "with_modules", "split_spec", "why_none_chosen"]

_NONE = Precision()


FORMATS = "a mixprec.lowbit format, or one of " + ", ".join(map(repr, shorthands()))


def gemm_dims(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a Linear or Conv1D layer, else None."""
    if is_conv1d(module):
        return tuple(module.weight.shape)
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return None


def _explicit_dtypes(model: nn.Module, policy: Policy) -> dict[nn.Module, torch.dtype | None]:
    """Each module's dtype of its own (the policy's modules map, to_float marks; inherited by
    sub-modules), or None."""
    pmap = policy.modules.updated(marks_map(model))

    def own(mod, name):
        entry = pmap.lookup(mod, name)
        return None if entry is None else entry.compute
    return module_dtypes(model, None, own)


def ineligible(model: nn.Module, policy: Policy) -> dict[str, str]:
    """Qualified name -> why it cannot take the policy's low-bit format (FP8 tensorwise when
    the policy has none), for every module that can't (GEMM layers and others alike)."""
    fmt = policy.fp8 if policy.fp8 is not None else Float8()
    dtypes = _explicit_dtypes(model, policy)
    modules = dict(model.named_modules())
    reasons = {}
    for name, mod in modules.items():
        dims = gemm_dims(mod)
        parent = modules.get(name.rpartition(".")[0]) if name else None
        if not name:
            why = "is the model itself (an FP8 layer is swapped into its parent module)"
        elif dims is None:
            why = f"is a {type(mod).__name__}, not an nn.Linear or a Hugging Face Conv1D"
        elif isinstance(parent, nn.MultiheadAttention):
            why = ("is a projection of nn.MultiheadAttention, which reads its weight directly "
                   "(the layer's forward never runs)")
        elif fmt.why_ineligible(*dims):
            why = fmt.why_ineligible(*dims)
        elif dtypes.get(mod) is not None:
            why = (f"computes in {dtypes[mod]} by the policy (its modules map: keep_fp32, "
                   f"overrides or to_float, on it or on a module around it)")
        elif "forward" in mod.__dict__:
            why = "has its forward replaced already (wrapped by another tool)"
        else:
            continue
        reasons[name] = why
    return reasons


def eligible_layers(model: nn.Module, policy: Policy) -> list[str]:
    """Qualified names of the layers that can take FP8, in ``named_modules()`` order."""
    bad = ineligible(model, policy)
    return [name for name, _ in model.named_modules() if name not in bad]


def _gemm_layers(modules: dict[str, nn.Module]) -> list[str]:
    """The GEMM layers that run their own forward (not nn.MultiheadAttention's projections)."""
    return [name for name, mod in modules.items() if gemm_dims(mod) is not None
            and not isinstance(modules.get(name.rpartition(".")[0]), nn.MultiheadAttention)]


def default_choice(model: nn.Module, policy: Policy) -> list[str]:
    """The eligible layers except the model's first and last GEMM layer; on CUDA, only those
    torchao's shape filter keeps."""
    modules = dict(model.named_modules())
    gemms = _gemm_layers(modules)
    ends = {gemms[0], gemms[-1]} if gemms else set()
    chosen = [n for n in eligible_layers(model, policy) if n not in ends]
    keep = policy.fp8.shape_filter() if module_device(model).type == "cuda" else None
    if keep is not None:
        chosen = [n for n in chosen if keep(_as_linear(modules[n]), n)]
    return chosen


def _as_linear(module: nn.Module) -> nn.Module:
    """A Conv1D as a shape-alike (meta) nn.Linear, for torchao's filter (it reads Linears)."""
    if not is_conv1d(module):
        return module
    fan_in, fan_out = gemm_dims(module)
    return nn.Linear(fan_in, fan_out, bias=False, device="meta")


def _check_names(model: nn.Module, policy: Policy, names: tuple[str, ...]) -> None:
    modules = {n for n, _ in model.named_modules() if n}
    unknown = [n for n in names if n not in modules]
    if unknown:
        hints = [f"{n!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(
            n, modules, n=1)) else "") for n in unknown]
        raise ValueError(f"fp8_modules name no module of the model: {', '.join(hints)}")
    bad = ineligible(model, policy)
    refused = [f"{n!r} {bad[n]}" for n in names if n in bad]
    if refused:
        raise ValueError(f"fp8_modules names layers that cannot run in FP8: "
                         f"{'; '.join(refused)}")


def choose(model: nn.Module, policy: Policy, chooser: Callable | None = None) -> tuple[str, ...]:
    """The qualified names of the layers ``policy`` (with ``fp8`` set) runs in its low-bit
    format, in ``named_modules()`` order.

    Args:
        model: the fp32 model, before conversion.
        policy: the policy; when its modules map gives layers a GEMM format (or ``"off"``), the
            map decides: the layers it names with a format (each must be eligible) and the
            eligible layers of the types it gives one.
        chooser: ``(module, name) -> bool`` picking among the eligible layers, or None for the
            default choice.

    Raises:
        ValueError: a name that is no module, or a layer that cannot take FP8 (the reason is
            given).
        TypeError: ``chooser`` is not callable.
    """
    pmap = policy.modules
    if pmap.sets_gemm:
        named = pmap.gemm_names()
        _check_names(model, policy, named)
        modules = dict(model.named_modules())
        eligible = set(eligible_layers(model, policy))
        return tuple(n for n, mod in modules.items() if n in named or (
            n in eligible and (pmap.lookup(mod, n) or _NONE).lowbit is not None))
    if chooser is None:
        return tuple(default_choice(model, policy))
    if not callable(chooser):
        raise TypeError(f"fp8_modules must be None, a list of qualified module names, or a "
                        f"callable (module, name) -> bool; got {type(chooser).__name__}")
    modules = dict(model.named_modules())
    return tuple(n for n in eligible_layers(model, policy) if chooser(modules[n], n))


def with_modules(policy: Policy, model: nn.Module, chooser: Callable | None = None) -> Policy:
    """``policy`` whose modules map names the layers that run low-bit for ``model`` (by
    qualified name; unchanged without ``fp8``, or when the map names them already)."""
    if policy.fp8 is None:
        return policy
    explicit = policy.modules.sets_gemm
    names = choose(model, policy, chooser)
    if not names and not explicit:  # chosen for the user, and nothing was
        warnings.warn(why_none_chosen(model, policy, chooser), UserWarning, stacklevel=4)
    by_type = any(not isinstance(k, str) and v.lowbit for k, v in policy.modules.items())
    if explicit and not by_type:
        return policy
    return dataclasses.replace(policy, fp8_modules=names)


def why_none_chosen(model: nn.Module, policy: Policy, chooser: Callable | None = None,
                    limit: int = 8) -> str:
    """The message of a choice that left no layer: why each GEMM layer was left out."""
    modules = dict(model.named_modules())
    gemms = _gemm_layers(modules)
    head = (f"fp8={str(policy.fp8)!r} converts no layer of this {type(model).__name__}: every "
            f"layer computes as without fp8= and the policy records fp8_modules=0. ")
    if not gemms:
        kinds = sorted({type(m).__name__ for n, m in modules.items() if n
                        and any(True for _ in m.parameters(recurse=False))})
        return head + (f"FP8 runs the GEMMs of nn.Linear and Hugging Face Conv1D layers only, "
                       f"and the model has none (its layers with parameters: "
                       f"{', '.join(kinds) or 'none'})")
    bad = ineligible(model, policy)
    ends = {gemms[0], gemms[-1]}
    why = []
    for name in gemms:
        if name in bad:
            reason = bad[name]
        elif chooser is not None:
            reason = "was not picked by the fp8_modules callable"
        elif name in ends:
            reason = ("is the model's first or last GEMM layer, kept in 16 bits by the default "
                      "choice (name it in fp8_modules to convert it)")
        else:
            reason = "is too small to run faster in FP8 (torchao's shape filter, on CUDA)"
        why.append(f"{name!r} {reason}")
    more = f"; and {len(why) - limit} more" if len(why) > limit else ""
    return head + "Left out: " + "; ".join(why[:limit]) + more


def split_spec(fp8, fp8_modules) -> tuple[tuple[str, ...] | None, Callable | None]:
    """``fp8_modules`` as given to ``prepare``: (names, None), (None, chooser) or (None, None).

    Raises:
        ValueError: ``fp8_modules`` without ``fp8``.
        TypeError: neither None, names nor a callable.
    """
    if fp8_modules is None:
        return None, None
    if fp8 is None:
        raise ValueError(f"fp8_modules chooses the layers that run in FP8: it needs fp8= "
                         f"({FORMATS})")
    if isinstance(fp8_modules, str):
        return (fp8_modules,), None
    if isinstance(fp8_modules, (list, tuple)) and all(isinstance(n, str) for n in fp8_modules):
        return tuple(fp8_modules), None
    if callable(fp8_modules):
        return None, fp8_modules
    raise TypeError(f"fp8_modules must be None, a list of qualified module names, or a callable "
                    f"(module, name) -> bool; got {type(fp8_modules).__name__} {fp8_modules!r}")
