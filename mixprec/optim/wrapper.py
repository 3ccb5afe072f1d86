"""What every mixprec master optimizer shares: wrapping a torch optimizer and stepping it.

A master optimizer (:class:`mixprec.MasterWeightOptimizer` with fp32 masters,
:class:`mixprec.optim.CompactMasterOptimizer` with Kahan-compensated or stochastically rounded
16-bit weights) wraps a torch optimizer, shares its ``param_groups`` and ``state`` (so LR
schedulers and hooks work as for any torch optimizer), steps it itself, and refuses to have its
inner optimizer stepped directly (that would bypass the masters). Loss scalers hand the step
the factor the gradients carry and the overflow flag: mixprec's through the protocol of
:mod:`mixprec.scaling.protocol`, ``torch.amp.GradScaler`` through torch's own
(``_step_supports_amp_scaling``: :meth:`WrappedOptimizer.amp_scaling`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..shards import local
from . import hooks, loadcheck, writes
from .buckets import is_per_parameter, make_buckets
from .refusals import check_bucket_mb
from .states import OWN_KEYS

__all__ = ["WrappedOptimizer", "reevaluating", "is_wrapped", "owner_of", "check_inner"]

_FUSED = ("auto", "compile", False)


# the live master optimizers (weakly: no reference to a parameter, which torch's swap-tensors
# loading refuses): a copy of a prepared model made together with its optimizer finds the
# copied one among them (mixprec.statedict)
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _groups_of(param_groups: list[dict]) -> tuple:
    """What :meth:`WrappedOptimizer.follow_reassigned` compares: each group's params list and
    its length."""
    return tuple((id(g["params"]), len(g["params"])) for g in param_groups)


def owner_of(param: torch.Tensor):
    """The live master optimizer stepping ``param`` (the latest built over it), or None. (An id
    in an optimizer's parameters is this parameter's: the optimizer holds its own alive.)"""
    owners = [opt for opt in list(_LIVE) if id(param) in getattr(opt, "_model_ids", ())]
    return owners[-1] if owners else None


def is_wrapped(optimizer: Any) -> bool:
    """True for any mixprec master optimizer (fp32 masters or compact ones)."""
    return isinstance(optimizer, WrappedOptimizer)


def check_inner(optimizer, wrapper_type: type) -> None:
    """Refuse what can't be wrapped: a wrapper already, or not a torch optimizer.

    Raises:
        ValueError: ``optimizer`` is already a mixprec master optimizer.
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if isinstance(optimizer, WrappedOptimizer):
        raise ValueError(
            f"optimizer is already a {type(optimizer).__name__} (around "
            f"{type(optimizer.inner).__name__}); wrap the plain torch optimizer only once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, e.g. "
            f"torch.optim.SGD(model.parameters(), lr=0.1); got {type(optimizer).__name__}")


def reevaluating(closure: Callable[[], Any], loss: Any, before: Callable[[], Any],
                 after: Callable[[], Any]) -> Callable[[], Any]:
    """``closure`` as an inner optimizer that calls it again inside its step (LBFGS) calls it:
    the first call gives ``loss`` (the evaluation before the step made the gradients the step
    reads); each later one runs ``before()`` (the model shown the values being stepped),
    evaluates, and runs ``after()`` (the new gradients taken in)."""
    calls = 0

    def evaluate() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return loss
        with torch.no_grad():
            before()
        with torch.enable_grad():
            out = closure()
        with torch.no_grad():
            after()
        return out
    return evaluate


class WrappedOptimizer(torch.optim.Optimizer):
    """Base of the master optimizers: the inner optimizer, its shared groups and state, the
    ``fused`` and ``bucket_mb`` options, buckets, and the refusals (see the module docstring).

    Subclasses call :meth:`_adopt` once the inner optimizer's groups hold what it steps, and
    define ``_check_fused``, ``_rebuild`` and ``_model_side``.
    """

    _set_up = False  # False while torch's Optimizer.__init__ registers the groups
    _torch_unscales = True  # torch's GradScaler.unscale_ takes param_groups' grads (not fp16)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch.amp.GradScaler's protocol for optimizers that unscale while they step: it sets
        ``grad_scale`` and ``found_inf`` on the optimizer before step() (see amp_scaling). Not
        while step pre-hooks would read the gradients and GradScaler's ``unscale_`` takes
        them: it then unscales first, as for any other optimizer, so the hooks see true
        gradients."""
        return not (self._torch_unscales and self.has_step_pre_hooks())

    def _adopt(self, optimizer: torch.optim.Optimizer, bucket_mb, fused) -> None:
        # torch's own set-up (hooks, step profiling), then share the inner optimizer's groups and
        # state so both objects see one truth
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._set_up = True
        hooks.share_hooks(self, optimizer)  # the user's hooks run once per step (see .hooks)
        self.param_names: dict[int, str] = {}
        self.register_load_state_dict_pre_hook(hooks.own(loadcheck.check_before_load))
        self.register_state_dict_pre_hook(writes.check_resized)  # state that fits no weight
        self._bucket_mb = bucket_mb
        self._rebuild()
        self._fused: bool | str = False
        self.fused = fused

    def __del__(self) -> None:
        # the model's state_dict() keeps this optimizer's fp32 values (mixprec.statedict); the
        # collector runs this whenever it runs, inside someone else's trace too (torch.export,
        # a dispatch mode): its ops and grad-mode changes stay out of what they record
        try:
            links = self.__dict__.get("_companions", ())
            if links:
                with _disable_current_modes(), torch._C.DisableTorchFunction():
                    for link in links:
                        link.orphaned(self)
        except Exception:  # (interpreter shutdown: nothing left to keep)
            pass

    def follow_reassigned(self) -> None:
        """``optimizer.state = defaultdict(dict)`` (a reset of the moments) or
        ``optimizer.param_groups = [...]`` assigned on this optimizer: the inner one, which
        steps them, takes them too; a group's ``params`` list edited in place (a parameter
        removed, as on a torch optimizer) is followed (each step checks two identities and
        each group's list and its length)."""
        inner = self.inner
        if self.state is not inner.state or self.param_groups is not inner.param_groups:
            inner.state, inner.param_groups = self.state, self.param_groups
            self._rebuild()
        elif self._groups_seen != _groups_of(self.param_groups):
            self._rebuild()

    # -- configuration -------------------------------------------------------------------------
    @property
    def fused(self) -> bool | str:
        """The update kernel: ``"auto"``, ``"compile"`` or ``False`` (see the class docstring)."""
        return self._fused

    @fused.setter
    def fused(self, value: bool | str) -> None:
        if not any(value is v or (isinstance(value, str) and value == v) for v in _FUSED):
            raise ValueError(f"fused must be 'auto', 'compile' or False; got {value!r}")
        self._check_fused(value)
        self._fused = value

    def _check_fused(self, value) -> None:
        """Raise ValueError when ``value`` can't run this optimizer."""

    @property
    def bucket_mb(self) -> float | None:
        """MiB of fp32 gradients per bucket (per-parameter optimizers; None: automatic)."""
        return self._bucket_mb

    @bucket_mb.setter
    def bucket_mb(self, value: float | None) -> None:
        check_bucket_mb(value)
        self._bucket_mb = value
        self._rebuild()

    def __getstate__(self) -> dict[str, Any]:
        # no per-instance ``step`` (an LR scheduler's wrapper bound to this optimizer, which
        # torch's pickling drops too), nor the step's scratch and its views (released storage)
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("step", "lists", "_companions")}
        if "scratch" in state:
            state["scratch"] = type(state["scratch"])()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "inner" in state:  # unpickled or deep-copied: torch's pickling of the inner dropped
            hooks.reshare_hooks(self, self.inner)  # its hooks
            self._rebuild()  # and what is keyed by the tensors' ids names the copies now
        elif "inner" in self.__dict__:  # load_state_dict: the inner optimizer's class fills
            # in what an older state_dict lacks (new group flags, a step saved as a number),
            # over the entries that hold its own state (not ours alone: a compensation saved
            # before the first step)
            theirs = {k: v for k, v in self.state.items()
                      if not isinstance(v, Mapping) or any(key not in OWN_KEYS for key in v)}
            self.inner.__setstate__({"state": theirs, "param_groups": self.param_groups})
            self.inner.state = self.state
            self._loaded()

    def _loaded(self) -> None:
        """A ``state_dict`` was loaded (subclasses forget what they cached of the state)."""

    # -- buckets and bookkeeping ---------------------------------------------------------------
    def _rebuild(self) -> None:
        """Recompute what depends on the param groups (subclasses add to it)."""
        self.layout_version = self.__dict__.get("layout_version", 0) + 1
        self._groups_seen = _groups_of(self.param_groups)
        held = [p for g in self.param_groups for p in g["params"]]
        self._held = {id(p) for p in held}
        self._model_params = list({id(m): m for m in (self._model_side(p)
                                                        for p in held)}.values())
        self.elements = sum(local(p).numel() for p in held)  # what a piece is sized by
        self._buckets = make_buckets(self.param_groups, self._bucket_mb,
                                     is_per_parameter(self.inner), self.elements)
        self._model_ids = {id(p) for p in self._model_params}
        _LIVE.add(self)

    @staticmethod
    def _model_side(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def buckets(self) -> list[list[list[torch.Tensor]]]:
        """The buckets ``step()`` walks: per bucket, per param group, its tensors."""
        return self._buckets

    @property
    def per_parameter(self) -> bool:
        """True when the inner optimizer is stepped a bucket at a time (see the class doc)."""
        return is_per_parameter(self.inner)

    def _holds(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._held

    def inner_step(self, closure=None) -> Any:
        """Run the inner optimizer's ``step`` (only the step paths call this), without torch's
        step hooks: ``step()`` ran them once (see :mod:`mixprec.optim.hooks`), with the
        keywords ``step()`` was given (``optimizer.step(closure, **kwargs)``, as Lightning's
        plugins forward them)."""
        return hooks.raw_step(self.inner, closure, **getattr(self, "step_kwargs", {}))

    def has_step_pre_hooks(self) -> bool:
        """True when step pre-hooks would run on :meth:`step` (a loss scaler then unscales the
        gradients before stepping, as torch's GradScaler does: the hooks see true values)."""
        return hooks.has_step_pre_hooks(self)

    def name_params(self, names: Mapping[torch.Tensor, str]) -> None:
        """Record qualified names of model parameters (``prepare`` does), used in messages."""
        self.param_names = {id(p): n for p, n in names.items()}

    def describe(self, tensor: torch.Tensor, where: str) -> str:
        """How messages name a tensor of the groups: its model parameter's qualified name when
        known, else ``where`` (e.g. "param_groups[0]['params'][3]")."""
        name = self.param_names.get(id(self._model_side(tensor)))
        return f"parameter {name!r} ({where})" if name else f"parameter {where}"

    @contextlib.contextmanager
    def only(self, bucket: list[list[torch.Tensor]]) -> Iterator[None]:
        """Inside the block, each param group holds only its tensors of ``bucket`` (in its own
        list, changed in place: some optimizers, LBFGS, keep the list they were made with)."""
        saved = [list(group["params"]) for group in self.param_groups]
        try:
            for group, tensors in zip(self.param_groups, bucket):
                group["params"][:] = tensors
            yield
        finally:
            for group, params in zip(self.param_groups, saved):
                group["params"][:] = params

    def params_widened(self, params: list[torch.Tensor]) -> None:
        """Model parameters now stored in fp32 or wider, holding their exact values (a cast of
        the prepared model, see :mod:`mixprec.modulecasts`); fp32 masters keep being written
        into them."""
        self._rebuild()

    # -- torch.amp.GradScaler ------------------------------------------------------------------
    def amp_scaling(self, grad_scale, found_inf) -> tuple:
        """This step's ``(grad_scale, found_inf)``: the keywords mixprec's scalers pass, or what
        ``torch.amp.GradScaler.step`` set on the optimizer (``_step_supports_amp_scaling``: it
        checked the gradients in ``param_groups``, which read as the model's, and hands over the
        factor they still carry, None after its ``unscale_``, and the 0/1 overflow flag).
        Where the step can't skip on the device, the flag is read here, as GradScaler reads it
        for any other optimizer: ``found_inf`` is then None, or the step is to be skipped
        (returned as ``(None, True)``)."""
        if "found_inf" not in self.__dict__:
            return grad_scale, found_inf
        if grad_scale is not None or found_inf is not None:
            raise RuntimeError("step() was given grad_scale/found_inf while torch.amp.GradScaler "
                               "drives it: use one scaler")
        grad_scale, found_inf = self.__dict__.get("grad_scale"), self.__dict__["found_inf"]
        if not self.skips_on_device():
            return (None, True) if found_inf.item() else (grad_scale, None)
        return grad_scale, found_inf

    def skips_on_device(self) -> bool:
        """Whether ``step(found_inf=f)`` can skip on the device."""
        return False

    # -- refusals ------------------------------------------------------------------------------
    def _refuse_direct_step(self, optimizer, args, kwargs) -> None:
        if optimizer is self.inner and not optimizer.__dict__.get(hooks.STEPPED_BY_WRAPPER):
            raise RuntimeError(
                f"this {type(optimizer).__name__} was wrapped in a {type(self).__name__} (by "
                "mixprec.prepare at level O2, or directly): only the wrapper steps its "
                "param_groups and writes the model's 16-bit weights. Call step() and "
                "zero_grad() on the optimizer prepare returned: "
                "model, optimizer = mp.prepare(model, optimizer, level='O2')")

    def _refuse_direct_state_dict(self, optimizer) -> None:
        if optimizer is self.inner:
            raise RuntimeError(
                f"this {type(optimizer).__name__} was wrapped in a {type(self).__name__}: its "
                "state_dict would leave out what the wrapper keeps (fp32 masters, compensation, "
                "the rounding generator). Call state_dict() on the optimizer prepare returned")

    def _refuse_direct_load(self, optimizer, state_dict) -> None:
        if optimizer is self.inner:
            raise RuntimeError(
                f"this {type(optimizer).__name__} was wrapped in a {type(self).__name__}: "
                "loading into it would bypass the wrapper (its masters and checks). Call "
                "load_state_dict() on the optimizer prepare returned")

    # -- gradients -----------------------------------------------------------------------------
    def drop_master_grads(self) -> None:
        """Drop the fp32 gradients made for the step (a scaler that skips a step calls this)."""

    @torch._disable_dynamo  # as torch's own zero_grad
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model parameters' gradients and drop the fp32 ones made from them.

        Args:
            set_to_none: set the model's ``.grad`` to None (default) instead of zeroing it.
        """
        if not hasattr(self, "_zero_grad_profile_name"):
            self._patch_step_function()
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
            self.drop_master_grads()  # (named in a profile as torch names its own)
            grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in self._model_params:
                g = p.grad
                if g is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                g.detach_() if g.grad_fn is not None else g.requires_grad_(False)
                grads.setdefault((g.device, g.dtype), []).append(g)
            with torch.no_grad():
                for same in grads.values():
                    torch._foreach_zero_(same)

    @torch._disable_dynamo  # as torch's own
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``; mixprec's own pre-hooks run after the user's, which may
        return a new state dict (:func:`.hooks.own_load_hooks_last`)."""
        hooks.own_load_hooks_last(self)
        super().load_state_dict(state_dict)

    def _check_new_group(self, param_group) -> tuple[dict, list]:
        """Validate a param group for :meth:`add_param_group`; return it (a copy) and its
        parameters."""
        if not isinstance(param_group, Mapping):
            raise TypeError("param_group must be a dict with a 'params' entry; got "
                            f"{type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError(f"param_group needs a 'params' entry; got keys {sorted(param_group)}")
        group = dict(param_group)
        params = group["params"]
        if isinstance(params, set):
            raise TypeError("param_group['params'] must be an ordered sequence, not a set")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        named = [p for p in params if isinstance(p, tuple)]  # named_parameters(), as torch takes
        if named:
            if len(named) != len(params):
                raise ValueError("all optimizer params should be with/without names. Some param "
                                 "names are missing")
            group["param_names"] = [name for name, _ in named]
            params = [p for _, p in named]
        group["params"] = params  # a generator is read once, here
        known = {id(self._model_side(p)) for g in self.param_groups for p in g["params"]}
        if any(id(p) in known for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        return group, params
