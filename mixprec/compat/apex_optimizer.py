"""The optimizer ``amp.initialize`` returns: a ``torch.optim.Optimizer`` wrapping the user's.

apex patched the user's optimizer in place (``optimizer._amp_stash``, a replaced ``step``). Here
the returned object wraps it instead: ``param_groups``, ``state`` and ``defaults`` are the inner
optimizer's (LR schedulers work), ``state_dict()``/``load_state_dict()`` are the inner one's
(with the fp32 masters at O2), and ``step()`` is skipped, exactly once, after a ``scale_loss``
block over this optimizer found inf/NaN gradients, leaving parameters and optimizer state
bitwise untouched.

Gradient bookkeeping follows apex, so several ``scale_loss`` blocks (several losses, each with
its own scale) can feed one optimizer before its ``step()``: on entering a block the gradients
already unscaled by earlier blocks are set aside, the block's backward writes fresh (scaled)
gradients, and on exit those are unscaled (into the fp32 masters at O2) and the set-aside ones
added back. Only the fresh gradients are checked for inf/NaN.

The fp32 masters are driven through the scaler protocol only
(:class:`mixprec.scaling.OwnsGradients`): ``grads_for_step()`` names the gradients the step
reads, ``unscale_grads_()`` makes the unscaled fp32 ones, ``drop_master_grads()`` drops them on
a skipped step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..optim import MasterWeightOptimizer
from ..optim.hooks import raw_step, share_hooks
from ..scaling import owns_gradients
from ..scaling.unscale import unscale_and_check_

__all__ = ["AmpOptimizer"]


class AmpOptimizer(torch.optim.Optimizer):
    """What ``amp.initialize`` returns for each optimizer (see the module docstring).

    Args:
        optimizer: the user's ``torch.optim.Optimizer``.
        master_weights: wrap it in a :class:`mixprec.MasterWeightOptimizer` (fp32 masters of the
            low-precision parameters; apex's O2).
        originals: parameter -> its fp32 value taken before the model was cast; masters start
            from these exact values.
        verbosity: > 0 prints a line when a step is skipped, as apex did.

    Attributes:
        inner: the optimizer stepped: the user's, or the MasterWeightOptimizer around it.
    """

    _set_up = False  # False while torch's Optimizer.__init__ registers the groups

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool,
                 originals: dict[torch.Tensor, torch.Tensor] | None = None,
                 verbosity: int = 1):
        inner = (MasterWeightOptimizer(optimizer, initial_masters=originals) if master_weights
                 else optimizer)
        self.inner = inner
        self.verbosity = verbosity
        # torch's own set-up (hooks, step profiling), then share the inner optimizer's groups,
        # state and defaults
        super().__init__([dict(g) for g in inner.param_groups], inner.defaults)
        self._share()
        # one set of hook dicts with the inner optimizer: a hook registered on either (or
        # torch's global ones) runs once per step(), here; the inner one is stepped raw
        share_hooks(self, inner, refuse=False)
        self._set_up = True
        self._live = False            # param_groups' gradients are unscaled ones since step()
        self.scaled_pending = False   # a delay_unscale block left scaled model gradients
        self._set_aside: dict[torch.Tensor, torch.Tensor] = {}
        self._overflows: list[tuple[int, torch.Tensor, Any]] = []  # since step(): id, flag, scaler

    def _share(self) -> None:
        """One truth: this object's groups, state and defaults are the inner optimizer's."""
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __repr__(self) -> str:
        return f"apex_amp.AmpOptimizer({self.inner!r})"

    # -- the scale_loss protocol ---------------------------------------------------------------
    def prepare_backward(self) -> None:
        """On entering a ``scale_loss`` block: set aside gradients the backward must not mix
        with, and clear them so that the backward writes fresh ones.

        An fp32 parameter's gradient is set aside whatever it holds (apex accumulated into it);
        a gradient the step reads through a master (a 16-bit parameter's) only when an earlier
        block unscaled it since the last step (otherwise it is stale and dropped, as in apex).
        """
        own = self._held()
        self._set_aside = {}
        for param, grad in self._step_grads():
            if id(param) in own:
                self._set_aside[param] = grad
            elif self._live:
                self._set_aside[param] = grad.float()
            param.grad = None
        if owns_gradients(self.inner):
            self.inner.drop_master_grads()

    def post_backward(self, inv_scale: torch.Tensor, device: torch.device) -> torch.Tensor:
        """On leaving a block: unscale the fresh gradients, add back the set-aside ones.

        Returns the inf/NaN flag of the fresh gradients (0-d tensor, no host sync).
        """
        own = self._held()
        if owns_gradients(self.inner):
            # a master with a set-aside gradient and none fresh: give its model parameter a
            # zero gradient, so that the optimizer makes (and later steps) the master gradient
            for param in self._set_aside:
                if id(param) not in own and param.grad is None:
                    param.grad = torch.zeros_like(param)
            found = self.inner.unscale_grads_(inv_scale)
        else:
            found = unscale_and_check_(self.param_groups, inv_scale, device)
        fresh = {id(p): g for p, g in self._step_grads()}
        grads, extra = [], []
        for param, g in self._set_aside.items():
            now = fresh.get(id(param))
            if now is None:
                param.grad = g
            else:
                grads.append(now)
                extra.append(g)
        if grads:
            with torch.no_grad():
                torch._foreach_add_(grads, extra)
        self._set_aside = {}
        self._live = True
        self.scaled_pending = False
        return found

    def _held(self) -> set[int]:
        """ids of the tensors in param_groups (a 16-bit parameter is read through a master)."""
        return {id(t) for group in self.param_groups for t in group["params"]}

    def _step_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (parameter, gradient) pairs the next step reads: the gradient tensors
        themselves, so that an in-place change is what the step uses."""
        if owns_gradients(self.inner):
            return self.inner.grads_for_step()
        return [(p, p.grad) for group in self.param_groups for p in group["params"]
                if p.grad is not None]

    def record_overflow(self, loss_id: int, found: torch.Tensor, scaler) -> None:
        """Remember a dynamic block's flag: the next ``step()`` is skipped if any is set."""
        self._overflows.append((loss_id, found, scaler))

    # -- the torch.optim.Optimizer surface -----------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the inner optimizer, unless a ``scale_loss`` block since the last step overflowed.

        One host sync (reading the overflow flags) when a dynamic ``scale_loss`` block ran.

        Raises:
            RuntimeError: a closure with fp32 master weights or with a pending skip (as apex).
        """
        owner = owns_gradients(self.inner)
        overflowed = self._read_overflow()
        if closure is not None and (overflowed is not None or owner):
            raise RuntimeError("amp optimizers with master weights, or after a gradient overflow, "
                               "do not take a closure (as apex): compute the loss, backward it "
                               "inside amp.scale_loss, then call optimizer.step()")
        self._live = False
        if overflowed is not None:
            if owner:
                self.inner.drop_master_grads()
            if self.verbosity > 0:
                loss_id, scale = overflowed
                print(f"apex_amp: gradient overflow, skipping this step; loss scaler {loss_id} "
                      f"reduced the loss scale to {scale}")
            return None
        return raw_step(self.inner, closure)

    def _read_overflow(self) -> tuple[int, float] | None:
        """(loss_id, its scale now) of the first overflowing block since step(), or None."""
        records, self._overflows = self._overflows, []
        if not records:
            return None
        flags = torch.stack([f.to(records[0][1].device) for _, f, _ in records]).tolist()
        for (loss_id, _, scaler), flag in zip(records, flags):
            if flag > 0:
                return loss_id, scaler.loss_scale()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model gradients (and the masters' at O2)."""
        self.inner.zero_grad(set_to_none=set_to_none)
        self._live = False
        self.scaled_pending = False
        self._set_aside = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the inner optimizer (fp16 parameters get fp32 masters at O2)."""
        if not self._set_up:  # torch's Optimizer.__init__ registering the shared groups
            return super().add_param_group(param_group)
        self.inner.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict (at O2 with the fp32 masters, so a resume is exact)."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load a state_dict from :meth:`state_dict` (or from a plain torch optimizer)."""
        self.inner.load_state_dict(state_dict)
        self._share()  # torch's load_state_dict gave the inner optimizer new groups and state
        self._live = False
        self.scaled_pending = False
        self._overflows = []
