"""The torch versions the package declares are the ones it is tested on, and the README says so."""

import re
from pathlib import Path

import pytest
import torch

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
packaging = pytest.importorskip("packaging.requirements")
from packaging.requirements import Requirement  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = Path(__file__).parents[1]
#: where each torch the README names is tested: the suite on CPU, the GPU tests on CUDA
TESTED = {"2.13": "CPU", "2.11": "CUDA"}


def _torch_requirement() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return next(r for r in reqs if r.name == "torch")


def test_the_declared_torch_range_holds_the_running_torch():
    spec = _torch_requirement().specifier
    assert spec.contains(Version(torch.__version__).base_version), (torch.__version__, str(spec))


def test_the_declared_range_is_what_is_tested():
    spec = _torch_requirement().specifier
    for version in TESTED:
        assert spec.contains(f"{version}.0"), (version, str(spec))
    # no untested minor version inside the range: 2.12 lies between the two tested ones
    lowest = min(Version(v) for v in TESTED)
    assert not spec.contains(f"{lowest.major}.{lowest.minor - 1}.0")
    highest = max(Version(v) for v in TESTED)
    assert not spec.contains(f"{highest.major}.{highest.minor + 1}.0")


def test_the_readme_names_the_declared_range_and_the_tested_versions():
    readme = (ROOT / "README.md").read_text()
    spec = str(_torch_requirement().specifier)
    ranges = re.findall(r"torch\s*(>=?\s*[\d.]+(?:\s*,\s*[<>!~=]=?\s*[\d.]+)*)", readme)
    declared = {str(Requirement(f"torch{m}").specifier) for m in ranges}
    assert declared == {spec}, declared  # every range the README states is pyproject's
    tested = re.search(r"Tested torch: (.*?)\.\s*$", readme, re.M | re.S)
    assert tested, "the README's install section says which torch versions are tested"
    sentence = " ".join(tested.group(1).split())
    for version, where in TESTED.items():
        assert re.search(rf"\b{re.escape(version)}\b[^,;]*\b{where}\b", sentence), (version, where)


def test_the_readme_says_which_torch_make_demo_installs():
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"pip install .*?torch==([\d.]+)(.*)", makefile)
    assert pin, "the Makefile pins torch"
    version, rest = pin.groups()
    assert Version(torch.__version__).release[:2] == Version(version).release[:2]
    readme = (ROOT / "README.md").read_text()
    demo = next(line for line in readme.splitlines() if line.startswith("make demo"))
    assert f"torch {version}" in demo
    if "whl/cpu" not in rest:  # PyPI's default build: CUDA on Linux x86-64
        assert "(CPU)" not in demo, demo
        said = " ".join(readme.split())
        assert f"`torch=={version}` from your pip index: on Linux x86-64 PyPI serves its CUDA " \
               f"build" in said
