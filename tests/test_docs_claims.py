"""What README and the advisor page say about the code and the figures agrees with them."""

import pathlib
import re

from mixprec import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
WORDS = {"three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}


def test_readme_names_the_gpu_of_the_table_it_points_to():
    pointers = list(re.finditer(r"the (\w+) table above", README))
    assert pointers
    for m in pointers:
        measured = re.findall(r"Measured with `make gpu-check` on an NVIDIA\s+(\w+)",
                              README[:m.start()])
        assert measured and measured[-1] == m.group(1), m.group(0)


def test_the_advisor_page_counts_the_models_the_error_lists(capsys):
    assert cli.main(["advise", "--model", "resnet50"]) == 2
    listed = capsys.readouterr().err.split("choose one of ")[1].strip().split(", ")
    page = (ROOT / "docs" / "precision-advisor.md").read_text(encoding="utf-8")
    (count,) = re.findall(r"the message lists all (\w+)\)", page)
    assert WORDS[count] == len(listed), listed


def test_readme_gives_the_demo_time_of_both_kinds_of_cpu():
    start = README.index("Both set everything up on a fresh machine")
    paragraph = " ".join(README[start:README.index("![make demo", start)].split())
    assert re.search(r"2-vCPU Sapphire Rapids VM .{0,60}?the demo took \d+ s\b", paragraph)
    # where bf16 GEMMs are slower than fp32's (AVX512-BF16, no AMX): a measured figure too
    assert re.search(r"AVX512-BF16 and no AMX.{0,300}?took \d+ (s|min)\b", paragraph), paragraph
