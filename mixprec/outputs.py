"""What a prepared model returns: its floating outputs in ``output_dtype``, each cast once, when
read.

A Hugging Face model called with labels returns its loss next to its logits, and has computed
that loss from its own ``logits.float()``. Casting every output to fp32 on the way out copies the
logits although the training step reads only the loss: at a 50k vocabulary, 1024 tokens and a
batch of 8, 1.6 GB of fp32 held through the step. So an output of that kind (a dataclass
``OrderedDict`` -- transformers' ``ModelOutput`` -- holding a ``loss`` tensor) gets its loss cast
at once and every other field cast on first read (attribute, key, index, ``values()``,
``items()``, ``to_tuple()``, pytree flattening), the cast kept for later reads. A field nobody
reads is never copied; what is read is in ``output_dtype``, as before. Every other output (and
any output in traced code) is cast at once.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from .autocast import cast_floating

__all__ = ["cast_outputs"]

_DTYPE, _CAST = "_mixprec_output_dtype", "_mixprec_cast_fields"


def cast_outputs(out, dtype: torch.dtype):
    """``out`` with its floating tensors in ``dtype``: cast now, or on first read for a model
    output that holds the model's own loss."""
    if (torch.compiler.is_compiling() or not isinstance(out, collections.OrderedDict)
            or not dataclasses.is_dataclass(out)
            or not isinstance(out.get("loss"), torch.Tensor)):
        return cast_floating(out, dtype)
    lazy = _lazy_class(type(out))
    fields = {f.name: out.__dict__.get(f.name) for f in dataclasses.fields(out)}
    fields["loss"] = cast_floating(fields["loss"], dtype)
    result = lazy(**fields)
    result.__dict__[_DTYPE] = dtype
    result.__dict__[_CAST] = {}
    return result


class _Field:
    """A data descriptor for one field: reads cast on first access, writes store the value."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        d = obj.__dict__
        raw, dtype, done = d.get(self.name), d.get(_DTYPE), d.get(_CAST)
        if raw is None or dtype is None:
            return raw
        if self.name not in done:
            done[self.name] = cast_floating(raw, dtype)
        return done[self.name]

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value
        obj.__dict__.get(_CAST, {}).pop(self.name, None)


def _getitem(self, key):
    if isinstance(key, str):
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)
    return self.to_tuple()[key]


def _get(self, key, default=None):
    return self[key] if key in self.keys() else default


def _values(self):
    return [self[k] for k in self.keys()]


def _items(self):
    return [(k, self[k]) for k in self.keys()]


_classes: dict[type, type] = {}


def _lazy_class(cls: type) -> type:
    """``cls`` with each field read through :class:`_Field`; pickles as ``cls``."""
    lazy = _classes.get(cls)
    if lazy is None:
        def __reduce__(self):
            return cls(**{k: self[k] for k in self.keys()}).__reduce__()

        namespace = {f.name: _Field(f.name) for f in dataclasses.fields(cls)}
        namespace.update(__getitem__=_getitem, get=_get, values=_values, items=_items,
                         __reduce__=__reduce__, __module__=__name__,
                         __qualname__=cls.__qualname__,
                         __doc__=f"{cls.__name__}, its fields cast on first read.")
        lazy = _classes[cls] = type(cls.__name__, (cls,), namespace)
    return lazy
