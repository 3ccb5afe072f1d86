"""apex's process-wide state, held in one object: :data:`AMP`.

apex's ``amp`` API is global by design: ``amp.state_dict()`` and ``amp.scale_loss(...)`` name no
session, and ``amp.register_*_function`` is called before ``amp.initialize``, for every model
initialized later. So the compatibility layer keeps exactly one module-level reference, to an
:class:`ApexAmpState`, and nothing else at module level that changes: the session of the last
``amp.initialize`` (an :class:`~mixprec.compat.apex_session.AmpSession`), the functions
registered for O1, the dtype O1 casts to while a forward runs, and the optimizers already
initialized.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any

__all__ = ["ApexAmpState", "AMP"]


class ApexAmpState:
    """Everything apex kept process-wide.

    Attributes:
        session: the :class:`~mixprec.compat.apex_session.AmpSession` of the last
            ``amp.initialize`` (None before the first).
        registrations: op name -> cast policy ("low_precision", "fp32" or "promote"), from
            ``register_*_function`` on torch's namespaces; O1 models initialized afterwards run
            the op in that list.
        cast_dtype: a ``ContextVar``: the low-precision dtype while an O1 model's forward runs,
            None elsewhere and inside ``disable_casts()`` (what the cast decorators read).
        initialized: the optimizers passed to ``amp.initialize`` (held weakly), each accepted
            once.
    """

    def __init__(self) -> None:
        self.session: Any = None
        self.registrations: dict[str, str] = {}
        self.cast_dtype: contextvars.ContextVar = contextvars.ContextVar("apex_amp_cast_dtype",
                                                                        default=None)
        self.initialized: weakref.WeakSet = weakref.WeakSet()

    def current(self, what: str):
        """The session of the last ``amp.initialize``.

        Raises:
            RuntimeError: ``amp.initialize`` has not been called (``what`` names the caller).
        """
        if self.session is None:
            raise RuntimeError(f"{what} needs amp.initialize first: model, optimizer = "
                               f"amp.initialize(model, optimizer, opt_level=...)")
        return self.session

    def snapshot(self) -> dict[str, str]:
        """A copy of the registrations (to undo ``register_*_function`` calls later)."""
        return dict(self.registrations)

    def restore(self, registrations: dict[str, str]) -> None:
        """Put back registrations taken by :meth:`snapshot`."""
        self.registrations = dict(registrations)


#: The one process-wide object of the apex compatibility layer (see the module docstring).
AMP = ApexAmpState()
