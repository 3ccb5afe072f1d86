"""Writes made outside the step into what a master optimizer holds, followed before it steps.

A 16-bit weight written directly (a clamp of ``model.parameters()`` for a Lipschitz bound, a
re-initialised head, a load) no longer equals the rounding of its master (fp32 masters) or of
the value its buffer makes of it (a Kahan compensation left from a weight of another size):
the weight is the truth there, as the user wrote it, and the master (or buffer) takes its value
where their rounding disagrees (:func:`rounds_to`), so a step never undoes the write. An fp32
master written in place (through ``optimizer.param_groups``) gives its rounding to its weight.

Which weights were written is read from torch's version counters, recorded after each step
(one list of integers): a step checks them (no host sync, no kernel where nothing was written;
about 0.1 us a tensor on the host); the elementwise check runs only for a weight written since.
A master written in place is found by ``state_dict()`` (its rounding is no longer its unwritten
weight).
"""

from __future__ import annotations

import operator

import torch

from ..masters.rounding import rounds_to
from ..shards import local

__all__ = ["rounds_to", "versions", "Record", "follow_masters", "follow_pairs", "check_resized"]

_VERSION = operator.attrgetter("_version")


def versions(tensors: list[torch.Tensor]) -> list[int]:
    """The version counters of ``tensors`` (an FSDP2 shard's: the DTensor's own, which a write
    through the DTensor moves)."""
    return list(map(_VERSION, tensors))


class Record:
    """The version counters of some tensors when their optimizer last made them consistent.

    ``changed(now)``: the indices whose counter moved since (every index before a first
    record, or after the tensors changed)."""

    __slots__ = ("key", "seen")

    def __init__(self) -> None:
        self.key, self.seen = None, None

    def changed(self, key, now: list[int]) -> list[int]:
        if key is not self.key or self.seen is None or len(self.seen) != len(now):
            return list(range(len(now)))
        if now == self.seen:
            return []
        return [i for i, (a, b) in enumerate(zip(now, self.seen)) if a != b]

    def take(self, key, now: list[int]) -> None:
        self.key, self.seen = key, now


def follow_masters(opt, settle: bool) -> None:
    """:meth:`MasterWeightOptimizer.follow_writes`: each weight written since the last record
    gives its value to its fp32 master where their rounding disagrees; with ``settle`` every
    other pair is compared too (a master written in place gives its rounding to its weight; a
    disagreement neither counter saw is the weight's, as written through ``.data``)."""
    params, held = opt._flat
    weights = opt._seen.changed(opt._flat, versions(params))
    with torch.no_grad():
        for i in weights:  # (a model moved apart from its masters: compared where they are)
            m, p = held[i], params[i].to(held[i].device)
            m.copy_(torch.where(rounds_to(m, p), m, p.float()))
        if settle:
            written = set(weights)
            edited = set(opt._masters_seen.changed(opt._flat, versions(held)))
            for i, (p, m) in enumerate(zip(params, held)):
                if i in written:
                    continue
                agree = rounds_to(m, p.to(m.device))
                if agree.all():
                    continue
                if i in edited:
                    p.copy_(m)
                else:
                    m.copy_(torch.where(agree, m, p.to(m.device).float()))
    if weights or settle:
        opt._record_writes()


def follow_pairs(opt, settle: bool) -> None:
    """:meth:`CompactMasterOptimizer.follow_writes`: where a weight written since the last
    record (with ``settle``: any weight) is not the rounding of what it and its buffer stand
    for, the buffer is zeroed (the pair stands for the weight as written)."""
    low = opt._low
    changed = list(range(len(low))) if settle else opt._seen.changed(low, versions(low))
    if not changed:
        return
    if opt._buffer_key is not None:
        with torch.no_grad():
            for i in changed:
                buf = opt.compensation(low[i])
                if buf is not None:
                    w, b = local(low[i].detach()), local(buf)
                    b.masked_fill_(~rounds_to(opt.master.load(w, b), w), 0)
    opt._seen.take(low, versions(low))


def check_resized(opt) -> None:
    """Refuse weights whose shape changed since ``opt`` was made (a ``.data`` assignment of
    another shape: Hugging Face's ``resize_token_embeddings``), which their masters, buffers and
    moments no longer fit: a step would stop on mismatched shapes, or step the old shape.

    Raises:
        RuntimeError: naming each such parameter's shapes and what to do instead.
    """
    masters = getattr(opt, "_master_of", None)
    pairs = (list(masters.items()) if masters is not None  # a master has the shape as made
             else list(zip(opt._low, opt._shapes)))
    bad = [(p, getattr(held, "shape", held)) for p, held in pairs
           if getattr(held, "shape", held) != p.shape]
    if bad:
        p, shape = bad[0]
        raise RuntimeError(
            f"{len(bad)} parameter(s) changed shape after the optimizer was made, e.g. one of "
            f"shape {tuple(p.shape)}, made with shape {tuple(shape)}"
            f" (a .data assignment of another shape, such as "
            f"Hugging Face's resize_token_embeddings): its master and optimizer state no longer "
            f"fit it. Resize the model before mp.prepare / amp.setup (make the optimizer after "
            f"resizing), or prepare the resized model again with a new optimizer")
