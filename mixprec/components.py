"""Typed, registered components: what a master method (:mod:`mixprec.masters`) and a low-bit
GEMM format (:mod:`mixprec.lowbit`) share.

A component is a frozen dataclass whose fields are its options, so equal options give equal
components (and equal policies); a :class:`Registry` maps its registered name to its class and
its string shorthands to (class, options). A shorthand compares equal to its component, prints
as it, and is what a policy's ``state_dict`` holds where one stands for the component (else the
component's :meth:`Component.state_dict`, tagged with its registered name).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

__all__ = ["Component", "Registry"]


class Registry:
    """Registered name -> class, and shorthand -> (class, options), of one kind of component.

    Args:
        what: the kind, for messages ("low-bit format", "master method").
        tag: the key naming the class in a component's ``state_dict`` ("format", "method").
    """

    def __init__(self, what: str, tag: str) -> None:
        self.what, self.tag = what, tag
        self.classes: dict[str, type] = {}
        self.shorthands: dict[str, tuple[type, dict]] = {}

    def register(self, cls: type, base: type, shorthands: dict[str, dict] | None) -> type:
        """Register ``cls`` (a named subclass of ``base``) and its shorthands.

        Raises:
            TypeError: not a named subclass of ``base``.
            ValueError: the name or a shorthand is taken by another class.
        """
        if not (isinstance(cls, type) and issubclass(cls, base) and cls.name):
            raise TypeError(f"register takes a {base.__name__} subclass with a name; "
                            f"got {cls!r}")
        if self.classes.get(cls.name, cls) is not cls:
            raise ValueError(f"the {self.what} name {cls.name!r} is taken by "
                             f"{self.classes[cls.name].__name__}")
        for short in shorthands or {}:
            if self.shorthands.get(short, (cls,))[0] is not cls:
                raise ValueError(f"the shorthand {short!r} is taken by "
                                 f"{self.shorthands[short][0].__name__}")
        self.classes[cls.name] = cls
        for short, opts in (shorthands or {}).items():
            self.shorthands[short] = (cls, dict(opts))
        return cls

    def from_shorthand(self, short: str):
        """The component ``short`` stands for, or None."""
        entry = self.shorthands.get(short)
        return entry[0](**entry[1]) if entry else None

    def from_state(self, state: dict):
        """The component a :meth:`Component.state_dict` describes.

        Raises:
            ValueError: an unknown registered name.
        """
        opts = dict(state)
        name = opts.pop(self.tag)
        if name not in self.classes:
            raise ValueError(f"a policy names the {self.what} {name!r}; known: "
                             f"{', '.join(map(repr, self.classes))}")
        return self.classes[name](**opts)

    def choices(self) -> str:
        """The shorthands, quoted, for messages."""
        return ", ".join(map(repr, self.shorthands))


class Component:
    """The identity of a registered component (mix into a frozen dataclass with ``eq=False``;
    set :attr:`registry` on the kind's base class and :attr:`name` on each registered class)."""

    name: ClassVar[str] = ""
    registry: ClassVar[Registry]

    def options(self) -> dict[str, Any]:
        """The component's fields, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def shorthand(self) -> str | None:
        """The string that resolves to this component, if one does."""
        for short, (cls, opts) in self.registry.shorthands.items():
            if cls is type(self) and self.options() == {**cls().options(), **opts}:
                return short
        return None

    def __str__(self) -> str:
        short = self.shorthand()
        if short is not None:
            return short
        args = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        if isinstance(other, str):  # a shorthand compares equal to its component
            other = self.registry.from_shorthand(other)
        return type(other) is type(self) and other.options() == self.options()

    def __hash__(self) -> int:
        return hash(str(self))

    def state_dict(self) -> dict:
        """Plain data the kind's ``resolve`` rebuilds the component from."""
        return {self.registry.tag: self.name, **self.options()}

    def to_data(self) -> str | dict:
        """What a policy's ``state_dict`` holds: the shorthand where one stands for the
        component, else :meth:`state_dict` (the kind's ``resolve`` takes either)."""
        return self.shorthand() or self.state_dict()
