"""Per-layer FP8 statistics, kept on the device while training and read when asked.

An FP8 layer that records (see :func:`mixprec.debug.fp8_stats`) measures, on each call, the three
tensors its GEMMs cast to FP8: its input, its weight and its output gradient. For each it keeps,
in one small tensor on the layer's device (no host sync):

* ``amax`` (the last call's largest magnitude) and ``amax_max`` (the largest seen);
* ``scale``: the factor the cast multiplies by, ``fmax / amax`` (rowwise recipes: the smallest
  of the rows' scales, the row with the largest amax);
* ``saturated``: the fraction of values that land beyond the format's largest value after
  scaling, or are inf/NaN (with dynamic scaling a tensor's own amax sets its scale, so only
  non-finite values saturate);
* ``underflow``: the fraction of nonzero values that the scaled cast flushes to zero (below half
  the format's smallest subnormal): what an outlier does to everything else under one scale;
* ``scale_range``: block-scaled formats (MXFP8): the ratio of the largest block scale to the
  smallest (1 for one scale per tensor or row); ``scale`` is then the factor of the block with
  the largest value.

Fractions are averaged over the calls recorded since the last reset. Under ``torch.compile``
recording is part of the compiled graph (a few reductions and one in-place write per tensor; the
statistics tensor is allocated when recording starts, so the graph is built once).
"""

from __future__ import annotations

import torch

from . import blocks

__all__ = ["ROLES", "FIELDS", "LayerStats", "STATS_ATTR", "stats_of", "attach", "detach",
           "format_name", "scaled_fractions"]

ROLES = ("input", "weight", "grad_output")
FIELDS = ("amax", "amax_max", "scale", "saturated", "underflow", "calls", "scale_range")
STATS_ATTR = "_mixprec_fp8_stats"
_EPS = 1e-12  # torchao's floor on amax when it computes a scale
_ROUNDING = 1 + 2.0 ** -20  # the amax itself may land a rounding error above fmax: not saturated


@torch.no_grad()
def scaled_fractions(tensor: torch.Tensor, dtype: torch.dtype, axis: int | None = None,
                     pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a dynamically scaled cast of ``tensor`` to the FP8 ``dtype`` does to its values.

    The scale is ``fmax / amax``, over the whole tensor or, with ``axis``, per slice along it
    (rowwise scaling), rounded down to a power of two with ``pow2``, as torchao's casts
    compute it.

    Returns:
        0-d tensors on ``tensor``'s device (no host sync): the amax of the whole tensor, the
        fraction of values saturated (beyond ``fmax`` after scaling by more than a rounding
        error, or inf/NaN), and the
        fraction of nonzero values flushed to zero.
    """
    fmt = torch.finfo(dtype)
    a = tensor.detach().abs().float()
    amax = a.amax()
    rows = amax if axis is None else a.amax(dim=axis, keepdim=True)
    scale = (fmt.max / rows.double().clamp(min=_EPS)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = a * scale
    saturated = ((scaled > fmt.max * _ROUNDING) | ~torch.isfinite(a)).float().mean()
    nonzero = a > 0
    flushed = (scaled <= fmt.smallest_normal * fmt.eps / 2) & nonzero
    return amax, saturated, flushed.sum() / nonzero.sum().clamp(min=1)


class LayerStats:
    """The statistics of one FP8 layer: a ``(3, 7)`` tensor, one row per role (see
    :data:`ROLES`, :data:`FIELDS`).

    Args:
        formats: the FP8 dtype each role is cast to.
        axes: per role, the dimension rowwise scaling reduces over (None: tensorwise), or the
            dimension blocks run along (with ``block``).
        pow2: scales are rounded down to powers of two (torchao's rowwise recipes).
        block: a block-scaled cast (:class:`mixprec.lowbit.blocks.BlockCast`), or None.
    """

    def __init__(self, formats: dict[str, torch.dtype], axes: dict[str, int | None],
                 pow2: bool = False, block=None):
        self.formats = dict(formats)
        self.axes = dict(axes)
        self.pow2 = pow2
        self.block = block
        self.data: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget what was recorded (in place: a compiled graph keeps writing the same
        tensor)."""
        if self.data is not None:
            self.data.zero_()

    def allocate(self, device) -> None:
        """Hold the statistics on ``device`` (zeros), before the first call records."""
        if self.data is None or self.data.device != torch.device(device):
            self.data = torch.zeros(len(ROLES), len(FIELDS), dtype=torch.float32,
                                    device=device)  # whatever the default dtype (O3)

    @torch.no_grad()
    def record(self, role: str, tensor: torch.Tensor) -> None:
        """Add one call's measurements of ``tensor`` cast for ``role`` (no host sync)."""
        dtype = self.formats[role]
        if self.block is not None:
            amax, saturated, underflow, largest, ratio = blocks.fractions(
                tensor, self.block, self.axes[role])
            scale = 1 / largest.clamp(min=_EPS)
        else:
            amax, saturated, underflow = scaled_fractions(tensor, dtype, self.axes[role],
                                                          self.pow2)
            scale = torch.finfo(dtype).max / amax.clamp(min=_EPS)
            ratio = torch.ones_like(amax)
        self.allocate(amax.device)  # (allocated by attach(): only a moved layer reallocates)
        row = self.data[ROLES.index(role)]
        row.copy_(torch.stack([amax, torch.maximum(row[1], amax), scale, row[3] + saturated,
                               row[4] + underflow, row[5] + 1, torch.maximum(row[6], ratio)]))

    def read(self) -> dict[str, dict]:
        """``{role: {field: value, "format": name}}`` averaged over the calls (a host sync)."""
        values = (self.data.tolist() if self.data is not None
                  else [[0.0] * len(FIELDS) for _ in ROLES])
        out = {}
        for role, row in zip(ROLES, values):
            calls = row[5]
            entry = dict(zip(FIELDS, row))
            entry["calls"] = int(calls)
            entry["saturated"] = row[3] / calls if calls else 0.0
            entry["underflow"] = row[4] / calls if calls else 0.0
            entry["format"] = format_name(self.formats[role])
            out[role] = entry
        return out


def format_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"e4m3"``, ``torch.float8_e5m2`` -> ``"e5m2"``."""
    return str(dtype).removeprefix("torch.float8_").removesuffix("fn")


def stats_of(module) -> tuple[LayerStats, ...]:
    """The statistics a layer records into (one per :func:`mixprec.debug.fp8_stats` handle
    recording it; empty when none is)."""
    return module.__dict__.get(STATS_ATTR, ())


def attach(module, recorder: LayerStats) -> None:
    """Make ``module`` record into ``recorder`` too (its statistics on the module's device)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        recorder.allocate(weight.device)
    module.__dict__[STATS_ATTR] = (*stats_of(module), recorder)


def detach(module, recorder: LayerStats) -> None:
    """Stop ``module`` recording into ``recorder``."""
    left = tuple(r for r in stats_of(module) if r is not recorder)
    if left:
        module.__dict__[STATS_ATTR] = left
    else:
        module.__dict__.pop(STATS_ATTR, None)

