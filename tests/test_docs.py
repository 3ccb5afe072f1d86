"""Every Python block of README.md and docs/*.md runs as written, in order, one namespace per
document (so a document may define a model in one block and train it in the next).

Only blocks fenced exactly ```` ```python ```` or ```` ```diff ```` run; a word after the language
(```` ```python before ````) marks code for another library (apex, PaddlePaddle, MindSpore), shown,
not run. A diff block runs as its new side: its context lines and its ``+`` lines.
docs/migrating.md has its own test (tests/test_migrating_docs.py), which also checks that the
other libraries' blocks are valid Python.

A printed output a document shows is compared with what the block prints:

* ``print(...)  # -> TEXT``, or a comment line ``# -> TEXT`` right below the print: TEXT is the
  line it prints. Comment lines below it at the same column (``#    more``) continue TEXT; a
  `` # `` inside TEXT starts a remark that is not compared;
* a block fenced ```` ```output ```` right after a Python block: everything that block printed.

Whitespace runs compare as one space, ``...`` stands for any text (doctest's ELLIPSIS), and a
decimal number (one with a point or an exponent: a measurement) matches within 2% or one unit of
its last printed digit; integers and every other character compare exactly.
"""

import ast
import builtins
import math
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                    if p.name != "migrating.md")]
FENCE = re.compile(r"^```(\S*)(.*)$")


def new_side(diff: list[str]) -> list[str]:
    """The code a unified diff's body leaves: context lines and added lines, markers dropped."""
    return [line[1:] for line in diff if not line.startswith("-")]


def fenced_blocks(path: pathlib.Path) -> list[tuple[str | None, int, list[str]]]:
    """(kind, first line number, lines) of every fenced block; kind None for a block of code
    for another library (a word after the language)."""
    blocks, current, start, kind = [], None, 0, None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = FENCE.match(line.strip()) if line.startswith("```") else None
        if current is None and match:
            current, start = [], number + 1
            kind = match.group(1) if not match.group(2).strip() else None
        elif current is not None and line.startswith("```"):
            blocks.append((kind, start, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """(first line number, code) of each runnable Python block."""
    return [(start, "\n".join(new_side(lines) if kind == "diff" else lines))
            for kind, start, lines in fenced_blocks(path) if kind in ("python", "diff")]


def shown_block_outputs(path: pathlib.Path) -> dict[int, str]:
    """{first line of a Python block: the ```output block right after it}."""
    blocks, shown = fenced_blocks(path), {}
    for (kind, start, _), (next_kind, _, lines) in zip(blocks, blocks[1:]):
        if kind in ("python", "diff") and next_kind == "output":
            shown[start] = "\n".join(lines)
    return shown


ARROW = re.compile(r"#\s*->\s?(.*)$")


def shown_prints(code: str) -> dict[tuple[int, int], str]:
    """{(first, last line of a print statement): the output its ``# -> `` comment shows}."""
    lines, shown = code.splitlines(), {}
    for node in ast.walk(ast.parse(code)):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "print"):
            continue
        first, last = node.lineno, node.end_lineno
        found = None
        for number in range(first, last + 2):  # on the statement, or the comment line below it
            if number > len(lines):
                break
            match = ARROW.search(lines[number - 1])
            if match and (number <= last or lines[number - 1].lstrip().startswith("#")):
                found = number, match
                break
        if found is None:
            continue
        number, match = found
        column, text = lines[number - 1].index("#", match.start()), [match.group(1)]
        for more in lines[number:]:  # continuation comment lines at the same column
            if len(more) > column and more[column] == "#" and not more[:column].strip() \
                    and not ARROW.match(more[column:]):
                text.append(more[column + 1:].strip())
            else:
                break
        shown[(first, last)] = " ".join(text)
    return shown


TOKEN = re.compile(r"\.\.\.|[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?%?|\s+|.")


def _tokens(text: str) -> list[str]:
    return [" " if t.isspace() else t for t in TOKEN.findall(text.strip())]


def _number(token: str) -> float | None:
    try:
        return float(token.rstrip("%"))
    except ValueError:
        return None


def _same_token(shown: str, got: str) -> bool:
    if shown == got:
        return True
    a, b = _number(shown), _number(got)
    if a is None or b is None or shown.endswith("%") != got.endswith("%") \
            or not re.search(r"[.eE]", shown):  # an integer (or a word) compares exactly
        return False
    mantissa = shown.rstrip("%").lower().split("e")[0]
    digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exponent = int(shown.rstrip("%").lower().split("e")[1]) if "e" in shown.lower() else 0
    return math.isclose(a, b, rel_tol=0.02, abs_tol=10.0 ** (exponent - digits))


def output_matches(shown: str, got: str) -> bool:
    """Does the printed ``got`` read as the document's ``shown``? (see the module docstring)"""
    shown = shown.split(" # ")[0]
    want, have = _tokens(shown), _tokens(got)

    def match(i: int, j: int) -> bool:  # recursing only at an ellipsis: long outputs too
        while i < len(want) and want[i] != "...":
            if j >= len(have) or not _same_token(want[i], have[j]):
                return False
            i, j = i + 1, j + 1
        if i == len(want):
            return j == len(have)
        return any(match(i + 1, k) for k in range(j, len(have) + 1))
    return match(0, 0)


def test_output_matching_reads_ellipses_and_measured_numbers():
    assert output_matches("{'loss': 0.19..., 'acc': 0.95...}", "{'loss': 0.1934, 'acc': 0.951}")
    assert output_matches("loss 4.87 -> 0.44", "loss 4.86 -> 0.44")  # one unit of the last digit
    assert output_matches("3.53e+03  0.000%", "3.55e+03 0.000%")
    assert output_matches("['2']  # '4' is 96 x 48", "['2']")
    assert not output_matches("['2', '4']", "['2']")
    assert not output_matches("2 torch.int16", "3 torch.int16")  # integers are exact
    assert not output_matches("loss 4.87 -> 0.44", "loss 4.87 -> 0.52")
    assert not output_matches("O2(master=fp32)", "O2(master=kahan)")
    code = ("x = 1\nprint(x,\n      x)  # -> 1 1\nprint(x)\n# -> 1\n#    more\n"
            "print(x)  # a remark\n")
    assert shown_prints(code) == {(2, 3): "1 1", (4, 4): "1 more"}


def test_every_document_has_python_blocks_found():
    assert len(python_blocks(ROOT / "README.md")) >= 2
    pages = {p.name for p in DOCS}
    assert {"getting-started.md", "levels.md", "low-bit.md", "numerics.md",
            "internals.md"} <= pages, pages
    assert sum(len(python_blocks(p)) for p in DOCS) >= 30


def test_a_diff_block_runs_as_its_new_side():
    assert new_side([" a = 1", "-b = 2", "+b = 3", ""]) == ["a = 1", "b = 3", ""]


# the advisor's page measures its planted cases and trains FP8 layers (about a minute here)
SLOW_DOCS = {"precision-advisor.md"}


@pytest.mark.filterwarnings("ignore::mixprec.SlowDtypeWarning",
                            # torch's own, from importing transformers first in a process
                            r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_DOCS
                                  else p for p in DOCS], ids=lambda p: p.name)
def test_python_blocks_run_as_written(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the examples write (checkpoints, plots) land here
    printed: list[tuple[str, int, str]] = []

    def recording_print(*args, sep=" ", end="\n", file=None, flush=False):
        builtins.print(*args, sep=sep, end=end, file=file, flush=flush)
        if file is None:  # what a reader would see: (block, line in the block, text)
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.startswith(path.name):
                frame = frame.f_back
            if frame is not None:
                printed.append((frame.f_code.co_filename, frame.f_lineno,
                                sep.join(map(str, args))))

    namespace = {"__name__": f"docs_{path.stem}", "print": recording_print}
    block_outputs, wrong = shown_block_outputs(path), []
    for line, code in python_blocks(path):
        name = f"{path.name}:{line}"
        start = len(printed)
        try:
            exec(compile(code, name, "exec"), namespace)
        except Exception as exc:  # name the block: the traceback alone points into exec
            pytest.fail(f"the Python block of {path.name} at line {line} raised {exc!r}")
        ours = [(n, text) for file, n, text in printed[start:] if file == name]
        for (first, last), shown in shown_prints(code).items():
            got = "\n".join(text for n, text in ours if first <= n <= last)
            if not output_matches(shown, got):
                wrong.append(f"{path.name}:{line + first - 1} shows {shown!r}, prints {got!r}")
        if line in block_outputs:
            got = "\n".join(text for _, text in ours)
            if not output_matches(block_outputs[line], got):
                wrong.append(f"the output block after {name} shows\n{block_outputs[line]}\n"
                             f"and the block prints\n{got}")
    assert not wrong, "\n".join(wrong)
