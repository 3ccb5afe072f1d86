"""apex's ``amp`` API on mixprec: change ``from apex import amp`` into
``from mixprec.compat import apex_amp as amp`` and the rest of an apex script runs unchanged.

* :func:`initialize` takes apex's arguments, defaults, O0-O3 table, overrides and errors
  (:mod:`mixprec.compat.apex_options`); models are cast through :func:`mixprec.prepare`, O1 runs
  each returned model's forward under :class:`mixprec.autocast` with apex's own op lists
  (:mod:`mixprec.compat.apex_lists`), and optimizers come back as
  :class:`~mixprec.compat.apex_optimizer.AmpOptimizer` (fp32 masters at O2).
* :func:`scale_loss` scales, unscales, checks and skips as apex did, one loss scaler per
  ``loss_id`` (:mod:`mixprec.compat.apex_scaler`).
* :func:`state_dict` / :func:`load_state_dict` use apex's format; models'
  ``state_dict()`` is fp32 at every level; the O2 masters travel in the optimizer's state_dict.

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

import contextlib
import contextvars
import dataclasses
import functools
import warnings
import weakref
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from .. import oplists
from ..autocast import autocast, cast_floating
from ..master import is_master_optimizer
from ..policy import Policy
from ..prepare import ForwardWrapper, module_device, policy_of, prepare
from .apex_lists import APEX_O1_LISTS
from .apex_optimizer import AmpOptimizer
from .apex_options import AmpProperties, check_dtype, resolve_properties
from .apex_scaler import ApexLossScaler

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "register_half_function", "register_float_function", "register_promote_function",
    "half_function", "float_function", "promote_function", "disable_casts", "AmpOptimizer",
]

_INITIALIZED_ATTR = "_mixprec_apex_initialized"
_POLICIES = ("low_precision", "fp32", "promote")


@dataclasses.dataclass
class _AmpState:
    """What apex kept in its global ``_amp_state``: the properties and one scaler per loss."""

    enabled: bool
    properties: AmpProperties | None = None
    scalers: list[ApexLossScaler] = dataclasses.field(default_factory=list)
    verbosity: int = 1


_state: _AmpState | None = None
_seen_optimizers: weakref.WeakSet = weakref.WeakSet()
_user_lists: dict[str, str] = {}  # op name -> policy (register_*_function on torch's namespaces)
# The low-precision dtype while an O1 model's forward runs (None elsewhere, or in disable_casts).
_cast_dtype: contextvars.ContextVar = contextvars.ContextVar("apex_amp_cast_dtype", default=None)


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
    global _state
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False; got {enabled!r}")
    if not enabled:
        _state = _AmpState(enabled=False)
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
    scalers = [ApexLossScaler(props.loss_scale, min_loss_scale, max_loss_scale)
               for _ in range(num_losses)]
    _check_models(model_list)
    _check_optimizers(opt_list)
    _print(verbosity, f"mixprec apex_amp: opt_level {props.brief()}\n{props.table()}")
    originals = _fp32_originals(model_list) if props.master_weights else None
    for model in model_list:
        _set_up_model(model, props, cast_model_outputs)
    amp_opts = [AmpOptimizer(opt, bool(props.master_weights), originals, verbosity)
                for opt in opt_list]
    if props.cast_model_type and not props.master_weights:
        for opt in opt_list:  # recast state made before initialize to the parameters' dtype
            if opt.state:
                opt.load_state_dict(opt.state_dict())
    _seen_optimizers.update(opt_list)
    _state = _AmpState(True, props, scalers, verbosity)
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


def _check_models(models: list[nn.Module]) -> None:
    for model in models:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            raise RuntimeError(f"the model is wrapped in {type(model).__name__}; wrap the model "
                               f"returned by amp.initialize, not the one passed to it")
        if getattr(model, _INITIALIZED_ATTR, False) or policy_of(model) is not None:
            raise RuntimeError("this model was already set up (by amp.initialize or "
                               "mixprec.prepare); pass a fresh fp32 model")
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        for name, t in tensors:
            if t.is_floating_point() and t.dtype in (torch.float16, torch.bfloat16):
                raise RuntimeError(f"found {name} with dtype {t.dtype}; amp.initialize expects "
                                   f"an fp32 model and casts it itself at every opt_level (do "
                                   f"not call .half() on the model first)")


def _check_optimizers(optimizers: list[torch.optim.Optimizer]) -> None:
    for opt in optimizers:
        if isinstance(opt, AmpOptimizer) or opt in _seen_optimizers:
            raise RuntimeError("a given optimizer should be passed through amp.initialize only "
                               "once; build a new one for a new initialize")
        if is_master_optimizer(opt):
            raise RuntimeError("pass the plain torch optimizer: amp.initialize adds fp32 master "
                               "weights itself (master_weights=True, the O2 default)")


def _fp32_originals(models: list[nn.Module]) -> dict[torch.Tensor, torch.Tensor]:
    """Exact fp32 copies of the parameters, taken before casting (the masters start from them)."""
    return {p: p.detach().clone() for m in models for p in m.parameters()
            if p.dtype == torch.float32}


def _set_up_model(model: nn.Module, props: AmpProperties, cast_model_outputs) -> None:
    cast_type = props.cast_model_type or None
    if cast_type is not None:
        _cast_with_mixprec(model, cast_type, bool(props.keep_batchnorm_fp32))
    out_dtype = cast_model_outputs or (torch.float32 if cast_type is not None else None)
    o1 = _O1Casts(model, props.low_dtype) if props.patch_torch_functions else None
    if out_dtype is not None or o1 is not None:
        model.forward = _AmpForward(model, out_dtype, o1)
    setattr(model, _INITIALIZED_ATTR, True)


def _cast_with_mixprec(model: nn.Module, cast_type: torch.dtype, keep_batchnorm: bool) -> None:
    """apex's model cast: parameters, buffers, inputs and compute in ``cast_type``.

    Affine BatchNorm layers stay fp32 when ``keep_batchnorm`` (they read the low-precision
    activations and return them in ``cast_type``); nothing runs under autocast (every op in the
    dtype of its inputs); ``state_dict()`` is fp32. Outputs are cast by the caller.
    """
    kept = tuple(name for name, m in model.named_modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine
                 ) if keep_batchnorm else ()
    prepare(model, policy=Policy(param_dtype=cast_type, compute_dtype=cast_type,
                                 output_dtype=None, keep_fp32=kept, autocast=False,
                                 cast_inputs=True))


class _AmpForward(ForwardWrapper):
    """Replaces ``model.forward``: run the forward it replaced under apex's O1 lists (if
    asked), cast the floating outputs to ``out_dtype`` (if given)."""

    def __init__(self, module: nn.Module, out_dtype, o1: _O1Casts | None):
        super().__init__(module)
        self.out_dtype = out_dtype
        self.o1 = o1

    def __call__(self, *args, **kwargs):
        if self.o1 is None:
            out = self.call_inner(*args, **kwargs)
        else:
            out = self.o1.run(self.call_inner, args, kwargs)
        return out if self.out_dtype is None else cast_floating(out, self.out_dtype)


def _o1_lists() -> dict[str, tuple[str, ...]]:
    """apex's O1 lists with the ``register_*_function`` names moved to their lists."""
    lists = {k: [n for n in v if n not in _user_lists] for k, v in APEX_O1_LISTS.items()}
    for name, policy in _user_lists.items():
        lists[policy].append(name)
    return {k: tuple(v) for k, v in lists.items()}


class _O1Casts:
    """apex's O1 for one model: its lists through mp.autocast on the model's device, and the
    cast decorators switched on, while the forward runs."""

    def __init__(self, model: nn.Module, low_dtype: torch.dtype):
        self.low_dtype = low_dtype
        self.device_type = module_device(model).type
        lists = _o1_lists()
        self.context = autocast(low_dtype, device_type=self.device_type, extend_defaults=False,
                                low_precision_ops=lists["low_precision"], fp32_ops=lists["fp32"],
                                promote_ops=lists["promote"]).context

    def run(self, fn, args: tuple, kwargs: dict):
        token = _cast_dtype.set(self.low_dtype)
        try:
            return self.context.run(fn, args, kwargs)
        finally:
            _cast_dtype.reset(token)


def _print(verbosity: int, message: str) -> None:
    dist = torch.distributed
    if verbosity > 0 and not (dist.is_available() and dist.is_initialized() and dist.get_rank()):
        print(message)


# -- scale_loss -------------------------------------------------------------------------------
@contextlib.contextmanager
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
    state = _current_state("amp.scale_loss")
    if not state.enabled:
        yield loss
        return
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        raise TypeError(f"loss must be a floating-point tensor; got {type(loss).__name__}")
    opts = _amp_optimizers(optimizers)
    if isinstance(loss_id, bool) or not isinstance(loss_id, int):
        raise TypeError(f"loss_id must be an integer; got {loss_id!r}")
    if not 0 <= loss_id < len(state.scalers):
        raise ValueError(f"loss_id must be in [0, num_losses) = [0, {len(state.scalers)}); got "
                         f"{loss_id} (pass num_losses to amp.initialize)")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or None; got {type(model).__name__}")
    scaler = state.scalers[loss_id]
    if not state.properties.master_weights and scaler.fixed == 1.0:
        yield loss.float()
        return
    if not delay_unscale:
        for opt in opts:
            if not opt.scaled_pending:
                opt.prepare_backward()
    yield loss.float() * scaler.scale(loss.device)
    if delay_unscale:
        for opt in opts:
            opt.scaled_pending = True
        return
    inv_scale = scaler.inv_scale()
    flags = [opt.post_backward(inv_scale, loss.device) for opt in opts]
    if delay_overflow_check:
        return
    found = torch.stack([f.to(loss.device) for f in flags]).sum() if flags else torch.zeros(
        (), device=loss.device)
    scaler.update(found)
    if scaler.dynamic:
        for opt in opts:
            opt.record_overflow(loss_id, found, scaler)


def _current_state(what: str) -> _AmpState:
    if _state is None:
        raise RuntimeError(f"{what} needs amp.initialize first: model, optimizer = "
                           f"amp.initialize(model, optimizer, opt_level=...)")
    return _state


def _amp_optimizers(optimizers) -> list[AmpOptimizer]:
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    for opt in opts:
        if not isinstance(opt, AmpOptimizer):
            raise TypeError(f"scale_loss needs the optimizer(s) returned by amp.initialize "
                            f"(model, optimizer = amp.initialize(model, optimizer)); got "
                            f"{type(opt).__name__}")
    return opts


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
    state = _current_state("amp.state_dict")
    destination = OrderedDict() if destination is None else destination
    for i, scaler in enumerate(state.scalers):
        destination[f"loss_scaler{i}"] = {"loss_scale": scaler.loss_scale(),
                                          "unskipped": scaler.unskipped()}
    return destination


def load_state_dict(state_dict) -> None:
    """Restore the loss scalers from :func:`state_dict` (apex's format), in order.

    A different number of entries than ``num_losses`` warns; extra entries are ignored.

    Raises:
        RuntimeError: a key without "loss_scaler" in it (apex's error).
        TypeError, ValueError: an entry that is not ``{"loss_scale": float, "unskipped": int}``.
    """
    state = _current_state("amp.load_state_dict")
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict; got {type(state_dict).__name__}")
    unexpected = [k for k in state_dict if not (isinstance(k, str) and "loss_scaler" in k)]
    if unexpected:
        raise RuntimeError(f"error(s) in loading the amp state_dict: unexpected key(s) "
                           f"{', '.join(map(repr, unexpected))}")
    if len(state_dict) != len(state.scalers):
        warnings.warn(f"the amp state_dict holds {len(state_dict)} loss scaler(s) and "
                      f"{len(state.scalers)} are in use (num_losses); loading the first "
                      f"{min(len(state_dict), len(state.scalers))}", UserWarning, stacklevel=2)
    for scaler, (key, entry) in zip(state.scalers, state_dict.items()):
        if not isinstance(entry, dict) or set(entry) != {"loss_scale", "unskipped"}:
            raise ValueError(f"state_dict[{key!r}] must be a dict with keys 'loss_scale' and "
                             f"'unskipped'; got {entry!r}")
        scaler.load(entry["loss_scale"], entry["unskipped"])


# -- user functions: registration, decorators, disable_casts --------------------------------
_TORCH_NAMESPACES = ((torch, ""), (F, ""), (torch.Tensor, ""), (torch.linalg, "linalg_"),
                     (torch.fft, "fft_"), (torch.special, "special_"))
_ORIGINAL_ATTR = "__mixprec_apex_original__"


def register_half_function(module, name: str) -> None:
    """Run ``module.name`` in the low-precision dtype under O1 (call before :func:`initialize`).

    A function of torch (``torch``, ``torch.nn.functional``, ``torch.Tensor``, ``torch.linalg``,
    ``torch.fft``, ``torch.special``) joins the O1 op lists, covering its function, method and
    operator forms; any other module's function is replaced by :func:`half_function` of it.

    Raises:
        ValueError: ``module`` has no attribute ``name`` (apex's error).
    """
    _register(module, name, "low_precision")


def register_float_function(module, name: str) -> None:
    """Run ``module.name`` in fp32 under O1, e.g. ``register_float_function(torch, "sigmoid")``."""
    _register(module, name, "fp32")


def register_promote_function(module, name: str) -> None:
    """Run ``module.name`` in the widest dtype of its floating inputs under O1."""
    _register(module, name, "promote")


def _register(module, name, policy: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a string; got {type(name).__name__}")
    if not hasattr(module, name):
        raise ValueError(f"no function named {name!r} in module {module!r}")
    prefix = next((p for ns, p in _TORCH_NAMESPACES if module is ns), None)
    if prefix is not None:
        op = prefix + name
        oplists.resolve_op(op)
        _user_lists[op] = policy
        return
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{module!r}.{name} is not callable")
    setattr(module, name, _cast_wrapper(getattr(fn, _ORIGINAL_ATTR, fn), policy))


def half_function(fn):
    """Decorator: under O1, cast ``fn``'s floating tensor arguments to the low-precision dtype."""
    return _cast_wrapper(fn, "low_precision")


def float_function(fn):
    """Decorator: under O1, cast ``fn``'s floating tensor arguments to fp32."""
    return _cast_wrapper(fn, "fp32")


def promote_function(fn):
    """Decorator: under O1, cast ``fn``'s floating arguments to the widest of their dtypes."""
    return _cast_wrapper(fn, "promote")


def _cast_wrapper(fn, policy: str):
    if not callable(fn):
        raise TypeError(f"expected a function to decorate; got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        low = _cast_dtype.get()
        if low is None:
            return fn(*args, **kwargs)
        if policy == "promote":
            dtypes = {t.dtype for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.is_floating_point()
                      and t.dtype != torch.float64}
            if len(dtypes) < 2:
                return fn(*args, **kwargs)
        dtype = low if policy == "low_precision" else torch.float32
        args, kwargs = cast_floating((args, kwargs), dtype)
        return fn(*args, **kwargs)

    setattr(wrapper, _ORIGINAL_ATTR, fn)
    return wrapper


@contextlib.contextmanager
def disable_casts():
    """Inside this block, O1's op lists and the cast decorators do nothing (autocast is off)."""
    token = _cast_dtype.set(None)
    try:
        with contextlib.ExitStack() as stack:
            for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        _cast_dtype.reset(token)
