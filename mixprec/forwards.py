"""The base of mixprec's forward wrappers: an object that replaces ``module.forward``.

Every forward mixprec installs (a region's entry or island, a low-bit layer's GEMM forward) is
a small picklable object owned by its module, set as the instance attribute ``forward``, so a
prepared model pickles, deep-copies and compiles as one graph. :class:`ForwardWrapper` holds
what they share: the module, the forward it replaced, and that forward's signature.
"""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["ForwardWrapper"]


class ForwardWrapper:
    """Replaces ``module.forward`` (as an instance attribute, picklable); ``call_inner`` runs the
    forward it replaced: an earlier wrapper, else the class's own ``forward``. Its signature is
    that forward's (``inspect.signature(model.forward)`` reads it: Hugging Face's Trainer picks
    the input columns it keeps from it)."""

    def __init__(self, module: nn.Module):
        self.module = module
        # a wrapper installed before this one, else None: the class's own forward
        self.inner = module.__dict__.get("forward")

    def call_inner(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __code__(self):
        """The replaced forward's code object (``torch.export`` names its trace by it)."""
        inner = self.inner if self.inner is not None else type(self.module).forward
        return inner.__code__

    @property
    def __signature__(self) -> inspect.Signature:
        inner = self.inner if self.inner is not None else \
            type(self.module).forward.__get__(self.module)
        return inspect.signature(inner)
