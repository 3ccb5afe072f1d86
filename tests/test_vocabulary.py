"""One vocabulary of precision keywords: every entry point takes the declared names with the
declared defaults (read through ``inspect.signature``), its docstring carries the declared text,
and a value other than the default reaches what the entry point builds (the policy of the
prepared model, the optimizer, the loss scaler, the autocast's op lists, the plan, the advice).
"""

import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec import vocabulary
from mixprec.parallel.sharding import fsdp

pytestmark = pytest.mark.filterwarnings(
    "ignore::mixprec.hardware.SlowDtypeWarning",
    # torch's own, from importing transformers first in a process
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")

lightning = pytest.importorskip("mixprec.integrations.lightning")
hf = pytest.importorskip("mixprec.integrations.transformers")
hf_accelerate = pytest.importorskip("mixprec.integrations.accelerate")
transformers = pytest.importorskip("transformers")

PRECISION, LOOP, EMULATION = vocabulary.PRECISION, vocabulary.LOOP, vocabulary.EMULATION
DISTRIBUTED, COMPILE = vocabulary.DISTRIBUTED, vocabulary.COMPILE
#: entry point -> (the keywords it takes, the defaults it documents as different)
ENTRY_POINTS = {
    "prepare": (mp.prepare, PRECISION + EMULATION, {}),
    "MixedPrecision": (mp.MixedPrecision, PRECISION + LOOP + EMULATION, {}),
    "Trainer": (mp.Trainer, PRECISION + LOOP + EMULATION + DISTRIBUTED + COMPILE, {}),
    "parallel.fsdp": (fsdp, PRECISION + DISTRIBUTED + EMULATION, {"level": "O2"}),
    "MixprecPrecision": (lightning.MixprecPrecision, PRECISION + LOOP + EMULATION, {}),
    "MixprecTrainer": (hf.MixprecTrainer, PRECISION + LOOP + EMULATION, {}),
    "MixprecAccelerator": (hf_accelerate.MixprecAccelerator, PRECISION + LOOP + EMULATION, {}),
    "plan": (mp.parallel.plan,
             ("level", "dtype", "policy", "master", "state_dtype", "reduce_dtype"),
             {"level": "O2", "dtype": "bf16"}),
    "advise": (mp.advise, ("loss_scale", "fp8"), {}),
    "Advice.policy": (mp.advisor.Advice.policy, ("level", "dtype", "fp8"),
                      {"level": "O2", "dtype": "bf16"}),
}
#: The keywords no entry point may take positionally.
KEYWORD_ONLY = LOOP[1:] + EMULATION + DISTRIBUTED + COMPILE


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_each_entry_point_takes_the_declared_keywords_and_defaults(name):
    entry, names, differs = ENTRY_POINTS[name]
    params = inspect.signature(entry).parameters
    assert vocabulary.keywords_of(entry) == names
    for keyword in names:
        param = params[keyword]
        assert param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD), keyword
        expected = differs.get(keyword, vocabulary.KEYWORDS[keyword].default)
        if keyword in ("level", "dtype"):  # a Default: told apart from the value passed
            assert type(param.default) is vocabulary.Default, keyword
            expected = vocabulary.Default(expected)
        assert type(param.default) is type(expected) and param.default == expected, keyword
        if keyword in KEYWORD_ONLY:
            assert param.kind is param.KEYWORD_ONLY, keyword
    assert not any(p.kind == p.VAR_KEYWORD and p.name in vocabulary.KEYWORDS
                   for p in params.values())


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_each_docstring_carries_the_declared_text(name):
    entry, names, differs = ENTRY_POINTS[name]
    doc = flat(entry.__doc__)
    assert vocabulary.MARKER not in entry.__doc__
    for keyword in names:
        assert flat(vocabulary.KEYWORDS[keyword].doc) in doc, keyword
    for keyword, default in differs.items():  # a different default says so, and why
        assert f"Default here: {default!r} (" in doc
    assert max(len(line) for line in entry.__doc__.splitlines()) <= 100


def test_what_is_absent_is_explained():
    for entry in (mp.parallel.plan, mp.advise):
        doc = flat(entry.__doc__)
        absent = [k for k in vocabulary.KEYWORDS if k not in vocabulary.keywords_of(entry)]
        assert absent and all(f"``{k}``" in doc or k in ("low_precision_ops", "fp32_ops")
                              for k in absent)
        assert "op lists" in doc


def test_setup_and_the_apex_layer_take_none_of_the_keywords():
    """``MixedPrecision.setup`` takes the model and its optimizers only; apex's ``initialize``
    keeps apex's own names (its point is running apex code unchanged)."""
    from mixprec.compat import apex_amp

    assert list(inspect.signature(mp.MixedPrecision.setup).parameters) == [
        "self", "model", "optimizers"]
    params = inspect.signature(apex_amp.initialize).parameters
    # apex's loss_scale (None, a number or "dynamic") and fp16 default, as apex has them
    assert set(params) & set(vocabulary.KEYWORDS) == {"loss_scale", "dtype"}
    assert (params["loss_scale"].default, params["dtype"].default) == (None, "fp16")


def test_the_declaration_checks_signatures_and_docstrings():
    def good(*, level=vocabulary.LEVEL, dtype=vocabulary.DTYPE):
        """Doc.

        Args:
            {precision keywords}
        """

    assert "level: \"O0\"" in vocabulary.takes("level", "dtype")(good).__doc__
    assert "Default: 'O1'." in good.__doc__  # the Default reads as its value

    def other_default(*, level=vocabulary.Default("O2")):
        """{precision keywords}"""

    with pytest.raises(TypeError, match=r"other_default's level= defaults to 'O2'; the "
                                        r"vocabulary declares 'O1'"):
        vocabulary.takes("level")(other_default)
    assert vocabulary.takes("level", differs={"level": ("O2", "why")})(other_default)

    def plain(*, level="O1"):  # cannot be told from level="O1" passed beside policy=
        """{precision keywords}"""

    with pytest.raises(TypeError, match=r"plain's level= must default to "
                                        r"vocabulary.Default\('O1'\): a plain 'O1'"):
        vocabulary.takes("level")(plain)

    def missing(*, level=vocabulary.LEVEL):
        """{precision keywords}"""

    with pytest.raises(TypeError, match="must take the keyword 'dtype'"):
        vocabulary.takes("level", "dtype")(missing)

    def unmarked(*, level=vocabulary.LEVEL):
        """No marker."""

    with pytest.raises(TypeError, match="needs one"):
        vocabulary.takes("level")(unmarked)
    with pytest.raises(TypeError, match="unknown precision keywords"):
        vocabulary.takes("levels")


def test_the_docs_table_lists_the_declared_defaults():
    text = (Path(__file__).resolve().parents[1] / "docs" / "levels.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", text, flags=re.M))
    for keyword in vocabulary.KEYWORDS.values():
        assert rows[keyword.name] == repr(keyword.default).replace("'", '"'), keyword.name


# -- values reach what each entry point builds -----------------------------------------------

def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 16))


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo process group (what ``parallel.fsdp`` shards over), torn down after."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def hf_args(tmp_path):
    return transformers.TrainingArguments(str(tmp_path / "hf"), use_cpu=True, report_to=[],
                                          disable_tqdm=True)


def build(name, model, opt, tmp_path, **kw):
    """(prepared model, optimizer, engine or None) from one entry point."""
    if name == "prepare":
        model, opt = mp.prepare(model, opt, **kw)
        return model, opt, None
    if name == "MixedPrecision":
        engine = mp.MixedPrecision(**kw)
        return (*engine.setup(model, opt), engine)
    if name.startswith("Trainer"):  # "Trainer[fsdp]": under that strategy
        strategy = name.partition("[")[2].rstrip("]") or "single"
        trainer = mp.Trainer(model, F.mse_loss, opt, progress=False, strategy=strategy, **kw)
        return mp.parallel.unwrap(trainer.model), trainer.optimizer, trainer.engine
    if name == "parallel.fsdp":
        return (*fsdp(model, opt, **kw), None)
    if name == "MixprecPrecision":
        engine = lightning.MixprecPrecision(**kw).engine
        return (*engine.setup(model, opt), engine)
    if name == "MixprecAccelerator":
        accelerator = hf_accelerate.MixprecAccelerator(cpu=True, **kw)
        model, opt = accelerator.prepare(model, opt)
        return model, opt.optimizer, accelerator.engine
    trainer = hf.MixprecTrainer(model, hf_args(tmp_path), optimizers=(opt, None), **kw)
    return trainer.model, trainer.create_optimizer(), trainer.mixed_precision


PREPARING = [n for n, (_, names, _) in ENTRY_POINTS.items() if "keep_fp32" in names]
PREPARING += ["Trainer[ddp]", "Trainer[fsdp]"]  # the strategies prepare the model themselves
IN_A_GROUP = ("parallel.fsdp", "Trainer[ddp]", "Trainer[fsdp]")
LOOPING = [n for n, (_, names, _) in ENTRY_POINTS.items()
           if "loss_scale" in names and n != "advise"]


@pytest.fixture(params=PREPARING)
def entry(request):
    if request.param in IN_A_GROUP:
        request.getfixturevalue("group")
    return request.param


def test_keep_fp32_master_and_state_dtype_reach_the_policy_and_the_optimizer(entry, tmp_path):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = build(entry, model, opt, tmp_path, level="O2", dtype="bf16",
                          keep_fp32=["4"], master="kahan", state_dtype="bf16")
    policy = mp.policy_of(model)
    assert "4" in policy.keep_fp32 and policy.master == "kahan"
    assert policy.state_dtype == torch.bfloat16
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["4.weight"] == torch.float32 and dtypes["0.weight"] == torch.bfloat16
    assert isinstance(opt, mp.CompactMasterOptimizer)


def test_a_policy_is_used_as_given(entry, tmp_path):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    given = mp.Policy.from_level("O3", "bf16")
    model, _, _ = build(entry, model, opt, tmp_path, policy=given)
    assert mp.policy_of(model) == given
    assert next(model.parameters()).dtype == torch.bfloat16


def test_fp32_ops_reach_the_autocast(entry, tmp_path):
    """At O1 bf16 a Linear computes in bf16 (its output differs from fp32's); listed in
    ``fp32_ops`` it computes in fp32, bitwise as the fp32 model does; one name given as a bare
    string is that name, at every entry point."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    reference = net()(x)
    outputs = {}
    for i, ops in enumerate(((), ("linear",), "linear")):
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, _, _ = build(entry, model, opt, tmp_path / str(i), level="O1",
                            dtype="bf16", fp32_ops=ops)
        outputs[ops] = model(x)
    assert not torch.equal(outputs[()], reference)
    torch.testing.assert_close(outputs[("linear",)], reference, rtol=0, atol=0)
    torch.testing.assert_close(outputs["linear"], reference, rtol=0, atol=0)


def test_low_precision_ops_reach_the_autocast(entry, tmp_path):
    """Softmax runs in fp32 at O1; listed in ``low_precision_ops`` it runs in bf16, so every
    value of the (fp32) output is a bf16 value."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    def representable(out):
        return torch.equal(out, out.bfloat16().float())

    results = {}
    for i, ops in enumerate(((), ("softmax",), "softmax")):  # a bare string: that one name
        model = nn.Sequential(net(), nn.Softmax(dim=-1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, _, _ = build(entry, model, opt, tmp_path / str(i), level="O1",
                            dtype="bf16", low_precision_ops=ops)
        out = model(x)
        assert out.dtype == torch.float32
        results[ops] = representable(out)
    assert results == {(): False, ("softmax",): True, "softmax": True}


def given(name, tmp_path, **kw):
    """Only what the user writes first: the engines and hosts built (no model set up yet);
    the entry points that take the model, called with it."""
    if name == "MixedPrecision":
        return mp.MixedPrecision(**kw)
    if name == "MixprecPrecision":
        return lightning.MixprecPrecision(**kw)
    if name == "MixprecAccelerator":
        return hf_accelerate.MixprecAccelerator(cpu=True, **kw)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if name == "MixprecTrainer":  # prepares the model when it builds its optimizer
        return hf.MixprecTrainer(model, hf_args(tmp_path), optimizers=(opt, None), **kw)
    return build(name, model, opt, tmp_path, **kw)


#: Values no model can make valid, and what each entry point says, where it is given them.
REFUSED = [({"keep_fp32": 3}, TypeError, r"keep_fp32 must be an nn\.Module subclass .*, or an "
                                         r"iterable of them; got int 3"),
           ({"keep_fp32": [nn.Linear, 3.5]}, TypeError, r"keep_fp32 entries must be"),
           ({"low_precision_ops": [3]}, TypeError,
            r"low_precision_ops must hold op names \(strings such as 'softmax'\), or be one; "
            r"got 3 \(int\)"),
           ({"fp32_ops": 5}, TypeError,
            r"fp32_ops must be an op name or a list of op names \(e\.g\. \['softmax'\]\); "
            r"got int"),
           ({"fp32_ops": ["sotfmax"]}, ValueError, r"unknown op name 'sotfmax'"),
           ({"emulate_fp16": "maybe"}, ValueError,
            r"emulate_fp16 must be 'auto', True or False; got 'maybe'"),
           ({"emulate_fp16": 2}, ValueError, r"emulate_fp16 must be 'auto', True or False; "
                                             r"got 2")]


def test_values_no_model_can_make_valid_are_refused_where_they_are_given(entry, tmp_path):
    """One check for every entry point, run where the keywords are given: a bad value stops
    the line that passes it, before any model is set up (the engines, Lightning's plugin and
    the Hugging Face hosts too), with the same message everywhere."""
    for kw, error, message in REFUSED:
        with pytest.raises(error, match=message):
            given(entry.partition("[")[0], tmp_path, level="O2", dtype="bf16", **kw)


def test_a_module_name_matching_nothing_is_refused_where_the_model_is_set_up(entry, tmp_path):
    """A name can only be checked against the model: the engines and hosts take it, and the
    set-up that meets the model refuses it, naming it."""
    model = net()
    with pytest.raises(ValueError, match=r"name no module of the model: 'nonexistent_module'"):
        build(entry, model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path, level="O2",
              dtype="bf16", keep_fp32="nonexistent_module")


@pytest.mark.filterwarnings("ignore::UserWarning:torchao.*",
                            "ignore::DeprecationWarning:torchao.*",
                            "ignore::FutureWarning:torchao.*")
def test_fp8_and_fp8_modules_reach_the_policy(entry, tmp_path):
    pytest.importorskip("torchao.float8")
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _, _ = build(entry, model, opt, tmp_path, level="O1", dtype="bf16",
                        fp8="rowwise", fp8_modules=["2"])
    policy = mp.policy_of(model)
    assert policy.fp8 == mp.lowbit.Float8("rowwise") and policy.fp8_modules == ("2",)
    assert list(mp.fp8_modules(model)) == ["2"]


@pytest.mark.parametrize("name", LOOPING)
def test_loss_scale_reaches_the_scaler(name, tmp_path):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, engine = build(name, model, opt, tmp_path, level="O2", dtype="fp16", loss_scale=8.0)
    assert isinstance(engine.scaler, mp.StaticLossScaler) and engine.scaler.get_scale() == 8.0


def test_trainer_loss_scaler_is_a_deprecated_alias():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(DeprecationWarning, match=r"loss_scaler= is deprecated; pass loss_scale="):
        trainer = mp.Trainer(model, F.mse_loss, opt, level="O2", dtype="fp16", loss_scaler=8.0,
                             progress=False)
    assert trainer.scaler.get_scale() == 8.0
    with pytest.raises(TypeError, match="both loss_scale= and its deprecated alias loss_scaler="):
        mp.Trainer(net(), F.mse_loss, opt, loss_scale=4.0, loss_scaler=8.0, progress=False)
    with warnings.catch_warnings():  # the new spelling warns about nothing
        warnings.simplefilter("error", DeprecationWarning)
        model = net()
        mp.Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                   loss_scale=8.0, progress=False)


@pytest.mark.parametrize("cls", ["Trainer", "MixprecPrecision", "MixprecTrainer",
                                 "MixprecAccelerator"])
def test_the_loops_take_an_engine_or_the_keywords_not_both(cls, tmp_path):
    engine = mp.MixedPrecision(level="O2", dtype="bf16")
    if cls == "Trainer":
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = mp.Trainer(model, F.mse_loss, opt, mixed_precision=engine, progress=False)
        assert trainer.engine is engine and trainer.policy.level == "O2"
        with pytest.raises(TypeError, match="got mixed_precision= and loss_scale"):
            mp.Trainer(net(), F.mse_loss, opt, mixed_precision=engine, loss_scale=8.0)
        with pytest.raises(TypeError, match="got mixed_precision= and loss_scale"):
            with pytest.warns(DeprecationWarning):
                mp.Trainer(net(), F.mse_loss, opt, mixed_precision=engine, loss_scaler=8.0)
    elif cls == "MixprecPrecision":
        assert lightning.MixprecPrecision(mixed_precision=engine).engine is engine
        with pytest.raises(TypeError, match="got mixed_precision= and level, master"):
            lightning.MixprecPrecision(level="O2", master="kahan", mixed_precision=engine)
    elif cls == "MixprecAccelerator":
        accelerator = hf_accelerate.MixprecAccelerator(mixed_precision=engine, cpu=True)
        assert accelerator.engine is engine
        with pytest.raises(TypeError, match="got mixed_precision= and fp8_modules"):
            hf_accelerate.MixprecAccelerator(mixed_precision=engine, fp8_modules=["0"], cpu=True)
    else:
        trainer = hf.MixprecTrainer(net(), hf_args(tmp_path), mixed_precision=engine)
        assert trainer.mixed_precision is engine
        with pytest.raises(TypeError, match="got mixed_precision= and keep_fp32"):
            hf.MixprecTrainer(net(), hf_args(tmp_path), mixed_precision=engine,
                              keep_fp32=[nn.Linear])


def test_plan_counts_master_state_dtype_and_policy():
    n = 10 ** 6
    fp32 = mp.parallel.plan(n, strategy="single")
    kahan = mp.parallel.plan(n, strategy="single", master="kahan", state_dtype="bf16")
    assert (fp32.masters, fp32.optimizer_state) == (4 * n, 8 * n)
    assert (kahan.masters, kahan.optimizer_state) == (2 * n, 4 * n)
    given = mp.parallel.plan(n, strategy="single", master="kahan", state_dtype="bf16",
                             policy=mp.Policy.from_level("O2", "bf16"))
    assert given == kahan
    o3 = mp.parallel.plan(n, strategy="single", policy=mp.Policy.from_level("O3", "fp16"))
    assert (o3.level, o3.dtype, o3.masters, o3.optimizer_state) == ("O3", "fp16", 0, 4 * n)
    with pytest.raises(ValueError, match="pass either policy= or level=/dtype="):
        mp.parallel.plan(n, level="O1", policy=mp.Policy.from_level("O3", "fp16"))
    with pytest.raises(ValueError, match="apply to a master-weight level"):
        mp.parallel.plan(n, level="O1", master="kahan")


def test_advise_judges_fp16_gradients_at_the_loss_scale_given():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    advice = mp.advise(model, batch, F.cross_entropy, formats=("fp16",), loss_scale=8.0)
    assert advice.loss_scales == {"fp16": 8.0} and advice.loss_scale == 8.0


# -- every keyword, every entry point ----------------------------------------------------------

def test_every_keyword_is_declared_once_with_its_text():
    assert len(vocabulary.KEYWORDS) == len(vocabulary._DECLARED)
    groups = PRECISION + LOOP + EMULATION + DISTRIBUTED + COMPILE
    assert sorted(groups) == sorted(vocabulary.KEYWORDS)  # each keyword in exactly one group
    for name in ("emulate_fp16", "monitor", "reduce_dtype", "compile"):
        assert vocabulary.KEYWORDS[name].doc


def test_the_policy_fields_say_why_their_defaults_differ():
    """A Policy holds resolved values; where a field of a keyword's name defaults otherwise,
    the vocabulary states the resolved default and why."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(mp.Policy)}
    for name, keyword in vocabulary.KEYWORDS.items():
        if name not in fields or fields[name].default is dataclasses.MISSING:
            continue
        default = fields[name].default
        if type(default) is type(keyword.default) and default == keyword.default:
            continue
        shown, why = vocabulary.RESOLVED[name]
        assert str(default) == shown and why, name
    assert set(vocabulary.RESOLVED) == {"level", "loss_scale", "master", "state_dtype"}


def at_defaults(name):
    entry, names, differs = ENTRY_POINTS[name]
    return {k: differs.get(k, vocabulary.KEYWORDS[k].default) for k in names}


@pytest.mark.parametrize("name", ["prepare", "MixedPrecision", "Trainer", "MixprecPrecision",
                                  "MixprecTrainer", "parallel.fsdp"])
def test_each_entry_point_accepts_every_keyword_at_its_declared_default(name, tmp_path, request):
    """Every applicable keyword, passed explicitly at its declared default, is accepted and
    builds what passing none builds."""
    if name in IN_A_GROUP:
        request.getfixturevalue("group")
    kw = at_defaults(name)
    if name == "Trainer":
        kw.pop("reduce_dtype"), kw.pop("compile")  # the Trainer's own, below
        model = net()
        trainer = mp.Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                             progress=False, reduce_dtype="fp32", compile=False, **kw)
        assert trainer.policy.level == "O1"
        return
    if name == "parallel.fsdp":
        kw.pop("reduce_dtype")
        model, _ = fsdp(net(), None, reduce_dtype="fp32", **kw), None
        assert mp.policy_of(model).level == "O2"
        return
    model = net()
    model, _, _ = build(name, model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path, **kw)
    plain = net()
    plain, _, _ = build(name, plain, torch.optim.SGD(plain.parameters(), lr=0.1),
                        tmp_path / "plain")
    assert mp.policy_of(model) == mp.policy_of(plain)


def test_plan_and_advise_accept_every_keyword_at_their_defaults():
    assert mp.parallel.plan(10 ** 6, **at_defaults("plan")) == mp.parallel.plan(10 ** 6)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    advice = mp.advise(model, batch, F.cross_entropy, formats=("bf16",), **at_defaults("advise"))
    assert advice.fp8_recipe == "tensorwise"
    assert advice.policy(**at_defaults("Advice.policy")) == advice.policy()


def test_trainer_emulate_fp16_reaches_the_engine():
    model = net()
    trainer = mp.Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                         level="O1", dtype="fp16", emulate_fp16=False, progress=False)
    assert trainer.engine.op_lists["emulate_fp16"] is False
    model = net()
    trainer = mp.Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                         level="O1", dtype="fp16", progress=False)
    assert trainer.engine.op_lists["emulate_fp16"] == "auto"


def test_monitor_is_keyword_only():
    monitor = mp.PrecisionMonitor()
    with pytest.raises(TypeError, match="positional"):
        lightning.MixprecPrecision("O1", "auto", "auto", None, monitor)
    assert lightning.MixprecPrecision(monitor=monitor).engine.monitor is monitor


@pytest.mark.parametrize("name", PREPARING + ["plan"])
def test_policy_with_a_level_or_dtype_beside_it_is_refused_everywhere(name, tmp_path, request):
    if name in IN_A_GROUP:
        request.getfixturevalue("group")
    given = mp.Policy.from_level("O2", "bf16")
    if name == "plan":
        call = lambda **kw: mp.parallel.plan(10 ** 6, policy=given, **kw)  # noqa: E731
    else:
        model = net()

        def call(**kw):
            build(name, model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path,
                  policy=given, **kw)
    # any value given, the entry point's own default included ("O1", or "O2" for fsdp/plan)
    defaults = {k: str(v) for k, v in at_defaults(name.partition("[")[0]).items()
                if k in ("level", "dtype")}
    cases = [({"level": "O3"}, "level='O3'"), ({"dtype": "fp16"}, "dtype='fp16'"),
             ({"level": defaults["level"]}, f"level='{defaults['level']}'"),
             ({"dtype": defaults["dtype"]}, f"dtype='{defaults['dtype']}'"),
             ({"level": "O2", "dtype": "bf16"}, "level='O2', dtype='bf16'")]
    for kw, shown in cases:
        with pytest.raises(TypeError, match=rf"got policy=O2.* and {shown}: pass either policy= "
                                            r"or level=/dtype=, not both"):
            call(**kw)
    assert issubclass(vocabulary.KeywordClash, ValueError)  # what earlier versions raised


@pytest.mark.parametrize("name", [n for n, (_, names, _) in ENTRY_POINTS.items()
                                  if "policy" in names])
def test_the_defaults_read_as_values_and_copy_as_plain_strings(name):
    """The signature's Default is the value for every reader (==, str, repr, a dict key), and
    a copy or pickle of it is the plain str (nothing of the class reaches a checkpoint)."""
    import copy
    import pickle

    entry = ENTRY_POINTS[name][0]
    for keyword in ("level", "dtype"):
        default = inspect.signature(entry).parameters[keyword].default
        plain = str(default)
        assert not vocabulary.is_given(default) and vocabulary.is_given(plain)
        assert default == plain and repr(default) == repr(plain) and {plain: 1}[default] == 1
        assert f"{default}" == plain and type(f"{default}") is str
        for copied in (pickle.loads(pickle.dumps(default)), copy.deepcopy(default)):
            assert type(copied) is str and copied == plain


def test_advise_fp8_recipe_is_a_deprecated_alias_of_fp8():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    kw = dict(formats=("bf16",))
    with pytest.warns(DeprecationWarning, match=r"fp8_recipe= is deprecated; pass fp8="):
        old = mp.advise(model, batch, F.cross_entropy, fp8_recipe="rowwise", **kw)
    assert old.fp8_recipe == "rowwise"
    assert mp.advise(model, batch, F.cross_entropy, fp8="rowwise", **kw).fp8_recipe == "rowwise"
    with pytest.raises(TypeError, match="both fp8= and its deprecated alias fp8_recipe="):
        mp.advise(model, batch, F.cross_entropy, fp8="rowwise", fp8_recipe="rowwise", **kw)


def subparser(command):
    from mixprec.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if a.choices and command in a.choices)
    return action.choices[command]


@pytest.mark.parametrize("command, names", [
    ("plan", ("level", "dtype", "reduce_dtype", "master", "state_dtype")),
    ("advise", ("level", "dtype", "fp8"))])
def test_the_cli_options_come_from_the_declaration(command, names):
    options = {a.dest: a for a in subparser(command)._actions}
    for name in names:
        keyword, action = vocabulary.KEYWORDS[name], options[name]
        assert keyword.flag in action.option_strings
        first = keyword.cli()["help"].split(" (default")[0]
        assert action.help.startswith(first), name
        if keyword.choices and name not in ("master", "dtype"):
            assert tuple(action.choices) == keyword.choices, name
    if command == "plan":
        assert set(options["master"].choices) >= {"fp32", "split", "kahan", "stochastic"}
        assert "remainder" in options["master"].help  # split's description, from the declaration


def test_the_advise_cli_takes_fp8_and_the_deprecated_fp8_recipe():
    from mixprec.commands.args import given_as

    p = subparser("advise")
    args = p.parse_args(["--fp8", "rowwise"])
    assert args.fp8 == "rowwise" and given_as(args, "fp8") == "--fp8"
    args = p.parse_args(["--fp8-recipe", "rowwise"])
    assert args.fp8 == "rowwise" and given_as(args, "fp8") == "--fp8-recipe"
    assert p.parse_args([]).fp8 == "tensorwise"
    with pytest.raises(SystemExit):
        p.parse_args(["--fp8", "rowwise", "--fp8-recipe", "tensorwise"])
