"""Argument parsing shared by the ``mixprec`` subcommands.

argparse keeps the last value of an option given twice (``-f bf16 -f fp16`` is ``-f fp16``),
silently. :class:`Parser` closes that pitfall for every subcommand: an option that takes one
value and names no ``action`` refuses a second occurrence with an error; an option that takes a
list says so with ``action="extend", type=comma_list`` (then ``-f bf16 -f fp16`` and
``-f bf16,fp16`` both mean the two).
"""

from __future__ import annotations

import argparse
from typing import Any

from .. import vocabulary

__all__ = ["Parser", "SingleValue", "comma_list", "add_keyword_options", "given_as"]

_GIVEN = "_mixprec_options_given"  # namespace attribute: the options given so far


class SingleValue(argparse.Action):
    """Store an option's one value, refusing the option when it is given a second time."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, _GIVEN, None)
        if given is None:
            given = {}
            setattr(namespace, _GIVEN, given)
        if self.dest in given:
            first, option = given[self.dest]
            parser.error(f"argument {'/'.join(self.option_strings)}: given twice ({option} "
                         f"{first} {option_string} {values}); it takes one value, "
                         f"give it once")
        given[self.dest] = (values, option_string)
        setattr(namespace, self.dest, values)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose single-valued options refuse to be repeated (see the module
    docstring); the subcommands' parsers are of this class too."""

    def add_argument(self, *args, **kwargs):
        optional = bool(args) and args[0].startswith(self.prefix_chars)
        if optional and "action" not in kwargs and kwargs.get("nargs") is None:
            kwargs["action"] = SingleValue
        return super().add_argument(*args, **kwargs)


def comma_list(text: str) -> list[str]:
    """The items of a comma-separated option value (``"O0, O2"`` -> ``["O0", "O2"]``)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated names; "
                                         f"got {text!r}")
    return items


def add_model_size_options(parser: argparse.ArgumentParser) -> None:
    """``--width --batch --depth --seq-len --image-size`` (None: the bench model's default)."""
    for name in ("width", "batch", "depth", "seq-len", "image-size"):
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"model {name} (default: per model)")


def add_keyword_options(parser: argparse.ArgumentParser, *names: str,
                        differs: dict[str, tuple[Any, str]] | None = None,
                        choices: dict[str, tuple[str, ...]] | None = None,
                        aliases: dict[str, str] | None = None) -> None:
    """One option per precision keyword of ``names`` (``--state-dtype`` for ``state_dtype``),
    its default, choices and help from :mod:`mixprec.vocabulary`: ``differs[name] =
    (default, why)`` where the subcommand's default differs, ``choices[name]`` where it takes
    fewer values, ``aliases[name]``: a deprecated second spelling of the option."""
    differs, choices, aliases = differs or {}, choices or {}, aliases or {}
    for name in names:
        keyword = vocabulary.KEYWORDS[name]
        flags = (keyword.flag, *((aliases[name],) if name in aliases else ()))
        parser.add_argument(*flags, dest=name,
                            **keyword.cli(*differs.get(name, ()), choices=choices.get(name)))


def given_as(args: argparse.Namespace, dest: str) -> str | None:
    """The option string an option was given as (None: not given)."""
    return getattr(args, _GIVEN, {}).get(dest, (None, None))[1]
