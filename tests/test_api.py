"""The public surface: ``mp.__all__`` is the contract's names (and ``AveragedModel``, beyond
it), and each of them resolves."""

import inspect
import subprocess
import sys

import pytest

import mixprec as mp

#: ``mp.__all__``, as the API contract names it.
PUBLIC = {
    "__version__",
    "device_capabilities", "SlowDtypeWarning", "Policy", "PrecisionMap", "Precision",
    "NormLayer", "is_norm_layer", "prepare", "policy_of", "MixedPrecision", "to_float",
    "activation_checkpoint",
    "fp8_modules", "lowbit", "masters",
    "autocast", "op_lists", "OpListWarning",
    "MasterWeightOptimizer", "CompactMasterOptimizer", "fp32_state_dict", "bytes_per_parameter",
    "AveragedModel",
    "DynamicLossScaler", "StaticLossScaler", "NoLossScaler", "make_loss_scaler",
    "NonFiniteGradientsError",
    "Trainer", "History", "Callback", "LossMonitor", "FP8Monitor", "ModelCheckpoint", "Accuracy",
    "advise", "Advice", "formats", "debug",
    "PrecisionMonitor", "monitor", "emulate_fp16",
    "parallel", "convert_checkpoint",
}
#: Names in the subpackages the contract promises, as ``mp.<dotted name>``.
CONTRACT = [
    "formats.get", "formats.FloatFormat", "formats.decompose", "formats.range_report",
    "Policy.from_level", "debug.trace_nonfinite", "debug.op_stats", "debug.grad_report",
    "parallel.ddp", "parallel.fsdp", "parallel.world_size", "parallel.rank",
    "parallel.is_main_process", "lowbit.Float8", "lowbit.MXFP8", "lowbit.NVFP4",
]
APEX = ["initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
        "register_half_function", "register_float_function", "register_promote_function",
        "half_function", "float_function", "promote_function", "disable_casts"]


def resolve(root, dotted: str):
    for part in dotted.split("."):
        root = getattr(root, part)
    return root


def test_the_public_names_are_the_contracts_and_each_resolves():
    """``dir(mp)`` is ``__all__``; each exported name (the lazy ones too) and each promised
    subpackage name is a class, a function or a module; the apex facade keeps apex's
    functions."""
    from mixprec.compat import apex_amp

    assert sorted(mp.__all__) == sorted(PUBLIC) == dir(mp)  # no submodule or helper shown
    assert isinstance(mp.__version__, str)
    for dotted in sorted(PUBLIC - {"__version__"}) + CONTRACT:
        obj = resolve(mp, dotted)
        assert callable(obj) or inspect.ismodule(obj), dotted
    for name in APEX:
        assert callable(getattr(apex_amp, name)), name


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


@pytest.mark.parametrize("entry,params", [
    (mp.DynamicLossScaler, ["init_scale", "growth_factor", "backoff_factor", "growth_interval",
                            "hysteresis", "min_scale", "max_scale", "max_skips_at_min",
                            "process_group", "enabled"]),
    (mp.StaticLossScaler, ["scale", "skip_on_overflow"]),
    (mp.Trainer, ["model", "loss_fn", "optimizer", "level", "dtype", "loss_scale", "metrics",
                  "scheduler", "grad_accum_steps", "max_grad_norm", "device", "callbacks"]),
    (mp.autocast, ["dtype", "enabled", "device_type", "low_precision_ops", "fp32_ops",
                   "cache_enabled"]),
    (mp.prepare, ["model", "optimizer", "level", "dtype", "keep_fp32"]),
], ids=lambda v: getattr(v, "__name__", None))
def test_contract_signatures(entry, params):
    """The contract's leading parameters, in order (the keywords' defaults and texts:
    tests/test_vocabulary.py)."""
    assert params == list(inspect.signature(entry).parameters)[:len(params)]


def test_import_is_light_and_clean():
    """`import mixprec` neither warns nor pulls in the plotting or data stacks."""
    code = ("import sys, warnings; warnings.simplefilter('error'); import mixprec; "
            "print(sorted(m for m in ('matplotlib', 'sklearn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-W", "ignore::UserWarning:torch", "-c", code],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
