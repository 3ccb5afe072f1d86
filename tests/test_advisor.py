"""The precision advisor: planted cases it must find (and the neighbours it must not flag), the
policy it advises, sound defaults on real models, the model left untouched, its FP8 emulation
against torchao, and the ``mixprec advise`` command."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec import cli
from mixprec.advisor.planted import outlier_case, overflow_case
from mixprec.benchmodels import get_model
from mixprec.commands.demo import DigitsCNN, digits_data
from mixprec.lowbit.fp8sim import fp8_matmul

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")


def overflow_net():
    return overflow_case()[0]


def outlier_net():
    return outlier_case()[0]


def test_a_layer_past_fp16_max_is_unsafe_in_fp16_only_and_the_advised_policy_stays_finite():
    x, y = overflow_case()[1]
    advice = mp.advise(overflow_net(), (x, y), F.cross_entropy)
    assert advice.unsafe("fp16") == ["2", "3"]  # its output, and the norm reading it
    assert advice.unsafe("bf16") == []
    assert "output overflow" in advice.reasons("fp16")["2"]
    assert "input overflow" in advice.reasons("fp16")["3"]
    policy = advice.policy("O2", "fp16")
    assert advice.precision_map("fp16") == mp.PrecisionMap({"2": "fp32", "3": "fp32"})
    assert policy.modules == mp.PrecisionMap({mp.NormLayer: "fp32", "2": "fp32", "3": "fp32"})
    plain = mp.prepare(overflow_net(), level="O2", dtype="fp16")
    advised = mp.prepare(overflow_net(), policy=policy)
    assert not torch.isfinite(plain(x)).all()
    assert torch.isfinite(advised(x)).all()


def test_a_layer_reading_an_outlier_feature_is_unsafe_in_fp8_its_neighbours_are_not():
    advice = mp.advise(outlier_net(), outlier_case()[1], F.cross_entropy)
    assert advice.unsafe("fp8_e4m3") == ["2"]
    assert "input underflow" in advice.reasons("fp8_e4m3")["2"]
    assert advice.unsafe("bf16") == []
    policy = advice.policy("O2", "bf16", fp8="tensorwise")
    assert policy.fp8 == "tensorwise" and policy.fp8_modules == ("0", "4")  # 6: 10 outputs


def test_the_model_is_left_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout(0.3),
                          nn.Flatten(), nn.Linear(16 * 36, 10))
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    F.cross_entropy(model(x), y).backward()  # gradients the user already has
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    first = mp.advise(model, (x, y), F.cross_entropy)
    second = mp.advise(model, (x, y), F.cross_entropy)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    assert torch.equal(rng, torch.get_rng_state()) and model.training
    for a in (first, second):  # dropout drew the same masks in every pass: same numbers
        a.cost.clear()
    assert first.to_dict() == second.to_dict()


def test_table_ranking_plot_and_dict(tmp_path):
    pytest.importorskip("matplotlib")
    advice = mp.advise(outlier_net(), outlier_case()[1], F.cross_entropy, ablation=True)
    rows = advice.table().splitlines()
    assert rows[1].startswith("2 ")  # the most sensitive layer in FP8 first
    assert "fp8 unsafe: 2: input underflow" in advice.table()
    assert advice.ranking("fp8_e4m3")[0] == "2"
    layer = advice.layers[0]
    assert layer.measurements["bf16"].measured_loss_change is not None
    data = json.loads(json.dumps(advice.to_dict()))
    assert data["formats"] == ["bf16", "fp16", "fp8_e4m3"] and len(data["layers"]) == 4
    assert data["cost"]["full_passes"] == 1 and data["cost"]["ablation_forwards"] == 12
    assert advice.plot(tmp_path / "advice.png").stat().st_size > 1000


def test_estimated_loss_changes_rank_like_measured_ones():
    bm = get_model("transformer", width=32, depth=1, seq_len=16, batch=4)
    torch.manual_seed(0)
    advice = mp.advise(bm.build(), bm.batch(torch.Generator().manual_seed(0)), bm.loss_fn,
                       formats=("bf16",), ablation=True)
    est = torch.tensor([a.measurements["bf16"].loss_change for a in advice.layers])
    got = torch.tensor([a.measurements["bf16"].measured_loss_change for a in advice.layers])
    rank = lambda t: t.argsort().argsort().float()  # noqa: E731
    rho = torch.corrcoef(torch.stack([rank(est), rank(got)]))[0, 1]
    assert rho > 0.9


def test_policy_arguments_and_errors():
    advice = mp.advise(outlier_net(), outlier_case()[1], F.cross_entropy, formats=("bf16",))
    assert advice.policy("O1", "bf16") == mp.Policy.from_level("O1", "bf16")
    with pytest.raises(ValueError, match="not 'fp16'"):
        advice.policy("O2", "fp16")
    with pytest.raises(ValueError, match="not 'fp8_e4m3'"):
        advice.policy("O2", "bf16", fp8="tensorwise")
    with pytest.raises(ValueError, match="formats must be"):
        mp.advise(outlier_net(), outlier_case()[1], F.cross_entropy, formats=("int8",))
    with pytest.raises(ValueError, match="not layers of the model"):
        mp.advise(outlier_net(), outlier_case()[1], F.cross_entropy, layers=["1"])
    with pytest.raises(ValueError, match="before mp.prepare"):
        mp.advise(mp.prepare(outlier_net(), level="O2", dtype="bf16"), outlier_case()[1],
                  F.cross_entropy)


def test_no_layer_of_the_demo_cnn_is_unsafe_in_bf16():
    pytest.importorskip("sklearn")
    train, _ = digits_data()
    x, y = train.tensors[0][:64], train.tensors[1][:64]
    advice = mp.advise(DigitsCNN(width=16), (x, y), F.cross_entropy)
    assert advice.unsafe("bf16") == [] and advice.unsafe("fp16") == []
    assert len(advice.layers) == 7 and advice.skipped == {}


def test_no_layer_of_gpt2_is_unsafe_in_any_format():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 64))
    advice = mp.advise(transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids})
    assert {f: advice.unsafe(f) for f in advice.formats} == {f: [] for f in advice.formats}
    kinds = {a.kind for a in advice.layers}
    assert {"Conv1D", "Embedding", "LayerNorm", "Linear"} == kinds
    assert sum(a.fp8_eligible for a in advice.layers) == 9  # 8 Conv1D and the head


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_fp8_emulation_is_torchaos_gemm(recipe):
    pytest.importorskip("torchao.float8")
    model = mp.prepare(nn.Sequential(nn.Linear(32, 64)), level="O0", fp8=recipe,
                       fp8_modules=["0"])
    x = torch.randn(16, 32, requires_grad=True)
    x_sim = x.detach().clone().requires_grad_(True)
    w_sim = model[0].weight.detach().clone().requires_grad_(True)
    g = torch.randn(16, 64)
    model(x).backward(g)
    (fp8_matmul(x_sim, w_sim.t(), recipe) + model[0].bias.detach()).backward(g)
    tol = dict(rtol=2.0 ** -7, atol=1e-4) if recipe == "rowwise" else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[0].weight.grad, w_sim.grad, **tol)
    torch.testing.assert_close(x.grad, x_sim.grad, **tol)


def test_the_advise_command(capsys):
    code = cli.main(["advise", "--model", "transformer", "--width", "32", "--depth", "1",
                     "--seq-len", "16", "--batch", "2", "--train-steps", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["model"] == "transformer" and len(out["layers"]) == 10
    if not torch.cuda.is_available():  # FP8 measured, and not advised where it is emulated
        assert out["policy"]["fp8"] is None and out["fp8_advice"]["layers"] == []
    code = cli.main(["advise", "--model", "nine-linear", "--width", "16", "--depth", "3",
                     "--batch", "4", "--formats", "bf16", "--train-steps", "1"])
    text = capsys.readouterr().out
    assert code == 0 and "advised policy: O2(" in text and "cost: 1 full" in text
    code = cli.main(["advise", "--model", "planted-overflow", "--formats", "bf16,fp16"])
    text = capsys.readouterr().out
    assert code == 0 and "fp16 unsafe: 2: output overflow" in text
    assert "advised policy: O2(params=bf16" in text  # bf16: nothing to keep in fp32
    assert cli.main(["advise", "--model", "planted-overflow", "--dtype", "fp16"]) == 0
    assert "modules=[2:fp32,3:fp32]" in capsys.readouterr().out
    assert cli.main(["advise", "--formats", "int8"]) == 2
    assert "--formats takes" in capsys.readouterr().err
    # a planted case is built at its own size: a size flag was ignored without a word
    assert cli.main(["advise", "--model", "planted-overflow", "--width", "16"]) == 2
    assert "planted-overflow is built at its own size: --width applies to the bench models" \
        in capsys.readouterr().err


def _fp8_net_advice():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 16))
    x, y = torch.randn(32, 64), torch.randint(0, 16, (32,))
    return mp.advise(net, (x, y), F.cross_entropy, formats=("bf16", "fp8_e4m3"))


def test_fp8_is_advised_only_where_it_gains(monkeypatch):
    advice = _fp8_net_advice()
    layers, why = advice.fp8_gains("cpu")
    assert layers == [] and "FP8 is emulated on a CPU: slower than bf16" in why
    layers, why = advice.fp8_gains("cuda-sm90")  # 64 wide, 32 tokens: casts dominate
    assert layers == [] and "no layer is large enough to gain from FP8 on cuda-sm90" in why
    # a layer estimated faster (shapes imposed): it alone runs FP8, the others stay out
    monkeypatch.setattr(mp.fp8.speed, "estimate",
                        lambda k, n, device, tokens: 1.4 if n == 16 else 0.3)
    layers, why = advice.fp8_gains("cuda-sm90")
    assert layers == ["4"] and why.startswith("1 of 3 layers that can take FP8 safely")
    policy = advice.policy("O2", "bf16", fp8="tensorwise", fp8_layers=layers)
    assert [k for k, v in policy.modules.items() if v.lowbit is not None] == ["4"]
    assert {k: str(v.gemm) for k, v in policy.modules.items() if k in ("0", "2")} == {
        "0": "off", "2": "off"}


def test_the_advise_command_advises_no_fp8_on_the_cpu_and_takes_dtype_auto(capsys, monkeypatch):
    from mixprec import hardware
    monkeypatch.delenv("MIXPRECISION_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(hardware, "cpu_gemm_probe", lambda: {  # bf16 measured slower
        "fp32_gflops": 80.0, "bf16_gflops": 40.0, "ratio": 0.5, "shape": [1024, 1024, 1024]})
    args = ["advise", "--model", "planted-overflow", "--formats", "bf16,fp8_e4m3",
            "--target", "cpu"]
    assert cli.main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"]["fp8"] is None and out["fp8_advice"]["target"] == "cpu"
    assert "emulated" in out["fp8_advice"]["why"]
    assert cli.main([*args, "--dtype", "auto"]) == 0
    text = capsys.readouterr().out
    assert "--dtype auto -> fp32 on cpu:" in text and "(0.50x)" in text
    assert "FP8 on cpu: FP8 is emulated on a CPU" in text
    assert "advised policy: O2(params=fp32,compute=fp32" in text and "fp8=" not in text
    monkeypatch.setattr(hardware, "cpu_gemm_probe", lambda: {
        "fp32_gflops": 80.0, "bf16_gflops": 400.0, "ratio": 5.0, "shape": [1024, 1024, 1024]})
    assert cli.main([*args, "--dtype", "auto"]) == 0
    assert "advised policy: O2(params=bf16" in capsys.readouterr().out
    assert cli.main(["advise", "--model", "planted-overflow", "--formats", "fp16",
                     "--dtype", "auto", "--target", "cpu"]) == 2
    assert "--dtype auto is bf16 on cpu" in capsys.readouterr().err


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_batch_holding_inf_or_nan_is_refused(bad):
    x, y = overflow_case()[1]
    x = x.clone()
    x[5, 3] = bad
    with pytest.raises(ValueError, match=r"inf or NaN values \(input 0\)"):
        mp.advise(overflow_net(), (x, y), F.cross_entropy)
    with pytest.raises(ValueError, match=r"inf or NaN values \(input 'x'\)"):
        mp.advise(KwargNet(), {"x": x}, lambda out, _: out.sum())


def test_a_frozen_layer_is_measured_as_a_trainable_one():
    """A frozen layer (a backbone, an embedding) gets its output gradient measured too: its
    first-order loss change read 0 in every format, and its gradient ranges went unchecked."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model[0].requires_grad_(False)
    batch = (torch.randn(64, 16), torch.randint(0, 4, (64,)))
    frozen = mp.advise(model, batch, F.cross_entropy).to_dict()["layers"][0]["formats"]
    for fmt in ("bf16", "fp16"):
        assert frozen[fmt]["loss_change"] > 1e-7
        assert frozen[fmt]["amax"]["grad_output"] > 0
    assert not model[0].weight.requires_grad and model[0].weight.grad is None


def test_a_model_whose_fp32_loss_is_not_finite_is_refused():
    """exp of a large activation overflows in fp32 itself: no format is to blame (every layer
    was reported unsafe, and the advised policy, fp32 for both, fixed nothing)."""
    class Overflowing(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(torch.exp(self.a(x) * 200))

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"fp32 loss on this batch is nan.*trace_nonfinite"):
        mp.advise(Overflowing(), (torch.randn(4, 8), torch.randint(0, 2, (4,))), F.cross_entropy)


class KwargNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        return self.lin(x)


def test_an_empty_batch_and_a_model_without_parameters_are_refused():
    x, y = overflow_case()[1]
    with pytest.raises(ValueError, match=r"empty tensor \(input 0 of shape \(0, 16\), target"):
        mp.advise(overflow_net(), (x[:0], y[:0]), F.cross_entropy)
    with pytest.raises(ValueError, match="ReLU has no parameters"):
        mp.advise(nn.ReLU(), (x, y), F.cross_entropy)
    frozen = overflow_net().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter of this Sequential requires grad"):
        mp.advise(frozen, (x, y), F.cross_entropy)


def test_mxfp8_as_fp8_and_an_unknown_format_say_what_to_write():
    """fp8="mxfp8" names a format of its own here (it was refused as an unknown Float8
    recipe); a format no advice can hold is not suggested as one to measure."""
    batch = outlier_case()[1]
    for fmt in ("mxfp8", "nvfp4"):
        with pytest.raises(ValueError, match=f"measure it with formats=\\(..., '{fmt}'\\)"):
            mp.advise(outlier_net(), batch, F.cross_entropy, fp8=fmt)
    advice = mp.advise(outlier_net(), batch, F.cross_entropy, formats=("bf16",))
    with pytest.raises(ValueError, match="unknown format 'fp7'.*mp.advise measures any of"):
        advice.unsafe("fp7")
    with pytest.raises(ValueError, match=r"formats=\(..., 'fp16'\)"):
        advice.unsafe("fp16")


def test_a_policy_takes_only_the_fp8_recipe_that_was_measured():
    batch = outlier_case()[1]
    tensorwise = mp.advise(outlier_net(), batch, F.cross_entropy, formats=("bf16", "fp8_e4m3"))
    with pytest.raises(ValueError, match="measured the 'tensorwise' recipe.*fp8='rowwise'"):
        tensorwise.policy("O2", "bf16", fp8="rowwise")
    assert tensorwise.policy("O2", "bf16", fp8="tensorwise").fp8 == "tensorwise"
    rowwise = mp.advise(outlier_net(), batch, F.cross_entropy, formats=("bf16", "fp8_e4m3"),
                        fp8="rowwise")
    assert rowwise.policy("O2", "bf16", fp8="rowwise_gw_hp").fp8 == "rowwise_gw_hp"
    with pytest.raises(ValueError, match="measured the 'rowwise' recipe"):
        rowwise.policy("O2", "bf16", fp8="tensorwise")


def test_the_advise_command_refuses_bad_options_before_measuring(capsys, tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr("mixprec.commands.advise.advise",
                        lambda *a, **k: measured.append(1))  # never reached
    missing = tmp_path / "no-such-dir" / "advice.png"
    assert cli.main(["advise", "--model", "planted-overflow", "--plot", str(missing)]) == 2
    assert f"the directory {missing.parent} does not exist" in capsys.readouterr().err
    # a directory: the chart went to <dir>.png beside it, and nothing said so
    assert cli.main(["advise", "--model", "planted-overflow", "--plot", str(tmp_path)]) == 2
    assert "is a directory; give the chart's file name" in capsys.readouterr().err
    # a format matplotlib cannot write, and a file where the folder should be: after the
    # measurement they were a traceback or a wrong reason
    assert cli.main(["advise", "--model", "planted-overflow", "--plot",
                     str(tmp_path / "advice.txt")]) == 2
    assert "matplotlib writes png" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert cli.main(["advise", "--model", "planted-overflow", "--plot",
                     str(tmp_path / "afile" / "advice.png")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli.main(["advise", "--model", "transformer", "--seq-len", "100000"]) == 2
    assert "seq_len must be at most 1024, the positions the transformer model has" in \
        capsys.readouterr().err
    assert cli.main(["advise", "--model", "gpt9"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt9'" in err
    assert all(name in err for name in ("nine-linear", "convnet", "transformer",
                                        "planted-overflow", "planted-outlier"))
    assert measured == []


# -- the loss scale fp16 gradients are judged at -----------------------------------------------
def test_fp16_loss_scale_is_where_dynamic_scaling_settles():
    from mixprec.advisor.measure import loss_scale_for
    fmax = torch.finfo(torch.float16).max
    assert loss_scale_for("fp16", 1.0, "auto") == 2.0 ** 15  # 2^16 would overflow
    assert loss_scale_for("fp16", 3.0, "auto") == 2.0 ** 14
    assert loss_scale_for("fp16", fmax / 2.0 ** 20, "auto") == 2.0 ** 20  # exactly fits
    assert loss_scale_for("fp16", fmax / 2.0 ** 20 * 1.001, "auto") == 2.0 ** 19
    assert loss_scale_for("fp16", 1e-9, "auto") == 2.0 ** 24  # the scaler's max_scale
    assert loss_scale_for("fp16", 0.0, "auto") == 2.0 ** 24
    assert loss_scale_for("fp16", 1e-9, 1024) == 1024.0 and loss_scale_for("bf16", 1.0, "auto") == 1


def test_a_scale_above_the_start_says_how_long_the_scaler_takes_to_reach_it():
    """Judged at 2^19, layers read safe that lose a third of their gradients for the run's
    first thousands of steps (a default scaler starts at 2^16 and doubles every 2000 clean
    steps): the table line says so, and how to judge the start."""
    from mixprec.advisor.measure import describe_scale
    line = describe_scale("auto", 2.0 ** 19)
    assert "judged at loss scale 2^19" in line
    assert "starts at 2^16 and doubles every 2000 clean steps" in line
    assert "after about 6000 steps" in line and "loss_scale=2.**16 judges the start" in line
    assert "starts at" not in describe_scale("auto", 2.0 ** 15)  # below the start: as trained
    assert "starts at" not in describe_scale(2.0 ** 20, 2.0 ** 20)


def test_a_small_bert_is_judged_at_the_scale_dynamic_scaling_reaches():
    """At a fixed 2^16 ~1.5% of two attention key layers' weight gradients flush in fp16 (the
    1% limit flags them); dynamic scaling grows past 2^16 when nothing overflows, and there
    they don't."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=64, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 512, (8, 32), generator=g),
             "labels": torch.randint(0, 2, (8,), generator=g)}
    fixed = mp.advise(model, batch, formats=("fp16",), loss_scale=2.0 ** 16)
    keys = [f"bert.encoder.layer.{i}.attention.self.key" for i in range(2)]
    assert fixed.unsafe("fp16") == keys
    assert all("weight_grad underflow" in why and "at loss scale 65536" in why
               for why in fixed.reasons("fp16").values())
    assert "judged at the fixed loss scale 2^16" in fixed.table()
    auto = mp.advise(model, batch, formats=("fp16",))
    scale = auto.loss_scales["fp16"]
    assert 2.0 ** 16 < scale <= 2.0 ** 24 and auto.unsafe("fp16") == []
    peaks = [m.amax[r] for a in auto.layers for m in a.measurements.values()
             for r in ("grad_output", "weight_grad") if r in m.amax]
    fmax = torch.finfo(torch.float16).max
    assert max(peaks) <= fmax < 2 * max(peaks) or scale == 2.0 ** 24  # the largest that fits
    assert f"judged at loss scale 2^{int(torch.log2(torch.tensor(scale)))} (dynamic" in \
        auto.table()
