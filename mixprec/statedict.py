"""fp32 weights: a prepared model's ``state_dict()`` (:mod:`mixprec.fp32export` copies them out
for any model: ``mp.fp32_state_dict``).

At O2 each trained low-precision parameter has an fp32 companion: its master in the optimizer
``prepare`` wrapped; under ``master="split"`` the exact master the weight and its remainder
hold, under ``"kahan"`` the weight plus its compensation (the best fp32 estimate), under
``"stochastic"`` the weight's upcast (computed when read, so an in-place
write into a ``state_dict()`` value does not reach the model there). ``state_dict()``
returns the companions themselves (detached), so it holds
the exact fp32 values, loads into a plain fp32 model, and an in-place write into a value (an EMA
that updates ``ema.state_dict()`` values, as timm's does) updates the model.
``load_state_dict`` sets the companions exactly and the parameters to their rounding. Other
low-precision tensors (O3, buffers) come back as exact fp32 upcasts.

A copy of a prepared model (``copy.deepcopy``, ``pickle``, ``torch.save``) carries the
companions' values with it as fp32 shadows, so a best-model snapshot or an EMA copy keeps the
fp32 weights. Companions and parameters are kept consistent: before ``state_dict()`` reads them,
a companion whose rounding no longer equals its parameter (the parameter was changed directly)
takes the parameter's value there; in a copy, a shadow written in place (through
``state_dict()`` values) is rounded into its parameter before the next forward.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .dtypes import is_low_precision
from .optim import CompactMasterOptimizer
from .optim.wrapper import owner_of
from .optim.writes import check_resized, rounds_to
from .regions import Entry

__all__ = ["Companions", "companions_of", "enclosing_companions", "links_of", "link_masters",
           "register_fp32_state_dict"]

_LINK_ATTR = "_mixprec_masters"
_FP32 = torch.float32


class Companions:
    """The fp32 values behind a prepared model's low-precision parameters.

    Live: the masters of a ``MasterWeightOptimizer`` (held weakly: the model does not keep its
    optimizer alive). A copy: fp32 shadows, one per parameter, owned by the copy.
    """

    def __init__(self, optimizers=(), model: nn.Module | None = None):
        self._refs = [weakref.ref(opt) for opt in optimizers]
        self._shadows: dict[torch.Tensor, torch.Tensor] = {}
        self._versions: dict[torch.Tensor, tuple[int, int]] = {}
        self._model = None if model is None else weakref.ref(model)  # (whose values to keep)

    def relink(self) -> None:
        """A copy made together with its optimizer (``copy.deepcopy((model, opt))``, pickle, a
        ``torch.save`` of both): once every shadowed parameter is stepped by a live master
        optimizer (the copied one), its masters are the companions again, as the original's."""
        if self._refs or not self._shadows:
            return
        owners = {id(o): o for o in map(owner_of, self._shadows)}
        if owners and None not in owners.values():
            self._refs = [weakref.ref(o) for o in owners.values()]
            self._shadows, self._versions = {}, {}
            for opt in owners.values():  # (told when it is collected, as the original's)
                opt.__dict__.setdefault("_companions", []).append(self)

    def pairs(self) -> dict[torch.Tensor, torch.Tensor]:
        """Low-precision parameter -> its fp32 companion."""
        self.relink()
        if self._refs:
            pairs: dict[torch.Tensor, torch.Tensor] = dict(self._shadows)
            for ref in self._refs:
                opt = ref()
                if opt is not None:
                    pairs.update(opt.masters_by_param())
            return pairs
        return self._shadows

    def keep(self, values: dict) -> None:
        """Hold ``values`` (parameter -> fp32 value) as shadows: parameters no live optimizer
        here steps (a later fit that trains part of the model)."""
        self._shadows.update(values)
        self._record()

    def orphaned(self, opt) -> None:
        """``opt`` (one of the optimizers whose masters these are) is being collected: its
        fp32 values stay with the model as shadows, as a copy's (the model's ``state_dict()``
        held the 16-bit weights upcast once the optimizer was gone)."""
        live = [ref for ref in self._refs if ref() is not None and ref() is not opt]
        if len(live) == len(self._refs):  # (the collector clears the weak references to an
            return                         # object before its finalizer runs)
        model = None if self.__dict__.get("_model") is None else self._model()
        own = None if model is None else {id(p) for p in model.parameters()}
        with torch.no_grad():  # (an optimizer may step several models: apex's initialize)
            values = {p: v.detach() for p, v in opt.masters_by_param().items()
                      if own is None or id(p) in own}
        self._refs = live
        self._shadows.update(values)
        self._record()

    def optimizers(self) -> list:
        """The live optimizers whose masters these are (none for a copy)."""
        return [opt for opt in (ref() for ref in self._refs) if opt is not None]

    def load(self, param: torch.Tensor, comp: torch.Tensor, value: torch.Tensor
             ) -> torch.Tensor:
        """Set ``param``'s companion ``comp`` to ``value`` exactly and return what torch's load
        must then write into ``param``: ``value`` (rounded by torch's cast, as fp32 masters
        write their weights), or, for a compact optimizer, whose companion is computed, the
        weight it set with the compensation (a split weight rounds exact ties away from zero:
        torch's cast of ``value`` would not match the remainder there)."""
        for ref in self._refs:
            opt = ref()
            if isinstance(opt, CompactMasterOptimizer) and opt.compensation(param) is not None:
                opt.load_fp32_(param, value)
                return param.detach().clone()
        comp.copy_(value)
        return value

    @property
    def is_copy(self) -> bool:
        return not self._refs

    def settle(self) -> dict[torch.Tensor, torch.Tensor]:
        """Make every companion consistent with its parameter, then return the pairs (one host
        sync per parameter: state_dict time only)."""
        self.relink()
        self.follow_writes()
        for opt in self.optimizers():  # writes made outside their steps (mixprec.optim.writes)
            check_resized(opt)
            opt.follow_writes()
        pairs = self.pairs()
        self._record()
        return pairs

    def follow_writes(self) -> None:
        """In a copy: round a shadow written in place into its parameter; take a parameter
        written in place into its shadow (cheap: version counters only)."""
        if not self._shadows:
            return
        with torch.no_grad():
            for param, shadow in self._shadows.items():
                pv, sv = self._versions.get(param, (None, None))
                if _version(shadow) != sv and _version(param) == pv:
                    param.copy_(shadow)
                elif _version(param) != pv and _version(shadow) == sv:
                    # the parameter's value where the shadow no longer rounds to it (a write
                    # of the values it held, a sub-module's own state dict loaded back, keeps
                    # the shadow: as a live master follows a direct write, optim.writes)
                    shadow.copy_(torch.where(rounds_to(shadow, param), shadow, param))
        self._record()

    def _record(self) -> None:
        if self._shadows:
            self._versions = {p: (_version(p), _version(s)) for p, s in self._shadows.items()}

    def __getstate__(self) -> dict:
        # copies: a master detached shares its storage, and a pickle of the model with its
        # optimizer would make the copy's shadows the copied masters themselves (a shadow
        # following its weight then wrote the 16-bit value into the master)
        return {"shadows": {p: c.detach().clone() for p, c in self.settle().items()}}

    def __setstate__(self, state: dict) -> None:
        self._refs = []
        self._shadows = dict(state["shadows"])
        self._versions = {}
        self._record()


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for a tensor made under ``torch.inference_mode`` (a copy
    taken there), which has none: its writes are not followed."""
    return None if t.is_inference() else t._version


def link_masters(model: nn.Module, optimizers: list) -> None:
    """Make the ``optimizers``' masters the fp32 companions of ``model``'s parameters (each
    optimizer tells them when it is collected: :meth:`Companions.orphaned`)."""
    link = Companions(optimizers, model)
    setattr(model, _LINK_ATTR, link)
    for opt in optimizers:
        opt.__dict__.setdefault("_companions", []).append(link)


def companions_of(model: nn.Module) -> Companions | None:
    """The companions of a prepared model, or None."""
    return getattr(model, _LINK_ATTR, None)


def enclosing_companions(module: nn.Module) -> Companions | None:
    """The companions of the prepared model ``module`` is a sub-module of (read from the load
    hook :func:`register_fp32_state_dict` gives its sub-modules), or None."""
    for hook in module._load_state_dict_pre_hooks.values():
        hook = getattr(hook, "hook", hook)  # (torch wraps it with its module)
        if isinstance(hook, _SubLoad) and hook.model is not None:
            model = hook.model()
            if model is not None:
                return companions_of(model)
    return None


def links_of(module: nn.Module) -> list[Companions]:
    """Every :class:`Companions` behind ``module``'s parameters, each once: its own and its
    sub-modules' (a prepared model inside another module), and the prepared model's it is a
    sub-module of."""
    links = [companions_of(sub) for sub in module.modules()] + [enclosing_companions(module)]
    return list({id(x): x for x in links if x is not None}.values())


def register_fp32_state_dict(model: nn.Module, masters: bool) -> None:
    """Install the state-dict hooks on a prepared model (and, with ``masters``, the forward
    pre-hook that keeps a copy's shadows and parameters consistent)."""
    if masters:
        entry = model.__dict__.get("forward")
        if isinstance(entry, Entry):  # no hook: torch.compile traces a hook as a frame
            entry.before = _follow_writes_before
        else:
            model.register_forward_pre_hook(_follow_writes)
    if not any(t.is_floating_point() and is_low_precision(t)
               for t in [*model.parameters(), *model.buffers()]):
        return
    post = getattr(model, "register_state_dict_post_hook", None)
    if post is not None:
        post(_fp32_state_dict_hook)
    else:  # torch < 2.5
        model._register_state_dict_hook(_fp32_state_dict_hook)
    pre = getattr(model, "register_load_state_dict_pre_hook", None)
    if pre is not None:
        pre(_load_companions_hook)
    else:  # torch < 2.5
        model._register_load_state_dict_pre_hook(_load_companions_hook, with_module=True)
    if masters:
        for sub in model.modules():
            if sub is not model and any(is_low_precision(p) for p in sub.parameters()):
                if pre is not None:
                    sub.register_load_state_dict_pre_hook(_SubLoad(model))
                else:  # torch < 2.5
                    sub._register_load_state_dict_pre_hook(_SubLoad(model), with_module=True)


class _SubLoad:
    """load_state_dict pre-hook of a prepared model's sub-modules: a load started at one
    (``model.backbone.load_state_dict(pretrained)``) sets the companions exactly, as a load
    through the model does (without it, torch rounded the values into the 16-bit weights and
    the masters took that rounding). Values of the weights' own dtype do not set them: a
    sub-module's own ``state_dict()`` holds its 16-bit weights, and loading it back leaves the
    masters as they were (fp16 values into bf16 weights set them exactly). A load through the
    model (the sub-module's keys then carry a prefix) is the model's hook's. The model is held
    weakly: a copy of the model gets a hook of the copy (``copy.deepcopy``), a copy of a
    sub-module alone or a pickle an inert one (a copy's fp32 values are its own shadows, set
    when it is loaded whole)."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = None if model is None else weakref.ref(model)

    def __call__(self, module, state_dict, prefix, *rest) -> None:
        model = None if self.model is None else self.model()
        if not prefix and model is not None:
            _refuse_assign(companions_of(model), rest[0] if rest else None)
            _load_into(companions_of(model), module, state_dict, prefix, not_own=True)

    def __deepcopy__(self, memo) -> "_SubLoad":
        model = None if self.model is None else self.model()
        return _SubLoad(memo.get(id(model)) if model is not None else None)

    def __reduce__(self):
        return _SubLoad, ()


def _follow_writes(module, args):
    _follow_writes_before(module)


def _follow_writes_before(module):
    link = companions_of(module)
    if link is not None and link.is_copy and not torch.compiler.is_compiling():
        link.follow_writes()


def _named_tensors(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    head = prefix[:-1] if prefix.endswith(".") else prefix
    return {**dict(module.named_parameters(prefix=head, remove_duplicate=False)),
            **dict(module.named_buffers(prefix=head, remove_duplicate=False))}


def _where(t: torch.Tensor) -> tuple | None:
    """Where a plain tensor's elements lie (``param.detach()`` lies where ``param`` does)."""
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(),
                t.dtype, t.device)
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (meta, a subclass)
        return None


def _replaced(value: torch.Tensor, own: torch.Tensor) -> bool:
    """True when a hook put another value there: ``value`` is not where ``own`` lies (torch's
    ``own.detach()``) and differs from it (a copy, ``.clone()`` or ``.cpu()``, is ``own``'s
    value: it takes the fp32 one). Tensors without a storage to compare (DTensor shards) count
    as torch's."""
    where, own_where = _where(value), _where(own)
    if where is None or own_where is None or where == own_where:
        return False
    return (value.shape != own.shape or value.dtype != own.dtype
            or not torch.equal(value, own.detach().to(value.device)))


def _by_storage(module: nn.Module) -> dict[tuple, torch.Tensor]:
    """``module``'s low-precision tensors by where they lie: a value whose key a state-dict
    hook renamed (torch's ``checkpoint_wrapper`` drops its ``_checkpoint_wrapped_module.``)
    is still found."""
    tensors = [*module.parameters(), *module.buffers()]
    return {w: t for t in tensors if is_low_precision(t) and (w := _where(t)) is not None
            and w[0] != 0}


def _fp32_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: low-precision floating values become fp32 (companions where
    known)."""
    link = companions_of(module)
    pairs = link.settle() if link is not None else {}
    tensors = _named_tensors(module, prefix)
    stored = None
    upcasts: dict[int, torch.Tensor] = {}  # one fp32 tensor per tensor: tied keys stay shared
    for key, value in list(state_dict.items()):
        own = tensors.get(key)
        if own is None and torch.is_tensor(value) and is_low_precision(value):
            stored = _by_storage(module) if stored is None else stored
            own = stored.get(_where(value))
        if own is None or value is own or not torch.is_tensor(value) \
                or not is_low_precision(value):
            continue  # not ours, keep_vars=True (the tensor itself), or already fp32
        if _replaced(value, own):  # a sub-module's state-dict hook (or an earlier one of the
            state_dict[key] = value.to(_FP32)  # model's) put it there: its value, in fp32
            continue
        comp = pairs.get(own)
        if comp is None:
            upcast = upcasts.get(id(own))
            if upcast is None:
                upcast = upcasts[id(own)] = value.to(_FP32)
            state_dict[key] = upcast
        else:  # the companion itself (in-place writes reach it), where the value is (the
            state_dict[key] = comp.detach().to(value.device)  # model's device, or a hook's)


def _load_companions_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                          unexpected_keys, error_msgs) -> None:
    """load_state_dict pre-hook: the companions take the loaded values exactly (torch then
    rounds them into the low-precision parameters)."""
    _refuse_assign(companions_of(module), local_metadata)
    _load_into(companions_of(module), module, state_dict, prefix)


def _refuse_assign(link: Companions | None, local_metadata) -> None:
    """``load_state_dict(assign=True)`` would replace the parameters the masters belong to."""
    if link is not None and link.pairs() and (local_metadata or {}).get(
            "assign_to_params_buffers"):
        raise RuntimeError(
            "load_state_dict(assign=True) into a prepared model replaces its 16-bit parameters "
            "with the loaded tensors, which its masters and optimizer do not know: load without "
            "assign= (the values are copied in, the masters set exactly)")


def _load_into(link: Companions | None, module, state_dict, prefix,
               not_own: bool = False) -> None:
    """The companions of ``module``'s parameters take the loaded values exactly (``not_own``:
    only values of another dtype than the parameter's storage; one of its own dtype is written
    as a weight written directly is, :mod:`mixprec.optim.writes`: the companion changes only
    where its rounding disagrees)."""
    pairs = link.pairs() if link is not None else {}
    if not pairs:
        return
    tensors = _named_tensors(module, prefix)
    if any(key not in tensors for key in state_dict if key.startswith(prefix)):
        # a key a state-dict hook renames (torch's checkpoint_wrapper): as state_dict() names it
        tensors = {**tensors, **{k: v for k, v in module.state_dict(
            prefix=prefix, keep_vars=True).items() if torch.is_tensor(v)}}
    with torch.no_grad():
        for key, value in state_dict.items():
            param = tensors.get(key)
            comp = pairs.get(param)
            if (comp is not None and torch.is_tensor(value) and value.shape == comp.shape
                    and not (not_own and value.dtype == param.dtype)):
                if value.is_meta or value.layout != torch.strided:  # (named, as torch does)
                    raise RuntimeError(
                        f'While copying the parameter named "{key}": ' + (
                            "a meta tensor holds no values to load" if value.is_meta else
                            f"a {value.layout} tensor does not copy into a dense parameter "
                            f"(load value.to_dense())"))
                # (torch's load_state_dict hands its hooks its own copy of the dict)
                state_dict[key] = link.load(param, comp, value)
