"""Every Python block of README.md and docs/*.md runs as written, in order, one namespace per
document (so a document may define a model in one block and train it in the next).

Only blocks fenced exactly ```` ```python ```` or ```` ```diff ```` run; a word after the language
(```` ```python before ````) marks code for another library (apex, PaddlePaddle, MindSpore), shown,
not run. A diff block runs as its new side: its context lines and its ``+`` lines.
docs/migrating.md has its own test (tests/test_migrating_docs.py), which also checks that the
other libraries' blocks are valid Python.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                    if p.name != "migrating.md")]
FENCE = re.compile(r"^```(\S*)(.*)$")


def new_side(diff: list[str]) -> list[str]:
    """The code a unified diff's body leaves: context lines and added lines, markers dropped."""
    return [line[1:] for line in diff if not line.startswith("-")]


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """(first line number, code) of each runnable Python block."""
    blocks, current, start, kind = [], None, 0, None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = FENCE.match(line.strip()) if line.startswith("```") else None
        if current is None and match:
            current, start = [], number + 1
            kind = match.group(1) if not match.group(2).strip() else None
        elif current is not None and line.startswith("```"):
            if kind in ("python", "diff"):
                blocks.append((start, "\n".join(new_side(current) if kind == "diff" else current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_every_document_has_python_blocks_found():
    assert len(python_blocks(ROOT / "README.md")) >= 2
    pages = {p.name for p in DOCS}
    assert {"getting-started.md", "levels.md", "low-bit.md", "numerics.md",
            "internals.md"} <= pages, pages
    assert sum(len(python_blocks(p)) for p in DOCS) >= 30


def test_a_diff_block_runs_as_its_new_side():
    assert new_side([" a = 1", "-b = 2", "+b = 3", ""]) == ["a = 1", "b = 3", ""]


@pytest.mark.filterwarnings("ignore::mixprec.SlowDtypeWarning",
                            # torch's own, from importing transformers first in a process
                            r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_run_as_written(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the examples write (checkpoints, plots) land here
    namespace = {"__name__": f"docs_{path.stem}"}
    for line, code in python_blocks(path):
        try:
            exec(compile(code, f"{path.name}:{line}", "exec"), namespace)
        except Exception as exc:  # name the block: the traceback alone points into exec
            pytest.fail(f"the Python block of {path.name} at line {line} raised {exc!r}")
