"""Facades for other libraries' mixed-precision APIs, built on mixprec.

* :mod:`mixprec.compat.apex_amp`: NVIDIA apex's ``amp`` (``initialize``, ``scale_loss``, ...);
  ``from mixprec.compat import apex_amp as amp`` replaces ``from apex import amp``.
"""

from . import apex_amp

__all__ = ["apex_amp"]
