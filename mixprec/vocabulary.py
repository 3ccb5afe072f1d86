"""The precision keywords, declared once: name, default, accepted values, docstring text.

Every entry point that sets a model up for a precision takes these keywords with these names
and defaults: :func:`mixprec.prepare`, :class:`mixprec.MixedPrecision`, :class:`mixprec.Trainer`,
:func:`mixprec.parallel.fsdp`, ``integrations.lightning.MixprecPrecision``,
``integrations.transformers.MixprecTrainer`` and ``integrations.accelerate.MixprecAccelerator``;
those that run a loop also take ``loss_scale``.
:func:`mixprec.parallel.plan` and :func:`mixprec.advise` take the ones that change what they
compute, and say why the others are absent.

Each entry point spells the keywords out as its own parameters (``inspect.signature``, ``help()``
and IDEs see them); :func:`takes` fills their ``Args`` entries into its docstring from the
declarations below and checks, at import, that the signature's defaults are the declared ones,
unless the entry point states why its default differs (``parallel.fsdp`` defaults to O2).
``level`` and ``dtype`` default to :class:`Default` strings (``'O1'``, ``'auto'`` to every
reader), so that one given beside ``policy=`` is refused even at its default value.

The apex compatibility layer (:mod:`mixprec.compat.apex_amp`) keeps apex's own names
(``opt_level``, ``keep_batchnorm_fp32``, ...): it exists to run apex code unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
import warnings
from typing import Any, Callable

__all__ = ["Default", "LEVEL", "DTYPE", "Keyword", "KEYWORDS", "PRECISION", "LOOP", "MARKER",
           "ALIASES", "UNSET", "takes", "keywords_of", "alias", "check_engine_alone", "EMULATION",
           "DISTRIBUTED", "COMPILE", "RESOLVED", "check_policy_alone", "KeywordClash", "is_given"]

#: The docstring line :func:`takes` replaces with the keywords' ``Args`` entries.
MARKER = "{precision keywords}"


class Default(str):
    """A keyword's default as a signature holds it: the value itself (a ``str`` equal to it, so
    code, ``help()`` and ``inspect.signature`` read ``'O1'``), told apart from the same value
    passed explicitly by its type. ``level``/``dtype`` beside ``policy=`` are refused when given
    at all, their defaults included; only these objects mean "not given".

    A copy or a pickle is the plain value (nothing of this class reaches a checkpoint).
    """

    __slots__ = ()

    def __reduce__(self):
        return (str, (str(self),))


def is_given(value: Any) -> bool:
    """Whether ``value`` was passed by the caller (not a signature's :class:`Default`)."""
    return not isinstance(value, Default)


#: ``level``'s declared default, as every entry point's signature holds it.
LEVEL = Default("O1")
#: ``dtype``'s declared default, as every entry point's signature holds it.
DTYPE = Default("auto")


@dataclasses.dataclass(frozen=True)
class Keyword:
    """One precision keyword.

    Attributes:
        name: the parameter name.
        default: its default at every entry point (unless one documents why it differs).
        accepts: the values it takes, in words.
        doc: what it means (the ``Args`` text after the accepted values).
    """

    name: str
    default: Any
    accepts: str
    doc: str
    choices: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """The command-line option (``--state-dtype`` for ``state_dtype``)."""
        return "--" + self.name.replace("_", "-")

    def cli(self, default: Any = dataclasses.MISSING, why: str = "",
            choices: tuple[str, ...] | None = None) -> dict[str, Any]:
        """``add_argument`` keywords for :attr:`flag`: ``default``, ``choices`` and ``help``
        from this declaration; a subcommand's own ``default`` (with ``why``) or ``choices``
        where it differs."""
        shown = self.default if default is dataclasses.MISSING else default
        first = re.sub(r":\w+:`([^`]*)`", r"\1", self.doc.split(". ")[0]).replace("``", "")
        text = f"{first.rstrip('.')} (default: {shown}{'; ' + why if why else ''})"
        out: dict[str, Any] = {"help": text.replace("%", "%%"), "default": shown}
        if choices or self.choices:
            out["choices"] = choices or self.choices
        return out

    def entry(self, default: Any = dataclasses.MISSING, why: str = "", note: str = "") -> str:
        """The ``Args`` entry (unwrapped): accepted values, meaning, an entry point's note, and
        its own default with the reason when it differs from the declared one."""
        text = f"{self.name}: {self.accepts}. {self.doc}"
        if note:
            text += f" {note}"
        if default is not dataclasses.MISSING:
            text += f" Default here: {default!r} ({why})."
        else:
            text += f" Default: {self.default!r}."
        return text


_DECLARED = (
    Keyword("level", LEVEL, '"O0", "O1", "O2" or "O3"',
            "O0: fp32; O1: fp32 weights, the forward under autocast; O2: 16-bit weights "
            "(norms and ``keep_fp32`` modules in fp32) trained through masters; O3: all "
            "16-bit (see :func:`mixprec.prepare`). Not given together with ``policy``.",
            ("O0", "O1", "O2", "O3")),
    Keyword("dtype", DTYPE, '"bf16", "fp16", a torch dtype, or "auto"',
            'The low-precision dtype; "auto" is the fast 16-bit type of the model\'s device, '
            "resolved on it."),
    Keyword("policy", None, "a :class:`mixprec.Policy`, or None",
            "Every choice set directly, instead of ``level``/``dtype``; a ``level`` or ``dtype`` "
            "given beside it (any value, its default included) is refused."),
    Keyword("keep_fp32", None, "None, an ``nn.Module`` subclass, a qualified module name, or a "
            "list of them",
            "Extra modules whose parameters and compute stay fp32 (added to the policy's)."),
    Keyword("low_precision_ops", (), "a list of op names (e.g. ``[\"bmm\"]``), or one name",
            "Ops the autocast of O1/O2 runs in the low-precision dtype, beyond its lists."),
    Keyword("fp32_ops", (), "a list of op names (e.g. ``[\"softmax\"]``), or one name",
            "Ops the autocast of O1/O2 runs in fp32, beyond its lists."),
    Keyword("master", None, 'a :mod:`mixprec.masters` method or its shorthand ("fp32", '
            '"split", "kahan", "stochastic"), or None',
            "How 16-bit parameters keep small updates under a master-weight policy (O2): fp32 "
            "master copies (:class:`mixprec.MasterWeightOptimizer`); the exact fp32 master as "
            "the bf16 weight plus a 16-bit remainder; a 16-bit Kahan compensation buffer; or "
            "stochastic rounding into bf16 weights (the last three "
            ":class:`mixprec.optim.CompactMasterOptimizer`). None: the policy's (fp32 masters "
            "at O2). The value is passed on as given; the policy checks it.",
            ("fp32", "split", "kahan", "stochastic")),
    Keyword("state_dtype", None, '"fp32", "bf16", or None',
            "The dtype of the optimizer's moment buffers under a master-weight policy. None: "
            "the policy's (fp32).", ("fp32", "bf16")),
    Keyword("fp8", None, "None, a :mod:`mixprec.lowbit` format, or its shorthand: "
            '"tensorwise" (FP8, one scale per tensor), "rowwise" (one per row), "rowwise_gw_hp" '
            "(rowwise, the weight gradient's GEMM in high precision), \"mxfp8\" (one "
            'power-of-two scale per 32 values); "nvfp4" is measured by :func:`mixprec.advise` '
            "only, and refused where a model is prepared",
            "The low-bit GEMM format of the chosen Linear layers (and Hugging Face ``Conv1D`` "
            "layers), through torchao; everything else follows the level."),
    Keyword("fp8_modules", None, "None, a list of qualified module names, or a callable "
            "``(module, name) -> bool``",
            "Which eligible Linear layers run in ``fp8``; None: the default choice (first and "
            "last Linear and layers of unfit shapes stay 16-bit). Needs ``fp8``."),
    Keyword("loss_scale", "auto", '"auto", "dynamic", a number, None, or a loss scaler',
            'A spec for :func:`mixprec.make_loss_scaler` ("auto": dynamic for fp16 at O1/O2, '
            "none otherwise; a number: a static scale) or a scaler object. A scaler that checks "
            "for overflow skips an update whose gradients hold inf/NaN."),
    Keyword("max_consecutive_skips", 8, "an integer >= 1, or None",
            "Steps skipped in a row for inf/NaN gradients that the loss scale cannot fix "
            "(without a loss scale, bf16: every such step; a dynamic scale: those at its "
            "``min_scale``) before :class:`mixprec.NonFiniteGradientsError` names the "
            "parameters; None: never. Without a loss scale the first skip warns."),
    Keyword("emulate_fp16", "auto", '"auto", True or False',
            "fp16 GEMM/conv emulated with fp32 arithmetic on fp16-rounded values where fp16 "
            'has no fast kernel ("auto"; see :mod:`mixprec.emulation`); True forces it, False '
            "runs torch's native fp16 kernels."),
    Keyword("monitor", None, "a :class:`mixprec.PrecisionMonitor`, or None",
            "Records the run (loss scale, skipped steps, gradient norm, per-layer statistics) "
            "every few steps; None records nothing and the step runs exactly as without one."),
    Keyword("reduce_dtype", "fp32", '"fp32", "bf16", "fp16", or a torch dtype',
            "The precision of the gradient reduction across ranks (DDP all-reduce, FSDP "
            "reduce-scatter); bf16 and fp16 halve the traffic.", ("fp32", "bf16", "fp16")),
    Keyword("compile", False, "True or False",
            "Run each step's forward and loss under ``torch.compile``."),
)

#: Every keyword by name, in declaration order.
KEYWORDS: dict[str, Keyword] = {k.name: k for k in _DECLARED}
#: What every entry point that prepares a model takes.
PRECISION = ("level", "dtype", "policy", "keep_fp32", "low_precision_ops", "fp32_ops", "master",
             "state_dtype", "fp8", "fp8_modules")
#: What an entry point that runs a loop takes as well.
LOOP = ("loss_scale", "monitor", "max_consecutive_skips")
#: What an entry point whose autocast can run fp16 emulated takes.
EMULATION = ("emulate_fp16",)
#: What an entry point that reduces gradients across ranks takes.
DISTRIBUTED = ("reduce_dtype",)
#: What a loop that owns its forward takes (``Trainer``).
COMPILE = ("compile",)

#: Deprecated spellings -> the keyword they stand for.
ALIASES = {"loss_scaler": "loss_scale", "fp8_recipe": "fp8"}

#: Where a :class:`mixprec.Policy` field of a keyword's name defaults otherwise, and why
#: (field -> (the field's default, written as ``str()`` shows it, the reason)).
RESOLVED = {
    "level": ("None", "a Policy's level is a label, not a setting: one built field by field has "
                      "none, Policy.from_level names it"),
    "loss_scale": ("None", "a Policy records the loss-scale spec of its level (\"dynamic\" for "
                           "fp16 at O1/O2, None otherwise); the keyword's \"auto\" resolves to "
                           "exactly that"),
    "master": ("fp32", "a Policy holds the resolved method; the keyword's None means \"the "
                       "policy's\", which is fp32 masters"),
    "state_dtype": ("torch.float32", "a Policy holds the resolved dtype; the keyword's None "
                                     "means \"the policy's\", fp32"),
}

_ATTR = "__precision_keywords__"


class _Unset:
    """The default of a deprecated alias: distinct from every value, None included."""

    def __repr__(self) -> str:
        return "<unset>"


#: The default of a deprecated alias keyword (``Trainer(loss_scaler=)``).
UNSET = _Unset()


def alias(value: Any, **old: Any) -> Any:
    """``value`` of a keyword, or the value given under its deprecated alias (one of
    :data:`ALIASES`, passed as ``old_name=value``), with a ``DeprecationWarning``.

    Raises:
        TypeError: both the keyword (not at its default) and its alias given.
    """
    (old_name, old_value), = old.items()
    new_name = ALIASES[old_name]
    if old_value is UNSET:
        return value
    if not _same(value, KEYWORDS[new_name].default):
        raise TypeError(f"got both {new_name}= and its deprecated alias {old_name}=; pass "
                        f"{new_name}= only")
    warnings.warn(f"{old_name}= is deprecated; pass {new_name}= (same values)",
                  DeprecationWarning, stacklevel=3)
    return old_value


def keywords_of(entry_point) -> tuple[str, ...]:
    """The keywords :func:`takes` declared for ``entry_point`` (empty if none)."""
    return getattr(entry_point, _ATTR, ())


def takes(*names: str, differs: dict[str, tuple[Any, str]] | None = None,
          notes: dict[str, str] | None = None) -> Callable:
    """A decorator: the function or class takes the keywords ``names``.

    It checks that the signature has each as a keyword parameter whose default is the declared
    one (or ``differs[name] = (default, why)``), and replaces the :data:`MARKER` line of the
    docstring with their ``Args`` entries (``notes[name]``: a sentence added to one). A keyword
    declared with a :class:`Default` (``level``, ``dtype``) must default to one in the signature
    (``level=vocabulary.LEVEL``, or ``vocabulary.Default("O2")`` where it differs), so that the
    entry point can tell it from the same value passed explicitly.

    Raises:
        TypeError: at import, a keyword missing from the signature or with another default.
    """
    differs, notes = differs or {}, notes or {}
    unknown = [n for n in (*names, *differs, *notes) if n not in KEYWORDS]
    if unknown:
        raise TypeError(f"unknown precision keywords {unknown}; declared: {list(KEYWORDS)}")

    def apply(obj):
        params = inspect.signature(obj).parameters
        for name in names:
            expected = differs[name][0] if name in differs else KEYWORDS[name].default
            if isinstance(KEYWORDS[name].default, Default):
                expected = Default(expected)
            param = params.get(name)
            if param is None or param.kind not in (param.KEYWORD_ONLY,
                                                    param.POSITIONAL_OR_KEYWORD):
                raise TypeError(f"{obj.__qualname__} must take the keyword {name!r}")
            if name in (*LOOP[1:], *EMULATION, *DISTRIBUTED, *COMPILE) \
                    and param.kind is not param.KEYWORD_ONLY:
                raise TypeError(f"{obj.__qualname__} must take {name!r} keyword-only")
            if isinstance(expected, Default) and not isinstance(param.default, Default):
                raise TypeError(f"{obj.__qualname__}'s {name}= must default to "
                                f"vocabulary.Default({str(expected)!r}): a plain "
                                f"{param.default!r} cannot be told from one passed explicitly")
            if not _same(param.default, expected):
                raise TypeError(f"{obj.__qualname__}'s {name}= defaults to {param.default!r}; "
                                f"the vocabulary declares {expected!r}")
        entries = [KEYWORDS[n].entry(*differs.get(n, ()), note=notes.get(n, "")) for n in names]
        obj.__doc__ = _fill(obj.__doc__ or "", entries, obj.__qualname__)
        setattr(obj, _ATTR, tuple(names))
        return obj
    return apply


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def _fill(doc: str, entries: list[str], where: str) -> str:
    """``doc`` with its marker line replaced by ``entries``, wrapped at its indentation."""
    lines = doc.splitlines()
    found = [i for i, line in enumerate(lines) if line.strip() == MARKER]
    if len(found) != 1:
        raise TypeError(f"{where}'s docstring needs one {MARKER!r} line in its Args section")
    i = found[0]
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    filled = []
    for entry in entries:
        filled += textwrap.wrap(entry, width=96, initial_indent=indent,
                                subsequent_indent=indent + "    ", break_on_hyphens=False)
    return "\n".join(lines[:i] + filled + lines[i + 1:])


def check_engine_alone(engine, given: dict[str, Any], entry_point) -> None:
    """Refuse keywords beside a ready engine (``mixed_precision=``), which already holds them.

    ``given``: keyword -> value as passed to ``entry_point``; a value other than the
    signature's default is refused (``level``/``dtype``: any value passed, as their
    :class:`Default` tells).

    Raises:
        TypeError: naming the keywords given beside the engine.
    """
    if engine is None:
        return
    params = inspect.signature(entry_point).parameters
    changed = [n for n, v in given.items() if not _same(v, params[n].default)]
    if changed:
        raise TypeError(f"{entry_point.__name__} got mixed_precision= and "
                        f"{', '.join(changed)}: the engine already holds its precision; set "
                        f"them on mp.MixedPrecision(...), or pass them here without "
                        f"mixed_precision=")


class KeywordClash(TypeError, ValueError):
    """``policy=`` given beside ``level=``/``dtype=`` (a TypeError; a ValueError as well, which
    earlier versions raised)."""


def check_policy_alone(policy, level: Any, dtype: Any, entry_point: str) -> None:
    """Refuse ``level``/``dtype`` given beside ``policy``: any value the caller passed, the
    default included, is a second answer to the question the policy answers. Only the
    signature's own :class:`Default` means "not given".

    Raises:
        KeywordClash: naming ``policy=`` and the keywords given beside it.
    """
    if policy is None:
        return
    shown = [f"{name}={value!r}" for name, value in (("level", level), ("dtype", dtype))
             if is_given(value)]
    if shown:
        raise KeywordClash(f"{entry_point} got policy={policy} and {', '.join(shown)}: pass "
                           f"either policy= or level=/dtype=, not both")
