"""``CompactMasterOptimizer``: 16-bit weights that train like fp32 ones, without fp32 masters.

Three ways to keep the updates a 16-bit weight would round away, at 2 or 0 extra bytes per
parameter instead of an fp32 master's 4 (each a :mod:`mixprec.masters` method, which makes the
per-parameter buffer and reads and writes the fp32 value the optimizer steps: its ``load`` and
``store``):

* ``master="split"``: an int16 remainder beside each bf16 weight; the pair is an exact fp32
  master (:mod:`mixprec.masters.split_bits`), so the masters evolve bit for bit as fp32 ones.
* ``master="kahan"``: a 16-bit compensation buffer holds what the last rounding of the weight
  lost; weight + compensation is the value stepped (:mod:`mixprec.masters.kahan`).
* ``master="stochastic"``: no buffer; the updated fp32 value is written into the bf16 weight
  with stochastic rounding (:mod:`mixprec.masters.rounding`), unbiased in expectation.

What the optimizer's ``state`` and ``state_dict()`` hold: :mod:`.compact_state`.

**The step** (:mod:`.family`): every optimizer, a bounded piece of the 16-bit parameters at a time
(a tensor larger than a piece is cut into slices, for torch's per-parameter optimizers): the
method's load into fp32 values, the inner optimizer's own ``step()`` over them, the method's store.
With ``fused="auto"`` (default) torch's fused kernel runs where torch has one for the device
(SGD/Adam/AdamW, called on lists made once per layout, :mod:`.compact_lists`; SGD from its second
step, when its momentum buffers exist), so ``"split"``'s masters step bit for bit as ``"fp32"``'s;
with ``fused=False`` the inner optimizer as configured (foreach or single-tensor); ``"compile"`` is
accepted and steps as ``"auto"`` (a compact step compiles nothing). Adam and SGD arithmetic is
torch's; the step's fp32 buffers are about 8 bytes per piece element (16 with bf16 Adam moments),
whatever the model's size, held while a step runs (:class:`~mixprec.optim.buckets.Scratch`), except
for an optimizer that reads several parameters at once (a global statistic), which is stepped over
everything in one piece (fresh buffers each step). A ``closure`` runs before the step (making
its gradients); an optimizer that calls it again (LBFGS) sees the model at the values it steps.

**The loss-scaler protocol** (:mod:`mixprec.scaling.protocol`): ``grads_for_step()`` gives the
model's gradients; ``unscale_grads_(inv)`` makes transient fp32 copies of the 16-bit ones
(which the step reads, and a clip scales: fp16 loses small unscaled values, and a clip of bf16
ones would round them), unscaled and checked in one pass, and ``settle_grads_(s)`` the same
with the step's arithmetic (a clip folded into the step, applied before it);
``step(grad_scale=s)`` divides by ``s`` while reading; ``drop_master_grads()`` drops the fp32
copies. A skipped step leaves weights, buffers, moments and the rounding generator
bitwise untouched: it never calls ``step()``, except with ``"split"`` and fp32 moments, whose
store gives back what its load read and which draws no rounding bits, where ``step(found_inf=f)``
hands the flag to torch's fused kernel (``skips_on_device()``), as fp32 masters do. No host
syncs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .. import masters
from ..dtypes import is_low_precision
from ..masters.rounding import DEFAULT_SEED, RoundingGenerator
from ..scaling.unscale import check_and_unscale_, divide_
from ..shards import like_shard, local
from . import compact_lists, compact_state, family, pieces, states, steps, writes
from .buckets import Scratch, is_per_parameter, widened
from .compact_state import load_generator, save_pending, share_with_inner
from .params import _is_current, _source_key
from .refusals import check_bucket_mb, check_grad_scale, check_listed_once, stale_fp16_error
from .wrapper import (
    WrappedOptimizer,
    check_inner,
)
from .writes import Record, versions

__all__ = ["CompactMasterOptimizer"]


class CompactMasterOptimizer(WrappedOptimizer):
    """Steps 16-bit parameters with a split remainder, Kahan compensation or stochastic
    rounding (see the module docstring).

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters (16-bit and fp32).
        master: a compact :mod:`mixprec.masters` method (``Split()``, ``Kahan()``,
            ``Stochastic()``) or its shorthand ``"split"``, ``"kahan"``, ``"stochastic"``.
        state_dtype: ``"fp32"`` or ``"bf16"``: the dtype moment buffers are stored in.
        fused: ``"auto"``, ``"compile"`` or ``False`` (see the module docstring).
        bucket_mb: MiB of fp32 values per piece of the step (None: the kernel table's piece
            for the device: 2^20 elements, 4 MiB, on the CPU; on CUDA 1/16 of the model's
            elements, between 2^20 and 2^25).
        initial_values: 16-bit parameter -> its exact fp32 value before the cast: a Kahan
            compensation starts as what the cast lost; a split pair holds it exactly.
        seed: seed of the rounding generator.
        salt: mixed into the rounding keys (FSDP2 shards need none).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: already wrapped; an unknown or non-compact ``master``, ``state_dtype``,
            ``fused`` or ``bucket_mb``; ``"stochastic"``/``"split"`` with fp16 parameters.
        RuntimeError: a big-endian machine (the store writes the halves of fp32 words).

    Example:
        >>> model = nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = CompactMasterOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "kahan")
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> opt.compensation(model.weight).dtype
        torch.bfloat16
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master="kahan", *,
                 state_dtype="fp32", fused: bool | str = "auto", bucket_mb: float | None = None,
                 initial_values: Mapping[torch.Tensor, torch.Tensor] | None = None,
                 seed: int = DEFAULT_SEED, salt: int = 0) -> None:
        check_inner(optimizer, CompactMasterOptimizer)
        check_bucket_mb(bucket_mb)
        method = masters.resolve(master)
        if not method.compact:
            compact = [s for s in masters.shorthands() if masters.resolve(s).compact]
            raise ValueError(f"CompactMasterOptimizer steps 16-bit weights without fp32 masters: "
                             f"master must be one of {', '.join(map(repr, compact))}; got "
                             f"{master!r} (fp32 masters: mixprec.MasterWeightOptimizer)")
        if sys.byteorder != "little":  # the store writes the halves of fp32 words
            raise RuntimeError(f"master={str(method)!r} steps on little-endian machines only; "
                               "use master='fp32'")
        self.master = method
        self._buffer_key = method.buffer_key
        self.state_dtype = states.check_state_dtype(state_dtype)
        self.rounding = RoundingGenerator(seed)
        self.salt = int(salt)
        self.inner = optimizer
        self._grads32: dict[torch.Tensor, tuple[torch.Tensor, tuple]] = {}
        self._pending: dict[torch.Tensor, torch.Tensor] = {}
        # each buffer put in the state, kept here too: a state cleared to reset the moments
        # (optimizer.state.clear()) gets it back, the pair's value unchanged
        self._kept: dict[torch.Tensor, torch.Tensor] = {}
        self.scratch = Scratch()  # a bounded piece's buffers, held during a step
        self.lists: compact_lists.Plan | None = None
        self._seen = Record()  # the weights' versions after the last step (.writes)
        self._adopt(optimizer, bucket_mb, fused)
        check_listed_once([p for g in self.param_groups for p in g["params"]], method)
        self._check_params(self._low)
        self._init_state(self._low, initial_values or {})
        self.register_load_state_dict_post_hook(share_with_inner)
        self.register_state_dict_post_hook(save_pending)
        states.register(self)
        self.register_load_state_dict_post_hook(load_generator)
        method.register_load_hooks(self)
        compact_state.register(self)
        self._seen.take(self._low, versions(self._low))  # the pairs hold the weights as made

    def __repr__(self) -> str:
        dt = str(self.state_dtype).replace('torch.', '')
        return (f"CompactMasterOptimizer(master={str(self.master)!r}, state_dtype={dt}, "
                f"{len(self._low)} 16-bit parameters, fused={self.fused!r}, {self.inner!r})")

    # -- set-up --------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        super()._rebuild()
        self._low = [p for p in self._model_params if is_low_precision(p)]
        self._shapes = [p.shape for p in self._low]  # as made (writes.check_resized)
        self._torch_unscales = not any(p.dtype == torch.float16 for p in self._low)
        self.lists = None  # made again after the next step

    def _check_params(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            if not p.is_leaf:
                raise ValueError(f"can't step a non-leaf {p.dtype} tensor of shape "
                                 f"{tuple(p.shape)}; pass the model's parameters (leaf tensors)")
            self.master.check_dtype(p.dtype, f"parameter of shape {tuple(p.shape)}")

    def _init_state(self, params: list[torch.Tensor], initial: Mapping) -> None:
        """Moments in the state dtype; buffers (compensations, remainders) made, held aside
        until the first step (an optimizer whose state is empty counts as fresh to torch's
        distributed checkpointing, which then steps it once at lr 0 to lay its state out)."""
        with torch.no_grad():
            for p in params:
                states.cast_moments(self.state[p], p, self.state_dtype, self.rounding)
                if self._buffer_key is None or self._buffer_key in self.state[p]:
                    continue
                self._pending[p] = self.master.make_buffer(p, initial.get(p))
        for p in params:  # no empty entries left behind by the reads above
            if not self.state[p]:
                del self.state[p]

    def _settle_pending(self) -> None:
        """Move the buffers held aside into the state (first step)."""
        key = self._buffer_key
        if key is None:
            return
        for p in self._low:
            state = self.state[p]
            if key not in state:
                buf = self._pending.pop(p, None)
                if buf is None:
                    buf = self._kept.get(p)
                state[key] = self._kept[p] = (buf if buf is not None
                                              else self.master.make_buffer(p, None))

    # -- what it holds -------------------------------------------------------------------------
    def compensation(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s buffer: its Kahan compensation (``"kahan"``) or int16 remainder
        (``"split"``); None for ``"stochastic"`` or fp32 params."""
        key = self._buffer_key
        comp = None if key is None else self.state.get(param, {}).get(key)
        if comp is None and key is not None:
            comp = self._pending.get(param)
            return self._kept.get(param) if comp is None else comp
        return comp

    def set_aside(self) -> dict[torch.Tensor, torch.Tensor]:
        """The buffers not in the state: made before the first step, or kept from a state
        cleared since (the next step puts them back); ``state_dict()`` saves them."""
        key = self._buffer_key
        if key is None:
            return {}
        kept = {p: b for p, b in self._kept.items() if key not in self.state.get(p, ())}
        return {**kept, **self._pending}

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Besides ``state``: fp32 gradients made for the step, buffers not yet in the state,
        and the step's scratch (:class:`~mixprec.optim.buckets.Scratch`: a piece's fp32
        values, gradients and widened moments, bounded by the piece size, not the model's; their
        memory is held during a step only)."""
        return {"gradients": [g for g, _ in self._grads32.values()],
                "compensation": list(self._pending.values()),
                "scratch": self.scratch.tensors()}

    def fp32_values(self) -> dict[torch.Tensor, torch.Tensor]:
        """16-bit parameter -> the best fp32 estimate of its value (new tensors): the exact
        master for ``"split"``, weight + compensation for ``"kahan"``, the weight's upcast for
        ``"stochastic"``."""
        with torch.no_grad():
            return {p: like_shard(self.master.load(local(p.detach()),
                                                   local(self.compensation(p))), p)
                    for p in self._low}

    def masters_by_param(self) -> dict[torch.Tensor, torch.Tensor]:
        return self.fp32_values()  # what mp.fp32_state_dict reads

    def load_fp32_(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set ``param`` from an fp32 ``value``: rounded to nearest, the compensation taking
        what the rounding lost (``"kahan"``); split exactly (``"split"``)."""
        with torch.no_grad():
            self.master.assign(param, self.compensation(param), value)

    def follow_writes(self, settle: bool = True) -> None:
        """Take the writes made into the weights outside the step (:mod:`.writes`): where a
        weight written directly is not the rounding of the value it and its buffer stand for
        (a compensation left from a weight of another size), the buffer is zeroed: the pair
        stands for the weight as written (a zero buffer adds nothing to its weight). With
        ``settle`` (``state_dict()`` time) every pair is checked: a write through ``.data``
        moves no version counter."""
        writes.follow_pairs(self, settle)

    # -- the loss-scaler protocol --------------------------------------------------------------
    def grads_for_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(parameter, gradient)`` pairs the next ``step()`` reads."""
        if not self._grads32:  # every gradient the step reads is the model's
            return [(p, p.grad) for p in self._model_params if p.grad is not None]
        return [(p, self._grad_of(p)) for p in self._model_params if p.grad is not None]

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        held = self._grads32.get(p) if self._grads32 else None
        if held is not None and _is_current(held[1], p.grad):
            return held[0]
        return p.grad

    def unscale_grads_(self, inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Make the fp32 gradients the step reads: the 16-bit ones into fp32 copies, times
        ``inv_scale`` (None: 1), fp32 ones in place; the model's 16-bit gradients read as the
        copies (rounded: fp16 loses small unscaled values, which the copies keep), as fp32
        masters hold fp32 gradients, so a clip of them is exact. Returns the 0-d inf/NaN flag
        (> 0: overflow). No host sync."""
        return self._copy_grads(inv_scale, divide=False)

    def settle_grads_(self, grad_scale: torch.Tensor) -> torch.Tensor:
        """``unscale_grads_`` with the step's arithmetic (a clip folded into the step, applied
        before it: ``LossScaler.settle_``): divided by ``grad_scale`` where the step hands it to
        torch's fused kernel for every tensor, else times the inverse the step computes, so the
        step from the copies is bitwise the step the fold would have made."""
        folds = steps.device_plan(self, "auto" if self.fused is not False else False)[0]
        if folds:
            return self._copy_grads(grad_scale, divide=True)
        return self._copy_grads(grad_scale.double().reciprocal().float(), divide=False)

    def _copy_grads(self, factor: torch.Tensor | None, divide: bool) -> torch.Tensor:
        self._grads32 = {}
        low, grads = [], []
        with torch.no_grad():
            for p in self._model_params:
                if p.grad is None:
                    continue
                if is_low_precision(p.grad):  # (sparse: repeated rows summed in fp32, as
                    low.append(p)              # fp32 masters sum them)
                else:
                    if p.grad.is_sparse:
                        p.grad = p.grad.coalesce()
                    grads.append(p.grad)
            low = list(zip(low, widened([p.grad for p in low])))
            grads += [copy for _, copy in low]
            found = check_and_unscale_(grads, None if divide else factor)
            if divide:
                divide_(grads, factor)
            if factor is not None:  # the model's gradients read as the true ones too
                dense = [(local(p.grad), local(copy)) for p, copy in low if not copy.is_sparse]
                if dense:  # (FSDP2 shards: their local tensors; DTensor has no foreach copy)
                    torch._foreach_copy_(*map(list, zip(*dense)))
                for p, copy in low:
                    if copy.is_sparse:
                        p.grad = copy.to(p.grad.dtype)
        self._grads32 = {p: (copy, _source_key(p.grad)) for p, copy in low}
        return found

    def refresh_grads_(self) -> None:
        """fp32 copies of the 16-bit gradients a backward changed (or made) since
        :meth:`unscale_grads_` made the copies, which the step and a clip then read (a loss
        scaler calls this in bf16); the current copies are kept."""
        with torch.no_grad():
            changed = [p for p in self._model_params
                       if p.grad is not None and is_low_precision(p.grad)
                       and not _is_current((self._grads32.get(p) or (None, None))[1], p.grad)]
            for p, wide in zip(changed, widened([p.grad for p in changed])):
                self._grads32[p] = (wide, _source_key(p.grad))

    def drop_master_grads(self) -> None:
        """Drop the fp32 gradient copies made by :meth:`unscale_grads_`."""
        self._grads32 = {}

    def held_grads(self) -> bool:
        """True while fp32 copies of 16-bit gradients are held (made by :meth:`unscale_grads_`)."""
        return bool(self._grads32)

    def skips_on_device(self) -> bool:
        """Whether ``step(found_inf=f)`` can skip on the device, as fp32 masters do
        (:func:`.steps.skips_on_device`): a method whose store gives back what its load read
        and that draws no rounding bits (``"split"``: a skipped step then leaves weights and
        remainders bitwise as they were, and the rounding generator untouched), fp32 moments,
        and the step on the cached lists (:mod:`.compact_lists`: torch's fused kernel, which
        skips on the flag and takes back its step count), with their state made. (Where a step
        finds the lists no longer hold, a parameter left without a gradient say, it reads the
        flag instead.)"""
        self.follow_reassigned()  # (the layout the step will see)
        return (not self.master.draws_bits and self.lists is not None
                and steps.skips_on_device(self))

    # -- the step ------------------------------------------------------------------------------
    @torch._disable_dynamo  # runs eagerly inside a compiled function (see .wrapper)
    def step(self, closure: Callable[[], Any] | None = None, *,
             grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
             **kwargs: Any) -> Any:
        """Update the parameters from their gradients (see the module docstring).

        Args:
            closure: re-evaluates the model and returns the loss (as for any torch optimizer).
                It runs first, making the gradients the step reads; an optimizer that calls it
                again inside its step (LBFGS) sees the model at its current values each time
                (the fp32 values, written into the 16-bit weights with torch's cast) and steps
                from the gradients that evaluation made.
            grad_scale: the factor the gradients still carry (a 0-d tensor), or None.
            found_inf: a 0-d float32 flag, 1 to skip (on the device), or None.
            kwargs: passed on to the inner optimizer's ``step`` (which then runs each step).

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: a ``closure`` together with ``grad_scale`` or ``found_inf`` (or
                driven by ``torch.amp.GradScaler``); ``found_inf`` while not
                ``skips_on_device()``; fp16 gradients changed after :meth:`unscale_grads_`.
        """
        self.follow_reassigned()
        grad_scale, found_inf = self.amp_scaling(grad_scale, found_inf)
        if found_inf is True:  # torch.amp.GradScaler's overflow, read: the step is skipped
            self.drop_master_grads()
            return None
        if closure is not None and (grad_scale is not None or found_inf is not None):
            raise RuntimeError("step() takes a closure or a grad_scale/found_inf, not both: a "
                               "closure recomputes the gradients")
        if grad_scale is not None:
            check_grad_scale(grad_scale)
        if found_inf is not None and not self.skips_on_device():
            raise RuntimeError("step(found_inf=...) takes the flag only where skips_on_device() "
                               "is True (a method that draws no rounding bits, fp32 moments, "
                               "torch's fused kernel for every tensor, no step hooks, state "
                               "made); read the flag and skip")
        stale = [p for p, (_, key) in self._grads32.items()  # bf16 has fp32's range: a change
                 if p.dtype == torch.float16 and not _is_current(key, p.grad)]  # is taken
        if stale:
            raise stale_fp16_error(len(stale), stale[0].shape, groups_hold_fp32=False)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.follow_writes(settle=False)
        inv = None if grad_scale is None else grad_scale.double().reciprocal().float()
        self._settle_pending()
        self.scratch.restore()
        self.step_kwargs = kwargs
        try:
            items, fp32 = pieces.items_of(self)
            keys = family.draw_keys(self, items)
            scale = None if grad_scale is None else grad_scale.to(torch.float32)
            again = (None if closure is None or is_per_parameter(self.inner)
                     else (closure, loss))  # LBFGS calls it again
            if self.lists is None:  # (a plan is made for the weights as they are now)
                writes.check_resized(self)
            if self.lists is None and items and compact_lists.make_state(self, items):
                compact_lists.prepare(self, items)  # Adam's first step on the lists too
            if again is None and compact_lists.step(self, items, keys, scale, found_inf):
                family.step_own(self, fp32, keys, scale, inv, found_inf)
            elif found_inf is not None and bool(found_inf.item()):  # the lists don't hold: the
                pass  # flag read, the step skipped
            else:
                writes.check_resized(self)  # (a weight's new storage: of its old shape?)
                family.step(self, items, fp32, scale, inv, keys, again)
                compact_lists.prepare(self, items)
        finally:
            self.step_kwargs = {}
            self.scratch.release()
            self.drop_master_grads()
            self._seen.take(self._low, versions(self._low))
        self._stepped = True  # (a state cleared after it: its state_dict saves the generator)
        states.record_generator(self.inner, self.rounding)  # both kinds round stochastically
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (its 16-bit parameters get their buffers under kahan/split).

        Raises:
            TypeError: ``param_group`` is not a dict, or its ``"params"`` is a set.
            ValueError: no ``"params"`` entry, a parameter already held, or an fp16 parameter
                under ``"stochastic"``.
        """
        if not self._set_up:  # torch's Optimizer.__init__ registering the wrapped groups
            return super().add_param_group(param_group)
        group, params = self._check_new_group(param_group)
        check_listed_once(params, self.master)
        self._check_params([p for p in params if is_low_precision(p)])
        self.inner.add_param_group(group)
        self._rebuild()
        self._init_state([p for p in params if is_low_precision(p)], {})

    def params_widened(self, params: list[torch.Tensor]) -> None:
        """Parameters now stored wide hold weight + compensation (or the split master): they
        are stepped as fp32 parameters from now on, without a buffer."""
        for p in params:
            self._pending.pop(p, None)
            self._kept.pop(p, None)
            if self._buffer_key is not None:
                self.state.get(p, {}).pop(self._buffer_key, None)
        super().params_widened(params)
