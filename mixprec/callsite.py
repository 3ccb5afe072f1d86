"""Where a warning points: the first frame outside mixprec, torch and the training libraries that
call mixprec (Lightning, Accelerate, transformers): the user's line.

mixprec's warnings are raised several calls deep (and, since its step, unscale and clips run
eagerly inside a compiled function, under torch's dynamo wrappers): a fixed ``stacklevel``
pointed at mixprec's own lines or at ``torch/_dynamo/eval_frame.py``. :func:`user_stacklevel`
counts the frames instead.
"""

from __future__ import annotations

import sys

__all__ = ["user_stacklevel"]

_INSIDE = ("mixprec", "torch", "lightning", "pytorch_lightning", "lightning_fabric",
           "accelerate", "transformers")  # (the hosts that call mixprec: past them, the user's)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that points at
    the first frame outside mixprec, torch and the hosts (the caller's own frame is level 1)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".", 1)[0] not in _INSIDE:
            return level
        frame, level = frame.f_back, level + 1
    return 1
