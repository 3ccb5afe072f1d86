"""One optimizer-math family for fp32 and compact masters: torch's own fused SGD/Adam/AdamW
kernels over a whole param group, between a master method's ``load`` and ``store``.

fp32 masters (``fused="auto"``) step their fp32 masters with torch's fused kernel
(``torch._fused_sgd_``/``_fused_adam_``/``_fused_adamw_``: one call per param group, device and
dtype; :mod:`.kernels`). The compact masters' default step (:func:`group_step`) runs the very same
kernel with the very same arguments, on fp32 values loaded from the 16-bit weights:

1. **load**: the group's weights (and their split remainders or Kahan compensations) are copied
   into one flat buffer each (one ``_foreach_copy_`` per list), and one element-wise kernel over
   those buffers makes the fp32 values (the master method's
   :meth:`~mixprec.masters.MasterMethod.load`: the exact split master, weight + compensation,
   or the weight);
2. **update**: the gradients are copied into one flat fp32 buffer, and torch's fused kernel
   steps the fp32 values, as it steps fp32 masters (dividing the gradients by a loss scale, or
   a clip folded into it, as it reads them): the Adam/SGD arithmetic is torch's, written once;
3. **store**: one element-wise kernel makes the 16-bit results (the method's
   :meth:`~mixprec.masters.MasterMethod.stored`: split exactly, Kahan-compensated, or rounded
   stochastically; it writes into none of its inputs), and one ``_foreach_copy_`` per list
   copies them into the weights and buffers.
   bf16 moments are widened into a flat fp32 buffer for the update and rounded back
   stochastically.

So ``master="split"`` steps its masters bit for bit as fp32 masters do from the same state and
gradients; its forward weight is torch's cast of the master (what fp32 masters write) except at
exact ties, which the split rounds away from zero (:mod:`mixprec.masters.split_bits`). The rounding
bits of Kahan and stochastic rounding are those of the per-tensor kernels: element ``i`` of a
tensor with key ``k`` gets the bits of ``(k, i)`` (a per-element key made from the per-tensor keys,
shifted by each tensor's place in the flat buffer and, for an FSDP2 shard, in its full tensor).

Per step and group: a fixed number of launches (about ten), none per tensor; hyper-parameters
go to torch's kernel as it takes them; step counts stay torch's per-parameter ``step`` tensors, on
the parameters' device; no host sync. The load and store kernels run compiled (checked against
their eager twins first, :mod:`.guard`) where the kernel table says so (CUDA, or
``fused="compile"``) and a compiler is available, else eagerly (the same bits). A group is
stepped a piece of at most :data:`mixprec.optim.compact_kernels.PIECE` elements at a time, so
the flat buffers are bounded by that (or by the largest tensor), not by the group.
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch

from ..masters import MasterMethod
from ..masters.rounding import KEY_STRIDE, round_into_lists, shard_key, stochastic_round
from ..shards import is_dtensor, local
from .guard import GuardedKernel
from .kernels import compile_options, torch_fused_problem

__all__ = ["group_ready", "group_step"]

_DEVICES = ("cpu", "cuda")
_NAN = 0x7FC0  # a NaN moment's bf16 pattern (the compiled rounding's)
_unflatten = torch._C._nn.unflatten_dense_tensors


def group_ready(optimizer: torch.optim.Optimizer, items: list[tuple]) -> bool:
    """True when :func:`group_step` can step ``items`` (``(param, grad, buffer)``): torch has a
    fused kernel for the optimizer on their device, and the weights, buffers and moments are
    dense and contiguous (the flat buffers are laid out as they are)."""
    if torch_fused_problem(optimizer, ()) is not None:
        return False
    for param, grad, buf in items:
        p = local(param)
        if p.device.type not in _DEVICES or not p.is_contiguous():
            return False
        if buf is not None and not local(buf).is_contiguous():
            return False
        if grad.is_sparse:
            return False
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            t = optimizer.state.get(param, {}).get(key)
            if t is not None and not local(t).is_contiguous():
                return False
    return True


# -- the element-wise kernels over the flat buffers (compiled or eager) --------------------------
def _round_moment(value: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return stochastic_round(value, key)


_OPTIONS = {**compile_options, "emulate_precision_casts": True}


def _eager(method: type[MasterMethod], name: str):
    """The eager kernel ``name`` ("load", "store", "round_moment") of a method class."""
    return {"load": method.load, "store": method.stored, "round_moment": _round_moment}[name]


@functools.lru_cache(maxsize=None)
def _guarded(method: type[MasterMethod], name: str) -> GuardedKernel:
    label = f"group {name}" if name == "round_moment" else f"group {name} ({method.name})"
    return GuardedKernel(label, _eager(method, name), _OPTIONS)


def _kernel(method: MasterMethod, name: str, compiled: bool):
    cls = MasterMethod if name == "round_moment" else type(method)  # one kernel for every method
    return _guarded(cls, name) if compiled else _eager(cls, name)


# -- the plan of a group: sizes, places, rounding-key shifts (made once per set of tensors) -------
class _Plan:
    def __init__(self, params: list[torch.Tensor], shards: list[torch.Tensor]):
        self.params = shards  # the optimizer's parameters (an FSDP2 shard's local view changes)
        sizes = [p.numel() for p in params]
        self.total = sum(sizes)
        self.pad = self.total % 2  # even: a CPU split pair is read as int32 words
        device = params[0].device
        shifts, offset = [], 0
        zero = torch.zeros((), dtype=torch.int32)
        for size, shard in zip(sizes, shards):
            shift = int(shard_key(zero, shard)) if is_dtensor(shard) else 0
            shifts.append(_wrap(shift - offset * KEY_STRIDE))
            offset += size
        sizes[-1] += self.pad
        self.shift = torch.tensor(shifts, dtype=torch.int32, device=device)
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=device)

    def element_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Per-element rounding keys from per-tensor ``keys``: element ``i`` of tensor ``t``
        draws the bits its tensor's kernel would (``flat index * KEY_STRIDE + key`` =
        ``i * KEY_STRIDE + key of t``)."""
        k = keys.to(self.shift.device) + self.shift
        return torch.repeat_interleave(k, self.sizes, output_size=self.total + self.pad)


def _wrap(value: int) -> int:
    value %= 2 ** 32
    return value - 2 ** 32 if value >= 2 ** 31 else value


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan(optimizer, params: list[torch.Tensor], shards: list[torch.Tensor]) -> _Plan:
    plans = _PLANS.setdefault(optimizer, {})
    key = tuple(map(id, shards))
    plan = plans.get(key)
    if (plan is None or plan.shift.device != params[0].device
            or any(a is not b for a, b in zip(plan.params, shards))):
        if len(plans) > 1024:  # param sets come and go (grads of some parameters are None)
            plans.clear()
        plan = plans[key] = _Plan(params, shards)
    return plan


# -- flat buffers ---------------------------------------------------------------------------------
def _gather(tensors: list[torch.Tensor], dtype: torch.dtype, total: int, pad: int = 0):
    """A flat buffer holding ``tensors`` one after the other (converted to ``dtype``), with
    ``pad`` zeros after them, and its views shaped as them."""
    flat = torch.empty(total + pad, dtype=dtype, device=tensors[0].device)
    views = list(_unflatten(flat[:total] if pad else flat, tensors))
    torch._foreach_copy_(views, tensors)
    if pad:
        flat[total:].zero_()
    return flat, views


# -- the update: torch's fused kernels ------------------------------------------------------------
def _scalar(value) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _lr(group: dict, device: torch.device):
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" and lr.device != device:
        lr = lr.to(device)
    return lr


def _adam(optimizer, method, group, params, values, grads, plan, keys, state_dtype, compiled,
          grad_scale):
    device = values[0].device
    entries = []
    for p in params:
        state = optimizer.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=device)
            state["exp_avg"] = _zeros(p, state_dtype)
            state["exp_avg_sq"] = _zeros(p, state_dtype)
        elif state["step"].device != device:  # torch's fused kernel keeps it on the device
            state["step"] = state["step"].to(device, torch.float32)
        entries.append(state)
    steps = [s["step"] for s in entries]
    moments = [[local(s[k]) for s in entries] for k in ("exp_avg", "exp_avg_sq")]
    wide = [m if m[0].dtype == torch.float32 else _gather(m, torch.float32, plan.total)
            for m in moments]
    lists = [m if m[0].dtype == torch.float32 else w[1] for m, w in zip(moments, wide)]
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    decoupled = group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
    torch._foreach_add_(steps, 1)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused(values, grads, lists[0], lists[1], [], steps, amsgrad=False, lr=_lr(group, device),
          beta1=beta1, beta2=beta2, weight_decay=_scalar(group["weight_decay"]),
          eps=_scalar(group["eps"]), maximize=False, grad_scale=grad_scale, found_inf=None)
    for i, (m, w) in enumerate(zip(moments, wide)):
        if m[0].dtype != torch.float32:
            _round_back(method, m, w[0], plan, keys[:, i + 1], compiled)


def _sgd(optimizer, method, group, params, values, grads, plan, keys, state_dtype, compiled,
         grad_scale):
    momentum = _scalar(group["momentum"])
    if group["nesterov"] and (momentum <= 0 or group["dampening"] != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    options = dict(weight_decay=_scalar(group["weight_decay"]), momentum=momentum,
                   lr=_lr(group, values[0].device), dampening=_scalar(group["dampening"]),
                   nesterov=bool(group["nesterov"]), maximize=False, grad_scale=grad_scale,
                   found_inf=None)
    if momentum == 0:
        torch._fused_sgd_(values, grads, [], is_first_step=False, **options)
        return
    entries = [optimizer.state[p] for p in params]
    first = [i for i, s in enumerate(entries) if "momentum_buffer" not in s]
    for i in first:  # torch starts the buffer at the first gradient
        entries[i]["momentum_buffer"] = _zeros(params[i], state_dtype)
    bufs = [local(s["momentum_buffer"]) for s in entries]
    wide = None if bufs[0].dtype == torch.float32 else _gather(bufs, torch.float32, plan.total)
    lists = bufs if wide is None else wide[1]
    if not first or len(first) == len(entries):
        torch._fused_sgd_(values, grads, lists, is_first_step=bool(first), **options)
    else:  # new parameters beside stepped ones
        chosen = set(first)
        for is_first in (True, False):
            idx = [i for i in range(len(entries)) if (i in chosen) == is_first]
            torch._fused_sgd_([values[i] for i in idx], [grads[i] for i in idx],
                              [lists[i] for i in idx], is_first_step=is_first, **options)
    if wide is not None:
        _round_back(method, bufs, wide[0], plan, keys[:, 1], compiled)


def _round_back(method, moments, wide_flat, plan, keys, compiled) -> None:
    if not compiled and sys.byteorder == "little":  # eagerly: the noise table's slices, in place
        round_into_lists(wide_flat, moments, keys.to(plan.shift.device) + plan.shift, _NAN)
        return
    keys = plan.element_keys(keys)[:plan.total]
    rounded = _kernel(method, "round_moment", compiled)(wide_flat, keys)
    torch._foreach_copy_(moments, _unflatten(rounded, moments))


def _zeros(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)


def group_step(optimizer: torch.optim.Optimizer, method: MasterMethod, group: dict,
               items: list[tuple],
               grad_scale: torch.Tensor | None, keys: torch.Tensor, state_dtype: torch.dtype,
               compiled: bool) -> None:
    """Step ``items`` (``(param, grad, buffer or None)`` of one param group, one device, one
    weight and buffer dtype) as the module docstring says.

    Args:
        optimizer: the inner SGD/Adam/AdamW (its ``state`` keyed by the model parameters).
        method: the compact master method: its load and store around the update.
        group: the param group the items belong to.
        grad_scale: a 0-d fp32 tensor torch's fused kernel divides the gradients by as it reads
            them (None: 1), as it does for fp32 masters.
        keys: ``(len(items), 3)`` int32 rounding keys (weight, first and second moment).
        state_dtype: dtype new moment buffers are made in.
        compiled: run the load/store kernels compiled (checked first), else eagerly.
    """
    params = [p for p, _, _ in items]
    weights = [local(p) for p in params]
    plan = _plan(optimizer, weights, params)
    bufs = None if items[0][2] is None else [local(b) for _, _, b in items]
    device = weights[0].device
    direct = not compiled and method.steps_lists()  # eager: straight from and into the lists
    if direct:
        values_flat = torch.empty(plan.total + plan.pad, device=device)
        method.load_lists(values_flat[:plan.total], weights, bufs)
    else:
        flat_w, _ = _gather(weights, weights[0].dtype, plan.total, plan.pad)
        flat_b = None if bufs is None else _gather(bufs, bufs[0].dtype, plan.total, plan.pad)[0]
        # compiled on a CPU: a split pair as int32 words (inductor vectorizes no int16
        # arithmetic); eagerly the int16 form makes fewer passes
        w, b = method.kernel_views(flat_w, flat_b) if compiled else (flat_w, flat_b)
        values_flat = _kernel(method, "load", compiled)(w, b)
    values = list(_unflatten(values_flat[:plan.total], weights))
    grads = list(_unflatten(torch.empty(plan.total, device=device), weights))
    torch._foreach_copy_(grads, [local(g) for _, g, _ in items])
    update = _sgd if type(optimizer) is torch.optim.SGD else _adam
    update(optimizer, method, group, params, values, grads, plan, keys, state_dtype, compiled,
           grad_scale)
    if direct:  # (the values are ours: the store may write into them)
        shifted = (keys[:, 0].to(device) + plan.shift) if method.draws_bits else None
        method.store_lists(values_flat[:plan.total], weights, bufs, shifted)
        return
    key = (plan.element_keys(keys[:, 0]) if method.draws_bits
           else keys[0, 0].to(device))  # exact (split): no random bits
    new_w, new_b = _kernel(method, "store", compiled)(w, b, values_flat, key)  # writes no input
    torch._foreach_copy_(weights, _unflatten(new_w.view(flat_w.dtype)[:plan.total], weights))
    if bufs is not None:
        torch._foreach_copy_(bufs, _unflatten(new_b.view(flat_b.dtype)[:plan.total], bufs))
