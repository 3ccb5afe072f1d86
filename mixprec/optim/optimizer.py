"""``MasterWeightOptimizer``: fp32 master copies of low-precision parameters (an update below
half a bf16 ulp rounds away; an fp32 copy lets it accumulate).

**torch's contract holds.** ``param_groups`` and ``state`` are the inner optimizer's own objects
(LR schedulers, edits of ``"lr"`` and hooks work as for any torch optimizer). A master's
``.grad`` is its model parameter's gradient in fp32, made when read, so ``clip_grad_norm_`` over
the optimizer's parameters sees the real gradients, and an in-place change is what the step
uses. torch's per-parameter optimizers (:data:`.buckets.PER_PARAMETER_OPTIMIZERS`) are stepped
a bucket at a time, others once per step. The inner optimizer refuses to be stepped directly.

**Memory.** ``step()`` widens the model's gradients to fp32 a bucket (``bucket_mb``) or a slice
at a time, into scratch held while it runs. Bytes per 16-bit parameter: 2 (weight) + 4
(master) + 2 (gradient) + the state (SGD momentum 4, Adam 8; half with bf16 moments).

**The loss-scaler protocol** (:mod:`mixprec.scaling.protocol` says what each call does):
``grads_for_step()``, ``unscale_grads_(inv_scale)`` (it makes the masters' fp32 gradients and
unscales the model's in place, so every reader sees true values), ``step(grad_scale=,
found_inf=)`` (torch's fused kernel divides and skips on the device) and ``drop_master_grads()``.
``torch.amp.GradScaler`` drives the same two values (``_step_supports_amp_scaling``).

**Update kernels** (``fused``): ``"auto"`` (default) torch's fused SGD/Adam/AdamW kernels on
cached lists (:mod:`.master_lists`), else through the configured step; ``False`` the configured
step; ``"compile"`` torch's single-tensor step compiled into one pass per low-precision
parameter (:mod:`.kernels`). Weights are written back with torch's cast (ties to even); bf16
moments: :mod:`.states`. No host sync, except that ``"compile"`` reads a GPU's Adam ``step``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..dtypes import is_low_precision
from ..masters.rounding import DEFAULT_SEED, RoundingGenerator
from ..scaling.unscale import check_and_unscale_, unscale_
from . import checkpoint, kernels, master_lists, states, steps, writes
from .buckets import Scratch, dense_layout, is_per_parameter
from .params import (
    GradCarry,
    MasterParameter,
    MasterState,
    derive_grads,
    drop_grad,
    is_master,
    is_stale,
    set_grad,
    valid_grad,
)
from .refusals import check_bucket_mb, check_grad_scale, not_ours, stale_fp16_error
from .wrapper import (
    WrappedOptimizer,
    check_inner,
    reevaluating,
)
from .writes import Record, versions

__all__ = ["MasterWeightOptimizer", "is_master_optimizer", "MASTERS_KEY"]

MASTERS_KEY = checkpoint.MASTERS_KEY


def is_master_optimizer(optimizer: Any) -> bool:
    """True when ``optimizer`` is a :class:`MasterWeightOptimizer`."""
    return isinstance(optimizer, MasterWeightOptimizer)


class MasterWeightOptimizer(WrappedOptimizer):
    """An optimizer that steps fp32 master copies of low-precision parameters.

    Every parameter narrower than fp32 is replaced, in the inner optimizer's ``param_groups``,
    by an fp32 master (a :class:`mixprec.optim.params.MasterParameter` laid out as its
    parameter); fp32 and fp64 parameters are their own masters. The module docstring says the
    rest.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters (bf16/fp16/fp32
            mixed freely, several param groups, tied parameters listed once). Any state it
            already holds is moved to the masters and cast to fp32.
        fused: ``"auto"``, ``"compile"`` or ``False`` (also settable later, as ``.fused``).
        bucket_mb: size of the transient fp32 gradient buckets in MiB for per-parameter
            optimizers; None: one piece of the kernel table's for the device (4 MiB on the
            CPU whatever the model's size; on CUDA 1/16 of the model's, 4 to 128 MiB).
        initial_masters: model parameter -> the fp32 tensor its master starts as (e.g. the
            exact fp32 weight before the model was cast), its storage (not a copy); others
            start from their upcast.
        state_dtype: "fp32" (default) or "bf16": the dtype moment buffers are stored in.
        seed: seed of the generator that rounds bf16 moments (:mod:`mixprec.masters.rounding`).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: ``optimizer`` is already a master optimizer, holds a low-precision tensor
            that is not a leaf, a bad ``fused``, ``bucket_mb`` or ``state_dtype``, or
            ``fused="compile"`` with an optimizer or option it does not support.

    Example:
        >>> model = nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> opt.master_param(model.weight).dtype
        torch.float32
    """

    def __init__(self, optimizer: torch.optim.Optimizer, fused: bool | str = "auto",
                 bucket_mb: float | None = None,
                 initial_masters: Mapping[torch.Tensor, torch.Tensor] | None = None, *,
                 state_dtype="fp32", seed: int = DEFAULT_SEED) -> None:
        check_inner(optimizer, MasterWeightOptimizer)
        check_bucket_mb(bucket_mb)
        self.state_dtype = states.check_state_dtype(state_dtype)
        self.rounding = RoundingGenerator(seed)
        self.inner = optimizer
        self._carry = GradCarry()  # the factor the model's gradients carry after a step
        self._seen = Record()  # the weights' versions after the last step (.writes)
        self._masters_seen = Record()  # the masters' (a master edited through param_groups)
        self._master_of: dict[torch.Tensor, MasterParameter] = {}  # model param -> master
        self._initial = dict(initial_masters or {})
        for group in optimizer.param_groups:  # in place: some optimizers (LBFGS) keep the list
            group["params"][:] = self._with_masters(group["params"])
        self._adopt(optimizer, bucket_mb, fused)
        if given := [p for p in (initial_masters or {}) if p in self._master_of]:
            with torch.no_grad():  # the weights as the masters round (torch's cast)
                torch._foreach_copy_(given, [self._master_of[p] for p in given])
        self._initial = {}
        states.register(self)  # (first: moments converted at a load draw rounding bits,
        checkpoint.register(self)  # then the saved generator state is restored)
        self._record_writes()  # the masters made from the weights

    def _check_fused(self, value) -> None:
        if value == "compile":
            kernels.check_compilable(self.inner)
            if self.state_dtype != torch.float32:
                raise ValueError("fused='compile' keeps fp32 moments; with state_dtype='bf16' "
                                 "use fused='auto' or False")

    def __repr__(self) -> str:
        return (f"MasterWeightOptimizer({len(self._master_of)} fp32 masters, fused={self.fused!r},"
                f" {self.inner!r})")

    def _with_masters(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizer params must be Tensors; got {type(p).__name__}")
            if is_low_precision(p):
                master = self._master_of.get(p)
                out.append(self._make_master(p) if master is None else master)
            else:
                out.append(p)
        return out

    def _make_master(self, param: torch.Tensor) -> MasterParameter:
        if not param.is_leaf:
            raise ValueError(
                f"can't keep a master for a non-leaf {param.dtype} tensor of shape "
                f"{tuple(param.shape)}; pass the model's parameters (leaf tensors)")
        initial = self._initial.pop(param, None)
        if initial is not None and (initial.shape != param.shape
                                    or initial.dtype != torch.float32
                                    or initial.device != param.device):
            raise ValueError(
                f"initial_masters holds a {initial.dtype} tensor of shape "
                f"{tuple(initial.shape)} on {initial.device} for a parameter of shape "
                f"{tuple(param.shape)} on {param.device}; it must be fp32, of the same shape "
                f"and device")
        value = (initial.detach() if initial is not None
                 else param.detach().to(torch.float32, copy=True))  # keeps the layout
        if not dense_layout(value):  # a view into a larger tensor (the fp32 parameter prepare
            value = value.contiguous()  # replaced): a master of its own, its gradient's layout
        master = MasterParameter(value, requires_grad=param.requires_grad)._link(param,
                                                                                 self._carry)
        self._master_of[param] = master
        state = self.inner.state  # (the raw keys: a MasterState maps param to master now)
        if dict.__contains__(state, param):  # state made before wrapping (or keyed by the
            # model parameter since): move it to the master, in fp32
            state[master] = {k: v.float() if torch.is_tensor(v) and v.dtype == param.dtype else v
                             for k, v in dict.pop(state, param).items()}
        return master

    def _rebuild(self) -> None:
        """Recompute the write-back pairs and the buckets after the param groups changed."""
        pairs: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for param, master in self._master_of.items():
            params, masters = pairs.setdefault((param.device, param.dtype), ([], []))
            params.append(param)
            masters.append(master)
        self._pairs = list(pairs.values())
        self._flat = ([p for ps, _ in self._pairs for p in ps],
                      [m for _, ms in self._pairs for m in ms])
        self._map_state()
        super()._rebuild()
        self.scratch = Scratch()  # views made for the old groups go with it
        self.pieces = master_lists.plan(self)  # the buckets' lists for torch's fused kernel

    def _map_state(self) -> None:
        """``state`` as a :class:`~.params.MasterState` (torch makes a plain one on a load; a
        copy and pickle give one)."""
        if type(self.state) is not MasterState:
            self.state = self.inner.state = MasterState(self.state, self._master_of)

    def _loaded(self) -> None:
        self._map_state()
        for piece in self.pieces:  # the next step runs through the inner optimizer's step
            if piece is not None:
                piece.ready = False

    @staticmethod
    def _model_side(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.model_param if is_master(tensor) else tensor

    def master_param(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizer steps for model parameter ``param``.

        Returns the fp32 master of a low-precision parameter, or ``param`` itself when it is
        already fp32/fp64 (it is its own master).

        Raises:
            TypeError: ``param`` is not a tensor.
            ValueError: ``param`` is not one of this optimizer's parameters.
        """
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"param must be a Tensor; got {type(param).__name__}")
        master = self._master_of.get(param)
        if master is not None:
            return master
        if self._holds(param) and not is_master(param):
            return param
        raise ValueError(not_ours(param, "MasterWeightOptimizer"))

    def masters_by_param(self) -> dict[torch.Tensor, torch.Tensor]:
        """Low-precision model parameter -> its fp32 master (a new dict)."""
        return dict(self._master_of)

    def model_param(self, master: torch.Tensor) -> torch.Tensor:
        """The model parameter behind ``master`` (a tensor from ``param_groups``).

        Raises:
            TypeError: ``master`` is not a tensor.
            ValueError: ``master`` is neither a master nor a parameter of this optimizer.
        """
        if not isinstance(master, torch.Tensor):
            raise TypeError(f"master must be a Tensor; got {type(master).__name__}")
        if self._holds(master):
            return self._model_side(master)
        if master in self._master_of:
            return master
        raise ValueError(not_ours(master, "MasterWeightOptimizer"))

    def refresh_masters(self) -> None:
        """Copy the model parameters into the masters (after editing model weights directly)."""
        with torch.no_grad():
            for params, masters in self._pairs:
                torch._foreach_copy_(masters, params)

    def follow_writes(self, settle: bool = True) -> None:
        """Take the writes made outside the step (:mod:`.writes`): a weight written directly
        gives its value to its master where their rounding disagrees. With ``settle``
        (``state_dict()`` time; one host read per parameter), every other pair is compared too:
        a master written in place (through ``param_groups``) gives its rounding to its weight;
        a disagreement neither version counter saw (a write through ``.data``) is the weight's,
        as written."""
        writes.follow_masters(self, settle)

    def _record_writes(self) -> None:
        params, held = self._flat
        self._seen.take(self._flat, versions(params))
        self._masters_seen.take(self._flat, versions(held))

    def write_back(self) -> None:
        """Copy the masters into the model parameters with torch's cast (round to nearest, ties
        to even): one ``_foreach_copy_`` per device and dtype."""
        with torch.no_grad():
            for params, masters in self._pairs:
                torch._foreach_copy_(params, masters)

    def grads_for_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(model parameter, gradient)`` pairs the next ``step()`` reads (see the class
        docstring); parameters without a gradient are left out."""
        if not self._carry.held:  # every gradient the step reads is the model's
            return [(p, p.grad) for p in self._model_params if p.grad is not None]
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if is_master(p):
                    grad = valid_grad(p)
                    param = p.model_param
                    grad = param.grad if grad is None else grad
                else:
                    param, grad = p, p.grad
                if grad is not None:
                    out.append((param, grad))
        return out

    def unscale_grads_(self, inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Make the fp32 master gradients (model gradient x ``inv_scale``); return inf/NaN flag.

        See the class docstring. ``inv_scale`` is a 0-d tensor (None: 1). Any master gradients
        made earlier are replaced. No host sync.

        Returns:
            A 0-d float32 flag, 1 when a gradient held inf/NaN, on the first gradient's device.
        """
        self._carry.inv = None
        masters, fp32 = [], []
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if is_master(p):
                        masters.append(p)
                    elif p.grad is not None:
                        if p.grad.is_sparse:
                            p.grad = p.grad.coalesce()
                        fp32.append(p.grad)
            made = derive_grads(masters)
            found = check_and_unscale_([g for _, g in made] + fp32, inv_scale)
            if inv_scale is not None:  # the model's gradients read as the true ones too
                unscale_([p.model_param.grad for p, _ in made], inv_scale)
        for p, grad in made:  # the model gradients changed version: made from them still
            set_grad(p, grad)
        return found

    def settle_grads_(self, grad_scale: torch.Tensor) -> torch.Tensor:
        """``unscale_grads_`` with the step's arithmetic (:func:`.steps.settle_grads`)."""
        return steps.settle_grads(self, grad_scale)

    def skips_on_device(self) -> bool:
        """Whether ``step(found_inf=f)`` can skip on the device (:func:`.steps.skips_on_device`)."""
        self.follow_reassigned()  # (the layout the step will see)
        return steps.skips_on_device(self)

    @torch._disable_dynamo  # runs eagerly inside a compiled function (see .wrapper)
    def step(self, closure: Callable[[], Any] | None = None, *,
             grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
             **kwargs: Any) -> Any:
        """Step the masters from the gradients and write them back (see the class docstring).

        Args:
            closure: re-evaluates the model and returns the loss (as for any torch optimizer):
                it runs first, making the gradients the step reads; an optimizer that calls it
                again (LBFGS) shows the model the current masters before each re-evaluation.
            grad_scale: the factor the gradients still carry (a 0-d tensor), or None.
            found_inf: a 0-d float32 flag, 1 to skip (on the device), or None.
            kwargs: passed on to the inner optimizer's ``step`` (each time it runs).

        Returns:
            The closure's loss (its first evaluation), or None.

        Raises:
            RuntimeError: a ``closure`` together with ``grad_scale`` or ``found_inf`` (or
                driven by ``torch.amp.GradScaler``); ``found_inf`` while not
                ``skips_on_device()``.
        """
        self.follow_reassigned()
        grad_scale, found_inf = self.amp_scaling(grad_scale, found_inf)
        if found_inf is True:  # torch.amp.GradScaler's overflow, read: the step is skipped
            self.drop_master_grads()
            return None
        self._carry.inv = None
        self.step_kwargs = kwargs
        try:
            return self._step(closure, grad_scale, found_inf)
        except RuntimeError:  # (a weight resized since: a shape mismatch, said so)
            writes.check_resized(self)
            raise
        finally:
            self.step_kwargs = {}
            self._record_writes()

    def _step(self, closure, grad_scale, found_inf) -> Any:
        loss = again = None
        if closure is not None:
            if grad_scale is not None or found_inf is not None:
                raise RuntimeError("step() takes a closure or a grad_scale/found_inf, not both: a "
                                   "closure recomputes the gradients")
            with torch.enable_grad():  # first: the gradients the step reads
                loss = closure()
        self.follow_writes(settle=False)  # (after the closure: it may write weights; a master
        if closure is not None:            # written in place is stepped as it is)
            if not is_per_parameter(self.inner):  # it calls the closure again (LBFGS)
                again = reevaluating(closure, loss, self.write_back,
                                     lambda: self.unscale_grads_(None))
        if grad_scale is not None:
            check_grad_scale(grad_scale)
        if found_inf is not None and not self.skips_on_device():
            raise RuntimeError("step(found_inf=...) takes the flag only where skips_on_device() "
                               "is True (torch's fused kernel for every tensor, fp32 moments, "
                               "no step hooks, optimizer state made); read the flag and skip")
        self._check_fp16_changes()
        if self._fused == "compile" and again is None and steps.keeps_compiling(self):
            steps.compiled_step(self, grad_scale)
        else:
            steps.bucketed_step(self, grad_scale, found_inf, again)
        if grad_scale is not None:  # reads after the step see the true gradients (torch.amp)
            self._carry.carry(grad_scale)
        if self.state_dtype != torch.float32:  # bf16 moments are rounded stochastically
            states.record_generator(self.inner, self.rounding)
        return loss

    def held_grads(self) -> bool:
        """True when some master may hold an fp32 gradient (``unscale_grads_``, a ``.grad``
        read); False: every gradient the step reads is the model's."""
        return self._carry.held

    def _check_fp16_changes(self) -> None:
        if self._carry.held and (stale := [m for m in self._master_of.values() if is_stale(m)
                                           and m.model_param.dtype == torch.float16]):
            raise stale_fp16_error(len(stale), stale[0].shape)

    def drop_master_grads(self) -> None:
        """Drop the masters' fp32 gradients (the model's stay; a scaler skipping a step)."""
        self._carry.inv = None
        if self._carry.held:
            for master in self._master_of.values():
                drop_grad(master)
            self._carry.held = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its low-precision parameters get fp32 masters.

        Raises:
            TypeError: ``param_group`` is not a dict, or its ``"params"`` is a set.
            ValueError: no ``"params"`` entry, or a parameter already in this optimizer.
        """
        if not self._set_up:  # torch's Optimizer.__init__ registering the wrapped groups
            return super().add_param_group(param_group)
        group, params = self._check_new_group(param_group)
        new = [p for p in params if isinstance(p, torch.Tensor) and is_low_precision(p)]
        try:
            group["params"] = self._with_masters(params)
            self.inner.add_param_group(group)
        except Exception:
            for p in new:
                self._master_of.pop(p, None)
            raise
        self._rebuild()
