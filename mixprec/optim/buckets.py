"""Stepping the masters in buckets, and the fp32 scratch every master step writes into.

A master optimizer makes fp32 gradients only during ``step()``. For an optimizer whose update of
one parameter reads only that parameter's gradient and state (torch's own SGD, Adam, AdamW, ...),
stepping the masters a bucket at a time gives exactly the one-call result while only one bucket's
fp32 gradients exist at once. Any other optimizer (a global gradient norm, a per-group step
counter, a closure: LAMB, LARS, Shampoo, LBFGS, third-party ones) is stepped once over all its
parameters: bucketing it would change its numbers.

The fp32 gradients of a bucket are views into one scratch buffer per device, laid out with the
strides of their masters (a channels_last master gets a channels_last gradient: torch's fused
kernels walk a parameter and its gradient as flat memory, so the two layouts must agree).
"""

from __future__ import annotations

import torch

from .. import kernel_table
from ..shards import local

__all__ = ["PER_PARAMETER_OPTIMIZERS", "is_per_parameter", "make_buckets", "Scratch",
           "fill_storages", "empty_storages", "dense_layout", "widened"]

#: torch optimizers whose update of each parameter reads only that parameter's gradient and state
#: (exact types: a subclass may add a global statistic, so it is stepped in one call).
PER_PARAMETER_OPTIMIZERS: tuple[type, ...] = tuple(
    t for t in (getattr(torch.optim, name, None) for name in (
        "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
        "ASGD", "Rprop", "SparseAdam", "Adafactor"))
    if t is not None)


def is_per_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer`` can be stepped a bucket of parameters at a time (see the module
    docstring)."""
    return type(optimizer) in PER_PARAMETER_OPTIMIZERS


def make_buckets(param_groups: list[dict], bucket_mb: float | None,
                 per_parameter: bool, elements: int = 0) -> list[list[list[torch.Tensor]]]:
    """Split the groups' tensors into buckets; a bucket lists, per group, its tensors.

    One bucket holding everything unless ``per_parameter``. Otherwise buckets of at most
    ``bucket_mb`` MiB of fp32 gradients (None: one piece of the kernel table's
    :meth:`~mixprec.kernel_table.KernelTable.step_piece` for the first tensor's device and
    ``elements`` stepped in all: 4 MiB on the CPU, whatever the model's size); a tensor of that
    size or more gets a bucket of its own, smaller ones are packed in order.
    """
    if not per_parameter:
        return [[list(group["params"]) for group in param_groups]]
    if bucket_mb is not None:
        limit = bucket_mb * 2 ** 20
    else:
        first = next((p for g in param_groups for p in g["params"]), torch.empty(0))
        limit = 4 * kernel_table.TABLE.step_piece(first.device.type, elements)
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


def dense_layout(t: torch.Tensor) -> bool:
    """True when ``t``'s strides cover exactly ``t.numel()`` elements (a view of a flat buffer
    with these strides is a valid tensor)."""
    return (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)
            or t.is_contiguous(memory_format=torch.channels_last_3d))


def _views(like: list[torch.Tensor], buffer_of) -> list[torch.Tensor]:
    """fp32 tensors shaped and strided as each of ``like``: views of ``buffer_of(device, numel)``
    where the layout is dense, else tensors of their own."""
    out: list[torch.Tensor | None] = [None] * len(like)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(like):
        if dense_layout(t):
            by_device.setdefault(t.device, []).append(i)
        else:  # an unusual layout: its own tensor, strided as the master (empty_like would
            # give a view into a larger buffer contiguous strides, and torch's fused kernel
            # pairs a parameter's and a gradient's elements by their place in memory)
            out[i] = torch.empty_strided(t.shape, t.stride(), dtype=torch.float32,
                                         device=t.device)
    for device, indices in by_device.items():
        buffer, start = buffer_of(device, sum(like[i].numel() for i in indices)), 0
        for i in indices:
            t = like[i]
            out[i] = buffer.as_strided(t.shape, t.stride(), start)
            start += t.numel()
    return out  # type: ignore[return-value]


def widened(tensors: list[torch.Tensor], like: list[torch.Tensor] | None = None
            ) -> list[torch.Tensor]:
    """fp32 copies of ``tensors`` (``t.float()`` each, a sparse one coalesced: repeated rows
    summed in fp32), the dense ones copied by one ``_foreach_copy_`` per device and dtype, not
    a copy per tensor (an FSDP2 shard through its local tensor: DTensor has no foreach copy).
    ``like``: for each tensor, the one whose layout its copy takes (a master's, for its
    gradient), else its own."""
    out, groups = [], {}
    for i, t in enumerate(tensors):
        if t.is_sparse:
            out.append(t.float().coalesce())
            continue
        out.append(torch.empty_like(t if like is None else like[i], dtype=torch.float32,
                                    memory_format=torch.preserve_format))
        dst, src = groups.setdefault((t.device, t.dtype), ([], []))
        dst.append(local(out[-1]))
        src.append(local(t))
    for dst, src in groups.values():
        torch._foreach_copy_(dst, src)
    return out


def fill_storages(buffers) -> None:
    """Give each of ``buffers`` (whole tensors, their storage emptied by :func:`empty_storages`)
    its memory again (uninitialised); their views see it."""
    for buffer in buffers:
        storage = buffer.untyped_storage()
        if storage.nbytes() < buffer.numel() * buffer.element_size():
            storage.resize_(buffer.numel() * buffer.element_size())


def empty_storages(buffers) -> None:
    """Give back the memory of each of ``buffers``; the tensors and their views stay."""
    for buffer in buffers:
        buffer.untyped_storage().resize_(0)


class Scratch:
    """The flat fp32 buffers a master step writes (gradients widened for torch's kernel, a
    compact piece's values, widened moments), one per device and use, reused from bucket to
    bucket and piece to piece (fresh memory for each costs page faults on a CPU) and sized by the
    largest: a piece's, not the model's. Their memory is held while a step runs only: the
    storages are emptied when it ends (:meth:`release`) and filled again by the next step's
    first :meth:`take` or :meth:`restore`, so nothing of it is held in the forward and backward;
    the tensors stay, and with them the views made of them once (:meth:`kept`; the compact
    optimizer's cached lists). ``version`` moves when a buffer grows (views of the old one are
    stale). Besides them, :meth:`views` makes fresh buffers each step, dropped when it ends:
    what an inner optimizer's own ``step`` reads as ``.grad`` (it may keep them)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.version = 0
        self._fresh: dict[torch.device, torch.Tensor] = {}
        self._views: dict = {}  # key -> (version, views)

    def take(self, device: torch.device, use: str, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the ``use`` buffer on ``device`` (uninitialised)."""
        buf = self.buffers.get((device, use))
        if buf is None or buf.numel() < numel:
            buf = self.buffers[device, use] = torch.empty(numel, device=device)
            self.version += 1
        else:
            fill_storages([buf])
        return buf[:numel]

    def kept(self, key, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """fp32 gradients shaped and strided as each of ``like``, views of the ``"grads"``
        buffer made once for ``key`` (again after the buffer grew); None where a layout is not
        dense (those buckets take :meth:`views`)."""
        version, out = self._views.get(key, (None, None))
        if out is not None and version == self.version:
            fill_storages(self.buffers.values())
            return out
        if not all(dense_layout(t) for t in like):
            return None
        out = _views(like, lambda device, n: self.take(device, "grads", n))
        self._views[key] = (self.version, out)
        return out

    def views(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Uninitialised fp32 tensors shaped and strided as each of ``like``, of a buffer
        dropped when the step ends."""
        def buffer_of(device, need):
            buffer = self._fresh.get(device)
            if buffer is None or buffer.numel() < need:
                buffer = self._fresh[device] = torch.empty(need, device=device)
            return buffer
        return _views(like, buffer_of)

    def restore(self) -> None:
        """A step starts: the buffers' memory taken again (uninitialised)."""
        fill_storages(self.buffers.values())

    def release(self) -> None:
        """The step ended: the buffers' memory given back (the tensors and their views stay),
        the fresh ones dropped."""
        self._fresh = {}
        empty_storages(self.buffers.values())

    def holds(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` shares memory with a buffer (state must not keep it); a sparse
        tensor never does (no step makes one in the scratch)."""
        if tensor.is_sparse:
            return False
        ptr = tensor.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in self.buffers.values())

    def tensors(self) -> list[torch.Tensor]:
        """The buffers (their memory is held during a step only)."""
        return list(self.buffers.values())
