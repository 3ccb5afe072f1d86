"""Helpers shared by the dispatch-mode diagnostics: the pass an op runs in, op names, tensors."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

PHASES = ("forward", "backward")


def current_phase() -> str:
    """"forward", or "backward" while autograd runs a node."""
    return "forward" if torch._C._current_autograd_node() is None else "backward"


def op_name(func) -> str:
    """``aten.addmm.default`` -> ``"addmm"``; other namespaces keep theirs (``"quantized.add"``)."""
    name = func.overloadpacket.__name__
    return name if func.namespace == "aten" else f"{func.namespace}.{name}"


def tensors_in(tree) -> list[torch.Tensor]:
    """The tensors in a pytree."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
