"""apex's ``amp`` API on mixprec: change ``from apex import amp`` into
``from mixprec.compat import apex_amp as amp`` and the rest of an apex script runs unchanged.

* :func:`initialize` takes apex's arguments, defaults, O0-O3 table, overrides and errors
  (:mod:`mixprec.compat.apex_options`); models are prepared through a
  :class:`mixprec.MixedPrecision` engine (:mod:`mixprec.compat.apex_models`), O1 runs each
  returned model's forward under :class:`mixprec.autocast` with apex's own op lists
  (:mod:`mixprec.compat.apex_casts`, :mod:`mixprec.compat.apex_lists`), and optimizers come back
  as :class:`~mixprec.compat.apex_optimizer.AmpOptimizer` (fp32 masters at O2).
* :func:`scale_loss` scales, unscales, checks and skips as apex did, one loss scaler per
  ``loss_id`` (:mod:`mixprec.compat.apex_session`, :mod:`mixprec.compat.apex_scaler`).
* :func:`state_dict` / :func:`load_state_dict` use apex's format; models'
  ``state_dict()`` is fp32 at every level; the O2 masters travel in the optimizer's state_dict.

apex's API is global (``amp.state_dict()`` names no session): the session of the last
:func:`initialize` and the ``register_*_function`` registrations live in one object,
:data:`mixprec.compat.apex_state.AMP`.

Nothing in torch is patched: casts are active inside the forward of the models ``initialize``
returned (apex patched ``torch.*`` globally), so a loss computed outside the model runs in the
dtype of its inputs. Works on CPU and CUDA; ``dtype="bf16"`` (an extension) trains in bf16.

Example:
    >>> import torch
    >>> from mixprec.compat import apex_amp as amp
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> model, opt = amp.initialize(model, opt, opt_level="O2", dtype="bf16", verbosity=0)
    >>> loss = model(torch.randn(8, 4)).pow(2).mean()
    >>> with amp.scale_loss(loss, opt) as scaled_loss:
    ...     scaled_loss.backward()
    >>> opt.step()
    >>> model.weight.dtype, model.state_dict()["weight"].dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from . import apex_casts
from .apex_optimizer import AmpOptimizer
from .apex_options import check_dtype, resolve_properties
from .apex_session import AmpSession, open_session
from .apex_state import AMP

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "register_half_function", "register_float_function", "register_promote_function",
    "half_function", "float_function", "promote_function", "disable_casts", "AmpOptimizer",
]


# -- initialize ---------------------------------------------------------------------------------
def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale=None, cast_model_outputs=None, num_losses=1, verbosity=1,
               min_loss_scale=None, max_loss_scale=2.**24, *, dtype="fp16"):
    """Set models and optimizers up for an apex ``opt_level`` (apex's signature and defaults).

    ======  ==============  =========================  ==========  =======  ==========
    level   cast_model_type patch_torch_functions      keep_bn     masters  loss_scale
    ======  ==============  =========================  ==========  =======  ==========
    O0      fp32            no                         None        no       1.0
    O1      None            yes (apex's op lists)      None        None     "dynamic"
    O2      fp16            no                         True        yes      "dynamic"
    O3      fp16            no                         False       no       1.0
    ======  ==============  =========================  ==========  =======  ==========

    Any property keyword that is not None overrides the level's value. Models are cast in place
    (their floating inputs cast to ``cast_model_type`` at entry, outputs to fp32 or
    ``cast_model_outputs``); their ``state_dict()`` is fp32 at every level. Call it once, after
    building models and optimizers and before wrapping models in DistributedDataParallel.

    Args:
        models: an ``nn.Module`` or a list of them (fp32, not wrapped in DataParallel).
        optimizers: a ``torch.optim.Optimizer``, a list of them, or None (inference).
        enabled: False returns ``models`` (and ``optimizers``) unchanged and makes
            :func:`scale_loss` a no-op.
        opt_level: "O0", "O1", "O2" or "O3" (the capital letter O).
        cast_model_type: override: a torch dtype the models are cast to, or False (no cast).
        patch_torch_functions: override: run the forward under apex's O1 op lists.
        keep_batchnorm_fp32: override: True/False or the strings "True"/"False".
        master_weights: override: fp32 master weights in the optimizers.
        loss_scale: override: a number, a numeric string such as "128.0", or "dynamic".
        cast_model_outputs: a dtype the models' floating outputs are cast to at any level.
        num_losses: independent loss scalers, chosen by ``scale_loss(..., loss_id=i)``.
        verbosity: 0 silences the printed properties and the overflow messages.
        min_loss_scale: floor of the dynamic loss scale (None: no floor).
        max_loss_scale: ceiling of the dynamic loss scale (and cap of its first value 2**16).
        dtype: (mixprec extension, keyword only) the low-precision dtype of the levels:
            "fp16" (apex's) or "bf16" (for CPUs and bf16 GPUs).

    Returns:
        Shaped like the input: ``model`` or ``[models]``, and with optimizers given,
        ``(model(s), optimizer)`` or ``(model(s), [optimizers])``. Returned optimizers are
        ``torch.optim.Optimizer`` objects wrapping yours; use them (and them only) from now on.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a bad value (``num_losses`` < 1, a loss scale that is not positive, ...).
        RuntimeError: an unknown ``opt_level`` ("O4", "01", "o1"); an override that contradicts
            the level (at O1: ``cast_model_type`` fp16, ``keep_batchnorm_fp32`` or
            ``master_weights`` set; ``patch_torch_functions=True`` elsewhere); a model that is
            not fp32, wrapped in (Distributed)DataParallel, or already initialized; an
            optimizer passed to ``initialize`` before.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False; got {enabled!r}")
    if not enabled:
        AMP.session = AmpSession(enabled=False)
        return models if optimizers is None else (models, optimizers)
    model_list, models_was_list = _as_list(models, nn.Module, "models", "an nn.Module")
    opt_list, opts_was_list = ([], False) if optimizers is None else _as_list(
        optimizers, torch.optim.Optimizer, "optimizers", "a torch.optim.Optimizer")
    props = resolve_properties(opt_level, check_dtype(dtype), cast_model_type=cast_model_type,
                               patch_torch_functions=patch_torch_functions,
                               keep_batchnorm_fp32=keep_batchnorm_fp32,
                               master_weights=master_weights, loss_scale=loss_scale)
    _check_int("num_losses", num_losses, 1)
    _check_int("verbosity", verbosity, 0)
    if cast_model_outputs is not None and not (isinstance(cast_model_outputs, torch.dtype)
                                               and cast_model_outputs.is_floating_point):
        raise TypeError(f"cast_model_outputs must be a floating torch dtype or None; "
                        f"got {cast_model_outputs!r}")
    AMP.session, amp_opts = open_session(
        model_list, opt_list, props, cast_model_outputs=cast_model_outputs,
        num_losses=num_losses, verbosity=verbosity, min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale)
    out_models = model_list if models_was_list else model_list[0]
    if opts_was_list:
        return out_models, amp_opts
    return out_models if not amp_opts else (out_models, amp_opts[0])


def _as_list(value, kind: type, what: str, one: str) -> tuple[list, bool]:
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, list) and all(isinstance(v, kind) for v in value):
        if len({id(v) for v in value}) != len(value):
            raise RuntimeError(f"the same object appears twice in {what}")
        return list(value), True
    got = (f"a list holding {sorted({type(v).__name__ for v in value})}"
           if isinstance(value, list) else type(value).__name__)
    raise TypeError(f"{what} must be either {one} or a list of them; got {got}")


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer; got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")


# -- scale_loss -------------------------------------------------------------------------------
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False):
    """Yield ``loss.float() * scale``; on exit unscale, check for inf/NaN and update the scale.

    ``with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`` replaces
    ``loss.backward()``. On exit the gradients of ``optimizers`` are unscaled (at O2 into their
    fp32 master gradients; the low-precision model gradients keep the scale), so clipping
    ``amp.master_params(optimizer)`` after the block clips the true gradients. With a dynamic
    scale an inf/NaN gradient halves this ``loss_id``'s scale and makes the next ``step()`` of
    exactly these optimizers a no-op; 2000 clean exits in a row double it. A fixed scale never
    skips. Without master weights and with a fixed scale of 1 (O0, O3) it yields
    ``loss.float()`` and does nothing else.

    Host syncs: none here; each optimizer's ``step()`` reads the overflow flags once.

    Args:
        loss: the loss tensor (``loss.float()`` is scaled, so it may have several elements).
        optimizers: the optimizer, or a list of the optimizers, returned by :func:`initialize`
            for which this backward produces gradients.
        loss_id: which of the ``num_losses`` loss scalers to use.
        model: unused (apex reserved it).
        delay_unscale: leave the gradients scaled (no unscale, no check, no update): gradient
            accumulation over several blocks, the last of which has ``delay_unscale=False``;
            ``step()`` must wait for that one.
        delay_overflow_check: unscale, but neither check for inf/NaN nor update the scale
            (apex's hook for sync-free fused optimizers): an overflow is then not skipped.

    Raises:
        RuntimeError: :func:`initialize` has not been called.
        TypeError: ``optimizers`` are not the ones :func:`initialize` returned, or a bad type.
        ValueError: ``loss_id`` outside ``[0, num_losses)``.
    """
    return AMP.current("amp.scale_loss").scale_loss(loss, optimizers, loss_id, model,
                                                   delay_unscale, delay_overflow_check)


def master_params(optimizer):
    """Iterate over the tensors ``optimizer`` steps: the fp32 masters at O2, else the params.

    ``torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)`` after the
    ``scale_loss`` block clips the unscaled gradients the step will use.
    """
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(f"master_params expects an optimizer returned by amp.initialize; got "
                        f"{type(optimizer).__name__}")
    for group in optimizer.param_groups:
        yield from group["params"]


# -- checkpoints -------------------------------------------------------------------------------
def state_dict(destination=None) -> OrderedDict:
    """The loss scalers in apex's format: ``{"loss_scaler0": {"loss_scale", "unskipped"}, ...}``.

    Save it next to ``model.state_dict()`` and ``optimizer.state_dict()`` (apex's recipe); load
    all three after :func:`initialize`. A host sync per scaler.
    """
    return AMP.current("amp.state_dict").state_dict(destination)


def load_state_dict(state_dict) -> None:
    """Restore the loss scalers from :func:`state_dict` (apex's format), in order.

    A different number of entries than ``num_losses`` warns; extra entries are ignored.

    Raises:
        RuntimeError: a key without "loss_scaler" in it (apex's error).
        TypeError, ValueError: an entry that is not ``{"loss_scale": float, "unskipped": int}``.
    """
    AMP.current("amp.load_state_dict").load_state_dict(state_dict)


# -- user functions: registration, decorators, disable_casts --------------------------------
def register_half_function(module, name: str) -> None:
    """Run ``module.name`` in the low-precision dtype under O1 (call before :func:`initialize`).

    A function of torch (``torch``, ``torch.nn.functional``, ``torch.Tensor``, ``torch.linalg``,
    ``torch.fft``, ``torch.special``) joins the O1 op lists, covering its function, method and
    operator forms; any other module's function is replaced by :func:`half_function` of it.

    Raises:
        ValueError: ``module`` has no attribute ``name`` (apex's error).
    """
    apex_casts.register(module, name, "low_precision")


def register_float_function(module, name: str) -> None:
    """Run ``module.name`` in fp32 under O1, e.g. ``register_float_function(torch, "sigmoid")``."""
    apex_casts.register(module, name, "fp32")


def register_promote_function(module, name: str) -> None:
    """Run ``module.name`` in the widest dtype of its floating inputs under O1."""
    apex_casts.register(module, name, "promote")


def half_function(fn):
    """Decorator: under O1, cast ``fn``'s floating tensor arguments to the low-precision dtype."""
    return apex_casts.cast_wrapper(fn, "low_precision")


def float_function(fn):
    """Decorator: under O1, cast ``fn``'s floating tensor arguments to fp32."""
    return apex_casts.cast_wrapper(fn, "fp32")


def promote_function(fn):
    """Decorator: under O1, cast ``fn``'s floating arguments to the widest of their dtypes."""
    return apex_casts.cast_wrapper(fn, "promote")


def disable_casts():
    """Inside this block, O1's op lists and the cast decorators do nothing (autocast is off)."""
    return apex_casts.disable_casts()
