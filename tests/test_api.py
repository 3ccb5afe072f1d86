"""The public surface: every exported name imports, and the API contract's names exist."""

import inspect
import subprocess
import sys

import pytest

import mixprec as mp

# Names the public API contract promises, as `mp.<name>`.
CONTRACT = [
    "formats.get", "formats.FloatFormat", "formats.decompose", "formats.range_report",
    "Policy", "Policy.from_level", "device_capabilities", "autocast", "op_lists", "prepare",
    "policy_of", "to_float", "MasterWeightOptimizer", "fp32_state_dict", "DynamicLossScaler",
    "StaticLossScaler", "NoLossScaler", "make_loss_scaler", "NonFiniteGradientsError", "Trainer",
    "History", "debug.trace_nonfinite", "debug.op_stats", "debug.grad_report",
    "parallel.ddp", "parallel.fsdp", "parallel.world_size", "parallel.rank",
    "parallel.is_main_process", "lowbit.Float8", "lowbit.MXFP8", "lowbit.NVFP4",
]
APEX = ["initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
        "register_half_function", "register_float_function", "register_promote_function",
        "half_function", "float_function", "promote_function", "disable_casts"]


@pytest.mark.parametrize("name", mp.__all__)
def test_every_exported_name_imports(name):
    assert getattr(mp, name) is not None


@pytest.mark.parametrize("dotted", CONTRACT)
def test_contract_names_exist(dotted):
    obj = mp
    for part in dotted.split("."):
        obj = getattr(obj, part)
    assert callable(obj) or inspect.ismodule(obj)


@pytest.mark.parametrize("name", APEX)
def test_apex_compat_names_exist(name):
    from mixprec.compat import apex_amp

    assert callable(getattr(apex_amp, name))


def test_distributed_names_keep_the_contract_signatures():
    trainer = list(inspect.signature(mp.Trainer).parameters)
    assert "strategy" in trainer and "reduce_dtype" in trainer
    assert inspect.signature(mp.Trainer).parameters["strategy"].default == "auto"
    assert inspect.signature(mp.Trainer).parameters["reduce_dtype"].default == "fp32"
    ddp = inspect.signature(mp.parallel.ddp).parameters
    assert list(ddp)[:2] == ["model", "reduce_dtype"] and ddp["reduce_dtype"].default == "fp32"
    assert list(inspect.signature(mp.parallel.fsdp).parameters)[:8] == [
        "model", "optimizer", "level", "dtype", "reduce_dtype", "units", "mesh", "keep_fp32"]


def test_apex_initialize_and_scale_loss_keep_apex_signatures():
    from mixprec.compat import apex_amp

    assert list(inspect.signature(apex_amp.initialize).parameters) == [
        "models", "optimizers", "enabled", "opt_level", "cast_model_type",
        "patch_torch_functions", "keep_batchnorm_fp32", "master_weights", "loss_scale",
        "cast_model_outputs", "num_losses", "verbosity", "min_loss_scale", "max_loss_scale",
        "dtype"]
    assert list(inspect.signature(apex_amp.scale_loss).parameters) == [
        "loss", "optimizers", "loss_id", "model", "delay_unscale", "delay_overflow_check"]


@pytest.mark.parametrize("cls,params", [
    (mp.DynamicLossScaler, ["init_scale", "growth_factor", "backoff_factor", "growth_interval",
                            "hysteresis", "min_scale", "max_scale", "max_skips_at_min",
                            "process_group", "enabled"]),
    (mp.StaticLossScaler, ["scale", "skip_on_overflow"]),
    (mp.Trainer, ["model", "loss_fn", "optimizer", "level", "dtype", "loss_scale", "metrics",
                  "scheduler", "grad_accum_steps", "max_grad_norm", "device", "callbacks"]),
])
def test_contract_signatures(cls, params):
    assert params == [p for p in inspect.signature(cls).parameters][:len(params)]


@pytest.mark.parametrize("fn,params", [
    (mp.autocast, ["dtype", "enabled", "device_type", "low_precision_ops", "fp32_ops",
                   "cache_enabled"]),
    (mp.prepare, ["model", "optimizer", "level", "dtype", "keep_fp32"]),
])
def test_contract_keywords(fn, params):
    assert params == [p for p in inspect.signature(fn).parameters][:len(params)]


def test_import_is_light_and_clean():
    """`import mixprec` neither warns nor pulls in the plotting or data stacks."""
    code = ("import sys, warnings; warnings.simplefilter('error'); import mixprec; "
            "print(sorted(m for m in ('matplotlib', 'sklearn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-W", "ignore::UserWarning:torch", "-c", code],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
