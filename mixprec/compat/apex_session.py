"""One ``amp.initialize``: the :class:`AmpSession` (apex's ``_amp_state``) and the loss scaling
of ``scale_loss``.

A session holds the resolved properties, the :class:`mixprec.MixedPrecision` engine the models
were prepared through, one :class:`~mixprec.compat.apex_scaler.ApexLossScaler` per ``loss_id``
and the verbosity. ``scale_loss`` keeps apex's order, which differs from the engine's on
purpose: the scaled backward, then on leaving the block the unscale and inf/NaN check of exactly
the optimizers passed (into the fp32 masters at O2) and the update of that ``loss_id``'s scale;
the skip happens at each optimizer's next ``step()``
(:class:`~mixprec.compat.apex_optimizer.AmpOptimizer`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict

import torch
from torch import nn

from ..engine import MixedPrecision
from ..scaling import owns_gradients
from ..statedict import link_masters
from .apex_models import check_models, fp32_originals, set_up_models
from .apex_optimizer import AmpOptimizer
from .apex_options import AmpProperties
from .apex_scaler import ApexLossScaler
from .apex_state import AMP

__all__ = ["AmpSession", "open_session"]


class AmpSession:
    """What one ``amp.initialize`` set up.

    Attributes:
        enabled: False after ``initialize(enabled=False)``: ``scale_loss`` yields the loss.
        properties: the :class:`~mixprec.compat.apex_options.AmpProperties` in force.
        engine: the :class:`mixprec.MixedPrecision` the models were prepared through (its
            ``policy`` and ``models``).
        scalers: one loss scaler per ``loss_id``.
        verbosity: 0 silences the overflow messages.
    """

    def __init__(self, enabled: bool, properties: AmpProperties | None = None,
                 engine: MixedPrecision | None = None,
                 scalers: list[ApexLossScaler] | None = None, verbosity: int = 1):
        self.enabled = enabled
        self.properties = properties
        self.engine = engine
        self.scalers = list(scalers or [])
        self.verbosity = verbosity

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizers, loss_id=0, model=None, delay_unscale=False,
                   delay_overflow_check=False):
        """:func:`mixprec.compat.apex_amp.scale_loss` for this session."""
        if not self.enabled:
            yield loss
            return
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise TypeError(f"loss must be a floating-point tensor; got {type(loss).__name__}")
        opts = _amp_optimizers(optimizers)
        if isinstance(loss_id, bool) or not isinstance(loss_id, int):
            raise TypeError(f"loss_id must be an integer; got {loss_id!r}")
        if not 0 <= loss_id < len(self.scalers):
            raise ValueError(f"loss_id must be in [0, num_losses) = [0, {len(self.scalers)}); "
                             f"got {loss_id} (pass num_losses to amp.initialize)")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None; got {type(model).__name__}")
        scaler = self.scalers[loss_id]
        if not self.properties.master_weights and scaler.fixed == 1.0:
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

    def state_dict(self, destination=None) -> OrderedDict:
        """The loss scalers in apex's format (a host sync per scaler)."""
        destination = OrderedDict() if destination is None else destination
        for i, scaler in enumerate(self.scalers):
            destination[f"loss_scaler{i}"] = {"loss_scale": scaler.loss_scale(),
                                              "unskipped": scaler.unskipped()}
        return destination

    def load_state_dict(self, state_dict) -> None:
        """Restore the loss scalers from :meth:`state_dict` (apex's format), in order."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict; got {type(state_dict).__name__}")
        unexpected = [k for k in state_dict if not (isinstance(k, str) and "loss_scaler" in k)]
        if unexpected:
            raise RuntimeError(f"error(s) in loading the amp state_dict: unexpected key(s) "
                               f"{', '.join(map(repr, unexpected))}")
        if len(state_dict) != len(self.scalers):
            warnings.warn(f"the amp state_dict holds {len(state_dict)} loss scaler(s) and "
                          f"{len(self.scalers)} are in use (num_losses); loading the first "
                          f"{min(len(state_dict), len(self.scalers))}", UserWarning,
                          stacklevel=3)
        for scaler, (key, entry) in zip(self.scalers, state_dict.items()):
            if not isinstance(entry, dict) or set(entry) != {"loss_scale", "unskipped"}:
                raise ValueError(f"state_dict[{key!r}] must be a dict with keys 'loss_scale' "
                                 f"and 'unskipped'; got {entry!r}")
            scaler.load(entry["loss_scale"], entry["unskipped"])


def open_session(models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 props: AmpProperties, *, cast_model_outputs, num_losses: int, verbosity: int,
                 min_loss_scale, max_loss_scale) -> tuple[AmpSession, list[AmpOptimizer]]:
    """Check, then set up ``models`` and ``optimizers`` for ``props``; return the session and
    the optimizers to use from now on (arguments as :func:`~mixprec.compat.apex_amp.initialize`
    takes them, validated).

    Raises:
        RuntimeError: a model or optimizer apex refused (see :func:`check_models`), or an
            optimizer passed to ``initialize`` before.
        ValueError: bad loss-scale bounds; an optimizer over none of the models' parameters.
    """
    scalers = [ApexLossScaler(props.loss_scale, min_loss_scale, max_loss_scale)
               for _ in range(num_losses)]
    check_models(models)
    _check_optimizers(optimizers, models)
    if verbosity > 0:
        _print_rank0(f"mixprec apex_amp: opt_level {props.brief()}\n{props.table()}")
    originals = fp32_originals(models) if props.master_weights else None
    engine = set_up_models(models, props, cast_model_outputs)
    amp_opts = [AmpOptimizer(opt, bool(props.master_weights), originals, verbosity)
                for opt in optimizers]
    if props.cast_model_type and not props.master_weights:
        for opt in optimizers:  # recast state made before initialize to the parameters' dtype
            if opt.state:
                opt.load_state_dict(opt.state_dict())
    masters = [opt.inner for opt in amp_opts if owns_gradients(opt.inner)]
    if masters:  # the models' state_dict() holds the exact fp32 masters, as at mixprec's O2
        for model in models:
            link_masters(model, masters)
    AMP.initialized.update(optimizers)
    return AmpSession(True, props, engine, scalers, verbosity), amp_opts


def _check_optimizers(optimizers: list[torch.optim.Optimizer], models: list) -> None:
    owned = {id(p) for model in models for p in model.parameters()}
    for opt in optimizers:
        if isinstance(opt, AmpOptimizer) or opt in AMP.initialized:
            raise RuntimeError("a given optimizer should be passed through amp.initialize only "
                               "once; build a new one for a new initialize")
        if owns_gradients(opt):
            raise RuntimeError("pass the plain torch optimizer: amp.initialize adds fp32 master "
                               "weights itself (master_weights=True, the O2 default)")
        params = [p for g in opt.param_groups for p in g["params"]]
        if params and not any(id(p) in owned for p in params):  # (apex takes a few tensors
            raise ValueError(                                      # of their own beside them)
                f"the optimizer holds none of the parameters of the models passed to "
                f"initialize (its {len(params)} tensors have shapes "
                f"{', '.join(str(tuple(p.shape)) for p in params[:3])}"
                f"{', ...' if len(params) > 3 else ''}): the models would not train; build it "
                f"from model.parameters() of the models you pass")


def _amp_optimizers(optimizers) -> list[AmpOptimizer]:
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    for opt in opts:
        if not isinstance(opt, AmpOptimizer):
            raise TypeError(f"scale_loss needs the optimizer(s) returned by amp.initialize "
                            f"(model, optimizer = amp.initialize(model, optimizer)); got "
                            f"{type(opt).__name__}")
    return opts


def _print_rank0(message: str) -> None:
    """Print on rank 0 only (everywhere without torch.distributed), as apex did."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_rank()):
        print(message)
