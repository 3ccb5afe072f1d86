"""``MasterWeightOptimizer``: fp32 master copies of low-precision parameters.

Why masters: a bf16 weight near 1.0 has an ulp of 2**-7. An update smaller than half of that
(2**-8) rounds away completely, on every step, so a model whose weights live in bf16 (or fp16)
silently stops learning wherever updates are small. Keeping an fp32 copy of each low-precision
weight (the master), applying the optimizer to it and writing the rounded result back lets those
small updates accumulate until they move the low-precision weight.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..dtypes import is_low_precision
from ..scaling.unscale import check_and_unscale_, unscale_
from . import kernels

__all__ = ["MasterWeightOptimizer", "is_master_optimizer", "MASTERS_KEY"]

#: Key of the fp32 master weights in ``MasterWeightOptimizer.state_dict()``.
MASTERS_KEY = "master_weights"

_FUSED = ("auto", "compile", False)
_MIN_BUCKET_BYTES = 4 * 2 ** 20
_BUCKETS_PER_MODEL = 16


def is_master_optimizer(optimizer: Any) -> bool:
    """True when ``optimizer`` is a :class:`MasterWeightOptimizer`."""
    return isinstance(optimizer, MasterWeightOptimizer)


class MasterWeightOptimizer(torch.optim.Optimizer):
    """An optimizer that steps fp32 master copies of low-precision parameters.

    Wraps a torch optimizer built over a model's parameters. Every parameter narrower than fp32
    (bf16, fp16) is replaced, in the inner optimizer's ``param_groups``, by an fp32 master copy;
    fp32 (and fp64) parameters stay as they are (they are their own masters). ``step()`` reads
    the model's gradients, steps the inner optimizer on the masters and writes the masters back
    into the model parameters, rounded to nearest even. Optimizer state (momentum, Adam moments)
    therefore lives in fp32 too.

    ``param_groups`` and ``state`` are the inner optimizer's own objects: LR schedulers, code
    that edits ``"lr"``, and hooks registered on this object work as for any torch optimizer.
    The inner optimizer itself must no longer be stepped directly (its ``param_groups`` now hold
    masters, which only this object gives gradients): its ``step()`` raises a ``RuntimeError``
    that says to use this one.

    **Gradients and memory.** No fp32 gradient lives between steps, and no fp32 gradient of the
    whole model ever exists. ``step()`` copies the model's gradients to fp32 one bucket at a
    time (``bucket_mb``), into one bucket-sized scratch buffer per device that is reused from
    bucket to bucket and freed when the step ends, steps that bucket and writes it back;
    ``fused="compile"`` reads the low-precision gradients directly and needs no scratch. Bytes
    per low-precision parameter: 2 (weight) + 4 (master) + 2 (gradient) + the optimizer state
    in fp32 (SGD with momentum 4, Adam 8); the one bucket exists only during ``step()``, when
    the activations are gone.

    **The loss-scaler protocol** (what :class:`mixprec.DynamicLossScaler` and the other mixprec
    scalers call; an optimizer that owns the gradients its step reads implements it):

    * ``grads_for_step()``: the ``(parameter, gradient)`` pairs the next ``step()`` reads, in
      their own dtypes: what a scaler checks for inf/NaN and measures for clipping.
    * ``unscale_grads_(inv_scale)``: makes the fp32 gradient of every master (its ``.grad`` in
      ``param_groups``) from the model's gradient times ``inv_scale``, unscales the fp32
      parameters' gradients in place, and returns a 0-d inf/NaN flag (> 0: overflow), in one
      pass over each gradient. After it, every tensor in ``param_groups`` has its true gradient
      (clip those, e.g. ``clip_grad_norm_`` over the optimizer's parameters), and the model's
      low-precision gradients read as unscaled too (``mp.debug.grad_report``). Changing the
      model's low-precision gradients afterwards (e.g. ``clip_grad_norm_(model.parameters())``)
      makes the next ``step()`` raise: clip the optimizer's parameters, or use
      ``scaler.clip_grad_norm_(optimizer, max_norm)``.
    * ``step(grad_scale=s)``: the model's gradients still carry the factor ``s`` (a 0-d tensor):
      they are divided by it as they are read (fp32 parameters' gradients in place).
      ``step()`` with no ``grad_scale`` uses the gradients ``unscale_grads_`` made, if it ran
      since the last step, else the model's gradients as they are.
    * ``drop_master_grads()`` drops the gradients ``unscale_grads_`` made (a scaler calls it
      when it skips the step); ``zero_grad()`` clears the model's gradients and drops them too.

    A scaler that skips a step simply does not call ``step()``: masters, model parameters and
    optimizer state stay untouched. torch's ``torch.amp.GradScaler`` cannot drive this optimizer
    (it looks for gradients in ``param_groups`` before the step): ``step()`` raises a clear
    error when it is driven by one.

    **Update kernels** (``fused``): ``"auto"`` (default) runs torch's own fused kernel for
    ``torch.optim.SGD``/``Adam``/``AdamW`` on CPU and CUDA (``fused=True`` for the call; the
    inner optimizer's own options are restored after) and the inner optimizer's configured step
    otherwise; ``False`` always runs the configured step (bitwise what the unwrapped optimizer
    does on fp32 tensors); ``"compile"`` runs one ``torch.compile``-d pass per low-precision
    parameter that reads its low-precision gradient, unscales it and writes master, state and
    rounded weight (SGD/Adam/AdamW only; the first step compiles, which needs a C++ compiler on
    CPU or Triton on GPU; results agree with the others to a few fp32 ulps). See
    :mod:`mixprec.master.kernels`.

    Host-device synchronisation: ``step()``, ``unscale_grads_()``, ``zero_grad()``,
    ``state_dict()`` and ``load_state_dict()`` add none (all copies are asynchronous device
    ops), except that ``fused="compile"`` reads Adam's ``step`` when that state lives on a GPU.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters (bf16/fp16/fp32
            mixed freely, several param groups, tied parameters listed once). Any state it
            already holds is moved to the masters and cast to fp32.
        fused: ``"auto"``, ``"compile"`` or ``False`` (also settable later, as ``.fused``).
        initial_masters: model parameter -> the fp32 tensor its master starts as (e.g. the
            exact fp32 weight before the model was cast); it becomes the master's storage, not
            a copy. Parameters not in it start from their upcast.
        bucket_mb: size of the transient fp32 gradient buckets in MiB; None picks
            max(4 MiB, 1/16 of all fp32 gradients). Optimizers that need every gradient at once
            (a ``closure``, e.g. LBFGS) get one bucket.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: ``optimizer`` is already a ``MasterWeightOptimizer``, holds a
            low-precision tensor that is not a leaf, a bad ``fused`` or ``bucket_mb``, or
            ``fused="compile"`` with an optimizer or option it does not support.

    Example:
        >>> model = nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> opt.master_param(model.weight).dtype
        torch.float32
    """

    _set_up = False  # False while torch's Optimizer.__init__ registers the groups
    # torch.amp.GradScaler then hands over grad_scale/found_inf instead of stepping blindly,
    # and step() refuses it with a message (see _refuse_torch_grad_scaler)
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, fused: bool | str = "auto",
                 bucket_mb: float | None = None,
                 initial_masters: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            raise ValueError(
                "optimizer is already a MasterWeightOptimizer (around "
                f"{type(optimizer.inner).__name__}); wrap the plain torch optimizer only once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer, e.g. "
                f"torch.optim.SGD(model.parameters(), lr=0.1); got {type(optimizer).__name__}")
        if bucket_mb is not None and not (isinstance(bucket_mb, (int, float))
                                          and not isinstance(bucket_mb, bool) and bucket_mb > 0):
            raise ValueError(f"bucket_mb must be None or a positive number; got {bucket_mb!r}")
        self.inner = optimizer
        self._master_of: dict[torch.Tensor, nn.Parameter] = {}  # model param -> master
        self._model_of: dict[torch.Tensor, torch.Tensor] = {}  # master -> model param
        self._initial = dict(initial_masters or {})
        for group in optimizer.param_groups:  # in place: some optimizers (LBFGS) keep the list
            group["params"][:] = self._with_masters(group["params"])
        # torch's own set-up (hooks, step profiling), then share the inner optimizer's groups and
        # state so both objects see one truth
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._set_up = True
        self.register_state_dict_post_hook(_save_masters)
        self.register_load_state_dict_pre_hook(_take_masters)
        self.register_load_state_dict_post_hook(_restore_masters)
        optimizer.register_step_pre_hook(self._refuse_direct_step)
        self._stepping_inner = False
        self._made: dict[torch.Tensor, tuple[torch.Tensor, int]] = {}  # master -> (grad, version)
        self._incoming_masters: dict | None = None
        self._scratch: dict[torch.device, torch.Tensor] = {}  # one bucket, during a step
        self.bucket_mb = bucket_mb
        self._initial = {}
        self._rebuild()
        self._fused: bool | str = False
        self.fused = fused

    # -- configuration -------------------------------------------------------------------------
    @property
    def fused(self) -> bool | str:
        """The update kernel: ``"auto"``, ``"compile"`` or ``False`` (see the class docstring)."""
        return self._fused

    @fused.setter
    def fused(self, value: bool | str) -> None:
        if not any(value is v or (isinstance(value, str) and value == v) for v in _FUSED):
            raise ValueError(f"fused must be 'auto', 'compile' or False; got {value!r}")
        if value == "compile":
            kernels.check_compilable(self.inner)
        self._fused = value

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "inner" in state:  # unpickled or deep-copied: torch's pickling of the inner dropped
            self.inner.register_step_pre_hook(self._refuse_direct_step)  # its hooks

    def __repr__(self) -> str:
        return (f"MasterWeightOptimizer({len(self._master_of)} fp32 masters, fused={self.fused!r},"
                f" {self.inner!r})")

    # -- master bookkeeping --------------------------------------------------------------------
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

    def _make_master(self, param: torch.Tensor) -> nn.Parameter:
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
                 else param.detach().to(torch.float32, copy=True))
        master = nn.Parameter(value, requires_grad=param.requires_grad)
        self._master_of[param] = master
        self._model_of[master] = param
        state = self.inner.state
        if param in state:  # state made before wrapping: move it to the master, in fp32
            state[master] = {k: v.float() if torch.is_tensor(v) and v.dtype == param.dtype else v
                             for k, v in state.pop(param).items()}
        return master

    def _rebuild(self) -> None:
        """Recompute the write-back pairs and the buckets after the param groups changed."""
        pairs: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for param, master in self._master_of.items():
            params, masters = pairs.setdefault((param.device, param.dtype), ([], []))
            params.append(param)
            masters.append(master)
        self._pairs = list(pairs.values())
        held = [p for g in self.param_groups for p in g["params"]]
        self._held = {id(p) for p in held}
        self._model_params = list({id(m): m for m in (self._model_of.get(p, p)
                                                        for p in held)}.values())
        total = sum(p.numel() * 4 for p in held)
        if self.bucket_mb is not None:
            limit = self.bucket_mb * 2 ** 20
        else:
            limit = max(_MIN_BUCKET_BYTES, math.ceil(total / _BUCKETS_PER_MODEL))
        self._buckets = _buckets(self.param_groups, limit)

    def _holds(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._held

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
        if self._holds(param):
            return param
        raise ValueError(_not_ours(param))

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
        param = self._model_of.get(master)
        if param is not None:
            return param
        if master in self._master_of or self._holds(master):
            return master
        raise ValueError(_not_ours(master))

    def refresh_masters(self) -> None:
        """Copy the model parameters into the masters (after editing model weights directly)."""
        with torch.no_grad():
            for params, masters in self._pairs:
                torch._foreach_copy_(masters, params)

    # -- the loss-scaler protocol --------------------------------------------------------------
    def grads_for_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(model parameter, gradient)`` pairs the next ``step()`` reads (see the class
        docstring); parameters without a gradient are left out."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                param = self._model_of.get(p)
                if param is None:
                    grad = p.grad
                    param = p
                else:
                    grad = p.grad if p in self._made else param.grad
                if grad is not None:
                    out.append((param, grad))
        return out

    def unscale_grads_(self, inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Make the fp32 master gradients (model gradient x ``inv_scale``); return inf/NaN flag.

        See the class docstring. ``inv_scale`` is a 0-d tensor (None: 1). Any master gradients
        made by an earlier call are replaced. No host sync.

        Returns:
            A 0-d float32 tensor, > 0 when some gradient held inf or NaN, on the device of the
            first gradient (or the CPU when there is none).
        """
        self._made = {}
        made, fp32 = [], []
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    param = self._model_of.get(p)
                    if param is None:
                        if p.grad is not None:
                            if p.grad.is_sparse:
                                p.grad = p.grad.coalesce()
                            fp32.append(p.grad)
                        continue
                    p.grad = _fp32_copy(param.grad)
                    if p.grad is not None:
                        made.append((p, param))
            found = check_and_unscale_([p.grad for p, _ in made] + fp32, inv_scale)
            if inv_scale is not None:  # the model's gradients read as the true ones too
                unscale_([param.grad for _, param in made], inv_scale)
        self._made = {p: (param.grad, param.grad._version) for p, param in made}
        return found

    # -- the step ------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None, *,
             grad_scale: torch.Tensor | None = None) -> Any:
        """Step the masters from the model's gradients and write them back (see the class doc).

        Args:
            closure: re-evaluates the model and returns the loss (as for any torch optimizer);
                the model sees the current masters before each re-evaluation.
            grad_scale: the factor the model's gradients still carry (a 0-d tensor), or None.

        Returns:
            What the inner optimizer's ``step`` returns (the closure's loss, or None).

        Raises:
            RuntimeError: the model's low-precision gradients changed after ``unscale_grads_``;
                driven by ``torch.amp.GradScaler``; a ``closure`` together with ``grad_scale``.
        """
        self._refuse_torch_grad_scaler()
        if closure is not None:
            if grad_scale is not None:
                raise RuntimeError("step() takes a closure or a grad_scale, not both: a closure "
                                   "recomputes the gradients")
            self._made = {}
            return self._closure_step(closure)
        if grad_scale is not None:
            _check_grad_scale(grad_scale)
            self._made = {}
        else:
            self._check_made_grads_current()
        if self._fused == "compile":
            self._compiled_step(grad_scale)
        else:
            try:
                for bucket in self._buckets:
                    self._bucket_step(bucket, grad_scale)
            finally:
                self._scratch = {}  # transient: the fp32 bucket does not outlive the step
        self._made = {}
        return None

    def _bucket_step(self, bucket: list[list[torch.Tensor]], grad_scale) -> None:
        dense, sparse, scaled, stepped = [], [], [], []
        for tensors in bucket:
            for t in tensors:
                param = self._model_of.get(t)
                if param is None:  # an fp32 parameter: its own gradient, unscaled in place
                    if t.grad is not None and grad_scale is not None:
                        scaled.append(t.grad)
                    continue
                if t in self._made:
                    stepped.append(t)
                elif param.grad is not None:
                    (sparse if param.grad.is_sparse else dense).append(t)
                    stepped.append(t)
        with torch.no_grad():
            self._fill_grads(dense)
            for t in sparse:
                t.grad = _fp32_copy(self._model_of[t].grad)
            if grad_scale is not None:
                made = [t.grad for t in dense + sparse]
                unscale_(scaled + made, grad_scale.reciprocal())
            tensors = [t for ts in bucket for t in ts]
            fused = self._fused == "auto" and kernels.torch_fused_problem(self.inner,
                                                                          tensors) is None
            with self._only(bucket), (kernels.torch_fused(self.inner) if fused
                                      else contextlib.nullcontext()):
                self._inner_step()
            if stepped:
                torch._foreach_copy_([self._model_of[t] for t in stepped], stepped)
        for t in stepped:
            t.grad = None

    def _fill_grads(self, masters: list[torch.Tensor]) -> None:
        """Give ``masters`` fp32 gradients: views into one scratch buffer per device, reused
        from bucket to bucket within a step (fresh memory for every bucket costs page faults
        on a CPU) and dropped when the step ends."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in masters:
            by_device.setdefault(t.device, []).append(t)
        for device, group in by_device.items():
            need = sum(t.numel() for t in group)
            scratch = self._scratch.get(device)
            if scratch is None or scratch.numel() < need:
                scratch = self._scratch[device] = torch.empty(need, dtype=torch.float32,
                                                              device=device)
            views, start = [], 0
            for t in group:
                views.append(scratch[start:start + t.numel()].view(t.shape))
                start += t.numel()
            torch._foreach_copy_(views, [self._model_of[t].grad for t in group])
            for t, view in zip(group, views):
                t.grad = view

    def _compiled_step(self, grad_scale) -> None:
        inv = None if grad_scale is None else grad_scale.reciprocal()
        made = self._made

        def grad_of(master):
            return master.grad if master in made else self._model_of[master].grad

        rest = kernels.compiled_step(self.inner, self._model_of, grad_of, inv)
        scaled = [t.grad for ts in rest for t in ts if t.grad is not None]
        if inv is not None:
            with torch.no_grad():
                unscale_(scaled, inv)
        with self._only(rest):
            self._inner_step()  # always runs, so hooks and schedulers see a step
        for master in made:
            master.grad = None

    def _closure_step(self, closure: Callable[[], Any]) -> Any:
        calls = 0

        def evaluate() -> Any:
            nonlocal calls
            if calls:  # the inner optimizer moved the masters: show them to the model first
                self._write_back()
            calls += 1
            loss = closure()
            self.unscale_grads_(None)
            return loss

        loss = self._inner_step(evaluate)
        self._write_back()
        for master in self._master_of.values():
            master.grad = None
        self._made = {}
        return loss

    def _inner_step(self, closure=None) -> Any:
        self._stepping_inner = True
        try:
            return self.inner.step() if closure is None else self.inner.step(closure)
        finally:
            self._stepping_inner = False

    @contextlib.contextmanager
    def _only(self, bucket: list[list[torch.Tensor]]) -> Iterator[None]:
        """Inside the block, each param group holds only its tensors of ``bucket``."""
        saved = [group["params"] for group in self.param_groups]
        try:
            for group, tensors in zip(self.param_groups, bucket):
                group["params"] = tensors
            yield
        finally:
            for group, params in zip(self.param_groups, saved):
                group["params"] = params

    def _write_back(self) -> None:
        with torch.no_grad():
            for params, masters in self._pairs:
                torch._foreach_copy_(params, masters)

    def _check_made_grads_current(self) -> None:
        for master, (grad, version) in self._made.items():
            now = self._model_of[master].grad
            if now is not grad or now._version != version:
                name = tuple(master.shape)
                raise RuntimeError(
                    f"the model's gradient of a {self._model_of[master].dtype} parameter of "
                    f"shape {name} changed after its fp32 master gradient was made "
                    "(scaler.unscale_(optimizer) or unscale_grads_()), e.g. by "
                    "clip_grad_norm_(model.parameters(), ...); step() uses the fp32 master "
                    "gradients, so that change would be lost. Clip with "
                    "scaler.clip_grad_norm_(optimizer, max_norm), or clip the optimizer's "
                    "parameters: clip_grad_norm_([p for g in optimizer.param_groups for p in "
                    "g['params']], max_norm)")

    def _refuse_torch_grad_scaler(self) -> None:
        if "grad_scale" in self.__dict__ or "found_inf" in self.__dict__:
            raise RuntimeError(
                "a MasterWeightOptimizer can't be driven by torch.amp.GradScaler: its "
                "param_groups hold fp32 masters whose gradients are made inside step(), so "
                "GradScaler would find no inf/NaN and never adapt its scale. Use mixprec's "
                "scalers, which take the same calls: scaler = mp.DynamicLossScaler() (or "
                "mp.make_loss_scaler('auto', policy)); scaler.scale(loss).backward(); "
                "scaler.step(optimizer); scaler.update()")

    def _refuse_direct_step(self, optimizer, args, kwargs) -> None:
        if not self._stepping_inner:
            raise RuntimeError(
                f"this {type(optimizer).__name__} was wrapped in a MasterWeightOptimizer (by "
                "mixprec.prepare at level O2, or directly): its param_groups now hold fp32 "
                "master weights, which only the wrapper gives gradients, so stepping it would "
                "change nothing. Call step() and zero_grad() on the optimizer prepare returned: "
                "model, optimizer = mp.prepare(model, optimizer, level='O2')")

    def drop_master_grads(self) -> None:
        """Drop the fp32 master gradients ``unscale_grads_`` made (a scaler that skips a step
        calls this; the model's gradients stay as they are)."""
        for master in self._made:
            master.grad = None
        self._made = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model parameters' gradients and drop the masters' (made by the step or by
        ``unscale_grads_``; masters never keep a gradient buffer).

        Args:
            set_to_none: set the model's ``.grad`` to None (default) instead of zeroing it.
        """
        self._made = {}
        for master in self._master_of.values():
            master.grad = None
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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its low-precision parameters get fp32 masters.

        Raises:
            TypeError: ``param_group`` is not a dict, or its ``"params"`` is a set.
            ValueError: no ``"params"`` entry, or a parameter already in this optimizer.
        """
        if not self._set_up:  # torch's Optimizer.__init__ registering the wrapped groups
            return super().add_param_group(param_group)
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
        known = {id(self._model_of.get(p, p)) for g in self.param_groups for p in g["params"]}
        if any(id(p) in known for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        new = [p for p in params if isinstance(p, torch.Tensor) and is_low_precision(p)]
        try:
            group["params"] = self._with_masters(params)
            self.inner.add_param_group(group)
        except Exception:
            for p in new:
                self._model_of.pop(self._master_of.pop(p, None), None)
            raise
        self._rebuild()

    # -- checkpoints ---------------------------------------------------------------------------
    def indexed_masters(self) -> dict[int, torch.Tensor]:
        """Masters by their flat index over ``param_groups`` (torch's state_dict numbering)."""
        out: dict[int, torch.Tensor] = {}
        seen: set[int] = set()
        start = 0
        for group in self.param_groups:
            for i, p in enumerate(group["params"], start):
                if p in self._model_of and id(p) not in seen:
                    out[i] = p
                    seen.add(id(p))
            start += len(group["params"])
        return out


def _save_masters(optimizer: MasterWeightOptimizer, state: dict) -> dict:
    """state_dict post-hook: the fp32 masters travel under ``"master_weights"``."""
    state[MASTERS_KEY] = {i: m.detach() for i, m in optimizer.indexed_masters().items()}
    return state


def _take_masters(optimizer: MasterWeightOptimizer, state_dict: Mapping) -> dict:
    """load_state_dict pre-hook: check and set aside the saved masters (a plain torch
    optimizer's state_dict has none: the masters then keep their values)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict; got {type(state_dict).__name__}")
    state_dict = dict(state_dict)
    saved = state_dict.pop(MASTERS_KEY, None)
    if saved is not None:
        _check_saved_masters(saved, optimizer.indexed_masters())
    optimizer._incoming_masters = saved
    return state_dict


def _restore_masters(optimizer: MasterWeightOptimizer) -> None:
    """load_state_dict post-hook: share the new groups and state with the inner optimizer,
    copy the saved masters in, and write them back into the model parameters."""
    optimizer.inner.param_groups = optimizer.param_groups
    optimizer.inner.state = optimizer.state
    saved, optimizer._incoming_masters = optimizer._incoming_masters, None
    masters = optimizer.indexed_masters()
    if saved:
        with torch.no_grad():
            torch._foreach_copy_(list(masters.values()), [saved[i] for i in masters])
    optimizer._write_back()
    optimizer._made = {}


def _buckets(param_groups: list[dict], limit: float) -> list[list[list[torch.Tensor]]]:
    """Split the groups' tensors into buckets of at most ``limit`` fp32 bytes; a bucket lists,
    per group, its tensors. A tensor of ``limit`` bytes or more gets a bucket of its own; the
    smaller ones are packed in order (a per-parameter optimizer does not care which tensors it
    steps together)."""
    buckets: list[list[list[torch.Tensor]]] = []
    current, size = [[] for _ in param_groups], 0.0
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            nbytes = p.numel() * 4
            if nbytes >= limit:
                alone = [[] for _ in param_groups]
                alone[gi].append(p)
                buckets.append(alone)
                continue
            if size + nbytes > limit:
                buckets.append(current)
                current, size = [[] for _ in param_groups], 0.0
            current[gi].append(p)
            size += nbytes
    if any(current) or not buckets:
        buckets.append(current)
    return buckets


def _fp32_copy(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A new fp32 tensor holding ``grad`` (coalesced when sparse), or None."""
    if grad is None:
        return None
    grad = grad.to(torch.float32, copy=True)
    return grad.coalesce() if grad.is_sparse else grad


def _check_grad_scale(grad_scale) -> None:
    if not (isinstance(grad_scale, torch.Tensor) and grad_scale.dim() == 0
            and grad_scale.is_floating_point()):
        raise TypeError(f"grad_scale must be a 0-d floating tensor (the factor the gradients "
                        f"carry) or None; got {grad_scale!r}")


def _not_ours(tensor: torch.Tensor) -> str:
    return (f"{tensor.dtype} tensor of shape {tuple(tensor.shape)} is not a parameter (or master) "
            "of this MasterWeightOptimizer")


def _check_saved_masters(saved: Mapping[int, torch.Tensor],
                         masters: dict[int, torch.Tensor]) -> None:
    if set(saved) != set(masters):
        raise ValueError(
            f"state_dict holds fp32 masters for parameter indices {sorted(saved)}, but this "
            f"optimizer's low-precision parameters are at {sorted(masters)}; load it into an "
            "optimizer built the same way over the same model (same groups, same dtypes)")
    for i, master in masters.items():
        if tuple(saved[i].shape) != tuple(master.shape):
            raise ValueError(
                f"saved master {i} has shape {tuple(saved[i].shape)}, but the parameter has "
                f"shape {tuple(master.shape)}")
