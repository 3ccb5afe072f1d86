"""Low-precision optimizer moments: bf16 storage, fp32 arithmetic, stochastic rounding.

With ``state_dtype="bf16"`` a master optimizer keeps every moment buffer (SGD's
``momentum_buffer``, Adam's ``exp_avg``/``exp_avg_sq``, any floating state tensor shaped as its
parameter) in bf16 between steps: 2 bytes per element instead of 4. The update itself runs in
fp32: before the inner optimizer steps, the moments of the tensors it steps are widened to fp32
copies; after it, they are written back to bf16.

**Why the write-back rounds stochastically.** An exponential moving average in bf16 stops moving
once its increment is below half an ulp of the state: Adam's ``exp_avg_sq`` with ``beta2=0.999``
adds ``(1 - beta2) * g**2 - (1 - beta2) * v``, i.e. 0.1% of the gap between ``g**2`` and the
state, while a bf16 ulp is 0.4-0.8% of the value. Rounded to nearest, the state freezes where it
is (it neither decays when gradients shrink nor grows when they grow) and Adam's step size is
silently wrong. Rounded stochastically (:mod:`mixprec.masters.rounding`), every write-back is
unbiased, so the bf16 state follows the fp32 one in expectation, with a noise of about an ulp.
``bench/compact_states.py`` measures both.

Loading a ``state_dict``: torch casts floating state to its parameter's dtype (an fp32 moment of
a bf16 parameter would become bf16, a bf16 moment of an fp32 master fp32). :func:`register` keeps
each saved tensor in the dtype it was saved in, then stores the moments in the optimizer's own
``state_dtype`` (a checkpoint saved with the other one loads: widened exactly, or rounded
stochastically).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterable, Iterator, Mapping

import torch

from .. import masters
from ..dtypes import to_dtype
from ..masters.kahan import COMPENSATION_KEY
from ..masters.rounding import (
    BF16_NAN,
    KEY_STRIDE,
    TABLE_SIZE,
    RoundingGenerator,
    round_into_lists,
    shard_key,
    stochastic_round,
)
from ..masters.split import REMAINDER_KEY
from ..shards import dtensor_class, is_dtensor, like_shard, local
from . import hooks

__all__ = ["STATE_DTYPES", "COMPENSATION_KEY", "REMAINDER_KEY", "BUFFER_KEYS", "GENERATOR_KEY",
           "OWN_KEYS", "check_state_dtype",
           "is_moment", "cast_moments", "fp32_moments", "make_adam_state", "ADAMS", "register",
           "record_generator", "restore_generator"]

STATE_DTYPES = (torch.float32, torch.bfloat16)
_unflatten = torch._C._nn.unflatten_dense_tensors
#: The state keys of the per-parameter buffers of compact master methods (not moments: never
#: cast): a Kahan compensation, a split remainder.
BUFFER_KEYS = tuple(m.buffer_key for m in masters.methods().values() if m.buffer_key)
#: The state key under which the rounding generator's state travels (in one parameter's entry,
#: so torch's, DCP's and FSDP2's optimizer state dicts carry it like any other state).
GENERATOR_KEY = "rounding_generator"
#: State keys a master optimizer adds beside the inner optimizer's own.
OWN_KEYS = (*BUFFER_KEYS, GENERATOR_KEY)


def check_state_dtype(state_dtype) -> torch.dtype:
    """The torch dtype of a ``state_dtype`` spec ("fp32", "bf16" or a torch dtype).

    Raises:
        ValueError: any other dtype.
    """
    try:
        dt = to_dtype(state_dtype, what="state_dtype")
    except (TypeError, ValueError):  # its message lists dtypes that are not state dtypes
        dt = None
    if dt not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be 'fp32' or 'bf16'; got {state_dtype!r}")
    return dt


def _plain(value) -> bool:
    """A plain (or DTensor) tensor; library subclasses (torchao's quantized states) are not
    touched."""
    return type(value) is torch.Tensor or (is_dtensor(value) and type(value) is dtensor_class())


def is_moment(key, value, param: torch.Tensor) -> bool:
    """True for a floating, dense state tensor shaped as ``param`` (not ``step``, not
    compensation). A sparse one (torch's SGD momentum of a sparse gradient) and an fp64
    parameter's (stepped in fp64) are kept as torch makes them."""
    return (key != "step" and key not in OWN_KEYS and _plain(value)
            and value.is_floating_point() and not value.is_sparse
            and value.shape == param.shape and param.dtype != torch.float64)


def cast_moments(state: dict, param: torch.Tensor, dtype: torch.dtype,
                 rounding: RoundingGenerator | None = None) -> None:
    """Store ``state``'s moments in ``dtype`` (bf16: rounded stochastically with ``rounding``'s
    keys; otherwise an exact or nearest cast)."""
    keys = [k for k, v in state.items() if is_moment(k, v, param) and v.dtype != dtype]
    if not keys:
        return
    drawn = rounding.keys(len(keys), salt=1) if (rounding and dtype == torch.bfloat16) else None
    with torch.no_grad():
        for i, k in enumerate(keys):
            value = state[k]
            if drawn is not None and value.dtype == torch.float32:
                key = shard_key(drawn[i], value)  # on the CPU: the table is sliced there
                # of a DTensor: its local shard, re-wrapped with its placements
                state[k] = like_shard(stochastic_round(local(value), key), value)
            else:
                state[k] = value.to(dtype)


ADAMS = (torch.optim.Adam, torch.optim.AdamW)


@torch.no_grad()
def make_adam_state(inner: torch.optim.Optimizer, group: Mapping,
                    tensors: Iterable[torch.Tensor], dtype: torch.dtype) -> bool:
    """Adam's or AdamW's state for the ``tensors`` of ``group`` that have none yet, as torch's
    fused step makes it (``step`` a float32 zero on the tensor's device, then zero ``exp_avg``,
    ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq``, laid out as the tensor), in
    ``dtype`` (an fp64 tensor's in fp64, as torch makes them: the kernel steps it in fp64): a
    first step then makes no moment as an fp32 temporary of the whole tensor to be rounded into
    a new one. For a step that runs torch's fused kernel. True when it made some."""
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    made = False
    for t in tensors:
        entry = inner.state.get(t)
        if entry is not None and any(k not in OWN_KEYS for k in entry):
            continue
        entry = inner.state[t]
        entry["step"] = torch.zeros((), dtype=torch.float32, device=local(t).device)
        like = t.dtype if t.dtype == torch.float64 else dtype
        for key in keys:
            entry[key] = torch.zeros_like(t, dtype=like, memory_format=torch.preserve_format)
        made = True
    return made


@contextlib.contextmanager
def fp32_moments(optimizer: torch.optim.Optimizer, tensors: Iterable[torch.Tensor],
                 dtype: torch.dtype, rounding: RoundingGenerator) -> Iterator[None]:
    """Inside the block the moments of ``tensors`` (keys of ``optimizer.state``) are fp32; after
    it they are stored in ``dtype`` again, new moments included. Nothing happens for fp32.

    Contiguous bf16 moments of contiguous tensors are widened per state key and device into one
    flat fp32 buffer (one ``_foreach_copy_``) whose views stand in for them, and rounded back
    in one pass (:func:`~mixprec.masters.rounding.round_into_lists`); the others (FSDP2
    shards, other layouts, moments the step made or replaced) one tensor at a time."""
    tensors = list(tensors)
    if dtype == torch.float32:
        yield
        return
    runs = _widen_runs(optimizer.state, tensors, dtype)
    for t in tensors:
        if t in optimizer.state:
            cast_moments(optimizer.state[t], t, torch.float32)
    try:
        yield
    finally:
        _narrow_runs(optimizer.state, runs, rounding)
        for t in tensors:
            if t in optimizer.state:
                cast_moments(optimizer.state[t], t, dtype, rounding)


def unwiden(runs: list) -> None:
    """Put back the moments :func:`_widen_runs` swapped out, unchanged (nothing stepped)."""
    for _, items in runs:
        for entry, key, original, _ in items:
            entry[key] = original


def _widen_runs(state: Mapping, tensors: list[torch.Tensor], dtype: torch.dtype,
                take=None) -> list:
    """Per state key and device, the bf16 moments of ``tensors`` that one flat fp32 buffer can
    stand in for, widened into it: ``(flat, [(entry, key, original, view)])``. ``take(device,
    use, numel)`` gives the buffers (a step's scratch); None: new tensors."""
    found: dict[tuple, list] = {}
    for t in tensors:
        entry = state.get(t)
        if not entry:
            continue
        for key, value in entry.items():
            if (type(value) is torch.Tensor and value.dtype == dtype == torch.bfloat16
                    and is_moment(key, value, t) and value.is_contiguous()
                    and t.is_contiguous()):
                found.setdefault((key, value.device), []).append((entry, key, value))
    runs = []
    with torch.no_grad():
        for (key, device), items in found.items():
            originals = [v for _, _, v in items]
            numel = sum(v.numel() for v in originals)
            flat = (torch.empty(numel, device=device) if take is None
                    else take(device, f"wide {key}", numel))
            views = list(_unflatten(flat, originals))
            torch._foreach_copy_(views, originals)
            for (entry, key, _), view in zip(items, views):
                entry[key] = view
            runs.append((flat, [(e, k, v, w) for (e, k, v), w in zip(items, views)]))
    return runs


def _narrow_runs(state: Mapping, runs: list, rounding: RoundingGenerator,
                 nan: int | None = BF16_NAN) -> None:
    """The flat buffers of :func:`_widen_runs` rounded back stochastically into their bf16
    moments (``nan``: as :func:`~mixprec.masters.rounding.round_into_lists` takes it); an
    entry the step replaced keeps its new tensor (stored one at a time after)."""
    with torch.no_grad():
        for flat, items in runs:
            kept = [entry[key] is view for entry, key, _, view in items]
            if all(kept):
                keys = rounding.draw(len(items), salt=1).tolist()  # on the CPU: no sync
                offsets = itertools.accumulate((o.numel() for _, _, o, _ in items), initial=0)
                shifted = torch.tensor([(k - o * KEY_STRIDE) % TABLE_SIZE
                                        for k, o in zip(keys, offsets)], dtype=torch.int32)
                round_into_lists(flat, [o for _, _, o, _ in items], shifted, nan)
                for entry, key, original, _ in items:
                    entry[key] = original
            # else the views left in place are stored one at a time, with the new tensors


# -- state_dict: moments keep the dtype they were saved in ---------------------------------------
def register(optimizer) -> None:
    """Install the load hooks that keep saved moments (and compensation) in their saved dtype."""
    optimizer.register_load_state_dict_pre_hook(hooks.own(_stash))
    optimizer.register_load_state_dict_post_hook(_restore)


# the state a load_state_dict call brought, from its pre-hook to its post-hook
_INCOMING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stash(optimizer, state_dict: Mapping) -> None:
    if isinstance(state_dict, Mapping):  # (not a dict: refused by the hooks after this one)
        _INCOMING[optimizer] = (state_dict.get("state"), state_dict.get("param_groups"))


def _restore(optimizer) -> None:
    saved, groups = _INCOMING.pop(optimizer, (None, None))
    if not saved or not groups:
        return
    ids = itertools.chain.from_iterable(g["params"] for g in groups)
    params = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    with torch.no_grad():
        for index, param in zip(ids, params):
            entry, state = saved.get(index), optimizer.state.get(param)
            if not entry or not state:
                continue
            for key, value in entry.items():
                now = state.get(key)
                if (torch.is_tensor(now) and _plain(value) and key != "step"
                        and now.dtype != value.dtype):
                    state[key] = value.to(device=now.device)
                elif isinstance(now, list) and isinstance(value, list):  # (LBFGS's history)
                    state[key] = _saved_dtypes(now, value)
            # moments saved in another state dtype: stored in this optimizer's
            cast_moments(state, param, optimizer.state_dtype, optimizer.rounding)


def _saved_dtypes(now: list, saved: list) -> list:
    """A list of state tensors as saved (torch's load cast them, nested ones too, to the
    parameter's dtype: a compact optimizer's 16-bit weight), on the device torch's load put
    them."""
    return [v.to(device=n.device) if torch.is_tensor(n) and torch.is_tensor(v) and _plain(v)
            and n.dtype != v.dtype else n for n, v in zip(now, saved)]


# -- the rounding generator in the state ---------------------------------------------------------
def record_generator(optimizer: torch.optim.Optimizer, rounding: RoundingGenerator) -> None:
    """Put the generator's state into the first state entry that holds the inner optimizer's own
    state (an entry of ours alone would make torch's optimizers skip their state set-up), else,
    when the inner optimizer keeps none (SGD without momentum), the first entry of ours (a
    Kahan compensation's), else an entry of its own."""
    anchor = ours = None
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            state.pop(GENERATOR_KEY, None)
            if anchor is None and any(k not in OWN_KEYS for k in state):
                anchor = state
            if ours is None and state:
                ours = state
    anchor = anchor if anchor is not None else ours
    if anchor is None:  # no state at all (stochastic rounding with SGD without momentum): an
        # entry of its own, at the first parameter stepped (torch made none it could skip)
        first = next((p for g in optimizer.param_groups for p in g["params"]  # (a master's
                      if getattr(p, "model_param", p).grad is not None), None)  # .grad: a copy)
        if first is None:
            return
        anchor = optimizer.state[first]
    anchor[GENERATOR_KEY] = rounding.state_dict()


def restore_generator(optimizer: torch.optim.Optimizer, rounding: RoundingGenerator) -> None:
    """Load the generator state found in ``optimizer.state`` (after ``load_state_dict``)."""
    for state in optimizer.state.values():
        saved = state.get(GENERATOR_KEY)
        if saved is not None:
            rounding.load_state_dict(saved.to(torch.uint8))
            return
