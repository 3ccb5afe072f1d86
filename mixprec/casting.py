"""How a model's tensors are cast: the dtype each module's tensors take, in-place casts that keep
every parameter's identity, and ``mp.to_float`` (MindSpore's ``Cell.to_float``).

``to_float`` never changes a parameter's storage (MindSpore keeps the Parameter in fp32 and
casts at compute): the module becomes a precision island (see :mod:`mixprec.regions`) that casts
its parameters for the call; its floating buffers take its dtype. ``mp.prepare`` decides storage
(:func:`cast_tensors`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import kernel_table
from .autocast import PrecisionContext
from .dtypes import TRAINING_DTYPES, to_dtype
from .precision import Precision
from .precision_map import PrecisionMap
from .regions import Island, island_of, refresh_island, region_modules

__all__ = ["to_float", "module_device", "module_dtypes", "cast_tensors", "float_mark",
           "marks_map", "check_materialised", "takes_low_precision_input", "FLOAT_ATTR",
           "PREPARED_ATTR"]

FLOAT_ATTR = "_mixprec_float_dtype"      # set by to_float: this module computes in that dtype
PREPARED_ATTR = "_mixprec_in_prepared"   # set on every submodule of a prepared model
_FP32 = torch.float32


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter (or buffer); the CPU for a module with none."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def module_dtypes(root: nn.Module, root_dtype, override) -> dict[nn.Module, torch.dtype]:
    """The dtype each module's own tensors take: an override, else the parent's (top-down)."""
    result: dict[nn.Module, torch.dtype] = {}

    def visit(mod: nn.Module, name: str, inherited: torch.dtype) -> None:
        dt = override(mod, name) or inherited
        result.setdefault(mod, dt)
        for child_name, child in mod.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, dt)

    visit(root, "", root_dtype)
    return result


def _wanted(dtypes: dict[nn.Module, torch.dtype], kind: str) -> dict[int, torch.dtype]:
    """id(tensor) -> dtype for each floating ``_parameters``/``_buffers`` tensor; a tensor
    shared by modules that want different dtypes takes the widest of them."""
    wanted: dict[int, torch.dtype] = {}
    for mod, dt in dtypes.items():
        for t in getattr(mod, kind).values():
            if t is not None and t.is_floating_point() and t.dtype != torch.float64:
                prev = wanted.get(id(t))
                wanted[id(t)] = dt if prev is None or _width(dt) > _width(prev) else prev
    return wanted


def cast_tensors(dtypes: dict[nn.Module, torch.dtype], kind: str,
                  originals: dict[torch.Tensor, torch.Tensor] | None = None,
                  keep=lambda t: False) -> None:
    """Cast each module's own floating ``kind`` ("_parameters" or "_buffers") in place to its
    dtype; a tied tensor once; ``keep(t)`` tensors are left as they are. With ``originals``,
    each fp32 parameter cast narrower leaves its fp32 data there (the storage itself, no copy:
    the masters start from it)."""
    wanted = _wanted(dtypes, kind)
    for mod in dtypes:
        tensors = getattr(mod, kind)
        for key, t in tensors.items():
            dt = None if t is None else wanted.get(id(t))
            if dt is None or t.dtype == dt or keep(t):
                continue
            if isinstance(t, nn.Parameter):
                if originals is not None and t.dtype == _FP32:
                    originals[t] = t.data
                t.data = t.data.to(dt)
            else:
                tensors[key] = t.to(dt)


def _width(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def float_mark(mod: nn.Module, _name: str = ""):
    return getattr(mod, FLOAT_ATTR, None)


def marks_map(model: nn.Module) -> PrecisionMap:
    """The ``to_float`` marks of ``model``'s modules as entries by qualified name."""
    return PrecisionMap({name: Precision(float_mark(mod)) for name, mod in model.named_modules()
                         if float_mark(mod) is not None})


def check_materialised(model: nn.Module) -> None:
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(
            f"{len(meta)} parameter(s)/buffer(s) of the model are on the meta device (e.g. "
            f"{meta[0]!r}): they hold no values to cast. Materialise the model first, e.g. "
            "model.to_empty(device='cpu') and initialise (or load) its weights, then prepare it")


def to_float(module: nn.Module, dtype) -> nn.Module:
    """Make ``module`` compute in ``dtype`` (MindSpore's ``Cell.to_float``).

    Its floating inputs are cast at entry, its parameters are cast for the call (their storage
    stays as it is, so an optimizer keeps updating them in their own precision: MindSpore keeps
    the Parameter in fp32 and casts at compute), its floating buffers are cast, and its forward
    runs with autocast off, so every op inside computes in ``dtype``. Its outputs are never
    rounded: an fp32 module's output is fp32; a 16-bit module's output is widened (losslessly) to
    the dtype of the code around it when that is wider (fp32 in a plain model, so the fp32 layers
    after it can consume it). Modules around it keep computing in their own dtype (a module of a
    ``to_float`` region casts its floating inputs to the region's dtype). A
    sub-module with its own ``to_float`` keeps its setting: ``to_float(net, "fp16");
    to_float(net.dense, "fp32")`` leaves ``net.dense`` in fp32 whichever call comes first.
    ``mp.prepare`` later stores parameters per its policy (16-bit with fp32 masters at O2).
    Before ``prepare``, ``to_float(module, "fp32")`` is an alias of ``keep_fp32=[<its name>]``:
    the same ``Policy.modules`` entry.

    Args:
        module: the sub-module.
        dtype: "fp32", "bf16", "fp16" or a floating torch dtype.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``dtype`` is not a training dtype; the module is on the meta device.
        RuntimeError: ``module`` belongs to a model already passed to :func:`prepare`.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> _ = to_float(net, "bf16"); _ = to_float(net[2], "fp32")
        >>> net[0].weight.dtype, net(torch.ones(1, 4)).dtype
        (torch.float32, torch.float32)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"to_float expects an nn.Module; got {type(module).__name__}")
    dt = to_dtype(dtype)
    if dt not in TRAINING_DTYPES:
        raise ValueError(f"to_float dtype must be 'fp32', 'fp16' or 'bf16'; got {dtype!r}")
    if getattr(module, PREPARED_ATTR, False):
        raise RuntimeError("to_float must be called before mp.prepare() on the model that holds "
                           "this module (prepare already fixed its parameter dtypes and optimizer)")
    check_materialised(module)
    setattr(module, FLOAT_ATTR, dt)
    cast_tensors({m: dt for m in region_modules(module)}, "_buffers")
    context = PrecisionContext.fixed(dt, module_device(module).type)
    island = island_of(module)
    if island is not None:  # re-marked: update the existing wrapper in place
        island.dtype, island.context = dt, context
        island.place(island.outer)
    else:
        module.forward = Island(module, dt, True, context)
    refresh_island(module)
    return module


def takes_low_precision_input(mod: nn.Module, device_type: str) -> bool:
    """Norm kernels that read bf16/fp16 activations with fp32 parameters (and statistics) and
    accumulate in fp32: the numbers of casting the input up, to the rounding of the output and
    fp32 reassociation, without two casts around the layer (BatchNorm on CPU and CUDA;
    LayerNorm and GroupNorm on CPU, 4x faster than the cast path there). Their output is in the
    activations' dtype, as torch.autocast's batch_norm. Which kernels do, on which device:
    ``norm_reads_low_precision`` of :mod:`mixprec.kernel_table`."""
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        kind = "batch_norm"
    elif isinstance(mod, nn.LayerNorm):
        kind = "layer_norm"
    elif isinstance(mod, nn.GroupNorm):
        kind = "group_norm"
    else:
        return False
    return kernel_table.TABLE.norm_reads_low_precision(kind, device_type)
