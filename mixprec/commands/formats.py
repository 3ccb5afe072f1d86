"""``mixprec formats`` (the table of formats) and ``mixprec explain VALUE`` (one value, bit by
bit)."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import re
from fractions import Fraction

from .. import formats
from .args import comma_list

__all__ = ["parse_value", "formats_table", "normalize_argv", "register"]

_SPECIAL = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "infinity": math.inf,
            "+infinity": math.inf, "-infinity": -math.inf, "nan": math.nan, "+nan": math.nan,
            "-nan": -math.nan}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.Pow: operator.pow}
_MAX_BITS = 20000  # bound on the size of exact intermediate results (2**-24 needs 25 bits)
# A token that starts like a negative VALUE (argparse would take it for an option).
_NEGATIVE = re.compile(r"-(\d|\.\d|\(|inf|nan)", re.IGNORECASE)
_DEFAULT_FORMAT = "fp16"
_HINT = "a number such as 65504, 1e-8, 0.00006666666, 2**-24 (or 2^-24), 1/3, 0x1p-14, inf or nan"


def parse_value(text: str) -> float:
    """Parse an ``explain`` VALUE exactly, then round it once to float64.

    Accepts decimal and hex float literals, ``inf``/``nan``, and arithmetic on numbers with
    ``+ - * / **`` (``^`` means ``**``), evaluated with exact fractions and no ``eval``.

    Raises:
        ValueError: not a number, or beyond the float64 range.
    """
    s = text.strip()
    if s.lower() in _SPECIAL:
        return _SPECIAL[s.lower()]
    if s.lower().lstrip("+-").startswith("0x"):
        try:
            value = float.fromhex(s)
        except OverflowError:
            raise ValueError(f"VALUE {text!r} is beyond the float64 range (max ~1.8e308)") from None
        except ValueError:
            raise ValueError(f"VALUE must be {_HINT}; got {text!r}") from None
        if value == 0 and _hex_mantissa_nonzero(s):  # fromhex rounds to 0 below the range
            raise ValueError(f"VALUE {text!r} is below the smallest float64 subnormal "
                             f"(~4.9e-324)")
        return value
    try:
        exact = Fraction(s)
    except (ValueError, ZeroDivisionError):
        exact = _evaluate(s.replace("^", "**"), text)
    if exact == 0:
        return -0.0 if s.startswith("-") else 0.0
    try:
        value = float(exact)
    except OverflowError:
        raise ValueError(f"VALUE {text!r} is beyond the float64 range (max ~1.8e308)") from None
    if value == 0:
        raise ValueError(f"VALUE {text!r} is below the smallest float64 subnormal (~4.9e-324)")
    return value


def _hex_mantissa_nonzero(s: str) -> bool:
    """Whether a hex float literal's digits (before its ``p`` exponent) are not all zero."""
    digits = s.lower().lstrip("+-")[2:].split("p")[0].replace(".", "")
    return any(d != "0" for d in digits)


def _evaluate(expr: str, text: str) -> Fraction:
    """Exact value of a small arithmetic expression, or ValueError."""
    try:
        return _node(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError, RecursionError):
        raise ValueError(f"VALUE must be {_HINT}; got {text!r}") from None


def _node(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _node(node.left), _node(node.right)
        if isinstance(node.op, ast.Pow):
            size = max(left.numerator.bit_length(), left.denominator.bit_length())
            if right.denominator != 1 or size * abs(right.numerator) > _MAX_BITS:
                raise ValueError("exponent must be a small integer")
        return Fraction(_BINOPS[type(node.op)](left, right))
    raise ValueError(f"unsupported expression: {ast.dump(node)}")


def _num(x: float) -> str:
    """Compact number, with the power of two for exact powers of two."""
    m, e = math.frexp(x)
    if m == 0.5:
        return f"2^{e - 1} ({x:.4g})"
    return f"{x:.6g}" if x < 1e6 else f"{x:.4g}"


def formats_table() -> str:
    """The known formats as a text table."""
    header = ("format", "bits", "s/exp/mant", "bias", "inf", "max", "min normal", "min subnormal",
              "eps")
    rows = [header]
    for name in formats.names():
        f = formats.get(name)
        rows.append((f.name, str(f.bits), f"1/{f.exponent_bits}/{f.mantissa_bits}", str(f.bias),
                     "yes" if f.has_inf else "no", _num(f.max), _num(f.min_normal),
                     _num(f.min_subnormal), _num(f.eps)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("fp8_e4m3 is the 'fn' variant (torch.float8_e4m3fn): no inf, one NaN pattern.")
    return "\n".join(lines)


def _run_formats(args) -> int:
    if args.json:
        table = [{k: (str(v) if k == "torch_dtype" else v)
                  for k, v in dataclasses.asdict(formats.get(n)).items()} for n in formats.names()]
        print(json.dumps(table, indent=2))
    else:
        print(formats_table())
    return 0


def normalize_argv(command: str, args: list[str]) -> list[str]:
    """Let ``explain`` take negative values as they are: ``-1``, ``-1e6``, ``-inf``, ``-nan``,
    ``-2**-24`` (argparse treats a leading '-' as an option). Each such token before ``--`` is
    given a leading space, which argparse does not read as an option and :func:`parse_value`
    strips; other commands' arguments are returned unchanged."""
    if command != "explain":
        return args
    out = list(args)
    for i, token in enumerate(out):
        if token == "--":
            break
        if _NEGATIVE.match(token):
            out[i] = " " + token
    return out


def _run_explain(args) -> int:
    fmts = []
    for name in args.format or [_DEFAULT_FORMAT]:
        fmt = formats.get(name)
        if fmt not in fmts:
            fmts.append(fmt)
    values = [parse_value(text.strip()) for text in args.value]
    blocks = [str(formats.decompose(v, f)) for v in values for f in fmts]
    print("\n\n".join(blocks))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("formats", help="table of floating-point formats and their ranges",
                              description="Bits, exponent/mantissa widths, bias, max, smallest "
                              "normal and subnormal values and eps of fp64, fp32, fp16, bf16 "
                              "and fp8.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run_formats)

    p = subparsers.add_parser(
        "explain", help="how a value is stored in a format, bit by bit",
        description="Round VALUE to a format (nearest-even) and show its sign, exponent and "
        "fraction bits, the stored value, the rounding error, and whether it overflows or "
        "underflows.",
        epilog="VALUE may be 65504, 1e-8, 2**-24, 2^-24, 1/3, 0x1p-14, inf or nan, and "
        "negative: mixprec explain -inf -2**-24 -1e6")
    p.add_argument("value", nargs="+", metavar="VALUE", help="the value(s) to explain")
    p.add_argument("--format", "-f", action="extend", type=comma_list, default=None,
                   help="format name(s), comma-separated or repeated (-f bf16 -f fp16): each "
                   "VALUE is explained in each format; " + ", ".join(formats.names()) +
                   f" (default: {_DEFAULT_FORMAT})")
    p.set_defaults(func=_run_explain)
