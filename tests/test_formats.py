"""mixprec.formats: constants vs torch.finfo, the MindSpore guide's worked examples, rounding,
torch's own casts, range reports."""

import math
import random
from fractions import Fraction

import pytest
import torch

import mixprec as mp
from mixprec.formats import decomposition, ranges, rounding

F = mp.formats
TORCH_FORMATS = [n for n in F.names() if F.get(n).torch_dtype is not None]
NARROW = [n for n in TORCH_FORMATS if n != "fp64"]
INT_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def from_pattern(pattern: int, fmt) -> float:
    """The value of an integer bit pattern, read by torch through the real dtype."""
    signed = (pattern - (1 << fmt.bits) if fmt.bits > 8 and pattern >= 1 << (fmt.bits - 1)
              else pattern)
    return torch.tensor([signed], dtype=INT_VIEW[fmt.bits]).view(fmt.torch_dtype).item()


def ref_round(x: float, fmt) -> float:
    """Independent reference: nearest-even rounding with exact rationals (finite x only)."""
    a = abs(Fraction(x))
    if a == 0:
        return x
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    quantum = Fraction(2) ** (max(e, 1 - fmt.bias) - fmt.mantissa_bits)
    v = round(a / quantum) * quantum
    if v > Fraction(fmt.max):
        return math.copysign(math.inf if fmt.has_inf else math.nan, x)
    return math.copysign(float(v), x)


def same(a: float, b: float) -> bool:
    """Equal, NaN equal to NaN, and the sign of zero compared."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1, a) == math.copysign(1, b)


# ----------------------------------------------------------------------------- constants

@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_constants_match_torch_finfo(name):
    fmt = F.get(name)
    fi = torch.finfo(fmt.torch_dtype)
    assert fmt.bits == fi.bits
    assert fmt.max == fi.max
    assert fmt.min_normal == fi.smallest_normal
    assert fmt.eps == fi.eps
    assert fmt.min_subnormal == from_pattern(1, fmt)  # the pattern 0...01
    # 1.0 has biased exponent == bias
    assert from_pattern(fmt.bias << fmt.mantissa_bits, fmt) == 1.0
    assert fmt.bits == 1 + fmt.exponent_bits + fmt.mantissa_bits  # sign + exponent + fraction


@pytest.mark.parametrize("name, bias, mx, min_normal, min_sub", [
    ("fp16", 15, 65504.0, 2.0 ** -14, 2.0 ** -24),
    ("bf16", 127, (2 - 2 ** -7) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -133),
    ("fp32", 127, (2 - 2 ** -23) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -149),
    ("fp64", 1023, 1.7976931348623157e308, 2.0 ** -1022, 5e-324),
    ("fp8_e4m3", 7, 448.0, 2.0 ** -6, 2.0 ** -9),
    ("fp8_e5m2", 15, 57344.0, 2.0 ** -14, 2.0 ** -16),
])
def test_constants_by_hand(name, bias, mx, min_normal, min_sub):
    fmt = F.get(name)
    assert (fmt.bias, fmt.max, fmt.min_normal, fmt.min_subnormal) == (bias, mx, min_normal, min_sub)


def test_seed_ranges():
    # Paddle guide: fp32 dynamic range [2^-126, 2^127]; bf16 has fp32's range; fp16 max 65504.
    fp32, bf16, fp16 = F.get("fp32"), F.get("bf16"), F.get("fp16")
    assert fp32.min_normal == 2.0 ** -126 and fp32.emax == 127
    assert (bf16.min_normal, bf16.emax) == (fp32.min_normal, fp32.emax)
    # MindSpore guide: fp16 valid range [5.9e-8, 65504]; fp32 from 1.4e-45. (Its fp32 upper end,
    # 1.7e38, is off by 2x: the true max is 3.4e38, checked against finfo above.)
    assert fp16.min_subnormal == pytest.approx(5.96e-8, rel=1e-3)
    assert fp32.min_subnormal == pytest.approx(1.401e-45, rel=1e-3)
    assert fp32.max == pytest.approx(3.4028e38, rel=1e-4)


def test_e4m3_is_the_fn_variant():
    fmt = F.get("fp8_e4m3")
    assert not fmt.has_inf and fmt.torch_dtype == torch.float8_e4m3fn
    assert F.get("fp8_e5m2").has_inf


# ----------------------------------------------------------------------------- get()

@pytest.mark.parametrize("spec, name", [
    ("half", "fp16"), ("float16", "fp16"), (" FP16 ", "fp16"), (torch.float16, "fp16"),
    ("bfloat16", "bf16"), (torch.bfloat16, "bf16"), ("double", "fp64"), ("float", "fp32"),
    ("e4m3", "fp8_e4m3"), (torch.float8_e4m3fn, "fp8_e4m3"), (torch.float8_e5m2, "fp8_e5m2"),
])
def test_get_aliases_and_dtypes(spec, name):
    assert F.get(spec).name == name
    assert F.get(F.get(spec)) is F.get(spec)


def test_get_unknown_name_lists_known():
    with pytest.raises(ValueError, match="unknown format 'fp12'.*fp16.*bf16.*fp8_e4m3"):
        F.get("fp12")
    with pytest.raises(ValueError, match="torch.int32"):
        F.get(torch.int32)
    with pytest.raises(TypeError, match="int"):
        F.get(16)


# ------------------------------------------------------------ the MindSpore guide's worked examples

@pytest.mark.parametrize("value, bits, kind", [
    (65504, "0 11110 1111111111", "normal"),        # MindSpore: the fp16 max
    (2.0 ** -14, "0 00001 0000000000", "normal"),   # MindSpore/Paddle: smallest normal
    (2.0 ** -24, "0 00000 0000000001", "subnormal"),  # the 2^-24 edge (blog, MindSpore)
    (-65504, "1 11110 1111111111", "normal"),
    (1.0, "0 01111 0000000000", "normal"),
    (-0.0, "1 00000 0000000000", "zero"),
    (math.inf, "0 11111 0000000000", "inf"),
])
def test_fp16_bit_patterns(value, bits, kind):
    d = F.decompose(value, "fp16")
    assert (d.bits, d.kind, d.overflow, d.underflow) == (bits, kind, False, False)
    assert d.stored == value and d.abs_error == 0


def test_fp16_max_by_the_mindspore_formula():
    d = F.decompose(65504, "fp16")
    assert (d.sign, d.biased_exponent, d.exponent, d.fraction) == (0, 30, 15, 1023)
    assert d.significand == 1.9990234375
    assert (-1) ** d.sign * 2.0 ** (d.biased_exponent - 15) * (1 + d.fraction / 1024) == 65504


@pytest.mark.parametrize("value, stored, underflow", [
    (2.0 ** -25, 0.0, True),               # exactly half of 2^-24: ties to even -> 0
    (2.0 ** -26, 0.0, True),
    (1e-8, 0.0, True),
    (1.5 * 2.0 ** -25, 2.0 ** -24, False),  # just below 2^-24 rounds up, not to zero
    (-(2.0 ** -26), -0.0, True),
    (3 * 2.0 ** -25, 2.0 ** -23, False),    # 1.5 * 2^-24 ties to even (2 * 2^-24)
])
def test_fp16_underflow_edge(value, stored, underflow):
    d = F.decompose(value, "fp16")
    assert same(d.stored, stored)
    assert d.underflow is underflow
    assert d.rel_error == (1.0 if underflow else abs(stored - value) / abs(value))


def test_mindspore_rounding_example():
    # "0.00006666666 ... will be represented as 0.000067 in FP16": true to 2 significant digits;
    # the stored value is (1 + 94/1024) * 2^-14.
    d = F.decompose(0.00006666666, "fp16")
    assert d.stored == (1 + 94 / 1024) * 2.0 ** -14 == 6.663799285888672e-05
    assert d.bits == "0 00001 0001011110"
    assert round(d.stored, 6) == 0.000067
    assert d.rel_error == pytest.approx(4.3e-4, rel=1e-2)
    assert F.decompose(0.00006666666, "fp32").rel_error < 2 ** -24


@pytest.mark.parametrize("fmt, stored", [
    ("fp16", 0.333251953125), ("bf16", 0.333984375), ("fp32", 0.3333333432674408),
    ("fp8_e4m3", 0.34375), ("fp8_e5m2", 0.3125), ("fp64", 1 / 3),
])
def test_one_third(fmt, stored):
    d = F.decompose(1 / 3, fmt)
    assert d.stored == stored
    assert d.rel_error <= F.get(fmt).eps / 2 * 1.0001


@pytest.mark.parametrize("fmt, value, stored, overflow", [
    ("fp16", 65519, 65504, False), ("fp16", 65520, math.inf, True), ("fp16", -1e6, -math.inf, True),
    ("bf16", 3.4e38, math.inf, True), ("fp32", 1e39, math.inf, True),
    ("fp8_e5m2", 61439, 57344, False), ("fp8_e5m2", 61440, math.inf, True),
    ("fp8_e4m3", 464, 448, False),       # the tie goes to the even 448
    ("fp8_e4m3", 465, math.nan, True),   # no inf in e4m3fn: overflow stores NaN
    ("fp8_e4m3", -1e4, math.nan, True),
])
def test_overflow(fmt, value, stored, overflow):
    d = F.decompose(value, fmt)
    assert same(d.stored, stored) and d.overflow is overflow
    if overflow:
        assert d.abs_error == math.inf and d.rel_error == math.inf
        assert d.kind == ("inf" if F.get(fmt).has_inf else "nan")


def test_e4m3_overflow_and_inf_bits():
    assert F.decompose(500, "fp8_e4m3").bits == "0 1111 111"
    d = F.decompose(-math.inf, "fp8_e4m3")
    assert d.kind == "nan" and not d.overflow  # the input was not finite
    assert F.decompose(448, "fp8_e4m3").bits == "0 1111 110"


def test_nan_and_inf_inputs():
    d = F.decompose(math.nan, "fp16")
    assert d.kind == "nan" and d.exponent is None and d.significand is None
    assert math.isnan(d.abs_error) and not d.overflow and not d.underflow
    d = F.decompose(-math.inf, "bf16")
    assert (d.kind, d.stored, d.abs_error, d.bits) == ("inf", -math.inf, 0.0, "1 11111111 0000000")


def test_subnormal_exponent_and_significand():
    d = F.decompose(3 * 2.0 ** -24, "fp16")
    assert (d.kind, d.biased_exponent, d.exponent, d.fraction) == ("subnormal", 0, -14, 3)
    assert d.significand * 2.0 ** d.exponent == d.stored


def test_double_rounding_avoided():
    # torch casts float64 -> fp16 through fp32 (1 + 2^-11 + 2^-40 -> 1 + 2^-11 -> tie -> 1.0);
    # correct nearest-even rounding of the float64 value gives 1 + 2^-10.
    assert F.decompose(1 + 2 ** -11 + 2 ** -40, "fp16").stored == 1 + 2 ** -10
    assert F.decompose(1 + 2 ** -8 + 2 ** -40, "bf16").stored == 1 + 2 ** -7


def test_decompose_accepts_tensors_and_rejects_bad_values():
    assert F.decompose(torch.tensor(65504.0), "half").bits == "0 11110 1111111111"
    with pytest.raises(TypeError, match="real number"):
        F.decompose("1.0", "fp16")
    with pytest.raises(TypeError, match="real number"):
        F.decompose(True, "fp16")
    with pytest.raises(TypeError, match="shape"):
        F.decompose(torch.ones(2), "fp16")
    with pytest.raises(ValueError, match="float64 range"):
        F.decompose(10 ** 400, "fp16")
    with pytest.raises(ValueError, match="unknown format"):
        F.decompose(1.0, "fp7")


def test_decomposition_str_reads_like_the_seed():
    text = str(F.decompose(65504, "fp16"))
    assert "0 11110 1111111111" in text and "30 - 15" in text and "1.9990234375" in text
    assert "kind       normal" in text and "overflow   no" in text
    assert "underflow  yes" in str(F.decompose(1e-9, "fp16"))


# ----------------------------------------------------------------------------- rounding vs torch

def _grid(name):
    """Every finite non-negative value of the format, the midpoints and their fp32 neighbours."""
    fmt = F.get(name)
    patterns = torch.arange(1 << fmt.bits, dtype=torch.int64)
    values = patterns.to(INT_VIEW[fmt.bits]).view(fmt.torch_dtype).to(torch.float32)
    values = values[torch.isfinite(values) & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32 for 16- and 8-bit formats
    up, down = torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)
    return torch.cat([values, mids, up, down, -values, -mids, -up, -down])


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_rounding_matches_torch_cast(name):
    fmt = F.get(name)
    x = _grid(name)
    in_range = x.abs() <= fmt.max  # torch saturates e4m3 overflow; compared separately below
    ours = rounding.round_to(x.double(), fmt)
    theirs = x.to(fmt.torch_dtype).double()
    assert torch.equal(ours[in_range], theirs[in_range])
    assert torch.equal(torch.signbit(ours[in_range]), torch.signbit(theirs[in_range]))


def test_rounding_matches_torch_cast_fp32():
    x = (torch.randn(20000, dtype=torch.float64)
         * torch.exp2(torch.randint(-160, 130, (20000,))).double())
    assert torch.equal(rounding.round_to(x, F.get("fp32")), x.float().double())


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2"])
def test_rounding_matches_exact_reference(name):
    fmt = F.get(name)
    rng = random.Random(name)
    lo = math.log2(fmt.min_subnormal) - 2
    hi = math.log2(fmt.max) + 1
    xs = [rng.choice((-1, 1)) * 2 ** rng.uniform(lo, hi) for _ in range(400)]
    for x in xs:
        assert same(F.decompose(x, fmt).stored, ref_round(x, fmt)), x


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_bits_round_trip_through_the_real_dtype(name):
    fmt = F.get(name)
    rng = random.Random(1)
    values = [fmt.max, -fmt.max, fmt.min_normal, fmt.min_subnormal, 3 * fmt.min_subnormal, 0.0,
              -0.0, 1.0, math.pi] + [rng.uniform(-4, 4) for _ in range(20)]
    for value in values:
        d = F.decompose(value, fmt)
        pattern = int(d.bits.replace(" ", ""), 2)
        assert same(from_pattern(pattern, fmt), d.stored)
        assert decomposition.encode(d.stored, fmt) == (d.sign, d.biased_exponent, d.fraction)
        assert len(d.bits) == fmt.bits + 2


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_pattern_decodes_like_torch(name):
    fmt = F.get(name)
    for pattern in range(256):
        sign, rest = pattern >> 7, pattern & 0x7F
        fields = (sign, rest >> fmt.mantissa_bits, rest & ((1 << fmt.mantissa_bits) - 1))
        assert same(decomposition.decode(*fields, fmt), from_pattern(pattern, fmt)), pattern


# ----------------------------------------------------------------------------- range_report

def test_range_report_counts_hand_built_tensor():
    x = torch.tensor([0.0, 0.0, -0.0,          # exact zeros
                      1e-9, -2e-8,             # underflow
                      1e-6, -3e-7,             # subnormal (representable)
                      1.0, 2.0, 1 / 3,         # normal (representable); 1/3 is rounded
                      7e4, -1e5,               # overflow
                      math.inf, math.nan])     # non-finite in the source
    r = F.range_report(x, "fp16")
    assert (r.numel, r.exact_zero, r.underflow, r.subnormal, r.representable, r.overflow,
            r.nonfinite) == (14, 3, 2, 2, 5, 2, 2)
    assert r.exact == 2  # 1.0 and 2.0
    assert r.overflow_fraction == 2 / 14 and r.underflow_fraction == 2 / 14
    assert r.subnormal_fraction == 2 / 14 and r.exact_zero_fraction == 3 / 14
    assert r.representable_fraction == 5 / 14
    fp16 = F.get("fp16")
    rounded = x[5:10].tolist()  # the representable values, as their fp32 values
    errors = [abs(ref_round(v, fp16) - v) / abs(v) for v in rounded]
    assert errors[1] > 2 ** -10  # -3e-7 is subnormal: far coarser than an fp16 ulp of 2^-11
    assert r.max_rel_error == pytest.approx(max(errors), rel=1e-12)
    assert r.mean_rel_error == pytest.approx(sum(errors) / 5, rel=1e-12)


def test_range_report_scale_rescues_underflow():
    g = torch.full((100,), 2.0 ** -30)
    assert F.range_report(g, "fp16").underflow == 100
    r = F.range_report(g, "fp16", scale=2.0 ** 16)
    assert (r.underflow, r.representable, r.exact, r.subnormal) == (0, 100, 100, 0)
    assert F.range_report(torch.full((4,), 1.0), "fp16", scale=2.0 ** 16).overflow == 4


def test_range_report_bf16_underflows_less_than_fp16():
    x = torch.tensor([1e-9, 1e-20, 1e-30], dtype=torch.bfloat16)
    assert F.range_report(x, "fp16").underflow == 3
    assert F.range_report(x, "bf16").underflow == 0


def test_range_report_empty_and_bad_input():
    r = F.range_report(torch.empty(0, 3), "fp16")
    assert r.numel == 0 and r.overflow_fraction == 0.0 and r.mean_rel_error == 0.0
    with pytest.raises(TypeError, match="int64"):
        F.range_report(torch.arange(4), "fp16")
    with pytest.raises(TypeError, match="bool"):
        F.range_report(torch.ones(2, dtype=torch.bool), "fp16")
    with pytest.raises(TypeError, match="list"):
        F.range_report([1.0], "fp16")
    with pytest.raises(ValueError, match="positive finite"):
        F.range_report(torch.ones(2), "fp16", scale=0.0)


def test_range_report_chunks_agree(monkeypatch):
    x = torch.randn(1000) * torch.exp2(torch.randint(-30, 20, (1000,)).float())
    whole = F.range_report(x, "fp16")
    monkeypatch.setattr(ranges, "_CHUNK", 77)
    chunked = F.range_report(x, "fp16")
    assert chunked.underflow == whole.underflow > 0 and chunked.overflow == whole.overflow > 0
    assert chunked.max_rel_error == whole.max_rel_error
    assert chunked.mean_rel_error == pytest.approx(whole.mean_rel_error, rel=1e-12)


def test_range_report_combine_and_str():
    a = F.range_report(torch.tensor([1e-9, 1.0]), "fp16")
    b = F.range_report(torch.tensor([1e5, 0.0, 1 / 3]), "fp16")
    both = F.RangeReport.combine([a, b])
    assert ((both.numel, both.underflow, both.overflow, both.exact_zero, both.representable)
            == (5, 1, 1, 1, 2))
    assert both.mean_rel_error == pytest.approx((a.mean_rel_error + b.mean_rel_error) / 2)
    with pytest.raises(ValueError, match="one format"):
        F.RangeReport.combine([a, F.range_report(torch.ones(1), "bf16")])
    text = str(both)
    assert "5 values -> fp16" in text and "underflow" in text and "20.00%" in text


# ----------------------------------------------------------------------------- torch's own cast

@pytest.mark.parametrize("value, stored, cast", [
    (500, math.nan, 448.0), (-500, math.nan, -448.0), (1e6, math.nan, 448.0),
    (math.inf, math.nan, 448.0), (-math.inf, math.nan, -448.0),
])
def test_e4m3_shows_the_rule_and_torch_saturating_cast(value, stored, cast):
    d = F.decompose(value, "fp8_e4m3")
    assert same(d.stored, stored) and d.torch_cast == cast
    assert d.torch_cast == torch.tensor(float(value)).to(torch.float8_e4m3fn).item()
    assert not d.torch_agrees and "saturates" in d.torch_note and "448" in d.torch_note
    assert math.copysign(1, d.stored) == math.copysign(1, value)  # NaN keeps the sign


@pytest.mark.parametrize("value, fmt", [(448, "fp8_e4m3"), (65504, "fp16"), (1e6, "fp16"),
                                        (1 / 3, "bf16"), (500, "fp8_e5m2"), (math.nan, "fp16"),
                                        (1 / 3, "fp64"), (0.1, "fp32")])
def test_torch_cast_agrees_where_torch_follows_the_rule(value, fmt):
    d = F.decompose(value, fmt)
    assert d.torch_agrees and d.torch_note == "" and same(d.torch_cast, d.stored)


def test_torch_cast_double_rounding_is_named():
    d = F.decompose(1 + 2 ** -11 + 2 ** -40, "fp16")
    assert d.stored == 1 + 2 ** -10 and d.torch_cast == 1.0
    assert "float32 first" in d.torch_note


def test_decomposition_str_shows_both_rule_and_torch_cast():
    text = str(F.decompose(500, "fp8_e4m3"))
    assert "stored     nan (the format's rule)" in text
    assert "torch cast 448.0 (float64 .to(torch.float8_e4m3fn)):" in text
    assert "saturates out-of-range values and inf to +-448" in text
    same_text = "torch cast 65504.0 (float64 .to(torch.float16): same)"
    assert same_text in str(F.decompose(65504, "fp16"))
