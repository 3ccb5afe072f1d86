"""Every numeric threshold the documentation and the error messages state, checked against the
format it follows from (``mp.formats``) or against a measurement with torch.

Each claim is a pattern that extracts the stated number(s) from README.md and docs/*.md; the
claim must be found (a rewrite that drops it fails here, so the check moves with it) and every
occurrence must agree with the computed value to the digits it is written with ("6.1e-05" is
2^-14 to two significant digits; "2^-25" must be exactly 2^-25).
"""

import math
import re
from decimal import Decimal
from pathlib import Path

import pytest
import torch

import mixprec as mp
from mixprec.commands import bench
from mixprec.lowbit.blocks import round_e2m1
from mixprec.optim.refusals import stale_fp16_error
from mixprec.prepare_checks import adam_state_underflow

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.SlowDtypeWarning")

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FP16, BF16 = mp.formats.get("fp16"), mp.formats.get("bf16")
NUMBER = r"(2\^-?\d+|\d+/\d+|\d[\d.]*(?:e-?\d+)?)"


def value(text: str) -> float:
    """A number as the docs write it: ``2^-25``, ``1/12``, ``6.1e-05``, ``65504``."""
    if "^" in text:
        base, exponent = text.split("^")
        return float(base) ** int(exponent)
    if "/" in text:
        num, den = text.split("/")
        return int(num) / int(den)
    return float(text)


def agrees(text: str, expected: float) -> bool:
    """``text`` is ``expected`` written to the digits it shows (a power of two: exactly)."""
    if "^" in text or "/" in text:
        return value(text) == expected
    half_unit = Decimal(5).scaleb(Decimal(text).as_tuple().exponent - 1)
    return abs(Decimal(text) - Decimal(expected)) <= half_unit


def half_ulp(fmt, x: float) -> float:
    return math.ldexp(fmt.eps, math.frexp(x)[1] - 1) / 2


ADAM = adam_state_underflow(0.999)

#: (name, pattern with one group per number, the values they must be)
CLAIMS = [
    ("fp16 max", r"its largest value is\s+" + NUMBER, [FP16.max]),
    ("fp16 rounds to inf from", r"values from\s+" + NUMBER + r"\s+\(65504 plus half its ulp of\s+"
     + NUMBER, [FP16.max + half_ulp(FP16, FP16.max), 2 * half_ulp(FP16, FP16.max)]),
    ("fp16 smallest normal", r"smallest normal\s+is\s+" + NUMBER + r"\s+=\s+" + NUMBER,
     [FP16.min_normal] * 2),
    ("fp16 smallest subnormal", r"smallest subnormal\s+" + NUMBER + r"\s+=\s+" + NUMBER,
     [FP16.min_subnormal] * 2),
    ("fp16 rounds to zero", r"magnitude is at most\s+" + NUMBER + r"\s+\(half the smallest",
     [FP16.min_subnormal / 2]),
    ("bf16 spacing in [1, 2)", r"between 1 and 2 its values are\s+" + NUMBER + r"\s+apart",
     [BF16.eps]),
    ("bf16 half spacing", r"smaller than half that\s+\(" + NUMBER + r"\s+=\s+" + NUMBER,
     [BF16.eps / 2] * 2),
    ("bf16 spacing near 1", r"bf16 weights in \[1, 2\) \(spacing\s+" + NUMBER, [BF16.eps]),
    ("bf16's spacing near 1.0", r"near 1\.0 where bf16's spacing is\s+" + NUMBER, [BF16.eps]),
    ("Adam state rounds to 0", r"for every `\|grad\| <=\s+" + NUMBER, [ADAM]),
    ("Adam state half subnormal", r"becomes 0 up to half fp16's smallest subnormal \(" + NUMBER,
     [FP16.min_subnormal / 2]),
    ("fp16 smallest normal (Adam eps)", r"below fp16's smallest normal \(" + NUMBER + r"\s+=\s+"
     + NUMBER, [FP16.min_normal] * 2),
    ("bench's fp16 eps note", r"smallest normal\s+number\s+" + NUMBER, [FP16.min_normal]),
    ("fp16 max in the advisor", r"beyond fp16's max\s+" + NUMBER, [FP16.max]),
    ("fp16's 65504", r"fp16's\s+" + NUMBER + r"\b", [FP16.max]),
    ("e4m3 saturation", r"saturates to\s+" + NUMBER, [mp.formats.get("fp8_e4m3").max]),
]


def _e2m1_ratio() -> float:
    values = round_e2m1(torch.linspace(0, 6, 4097, dtype=torch.float64)).unique()
    return float(values[values > 0].min() / values.max())


CLAIMS.append(("e2m1 smallest over largest",
               r"e2m1's smallest nonzero value is\s+" + NUMBER + r"\s+of its largest",
               [_e2m1_ratio()]))


@pytest.mark.parametrize("name, pattern, expected", CLAIMS, ids=[c[0] for c in CLAIMS])
def test_each_stated_threshold_follows_from_the_format(name, pattern, expected):
    found = [(path.name, m.groups()) for path in DOCS
             for m in re.finditer(pattern, path.read_text(encoding="utf-8"))]
    assert found, f"{name}: no page states it any more ({pattern!r}); move or drop this check"
    for page, numbers in found:
        for text, want in zip(numbers, expected):
            assert agrees(text, want), f"{page} states {text} for {name}; the format gives {want!r}"


def test_fp16_rounding_boundaries_are_torchs():
    """The stated boundaries are where torch's own cast (from fp32) puts them."""
    tie = torch.tensor([FP16.min_subnormal / 2])
    assert tie.half().item() == 0.0  # exactly 2^-25: a tie, rounded to the even 0
    above = torch.nextafter(tie, torch.ones(1))
    assert above.half().item() == FP16.min_subnormal
    top = torch.tensor([FP16.max + half_ulp(FP16, FP16.max)])
    assert torch.isinf(top.half()).all()
    below_top = torch.nextafter(top, torch.zeros(1))
    assert below_top.half().item() == FP16.max
    assert torch.tensor(1e-8).half().item() == 0.0  # torch's default Adam eps, in fp16


def _adam_second_moment(g: float) -> float:
    p = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
    opt = torch.optim.Adam([p], betas=(0.9, 0.999))
    p.grad = torch.full((1,), g, dtype=torch.float16)
    opt.step()
    return opt.state[p]["exp_avg_sq"].item()


def test_adam_fp16_state_underflow_is_measured_where_the_docs_say():
    """torch's Adam keeps (1 - beta2) * g^2 as 0 up to the stated |g| and 2^-24 just above."""
    grads = torch.tensor([ADAM], dtype=torch.float64).half().float()
    last_zero = grads.item() if grads.item() <= ADAM else torch.nextafter(
        grads.half(), torch.zeros(1, dtype=torch.float16)).item()
    first_nonzero = torch.nextafter(torch.tensor([last_zero], dtype=torch.float16),
                                    torch.ones(1, dtype=torch.float16)).item()
    assert _adam_second_moment(last_zero) == 0.0
    assert _adam_second_moment(first_nonzero) == FP16.min_subnormal
    text = (ROOT / "docs" / "levels.md").read_text(encoding="utf-8")
    stated = r"measured with\s+torch's Adam: 0 at\s+" + NUMBER + r", 2\^-24 from\s+" + NUMBER
    zero, nonzero = re.search(stated, text).groups()
    assert _adam_second_moment(value(zero)) == 0.0
    assert _adam_second_moment(value(nonzero)) == FP16.min_subnormal


def test_error_messages_state_the_formats_thresholds():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError) as refused:
        mp.prepare(model, torch.optim.Adam(model.parameters()), level="O3", dtype="fp16")
    message = str(refused.value)
    stated = re.search(r"\|grad\| <= " + NUMBER, message).group(1)
    assert agrees(stated, ADAM) and stated == f"{ADAM:.2e}"
    assert agrees(re.search(r"smallest normal " + NUMBER, message).group(1), FP16.min_normal)
    assert agrees(re.search(r"gradients below " + NUMBER, str(stale_fp16_error(1, (2,)))).group(1),
                  FP16.min_normal)


@pytest.mark.parametrize("eps", [1e-8, 2.0 ** -25, 2.0 ** -24, 1e-6])
def test_the_bench_note_says_what_the_eps_becomes_in_fp16(eps):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), eps=eps)
    note = bench._fp16_state_eps(opt, "O3", torch.float16)
    stated = re.search(r"smallest normal (2\^-?\d+) = " + NUMBER, note).groups()
    assert all(agrees(s, FP16.min_normal) for s in stated)
    rounds_to_zero = torch.tensor(eps, dtype=torch.float64).half().item() == 0.0
    assert ("rounds to 0" in note) is rounds_to_zero, note


def test_no_page_repeats_a_corrected_threshold():
    """Numbers that were wrong once: fp16 does not flush everything below 2^-24, and the Adam
    state's boundary at beta2 = 0.999 is 5.46e-3, not 7.7e-3 (that is where it reaches 2^-24)."""
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        assert "below 2^-24 become 0" not in text, path.name
        assert "7.7e-3" not in text and "7.7e-03" not in text, path.name
