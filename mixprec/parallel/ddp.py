"""``mp.parallel.ddp``: a prepared model in torch's ``DistributedDataParallel``, gradients averaged
across ranks in a chosen precision.

The reduce dtype is set by a DDP communication hook, so whatever consumes the gradients afterwards
(a plain optimizer, a :class:`mixprec.MasterWeightOptimizer`, a loss scaler's unscale pass) reads
gradients that are already averaged:

* ``"fp32"`` (default): fp32 buckets are averaged as DDP does by default; a bucket of 16-bit
  gradients (levels O2/O3) is copied to fp32, averaged there and rounded back once, so the sum of
  many ranks does not lose bits at every addition (what Megatron-LM and torchtune do).
* ``"bf16"`` / ``"fp16"``: every bucket is cast to that dtype, divided by the world size first
  (so the sum cannot overflow), all-reduced and cast back: half the traffic of fp32. This is
  torch's ``fp16_compress_hook`` / ``bf16_compress_hook``; torch refuses its bf16 hook outside
  NCCL, so on gloo mixprec's own hook does the same thing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from .. import distenv as env
from ..dtypes import dtype_name, to_dtype
from ..prepare import policy_of

__all__ = ["ddp", "reduce_dtype_of", "cast_reduce_hook", "REDUCE_DTYPES"]

#: The dtypes gradients can be reduced in.
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reduce_dtype_of(spec: Any) -> torch.dtype:
    """Validate a ``reduce_dtype`` argument ("fp32", "bf16", "fp16" or a torch dtype).

    Raises:
        ValueError: any other value.
    """
    try:
        dt = to_dtype(spec, what="reduce_dtype")
    except (TypeError, ValueError):
        dt = None  # (its message would list dtypes refused here too)
    if dt not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype must be 'fp32', 'bf16' or 'fp16' (or their torch "
                         f"dtypes); got {spec!r}")
    return dt


def cast_reduce_hook(dtype: torch.dtype):
    """A DDP comm hook that averages each bucket in ``dtype`` and writes the result back.

    A bucket already in ``dtype`` is divided and all-reduced in place (DDP's default); another
    bucket is copied to ``dtype`` first and the average copied back (one rounding).
    """
    # No annotations: DDP compares them with the real classes, and this module's are strings.
    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        reduced = buffer.div_(group.size()) if buffer.dtype == dtype else \
            buffer.to(dtype).div_(group.size())
        fut = dist.all_reduce(reduced, group=group, async_op=True).get_future()

        def write_back(done) -> torch.Tensor:
            value = done.value()[0]
            if value is not buffer:
                buffer.copy_(value)
            return buffer

        return fut.then(write_back)

    hook.__name__ = hook.__qualname__ = f"mixprec_{dtype_name(dtype)}_reduce_hook"
    return hook


def _comm_hook(dtype: torch.dtype, group):
    if dtype == torch.float16:
        return default_hooks.fp16_compress_hook
    backend = dist.get_backend(group)
    if dtype == torch.bfloat16 and "nccl" in str(backend) and torch.cuda.is_available():
        return default_hooks.bf16_compress_hook
    return cast_reduce_hook(dtype)


def device_ids_for(device: torch.device) -> dict[str, Any]:
    """DDP's ``device_ids`` for a model on ``device``: the one CUDA device it lives on; none
    for the CPU (DDP refuses ``device_ids`` there)."""
    return {"device_ids": [device]} if device.type == "cuda" else {}


def _has_low_precision(model: nn.Module) -> bool:
    return any(p.is_floating_point() and p.element_size() < 4 for p in model.parameters())


def _check_same_weights(model: nn.Module, group) -> None:
    """Masters were copied from each rank's own weights: they must agree before DDP broadcasts."""
    params = [p.detach() for p in model.parameters()]
    if not params:
        return
    dev = params[0].device
    sums = torch.stack([p.double().sum().to(dev) for p in params])
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise ValueError("the model's parameters differ across ranks, and at this level the "
                         "optimizer's fp32 master weights were copied from each rank's own "
                         "weights: DDP would broadcast rank 0's weights but keep different "
                         "masters. Seed identically (torch.manual_seed) before building the "
                         "model on every rank, or use mp.Trainer(strategy='ddp'), which "
                         "broadcasts before preparing")


def ddp(model: nn.Module, *, reduce_dtype: Any = "fp32", **ddp_kwargs) -> DistributedDataParallel:
    """Wrap a (prepared) model in ``DistributedDataParallel`` with gradients reduced in a dtype.

    Call it after :func:`mixprec.prepare` on every rank, with the model on this rank's device.
    The process group is created from torchrun's environment when none exists. Gradients are
    averaged over the ranks in ``reduce_dtype`` (see the module docstring); loss scalers keep
    agreeing across ranks (their overflow flag is all-reduced). For gradient accumulation, run
    all but the last micro-batch's backward inside ``model.no_sync()``.

    By default ``gradient_as_bucket_view=True`` (gradients live in DDP's buckets instead of a
    second copy) and, on CUDA, ``device_ids=[the model's device]``; ``ddp_kwargs`` override them.

    Args:
        model: the model, already prepared (:func:`mixprec.prepare`) and on its device.
        reduce_dtype: "fp32" (default), "bf16" or "fp16".
        **ddp_kwargs: passed to ``torch.nn.parallel.DistributedDataParallel`` (``process_group``
            chooses the group).

    Returns:
        The ``DistributedDataParallel`` module (``.module`` is ``model``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or is already wrapped.
        ValueError: an unknown ``reduce_dtype``; no process group and no torchrun environment;
            at O2, parameters that differ across ranks (their fp32 masters would differ).

    Example:
        >>> # torchrun --nproc-per-node 2 train.py
        >>> model, opt = mp.prepare(net, opt, level="O2", dtype="bf16")  # doctest: +SKIP
        >>> model = mp.parallel.ddp(model)                                # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ddp expects an nn.Module; got {type(model).__name__}")
    if isinstance(model, DistributedDataParallel):
        raise TypeError("this model is already a DistributedDataParallel; wrap it once")
    dtype = reduce_dtype_of(reduce_dtype)
    env.require_group("mp.parallel.ddp")
    group = ddp_kwargs.get("process_group")
    policy = policy_of(model)
    if policy is not None and policy.master_weights and _has_low_precision(model):
        _check_same_weights(model, group)
    ddp_kwargs.setdefault("gradient_as_bucket_view", True)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    for key, value in device_ids_for(dev).items():
        ddp_kwargs.setdefault(key, value)
    wrapped = DistributedDataParallel(model, **ddp_kwargs)
    if dtype != torch.float32 or _has_low_precision(model):  # else DDP's own fp32 all-reduce
        wrapped.register_comm_hook(group, _comm_hook(dtype, group))
        wrapped.register_comm_hook = _hook_taken  # torch allows one: say whose it is
    return wrapped


def _hook_taken(*args, **kwargs):
    raise RuntimeError(
        "mp.parallel.ddp registered its own communication hook on this model (it averages the "
        "16-bit gradients in reduce_dtype, and torch takes one hook per model): choose the "
        "dtype with mp.parallel.ddp(model, reduce_dtype='bf16' or 'fp16'), or wrap the model in "
        "torch's DistributedDataParallel yourself and register your hook on it")
