"""docs/migrating.md: every mixprec code block runs (in order, on the tiny model and data the
page defines); the other libraries' blocks are valid Python; each section has its argument
tables and a before/after pair; every torch name in the Paddle op map is a known op."""

import re
from pathlib import Path

import pytest
import torch

from mixprec import oplists

pytestmark = [pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning"),
              pytest.mark.usefixtures("restore_apex_registrations")]

DOC = Path(__file__).resolve().parent.parent / "docs" / "migrating.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```\s*$", re.S | re.M)
SECTIONS = ("From apex", "From torch.amp", "From PaddlePaddle", "From MindSpore")


def _blocks(text):
    """(info string, code, line number) of every fenced block."""
    return [(m.group(1).strip(), m.group(2), text[:m.start()].count("\n") + 1)
            for m in FENCE.finditer(text)]


def _sections(text):
    parts = re.split(r"^## ", text, flags=re.M)
    return {p.splitlines()[0]: p for p in parts[1:]}


def test_fence_languages_are_known():
    infos = {info for info, _, _ in _blocks(DOC.read_text())}
    assert infos <= {"python", "python before"}, infos


def test_mixprec_blocks_run(capsys):
    namespace: dict = {"__name__": "migrating_md"}
    ran = 0
    for info, code, line in _blocks(DOC.read_text()):
        if info == "python":
            exec(compile(code, f"{DOC.name}:{line}", "exec"), namespace)
            ran += 1
    assert ran >= 10
    assert "epoch: 1 step: 4, loss is " in capsys.readouterr().out
    _check_dynamic_loss_scale_manager_grows(namespace["dynamic"])


def _check_dynamic_loss_scale_manager_grows(dynamic):
    """The page's DynamicLossScaleManager() translation grows from 2**24, as MindSpore's does
    (it has no ceiling below fp32's range)."""
    assert dynamic.get_scale() == 2.0 ** 24 and dynamic.get_growth_interval() == 2000
    dynamic.set_growth_interval(1)  # one clean step is enough to grow
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for expected in (2.0 ** 25, 2.0 ** 26):
        dynamic.scale(model(torch.ones(1, 2)).sum()).backward()
        assert dynamic.step(opt) is True
        dynamic.update()
        opt.zero_grad()
        assert dynamic.get_scale() == expected


def test_other_libraries_blocks_are_valid_python():
    compiled = 0
    for info, code, line in _blocks(DOC.read_text()):
        if info == "python before":
            compile(code, f"{DOC.name}:{line}", "exec")
            compiled += 1
    assert compiled >= len(SECTIONS)  # one "before" block per library at least


@pytest.mark.parametrize("title", SECTIONS)
def test_each_section_has_tables_and_a_before_after_pair(title):
    sections = _sections(DOC.read_text())
    body = next(v for k, v in sections.items() if k.startswith(title))
    infos = [info for info, _, _ in _blocks(body)]
    assert "python before" in infos and "python" in infos
    assert infos.index("python before") < len(infos) - 1 - infos[::-1].index("python")
    header = re.search(r"^\|[^\n]*default[^\n]*\|$", body, re.M)
    assert header, "no table with both defaults"


def test_paddle_op_map_names_torch_ops():
    body = next(v for k, v in _sections(DOC.read_text()).items() if k.startswith("From Paddle"))
    table = body[body.index("| Paddle op | torch name |"):]
    rows = re.findall(r"^\| (`[^|]+`) \| `(\w+)` \|$", table, re.M)
    assert len(rows) >= 20
    for _, torch_name in rows:
        oplists.resolve_op(torch_name)


def test_paddle_op_names_are_refused_naming_torchs_as_the_guide_table_does():
    """A Paddle kernel name (``elementwise_add``) was refused with close spellings of other
    ops ("did you mean 'bitwise_and', 'nelement'?"); it names torch's, from the table the
    guide shows."""
    import mixprec as mp
    from mixprec.oplists.names import PADDLE_NAMES
    table = DOC.read_text().split("| Paddle op | torch name |")[1].split("\n\n")[0]
    rows = {}
    for line in table.strip().splitlines()[1:]:
        paddle, torch_name = (cell.strip() for cell in line.strip("|").split("|"))
        for name in re.findall(r"`([a-z0-9_]+)`", paddle):
            rows[name] = torch_name.strip("`")
    try_names = {n: t for n, t in rows.items() if n != t}
    for name, torch_name in try_names.items():
        try:
            oplists.resolve_op(name)
        except ValueError as error:  # not a torch name: the error names torch's
            assert PADDLE_NAMES[name] == torch_name
            assert f"torch's is {torch_name!r}" in str(error)
        else:
            assert name not in PADDLE_NAMES  # a torch name too (Paddle's mul): left alone
    assert set(PADDLE_NAMES) <= set(try_names)
    with pytest.raises(ValueError, match="PaddlePaddle kernel name: torch's is 'add'"):
        mp.autocast("bf16", device_type="cpu", low_precision_ops=["elementwise_add"])
