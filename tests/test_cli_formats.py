"""`mixprec formats` and `mixprec explain`: output, the MindSpore guide's examples, bad input,
negative values, torch's own cast next to the format's rule, and `--version`."""

import importlib.metadata
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import mixprec
from mixprec import cli

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:
    tomllib = None
from mixprec.commands.formats import parse_value


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def field(out: str, name: str) -> str:
    """The value of one ``  name   value`` line of an explanation."""
    for line in out.splitlines():
        if line.strip().startswith(name + " "):
            return line.strip()[len(name):].strip()
    raise AssertionError(f"no {name!r} line in:\n{out}")


def test_formats_table(capsys):
    code, out, err = run(capsys, "formats")
    assert code == 0 and err == ""
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:8]}
    assert list(rows) == ["fp64", "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
    assert rows["fp16"][:6] == ["fp16", "16", "1/5/10", "15", "yes", "65504"]
    assert "2^-14" in rows["fp16"] and "2^-24" in rows["fp16"] and "2^-10" in rows["fp16"]
    assert rows["fp8_e4m3"][4:6] == ["no", "448"]
    assert rows["bf16"][3] == "127" and "2^-126" in rows["bf16"]


def test_formats_json(capsys):
    code, out, _ = run(capsys, "formats", "--json")
    table = {row["name"]: row for row in json.loads(out)}
    assert (code == 0 and table["fp16"]["max"] == 65504
            and table["fp16"]["min_subnormal"] == 2.0 ** -24)
    assert table["fp8_e4m3"]["has_inf"] is False


@pytest.mark.parametrize("value, bits, kind, stored", [
    ("65504", "0 11110 1111111111", "normal", "65504.0"),
    ("2**-14", "0 00001 0000000000", "normal", "6.103515625e-05 = 2^-14"),
    ("2^-24", "0 00000 0000000001", "subnormal", "5.960464477539063e-08 = 2^-24"),
    ("0.00006666666", "0 00001 0001011110", "normal", "6.663799285888672e-05"),
    ("1/3", "0 01101 0101010101", "normal", "0.333251953125"),
])
def test_explain_mindspore_guide_examples(capsys, value, bits, kind, stored):
    code, out, err = run(capsys, "explain", value)
    assert code == 0 and err == ""
    assert field(out, "bits") == bits
    assert field(out, "kind") == kind
    assert field(out, "stored") == stored
    assert field(out, "overflow") == "no" and field(out, "underflow") == "no"


def test_explain_max_shows_the_formula(capsys):
    _, out, _ = run(capsys, "explain", "65504")
    assert field(out, "exponent") == "11110 (30 - 15) -> 2^15"
    assert field(out, "value") == "(-1)^0 x 2^15 x 1.9990234375 = 65504.0"


@pytest.mark.parametrize("argv, flag", [
    (["explain", "1e-8"], "underflow"),
    (["explain", "2**-25"], "underflow"),
    (["explain", "65520"], "overflow"),
    (["explain", "500", "--format", "fp8_e4m3"], "overflow"),
    (["explain", "--", "-1e6"], "overflow"),
    (["explain", "-1e6"], "overflow"),
])
def test_explain_flags_overflow_and_underflow(capsys, argv, flag):
    code, out, _ = run(capsys, *argv)
    assert code == 0 and field(out, flag) == "yes"
    other = "underflow" if flag == "overflow" else "overflow"
    assert field(out, other) == "no"


def test_explain_below_2_to_24_rounds_up_not_to_zero(capsys):
    _, out, _ = run(capsys, "explain", "1.5*2**-25")
    assert field(out, "stored") == "5.960464477539063e-08 = 2^-24"
    assert field(out, "underflow") == "no"


def test_explain_several_values_and_formats(capsys):
    code, out, _ = run(capsys, "explain", "1/3", "inf", "--format", "fp16,bf16")
    blocks = out.strip().split("\n\n")
    assert code == 0 and len(blocks) == 4
    assert [b.splitlines()[0].split(" in ")[1].split()[0] for b in blocks] == ["fp16", "bf16"] * 2
    assert field(blocks[1], "stored") == "0.333984375"
    assert field(blocks[2], "kind") == "inf" and field(blocks[3], "bits") == "0 11111111 0000000"


def test_explain_repeated_format_options_explain_every_format(capsys):
    code, out, err = run(capsys, "explain", "1/3", "-1", "-f", "bf16", "-f", "fp16")
    blocks = out.strip().split("\n\n")
    assert code == 0 and err == "" and len(blocks) == 4
    assert [b.splitlines()[0].split(" in ")[1].split()[0] for b in blocks] == ["bf16", "fp16"] * 2
    assert [field(b, "stored") for b in blocks[:2]] == ["0.333984375", "0.333251953125"]
    code, out, _ = run(capsys, "explain", "1", "--format", "bf16,fp16", "-f", "fp8_e4m3",
                       "-f", "fp16")  # mixed spellings; a format given twice is shown once
    names = [b.splitlines()[0].split(" in ")[1].split()[0] for b in out.strip().split("\n\n")]
    assert code == 0 and names == ["bf16", "fp16", "fp8_e4m3"]


@pytest.mark.parametrize("argv", [
    ["plan", "--params", "1B", "--dtype", "bf16", "--dtype", "fp16"],
    ["plan", "--params", "1B", "--params", "2B"],
    ["bench", "--dtype", "bf16", "--dtype", "fp16"],
    ["bench", "--model", "convnet", "--model", "transformer"],
    ["bench", "--steps", "1", "--steps", "2"],
    ["doctor", "--shape", "8,8,8", "--shape", "16,16,16"],
    ["demo", "--epochs", "1", "--epochs", "2"],
])
def test_single_valued_options_given_twice_are_refused(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"argument {argv[-2]}: given twice ({' '.join(argv[-4:])}); " in err
    assert "it takes one value" in err


def test_explain_format_option_accumulates_when_repeated():
    parse = cli.build_parser().parse_args
    assert parse(["explain", "1", "-f", "bf16,fp16", "-f", "fp16"]).format == [
        "bf16", "fp16", "fp16"]
    assert parse(["explain", "1"]).format is None  # the command's default: fp16


@pytest.mark.parametrize("argv, message", [
    (["explain", "abc"], "VALUE must be a number"),
    (["explain", "1e400"], "beyond the float64 range"),
    (["explain", "2**-2000"], "below the smallest float64 subnormal"),
    (["explain", "1/0"], "VALUE must be a number"),
    (["explain", "__import__('os').getcwd()"], "VALUE must be a number"),
    (["explain", "2**10**10"], "VALUE must be a number"),
    (["explain", "1", "--format", "fp12"], "unknown format 'fp12'"),
])
def test_explain_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("mixprec explain: error: ") and message in err


@pytest.mark.parametrize("text, value", [
    ("65504", 65504.0), ("1e-8", 1e-8), ("2**-24", 2.0 ** -24), ("2^-24", 2.0 ** -24),
    ("-2**-24", -(2.0 ** -24)), ("1/3", 1 / 3), ("0x1p-14", 2.0 ** -14),
    ("3*2**-25", 3 * 2.0 ** -25),
    ("inf", math.inf), ("-Infinity", -math.inf), (" 0.00006666666 ", 0.00006666666),
    ("(1+2**-10)*2**15", 32800.0), ("1e-320", 1e-320),
])
def test_parse_value(text, value):
    assert parse_value(text) == value


def test_parse_value_is_exact_then_rounded_once():
    # 1 + 2^-53 + 2^-80 is exactly representable nowhere; summing floats would round to 1.0,
    # the exact fraction rounds once, up to 1 + 2^-52.
    assert parse_value("1 + 2**-53 + 2**-80") == 1 + 2.0 ** -52
    assert math.isnan(parse_value("nan"))
    assert math.copysign(1, parse_value("-0.0")) == -1


def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "mixprec", "explain", "65504"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "0 11110 1111111111" in done.stdout


def test_explain_e4m3_beyond_max_shows_rule_and_torch_cast(capsys):
    code, out, _ = run(capsys, "explain", "500", "--format", "fp8_e4m3")
    assert code == 0
    assert field(out, "stored") == "nan (the format's rule)"
    assert field(out, "torch cast").startswith("448.0 (float64 .to(torch.float8_e4m3fn)):")
    assert "saturates" in out and field(out, "overflow") == "yes"


@pytest.mark.parametrize("argv, stored, sign", [
    (["explain", "-1"], "-1.0 = -2^0", "1 (-)"),
    (["explain", "-inf"], "-inf", "1 (-)"),
    (["explain", "-Infinity", "-f", "bf16"], "-inf", "1 (-)"),
    (["explain", "-2**-24"], "-5.960464477539063e-08 = -2^-24", "1 (-)"),
    (["explain", "-0x1p-14", "--format", "fp16"], "-6.103515625e-05 = -2^-14", "1 (-)"),
    (["explain", "-.5"], "-0.5 = -2^-1", "1 (-)"),
    (["explain", "-nan", "-f", "fp8_e4m3"], "nan", "1 (-)"),
    (["explain", "-f", "fp16", "-inf"], "-inf", "1 (-)"),
])
def test_explain_negative_values_need_no_double_dash(capsys, argv, stored, sign):
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == ""
    assert field(out, "stored") == stored and field(out, "sign") == sign


def test_explain_negative_values_mixed_with_others_keep_their_order(capsys):
    code, out, _ = run(capsys, "explain", "1", "-inf", "-2", "--format", "fp16")
    blocks = out.strip().split("\n\n")
    assert code == 0
    assert [field(b, "stored") for b in blocks] == ["1.0 = 2^0", "-inf", "-2.0 = -2^1"]
    code, _, err = run(capsys, "explain", "-1e400")
    assert code == 2 and "beyond the float64 range" in err and "' -1e400'" not in err


def test_normalize_argv_touches_explain_values_only():
    assert cli.normalize_argv(["explain", "-inf", "-f", "bf16"]) == [
        "explain", " -inf", "-f", "bf16"]
    assert cli.normalize_argv(["explain", "--", "-inf"]) == ["explain", "--", "-inf"]
    assert cli.normalize_argv(["doctor", "--shape", "1,2,3"]) == ["doctor", "--shape", "1,2,3"]
    assert cli.normalize_argv(["--version"]) == ["--version"]


def test_version_comes_from_one_place(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out == f"mixprec {mixprec.__version__}\n"
    assert importlib.metadata.version("mixprec") == mixprec.__version__
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mixprec.__version__"}


@pytest.mark.parametrize("argv, message", [
    (["demo", "--lr", "nan"], "--lr must be a positive finite number; got nan"),
    (["demo", "--lr", "-1"], "--lr must be a positive finite number; got -1.0"),
    (["demo", "--out", "/proc/mixprec-demo"], "is not a folder the demo can write"),
])
def test_demo_refuses_bad_options_before_training(capsys, argv, message):
    """``--lr nan`` trained four NaN runs whose table showed finite losses; an ``--out`` that
    can't be made failed with a traceback after the runs (minutes)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_report_to_a_directory_is_a_command_line_error(tmp_path, capsys):
    run = tmp_path / "run.jsonl"
    run.write_text('{"step": 0, "mixprec/loss": 1.0}\n')
    assert cli.main(["report", str(run), "-o", str(tmp_path)]) == 2  # was an IsADirectoryError
    assert "Is a directory" in capsys.readouterr().err
