"""The monitor's statistics over every rank of a sharded (FSDP) run, in one collective.

Under FSDP each rank holds a shard of every parameter, its gradient and its optimizer state,
and trains on its own part of the batch, so what one rank measures is part of the whole. At a
recorded step the monitor gathers its partial statistics from every rank and combines them as
one process over the whole model and the global batch would have measured them:

* sums (a shard's squared gradient norm, underflow counts, the update probe's dot products)
  are added over the ranks, so norms come out as the root of the summed squares and fractions
  as ratios of summed counts;
* largest values (activation amax) are the maximum over the ranks, smallest values (FP8
  scales, ``fmax / amax``) the minimum;
* means (the loss of each rank's part of the batch) are averaged over the ranks.

An inf or NaN on any rank reaches every rank: a sum or maximum that holds one is itself
non-finite.

All of it travels in one float64 tensor per rank through one ``all_gather`` (at recorded steps
only, and no host sync: the monitor's one host sync reads the combined values afterwards).
Every rank combines the same gathered table, so every rank records the same numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["RankReduction", "Reduced", "mesh_of", "lost_fraction"]

_KINDS = ("sum", "max", "min", "mean")


def mesh_of(tensors) -> object | None:
    """The device mesh of the first FSDP2-sharded tensor (a ``DTensor``) among ``tensors``, or
    None when none is sharded."""
    return next((t.device_mesh for t in tensors if callable(getattr(t, "to_local", None))), None)


def lost_fraction(total: torch.Tensor) -> torch.Tensor:
    """The fraction of an update lost, ``1 - <taken, intended> / <intended, intended>``, from
    ``total = [<taken, intended>, <intended, intended>]`` (summed over parameters, and over the
    ranks' shards): 0 when nothing was intended; float32."""
    ratio = torch.where(total[1] > 0, total[0] / total[1].clamp(min=1e-300),
                        torch.ones_like(total[0]))
    return (1 - ratio).float()


class Reduced:
    """One value given to :class:`RankReduction`; ``value`` holds the combined result after
    :meth:`RankReduction.run` (this rank's own value when nothing is reduced)."""

    def __init__(self, value: torch.Tensor, kind: str):
        self.value = value
        self.kind = kind


class RankReduction:
    """Collect values, then combine each over the ranks with one collective.

    Args:
        active: combine across the ranks (False: every value stays this rank's own, and no
            collective runs; one process, or a run whose statistics are not sharded).
        group: the process group (None: the default group).
    """

    def __init__(self, active: bool, group=None):
        self.active = active
        self.group = group
        self._items: list[Reduced] = []

    @classmethod
    def over(cls, mesh) -> "RankReduction":
        """Over the ranks that share out the parameters: a 1-D device mesh's, or the last
        (sharding) dimension's of a hybrid one; inactive for None or one rank."""
        if mesh is None or mesh.size(mesh.ndim - 1) <= 1:
            return cls(active=False)
        return cls(active=True, group=mesh.get_group(mesh.ndim - 1))

    def add(self, value: torch.Tensor, kind: str) -> Reduced:
        """Register ``value`` (a tensor of any shape) to be combined by ``kind``: "sum",
        "max", "min" or "mean"."""
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}; got {kind!r}")
        item = Reduced(value, kind)
        self._items.append(item)
        return item

    def run(self) -> None:
        """Combine every registered value over the ranks (one ``all_gather``)."""
        if not (self.active and self._items):
            return
        device = self._items[0].value.device
        parts = [item.value.detach().to(device, torch.float64).reshape(-1)
                 for item in self._items]
        packed = torch.cat(parts)
        world = dist.get_world_size(self.group)
        gathered = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(gathered, packed, group=self.group)
        table = torch.stack(gathered)  # (ranks, values), in rank order
        start = 0
        for item, part in zip(self._items, parts):
            column = table[:, start:start + part.numel()]
            start += part.numel()
            if item.kind == "sum":
                combined = column.sum(0)
            elif item.kind == "mean":
                combined = column.sum(0) / world
            elif item.kind == "max":
                combined = column.amax(0)
            else:
                combined = column.amin(0)
            item.value = combined.reshape(item.value.shape)

