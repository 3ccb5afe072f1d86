"""The effective op lists: torch's table for a device, mixprec's fp32 additions, and the custom
lists moved on top."""

from __future__ import annotations

from ..dtypes import to_dtype
from .names import validate_custom_lists
from .tables import MIXPREC_FP32_ADDITIONS, TORCH_DEFAULTS, check_device_type

__all__ = ["op_lists"]


def op_lists(device_type: str = "cpu", dtype="bf16", *, extend_defaults: bool = True,
             low_precision_ops=(), fp32_ops=(), promote_ops=()) -> dict[str, list[str]]:
    """The effective cast policy lists of :func:`mixprec.autocast`.

    Args:
        device_type: "cpu" or "cuda".
        dtype: the low-precision dtype (validated; the lists are the same for fp16 and bf16).
        extend_defaults: include mixprec's fp32 additions (softmax, norms) on top of torch's list.
        low_precision_ops: op names moved to the low-precision list.
        fp32_ops: op names moved to the fp32 list.
        promote_ops: op names moved to the promote list (inputs cast to the widest input dtype).

    Returns:
        ``{"low_precision": [...], "fp32": [...], "promote": [...]}``, each sorted.

    Example:
        >>> "mm" in op_lists("cpu", "bf16")["low_precision"]
        True
    """
    check_device_type(device_type)
    to_dtype(dtype)
    low, fp32, promote = validate_custom_lists(low_precision_ops, fp32_ops, promote_ops)
    table = {k: set(v) for k, v in TORCH_DEFAULTS[device_type].items()}
    if extend_defaults:
        table["fp32"] |= MIXPREC_FP32_ADDITIONS
    for moved, target in ((low, "low_precision"), (fp32, "fp32"), (promote, "promote")):
        for name in moved:
            for key in table:
                table[key].discard(name)
            table[target].add(name)
    return {k: sorted(v) for k, v in table.items()}
