"""fp32 master weights for low-precision parameters: ``MasterWeightOptimizer``, ``fp32_state_dict``.

Why masters: a bf16 weight near 1.0 has an ulp of 2**-7. An update smaller than half of that
(2**-8) rounds away completely, on every step, so a model whose weights live in bf16 (or fp16)
silently stops learning wherever updates are small. Keeping an fp32 copy of each low-precision
weight (the master), applying the optimizer to it and writing the rounded result back lets those
small updates accumulate until they move the low-precision weight.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from . import kernels as _fusedstep

__all__ = ["MasterWeightOptimizer", "fp32_state_dict", "is_master_optimizer", "needs_master"]

# Key of the fp32 master weights in ``MasterWeightOptimizer.state_dict()``.
MASTERS_KEY = "master_weights"


def needs_master(tensor: torch.Tensor) -> bool:
    """True for a floating tensor narrower than fp32 (bf16, fp16, fp8): it gets an fp32 master."""
    return tensor.is_floating_point() and tensor.element_size() < 4


def is_master_optimizer(optimizer: Any) -> bool:
    """True when ``optimizer`` is a :class:`MasterWeightOptimizer`."""
    return isinstance(optimizer, MasterWeightOptimizer)


class MasterWeightOptimizer(torch.optim.Optimizer):
    """An optimizer that steps fp32 master copies of low-precision parameters.

    Wraps a torch optimizer built over a model's parameters. Every parameter narrower than fp32
    (bf16, fp16) is replaced, in the inner optimizer's ``param_groups``, by an fp32 master copy;
    fp32 (and fp64) parameters stay as they are. Each ``step()`` copies the model gradients into
    the masters' fp32 gradients, steps the inner optimizer on the masters and writes the masters
    back into the model parameters, rounded to nearest even. Optimizer state (momentum, Adam
    moments) therefore lives in fp32 too.

    Contract for loss scalers and gradient clipping:
        * ``param_groups`` IS ``inner.param_groups``: it holds the masters (and the fp32 model
          parameters), so ``torch.optim.lr_scheduler`` schedulers and code that edits ``"lr"``
          work unchanged.
        * ``sync_grads()`` copies every model gradient into its master's ``.grad`` (fp32, one
          ``torch._foreach_copy_`` per device/dtype into buffers kept between steps). A model
          parameter whose ``.grad`` is None gives a master ``.grad`` of None. After it, every
          tensor in ``param_groups`` with a gradient has an fp32 (or fp64) gradient that may be
          unscaled or clipped in place. It is idempotent until the next ``step()``,
          ``zero_grad()`` or ``load_state_dict()``: calling it again does not overwrite
          gradients already unscaled.
        * ``step()`` calls ``sync_grads()`` unless it already ran, so a scaler that skips a step
          simply does not call ``step()``; masters, model parameters and state stay untouched.

    Host-device synchronisation: none of ``sync_grads()``, ``step()``, ``zero_grad()``,
    ``state_dict()``, ``load_state_dict()`` adds one (all copies are asynchronous device ops);
    the inner optimizer's own step behaves as it would unwrapped.

    Memory: each low-precision parameter costs an fp32 master plus an fp32 gradient buffer that
    stays allocated between steps (``zero_grad(set_to_none=True)`` still sets every ``.grad``,
    model and master, to None). Wrap after the model is cast and moved to its device; after
    editing model weights directly, call ``refresh_masters()``.

    Fused step (``fused=True``, opt-in): for ``torch.optim.SGD`` and ``Adam``/``AdamW`` (see
    ``mixprec._fusedstep.SUPPORTED``), ``step()`` updates each low-precision parameter in one
    ``torch.compile``-d elementwise pass that reads its gradient (the model's low-precision
    gradient, or the fp32 master gradient when ``sync_grads()`` ran, e.g. in a scaler's
    ``unscale_``), the master and the optimizer state, and writes master, state and the rounded
    model parameter; no fp32 gradient buffer is written. fp32 parameters go through the inner
    optimizer's own step. State keys are torch's, so state dicts and ``fused`` can be switched
    freely; results agree with the unfused step to a few fp32 ulps. Hyper-parameters reach the
    kernel as tensors: schedulers do not recompile. The first step compiles (seconds on a CPU;
    dynamic shapes, one compile per kernel and parameter/gradient dtype pair), so it needs a
    working ``torch.compile`` (a C++ compiler on CPU, Triton on GPU). No host sync is added,
    except reading Adam's ``step`` when that state lives on a GPU.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters (bf16/fp16/fp32 mixed
            freely, several param groups, tied parameters listed once). Any state it already
            holds is moved to the masters and cast to fp32.
        fused: use the fused step (also settable later through the ``fused`` attribute).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: ``optimizer`` is already a ``MasterWeightOptimizer``, or holds a
            low-precision tensor that is not a leaf, or ``fused=True`` with an optimizer or
            option the fused step does not support.

    Example:
        >>> model = nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> opt.master_param(model.weight).dtype
        torch.float32
    """

    def __init__(self, optimizer: torch.optim.Optimizer, fused: bool = False) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            raise ValueError(
                "optimizer is already a MasterWeightOptimizer (around "
                f"{type(optimizer.inner).__name__}); wrap the plain torch optimizer only once"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer, e.g. "
                f"torch.optim.SGD(model.parameters(), lr=0.1); got {type(optimizer).__name__}"
            )
        self.inner = optimizer
        for name in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                     "load_state_dict_pre", "load_state_dict_post"):
            setattr(self, f"_optimizer_{name}_hooks", OrderedDict())
        self._patch_step_function()  # torch's own step-hook machinery (register_step_pre_hook)
        self._master_of: dict[torch.Tensor, nn.Parameter] = {}  # model param -> master
        self._model_of: dict[torch.Tensor, torch.Tensor] = {}  # master -> model param
        self._grad_bufs: dict[torch.Tensor, torch.Tensor] = {}  # master -> its fp32 grad buffer
        self._synced = False
        self._seen_grads: list = []
        for group in optimizer.param_groups:  # in place: some optimizers (LBFGS) keep the list
            group["params"][:] = self._replace_with_masters(group["params"])
        self._rebuild_buckets()
        self._fused = False
        self.fused = fused

    @property
    def fused(self) -> bool:
        """Whether ``step()`` runs the fused master step (see the class docstring)."""
        return self._fused

    @fused.setter
    def fused(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"fused must be True or False; got {value!r}")
        if value:
            _fusedstep.check_supported(self.inner)
        self._fused = value

    # -- forwarded attributes ------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's param groups (holding masters); edit ``"lr"`` here."""
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's state, keyed by master (fp32) tensors."""
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's defaults."""
        return self.inner.defaults

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({len(self._master_of)} fp32 masters, {self.inner!r})"

    # -- master bookkeeping --------------------------------------------------------------------
    def _replace_with_masters(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizer params must be Tensors; got {type(p).__name__}")
            if needs_master(p):
                master = self._master_of.get(p)
                out.append(self._make_master(p) if master is None else master)
            else:
                out.append(p)
        return out

    def _make_master(self, param: torch.Tensor) -> nn.Parameter:
        if not param.is_leaf:
            raise ValueError(
                f"can't keep a master for a non-leaf {param.dtype} tensor of shape "
                f"{tuple(param.shape)}; pass the model's parameters (leaf tensors)"
            )
        master = nn.Parameter(param.detach().to(torch.float32, copy=True),
                              requires_grad=param.requires_grad)
        self._master_of[param] = master
        self._model_of[master] = param
        state = self.inner.state
        if param in state:  # state made before wrapping: move it to the master, in fp32
            state[master] = {k: v.float() if torch.is_tensor(v) and v.dtype == param.dtype else v
                             for k, v in state.pop(param).items()}
        return master

    def _rebuild_buckets(self) -> None:
        buckets: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for param, master in self._master_of.items():
            params, masters = buckets.setdefault((param.device, param.dtype), ([], []))
            params.append(param)
            masters.append(master)
        self._buckets = list(buckets.values())
        seen: dict[int, torch.Tensor] = {}
        for group in self.inner.param_groups:
            for p in group["params"]:
                model_p = self._model_of.get(p, p)
                seen.setdefault(id(model_p), model_p)
        self._model_params = list(seen.values())
        self._held = {id(p) for g in self.inner.param_groups for p in g["params"]}

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

    # -- the hot path --------------------------------------------------------------------------
    def sync_grads(self) -> None:
        """Copy model gradients into the masters' fp32 ``.grad`` (see the class docstring)."""
        if self._synced and self._grads_unchanged():
            return
        for params, masters in self._buckets:
            dst, src = [], []
            for p, m in zip(params, masters):
                g = p.grad
                if g is None or g.is_sparse:
                    m.grad = None if g is None else g.float()
                    continue
                buf = self._grad_bufs.get(m)
                if buf is None:
                    buf = self._grad_bufs[m] = torch.empty_like(m)
                if m.grad is not buf:
                    m.grad = buf
                dst.append(buf)
                src.append(g)
            if dst:
                with torch.no_grad():
                    torch._foreach_copy_(dst, src)
        self._synced = True
        self._seen_grads = [(weakref.ref(g), g._version) if g is not None else None
                            for g in (p.grad for p in self._master_of)]

    def _grads_unchanged(self) -> bool:
        """True while every low-precision model gradient is the tensor, at the version, synced.

        Catches ``model.zero_grad()`` (new tensors or in-place zeroing) and a new backward after
        a skipped step, which must not leave stale (e.g. inf) master gradients behind.
        """
        seen = self._seen_grads
        for p, rec in zip(self._master_of, seen):
            g = p.grad
            if rec is None or g is None:
                if rec is not g:
                    return False
            elif rec[0]() is not g or rec[1] != g._version:
                return False
        return len(seen) == len(self._master_of)

    def _write_back(self) -> None:
        with torch.no_grad():
            for params, masters in self._buckets:
                torch._foreach_copy_(params, masters)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Sync gradients (unless already synced), step the inner optimizer, write back.

        With ``fused=True``: one compiled pass per low-precision parameter instead (reading the
        fp32 master gradient if ``sync_grads()`` ran since the last backward, else the model's
        gradient), then the inner optimizer's step over the fp32 parameters only.

        Args:
            closure: re-evaluates the model and returns the loss (as for any torch optimizer);
                the model sees the current masters before each re-evaluation.

        Returns:
            What the inner optimizer's ``step`` returns (the closure's loss, or None).
        """
        if self._fused:
            return self._fused_step(closure)
        if closure is None:
            self.sync_grads()
            loss = self.inner.step()
        else:
            loss = self.inner.step(self._wrap_closure(closure))
        self._write_back()
        self._synced = False
        return loss

    def _fused_step(self, closure: Callable[[], Any] | None) -> Any:
        loss = None
        if closure is not None:  # evaluated once, before the update, as torch's SGD/Adam do
            with torch.enable_grad():
                loss = closure()
            self._synced = False
        master_grads = self._synced and self._grads_unchanged()
        _fusedstep.fused_step(self.inner, self._model_of, master_grads)
        self._synced = False
        return loss

    def _wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        calls = 0

        def evaluate() -> Any:
            nonlocal calls
            if calls:  # the inner optimizer moved the masters: show them to the model first
                self._write_back()
            calls += 1
            self._synced = False
            loss = closure()
            self.sync_grads()
            return loss

        return evaluate

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model parameters and of the masters.

        Args:
            set_to_none: set ``.grad`` to None (default; the masters' fp32 buffers stay
                allocated for the next step) instead of filling it with zeros.
        """
        self._synced = False
        tensors = [*self._model_params, *self._master_of.values()]
        if set_to_none:
            for t in tensors:
                t.grad = None
            return
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            g = t.grad
            if g is not None:
                g.detach_() if g.grad_fn is not None else g.requires_grad_(False)
                grads.setdefault((g.device, g.dtype), []).append(g)
        with torch.no_grad():
            for same in grads.values():
                torch._foreach_zero_(same)

    def refresh_masters(self) -> None:
        """Copy the model parameters into the masters (after editing model weights directly)."""
        with torch.no_grad():
            for params, masters in self._buckets:
                torch._foreach_copy_(masters, params)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its low-precision parameters get fp32 masters.

        Raises:
            TypeError: ``param_group`` is not a dict, or its ``"params"`` is a set.
            ValueError: no ``"params"`` entry, or a parameter already in this optimizer.
        """
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
        new = [p for p in params if isinstance(p, torch.Tensor) and needs_master(p)]
        try:
            group["params"] = self._replace_with_masters(params)
            self.inner.add_param_group(group)
        except Exception:
            for p in new:
                self._model_of.pop(self._master_of.pop(p, None), None)
            raise
        self._rebuild_buckets()

    # -- checkpoints ---------------------------------------------------------------------------
    def _indexed_masters(self) -> dict[int, torch.Tensor]:
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

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict plus the fp32 masters under ``"master_weights"``.

        Returns:
            ``{"state", "param_groups", "master_weights": {flat param index: fp32 tensor}}``;
            tensors are references, as with torch optimizers (``torch.save`` or deep-copy it).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = self.inner.state_dict()
        state[MASTERS_KEY] = {i: m.detach() for i, m in self._indexed_masters().items()}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state = post_hook(self, state) or state
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a ``state_dict()``: masters, inner state, then re-sync the model parameters.

        A plain torch optimizer state_dict (no ``"master_weights"``) is accepted too: the
        masters then keep their current values.

        Raises:
            TypeError: ``state_dict`` is not a mapping.
            ValueError: the saved masters do not match this optimizer's low-precision params.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict; got {type(state_dict).__name__}")
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        state_dict = dict(state_dict)
        saved = state_dict.pop(MASTERS_KEY, None)
        masters = self._indexed_masters()
        if saved is not None:
            _check_saved_masters(saved, masters)
        self.inner.load_state_dict(state_dict)
        if saved:
            with torch.no_grad():
                torch._foreach_copy_(list(masters.values()), [saved[i] for i in masters])
        self._write_back()
        self._synced = False
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _not_ours(tensor: torch.Tensor) -> str:
    return (f"{tensor.dtype} tensor of shape {tuple(tensor.shape)} is not a parameter (or master) "
            "of this MasterWeightOptimizer")


def _check_saved_masters(saved: Mapping[int, torch.Tensor],
                         masters: dict[int, torch.Tensor]) -> None:
    if set(saved) != set(masters):
        raise ValueError(
            f"state_dict holds fp32 masters for parameter indices {sorted(saved)}, but this "
            f"optimizer's low-precision parameters are at {sorted(masters)}; load it into an "
            "optimizer built the same way over the same model (same groups, same dtypes)"
        )
    for i, master in masters.items():
        if tuple(saved[i].shape) != tuple(master.shape):
            raise ValueError(
                f"saved master {i} has shape {tuple(saved[i].shape)}, but the parameter has "
                f"shape {tuple(master.shape)}"
            )


def fp32_state_dict(model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> OrderedDict[str, Any]:
    """An fp32 copy of ``model.state_dict()``, taking weights from fp32 masters where they exist.

    Floating parameters and buffers are returned as fp32 copies (low-precision weights whose
    master lives in ``optimizer`` are taken from the master, so no precision is lost); integer
    buffers are copied unchanged. The result loads into an fp32 copy of the model.

    Args:
        model: the (possibly low-precision) model.
        optimizer: its ``MasterWeightOptimizer``; None, or another torch optimizer, means no
            masters (weights are upcast from the model).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``optimizer`` not an optimizer.
        ValueError: ``optimizer`` is a ``MasterWeightOptimizer`` over another model's params.

    Example:
        >>> model = nn.Linear(2, 2).to(torch.bfloat16)
        >>> fp32_state_dict(model)["weight"].dtype
        torch.float32
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be None or a torch.optim.Optimizer; got {type(optimizer).__name__}"
        )
    masters = optimizer._master_of if is_master_optimizer(optimizer) else {}
    source = model.state_dict(keep_vars=True)
    if masters and not any(torch.is_tensor(v) and v in masters for v in source.values()):
        raise ValueError("optimizer holds none of this model's parameters; pass the optimizer "
                         "that was built over this model")
    out: OrderedDict[str, Any] = OrderedDict()
    with torch.no_grad():
        for name, value in source.items():
            if not torch.is_tensor(value):
                out[name] = value  # extra state
                continue
            value = masters.get(value, value).detach()
            out[name] = (value.to(torch.float32, copy=True) if value.is_floating_point()
                         else value.clone())
    out._metadata = getattr(source, "_metadata", None)  # type: ignore[attr-defined]
    return out
