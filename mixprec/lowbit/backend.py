"""torchao, the engine of mixprec's low-bit layers: imported on first use, device checks, and
torchao's Float8 configs (the :class:`mixprec.lowbit.Float8` format chooses among them).

torchao is an optional dependency (``pip install mixprec[fp8]``). Nothing in mixprec imports it
until FP8 is asked for; then it must be there: asking for FP8 without it raises an
``ImportError`` that names the extra, never a silent fallback to 16 bits. The messages its
import logs about compiled kernels mixprec never runs are dropped (:func:`quiet_import`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import re

import torch

__all__ = ["EXTRA_HINT", "require", "quiet_import", "float8_config", "check_device",
           "shape_filter"]

EXTRA_HINT = "pip install mixprec[fp8]"
_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89) and Hopper (sm90) onwards


#: What importing torchao logs that is not the user's business, by logger: its optional
#: compiled kernels that do not load here (mixprec's FP8 layers use none of them: their GEMMs
#: run through ``torch._scaled_mm``), and torch's notice that torchao registers its Enum classes
#: with ``_pytree`` the deprecated way. Nothing else is filtered.
_IMPORT_NOISE = (
    ("torchao", re.compile(r"^Failed to load \S*torchao[/\\]_C\w*\.\S*so\b")),
    ("torch.utils._pytree", re.compile(r"is an Enum subclass and is now natively supported")),
)


class _Drop(logging.Filter):
    """Drops the records whose message matches ``pattern``."""

    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@contextlib.contextmanager
def quiet_import():
    """Within the block, the import-time messages of torchao listed in ``_IMPORT_NOISE`` are
    dropped (for importing torchao, or a package that imports it: ``transformers.trainer``);
    every other message, and every message after the block, is shown."""
    added = [(logging.getLogger(name), _Drop(pattern)) for name, pattern in _IMPORT_NOISE]
    for logger, drop in added:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in added:
            logger.removeFilter(drop)


def require(what: str = "FP8 layers", module: str = "torchao.float8"):
    """The torchao ``module`` (``torchao.float8`` unless told), imported now (without the
    import-time messages that concern kernels mixprec never runs, see :func:`quiet_import`).

    Raises:
        ImportError: torchao is not installed (the message names the ``fp8`` extra).
    """
    try:
        with quiet_import():
            return importlib.import_module(module)  # optional: torchao
    except ImportError as exc:
        raise ImportError(f"{what} run on torchao, which is not installed: {EXTRA_HINT} "
                          f"(or pip install torchao==0.18.0)") from exc


def float8_config(recipe: str, *, all_gather: bool = False):
    """torchao's ``Float8LinearConfig`` of one of its ``Float8LinearRecipeName`` values
    (``all_gather``: FSDP2 all-gathers the weights in FP8)."""
    f8 = require()
    config = f8.Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def check_device(device: torch.device) -> None:
    """Refuse a device whose FP8 GEMMs cannot run: a CUDA GPU older than sm89.

    On a CPU ``torch._scaled_mm`` runs (slowly: FP8 on a CPU is for numerics, never speed).

    Raises:
        RuntimeError: a CUDA device of compute capability below 8.9.
    """
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < _MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(f"FP8 GEMMs need a GPU of compute capability 8.9 or newer (Ada, "
                           f"Hopper); {name} is {capability[0]}.{capability[1]}. Prepare "
                           f"without fp8= on this GPU")


def shape_filter(recipe: str):
    """torchao's shape filter for its ``recipe``: ``(nn.Linear, name) -> bool``, False for a
    layer too small to gain from FP8 on an H100."""
    return require()._auto_filter_for_recipe(recipe, filter_fqns=[])
