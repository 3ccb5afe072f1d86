"""docs/low-bit.md's bytes-per-parameter table, checked against ``mp.bytes_per_parameter``.

Each row is measured on a bias-free 512x512 linear layer prepared as the row says: weights,
masters and compensation after ``prepare``, gradients after a backward, optimizer state after
one step of SGD with momentum and of AdamW. Cells match to 0.03 bytes where the row is plain
torch (Adam's step counter and the 5 kB state of the rounding generator add 0.02 bytes per
parameter on these 262k parameters), and to 0.05 for the low-bit libraries' rows (block scales
and quantization maps).
"""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec as mp

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning",
    "ignore::UserWarning:torchao.*", "ignore::DeprecationWarning:torchao.*",
    "ignore::FutureWarning:torchao.*", "ignore::UserWarning:bitsandbytes.*",
    "ignore::mixprec.hardware.SlowDtypeWarning")

DOC = Path(__file__).resolve().parents[1] / "docs" / "low-bit.md"
MARK = "<!-- bytes-per-parameter table: checked by tests/test_memory_table.py -->"
COLUMNS = ("weights", "masters", "compensation", "gradients", "sgd", "adam", "total")


def table_rows():
    lines = DOC.read_text().split(MARK, 1)[1].strip().splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        level, master, moments = cells[:3]
        values = [None if c == "-" else float(c) for c in cells[3:]]
        rows.append(pytest.param(level, master, moments, dict(zip(COLUMNS, values)),
                                 id=f"{level}-{master}-{moments}"))
    return rows


def lowbit(moments):
    if moments.startswith("torchao"):
        return getattr(pytest.importorskip("torchao.optim"), moments.split()[1])
    bnb = pytest.importorskip("bitsandbytes")
    return bnb.optim.AdamW8bit


def measure(level, master, moments, optimizer):
    torch.manual_seed(0)
    model = nn.Linear(512, 512, bias=False)
    opt = optimizer(model.parameters())
    level_name = re.match(r"O\d", level).group(0)
    options = {}
    if level_name == "O2":
        options = {"master": master,
                   "state_dtype": moments if moments in ("fp32", "bf16") else "fp32"}
    model, opt = mp.prepare(model, opt, level=level_name, dtype="bf16", **options)
    model(torch.randn(4, 512)).float().pow(2).mean().backward()
    held = mp.bytes_per_parameter(model, opt)
    opt.step()
    state = mp.bytes_per_parameter(model, opt)["optimizer_state"]
    return held, state


@pytest.mark.parametrize("level,master,moments,want", table_rows())
def test_readme_table_row_is_what_the_run_holds(level, master, moments, want):
    plain = moments in ("fp32", "bf16")
    tol = 0.03 if plain else 0.05
    adam = (lambda ps: torch.optim.AdamW(ps, lr=1e-3)) if plain else \
        (lambda ps: lowbit(moments)(ps, lr=1e-3))
    held, adam_state = measure(level, master, moments, adam)
    for key in ("weights", "masters", "compensation", "gradients"):
        assert held[key] == pytest.approx(want[key], abs=tol), key
    assert adam_state == pytest.approx(want["adam"], abs=tol)
    total = sum(held[k] for k in ("weights", "masters", "compensation", "gradients"))
    assert total + adam_state == pytest.approx(want["total"], abs=tol)
    if want["sgd"] is not None:
        _, sgd_state = measure(level, master, moments,
                               lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        assert sgd_state == pytest.approx(want["sgd"], abs=tol)
