"""Checking an optimizer ``state_dict`` against the parameters it is loaded into.

torch's ``Optimizer.load_state_dict`` checks the number of groups and of parameters per group,
then maps saved state to parameters by position; a state tensor of another shape (a checkpoint
of another model, or of reordered layers) is caught only when the update reads it, and torch's
fused CPU kernels do not check shapes at all (an AdamW moment of shape (48, 16) for a (32, 16)
parameter would be stepped). So every master optimizer runs :func:`check_before_load` as a
``load_state_dict`` pre-hook. Per parameter with saved state:

* every floating, non-scalar state tensor of torch's elementwise optimizers
  (:data:`ELEMENTWISE_OPTIMIZERS`), and the method's buffer, must have the parameter's shape;
  any other optimizer's state tensors the shape of the state it holds now under the same key,
  where it holds one (Adafactor's factored moments are its own business);
* the buffer must be in the dtype the method keeps it in (a Kahan compensation the weight's, a
  split remainder int16), and a buffer of another master method is refused (it would be read as
  the wrong half of a different number).

A mismatch is a ``ValueError`` naming the parameter (its qualified name when ``prepare`` made
the optimizer, else its group and index), the state key and both shapes or dtypes. Moments saved
in another dtype than the optimizer's ``state_dtype`` are converted after loading
(:mod:`mixprec.optim.states`); a Kahan pair is split the saved way by the method's own load hooks
(:meth:`mixprec.masters.Kahan.register_load_hooks`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .buckets import PER_PARAMETER_OPTIMIZERS
from .checkpoint import MASTERS_KEY as _MASTERS
from .states import BUFFER_KEYS, COMPENSATION_KEY, GENERATOR_KEY

__all__ = ["ELEMENTWISE_OPTIMIZERS", "check_before_load"]

#: torch optimizers whose every floating state tensor but ``step`` is shaped as its parameter.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    t for t in PER_PARAMETER_OPTIMIZERS if t.__name__ != "Adafactor")


def check_before_load(optimizer, state_dict) -> None:
    """``load_state_dict`` pre-hook: raise ValueError where ``state_dict``'s per-parameter state
    does not fit ``optimizer``'s parameters (see the module docstring; a malformed dict is left
    to torch's own checks, which follow)."""
    if not isinstance(state_dict, Mapping):
        return
    method = getattr(optimizer, "master", None)
    if method is not None and getattr(method, "compact", False) and _MASTERS in state_dict:
        raise ValueError(
            f"this optimizer state_dict holds fp32 masters ({_MASTERS!r}: saved by "
            f"master='fp32'), and this optimizer keeps master={str(method)!r}, whose masters "
            "are its weights with their buffers: loading it would drop the saved masters. Load "
            "it into an optimizer of master='fp32', or load the model's state_dict (its fp32 "
            "values) into this one and start its optimizer state afresh")
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, (list, tuple)) or not isinstance(state, Mapping):
        return
    mine = optimizer.param_groups
    if len(groups) != len(mine) or any(
            not isinstance(g, Mapping) or len(g.get("params", ())) != len(m["params"])
            for g, m in zip(groups, mine)):
        return  # torch's load_state_dict raises its own error for this
    elementwise = type(optimizer.inner) in ELEMENTWISE_OPTIMIZERS
    for gi, (saved, group) in enumerate(zip(groups, mine)):
        for pi, (index, param) in enumerate(zip(saved["params"], group["params"])):
            entry = state.get(index)
            if isinstance(entry, Mapping):
                where = f"param_groups[{gi}]['params'][{pi}]"
                _check_entry(optimizer, entry, param, elementwise, where)


def _check_entry(optimizer, entry: Mapping, param: torch.Tensor, elementwise: bool,
                 where: str) -> None:
    current = optimizer.state.get(param, {})
    mine = getattr(optimizer, "_buffer_key", None)
    for key, value in entry.items():
        if not isinstance(value, torch.Tensor) or key in ("step", GENERATOR_KEY):
            continue
        if key in BUFFER_KEYS and key != mine:
            method = getattr(optimizer, "master", "fp32")
            raise ValueError(
                f"optimizer state_dict holds a {key!r} buffer for "
                f"{optimizer.describe(param, where)}, which a master method other than this "
                f"optimizer's master={str(method)!r} keeps "
                f"({'its buffer is ' + repr(mine) if mine else 'it keeps no buffer'}). Load a "
                "state_dict saved with the same master method")
        if key in BUFFER_KEYS or (elementwise and value.is_floating_point()
                                        and value.dim() > 0):  # ASGD's eta, NAdam's mu_product
            expected = tuple(param.shape)
        else:
            now = current.get(key)
            if not isinstance(now, torch.Tensor):
                continue
            expected = tuple(now.shape)
        if tuple(value.shape) != expected:
            raise ValueError(
                f"optimizer state_dict does not fit this optimizer: state {key!r} of "
                f"{optimizer.describe(param, where)} has shape {tuple(value.shape)}, but the "
                f"parameter needs shape {expected}. Load a state_dict saved from an optimizer "
                "over the same model, with the same param groups in the same order")
        if key in BUFFER_KEYS:  # the method's own (another method's was refused above)
            weight = optimizer._model_side(param)
            want = optimizer.master.buffer_dtype(weight.dtype)
            if value.dtype != want:
                what = "Kahan compensation" if key == COMPENSATION_KEY else f"{key!r} buffer"
                raise ValueError(
                    f"optimizer state_dict holds a {value.dtype} {what} for "
                    f"{optimizer.describe(param, where)}, whose weight is {weight.dtype}; "
                    f"master={str(optimizer.master)!r} keeps it in {want}: load a state_dict "
                    "saved with the same dtype and master method")
