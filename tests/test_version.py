"""The release number is written once (``mixprec.__version__``), and the changelog, the package
metadata and the documented ``mixprec --version`` output agree with it."""

import re
from pathlib import Path

import pytest

import mixprec as mp
from mixprec.cli import main

ROOT = Path(__file__).parents[1]


def changelog_versions() -> list[str]:
    text = (ROOT / "CHANGELOG.md").read_text()
    return re.findall(r"^## (\d+\.\d+\.\d+)\s*$", text, flags=re.M)


def test_the_changelog_top_entry_is_this_version():
    versions = changelog_versions()
    assert versions and versions[0] == mp.__version__, (versions[:1], mp.__version__)
    # newest first, each release once
    keys = [tuple(map(int, v.split("."))) for v in versions]
    assert keys == sorted(set(keys), reverse=True), versions


def test_pyproject_reads_the_version_from_the_package():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mixprec.__version__"}


def test_the_cli_and_the_docs_print_this_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.split() == ["mixprec", mp.__version__]
    documented = re.findall(r"^mixprec --version\s+# mixprec (\S+)$",
                            (ROOT / "docs" / "numerics.md").read_text(), flags=re.M)
    assert documented == [mp.__version__]


def test_the_docs_speak_of_released_versions_only():
    """A version the docs name as earlier ("0.3's ...", "the released 0.3 code") is a changelog
    entry older than this one."""
    older = {v.rsplit(".", 1)[0] for v in changelog_versions()[1:]}
    this = mp.__version__.rsplit(".", 1)[0]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = set()
    for page in pages:
        named |= set(re.findall(r"\b(0\.\d+)(?:'s\b| ran\b| stepped\b| code\b)",
                                page.read_text()))
    assert named, "the docs name no earlier release (the pattern found nothing)"
    assert named <= older and this not in named, (named, older)
