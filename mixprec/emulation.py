"""fp16 emulation: fp16 GEMM/conv as fp32 arithmetic on fp16-rounded values.

Tensor Cores multiply fp16 values exactly and accumulate in fp32, then round the result to
fp16. On a device without fast fp16 kernels (most CPUs) mixprec reproduces those numerics at
fp32 speed: the inputs of a matmul, linear, convolution or attention are rounded to fp16, the
op runs in fp32 and its output is rounded to fp16. The casts are ordinary differentiable
``Tensor.to`` calls, so the backward pass also runs fp32 math on fp16-rounded values and the
gradients come out fp16 (rounded), as on the GPU.

The emulation is a :class:`~torch.overrides.TorchFunctionMode`: thread-local, composable with
other modes, no patching of torch. It catches the Python-level functions below (functions,
``Tensor`` methods and the ``@`` operator); ``nn.Linear``, ``nn.Conv*``, ``nn.ConvTranspose*``,
``nn.MultiheadAttention`` and ``F.scaled_dot_product_attention`` all reach them. Recurrent
layers (``nn.LSTM``/``nn.GRU``) are not emulated.

Two situations are handled:

* inside ``torch.autocast(device_type, dtype=torch.float16)`` the inputs still are fp32 when
  the function is called (autocast casts below the Python layer): an op that autocast runs in
  fp16 (torch's low-precision list, see :data:`mixprec.oplists.TORCH_DEFAULTS`) is emulated,
  every other op is left to autocast;
* outside autocast, an op whose floating inputs are all fp16 (models cast to fp16, levels
  O2/O3) is emulated.
"""

from __future__ import annotations

import collections
import contextlib
import logging

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from . import hardware, oplists
from .dtypes import ROUNDABLE_DTYPES, to_dtype

__all__ = ["emulation_context", "should_emulate", "check_mode", "Fp16EmulationMode",
           "emulate_fp16", "EMULATED_FUNCTIONS"]

_LOG = logging.getLogger("mixprec")
_FP16 = torch.float16
_MODES = ("auto", True, False)


def _functions() -> dict:
    """Python callable -> the ATen op name autocast knows it by (the key to its cast policy)."""
    names = {
        "linear": [F.linear], "bilinear": [F.bilinear],
        "conv1d": [F.conv1d], "conv2d": [F.conv2d], "conv3d": [F.conv3d],
        "conv_transpose1d": [F.conv_transpose1d], "conv_transpose2d": [F.conv_transpose2d],
        "conv_transpose3d": [F.conv_transpose3d],
        "scaled_dot_product_attention": [F.scaled_dot_product_attention],
        # Python-level composites: their inner linear/bmm calls never reach a mode, so the
        # whole call is emulated; autocast runs their GEMMs in low precision ("linear"/"bmm").
        "multi_head_attention_forward": [F.multi_head_attention_forward],
        "einsum": [torch.einsum], "tensordot": [torch.tensordot],
    }
    for name in ("matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv"):
        names[name] = [getattr(torch, name), getattr(torch.Tensor, name)]
    names["matmul"] += [torch.Tensor.__matmul__, torch.Tensor.__rmatmul__]
    return {fn: name for name, fns in names.items() for fn in fns}


#: Every Python callable the emulation catches, mapped to its op name.
EMULATED_FUNCTIONS: dict = _functions()

# Composites that torch.autocast does not list by name but whose GEMMs it casts.
_AUTOCAST_VIA = {"multi_head_attention_forward": "linear", "einsum": "bmm", "tensordot": "mm",
                 "bilinear": None}


def autocast_runs_in_low_precision(op: str, device_type: str) -> bool:
    """True when ``torch.autocast(device_type)`` computes ``op`` in its low-precision dtype."""
    table = oplists.TORCH_DEFAULTS.get(device_type, oplists.TORCH_DEFAULTS["cuda"])
    name = _AUTOCAST_VIA.get(op, op)
    return name is not None and name in table["low_precision"]


def _labels(term: str) -> list[str]:
    """The index labels of one einsum operand or output (an ellipsis is one label)."""
    return (["..."] if "..." in term else []) + list(term.replace("...", ""))


def einsum_contracts(args) -> bool:
    """Whether ``torch.einsum(*args)`` contracts an index that two operands share: torch then
    multiplies them with ``bmm`` (which autocast casts); a permutation, a reduction, a diagonal
    or an elementwise or outer product runs no GEMM and stays in its inputs' dtype. (The
    sublist form is taken as a contraction.)"""
    if not args or not isinstance(args[0], str):
        return True
    lhs, arrow, out = args[0].replace(" ", "").partition("->")
    inputs = [_labels(term) for term in lhs.split(",")]
    if len(inputs) < 2:
        return False
    shared = collections.Counter(label for labels in inputs for label in set(labels))
    if arrow:
        kept = set(_labels(out))
    else:  # the implicit output: labels written once, and the ellipsis
        written = collections.Counter(label for labels in inputs for label in labels)
        kept = {label for label, n in written.items() if n == 1} | {"..."}
    return any(n >= 2 and label not in kept for label, n in shared.items())


def _round(t):
    """A floating tensor as fp32 holding fp16-rounded values (differentiable)."""
    if isinstance(t, torch.Tensor) and t.dtype in ROUNDABLE_DTYPES:
        return t.to(_FP16).to(torch.float32)
    return t


def _to_fp16(t):
    if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
        return t.to(_FP16)
    return t


class Fp16EmulationMode(TorchFunctionMode):
    """Runs fp16 GEMM/conv/attention as fp32 math on fp16-rounded values (see module doc)."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            op = EMULATED_FUNCTIONS.get(func)
        except TypeError:  # an unhashable callable is never one of ours
            op = None
        if op is None or kwargs.get("out") is not None or not self._wanted(op, args, kwargs):
            return func(*args, **kwargs)
        args, kwargs = tree_map(_round, (args, kwargs))
        with torch.autocast(self.device_type, enabled=False):
            out = func(*args, **kwargs)
        return tree_map(_to_fp16, out)

    def _wanted(self, op: str, args, kwargs) -> bool:
        """Would this call run an fp16 kernel on our device without the emulation?"""
        if op == "einsum" and not einsum_contracts(args):  # no GEMM inside: torch's own ops
            return False
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        floating = [t for t in tensors if t.is_floating_point()]
        if not floating or any(t.device.type != self.device_type for t in tensors):
            return False
        if torch.is_autocast_enabled(self.device_type) and autocast_runs_in_low_precision(
                op, self.device_type):
            return (torch.get_autocast_dtype(self.device_type) == _FP16
                    and all(t.dtype in ROUNDABLE_DTYPES for t in floating))
        return all(t.dtype == _FP16 for t in floating)


_noticed: set[str] = set()


def _notice(device_type: str) -> None:
    if device_type in _noticed:
        return
    _noticed.add(device_type)
    _LOG.info("mixprec: fp16 has no fast kernels on %s; emulating fp16 matmul/conv with fp32 "
              "arithmetic on fp16-rounded values (fp16 numerics, fp32 speed). "
              "Pass emulate_fp16=False to use torch's native fp16 kernels.", device_type)


def _device_type(device) -> str:
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str) and device:
        try:
            return torch.device(device).type
        except RuntimeError:
            pass
    raise ValueError(f"device_type must be a device type such as 'cpu' or 'cuda' (or a "
                     f"torch.device); got {device!r}")


def check_mode(mode, what: str = "mode") -> None:
    """Refuse an emulation mode other than "auto", True or False (``what``: the name the
    message gives it, ``emulate_fp16`` at the entry points).

    Raises:
        ValueError: naming ``what``, the value received and the three valid ones.
    """
    if not any(mode is m or (isinstance(mode, str) and mode == m) for m in _MODES):
        raise ValueError(f"{what} must be 'auto', True or False; got {mode!r}")


def should_emulate(device_type, dtype, mode="auto") -> bool:
    """Whether fp16 GEMM/conv on ``device_type`` are emulated for compute ``dtype``.

    Args:
        device_type: "cpu", "cuda", ... (a ``torch.device`` is accepted too).
        dtype: the compute dtype of the block; only fp16 is ever emulated.
        mode: "auto" emulates when ``dtype`` is fp16 and fp16 is not fast on the device
            (:func:`mixprec.hardware.is_fast`), logging one notice on the "mixprec" logger;
            True always emulates fp16; False never does.

    Raises:
        ValueError: ``mode`` is not "auto", True or False, or a bad device type or dtype.
    """
    check_mode(mode)
    device_type = _device_type(device_type)
    if to_dtype(dtype) != _FP16 or mode is False:
        return False
    if mode == "auto":
        if hardware.is_fast(_FP16, device_type):
            return False
        _notice(device_type)
    return True


def emulation_context(device_type, dtype, mode="auto"):
    """The context manager that emulates fp16 GEMM/conv on ``device_type``, or a no-op.

    Arguments as for :func:`should_emulate`.

    Returns:
        A fresh emulation mode to enter with ``with``, or ``contextlib.nullcontext()`` when
        nothing is emulated (zero overhead).

    Example:
        >>> import torch
        >>> a = torch.randn(4, 8, dtype=torch.float16)
        >>> with emulation_context("cpu", torch.float16, mode=True):
        ...     (a @ a.T).dtype
        torch.float16
    """
    if should_emulate(device_type, dtype, mode):
        return Fp16EmulationMode(_device_type(device_type))
    return contextlib.nullcontext()


def emulate_fp16(enabled=True, *, device_type="cpu"):
    """Run fp16 matmul/linear/conv/attention as Tensor Cores would, with fp32 kernels.

    Inside the block, fp16 GEMMs and convolutions (and those ``torch.autocast`` runs in fp16)
    compute in fp32 on fp16-rounded inputs and round their outputs to fp16: fp16 numerics at
    fp32 speed on devices without fast fp16.

    Args:
        enabled: True emulates, False is a no-op, "auto" emulates only where fp16 is not fast.
        device_type: the device type whose tensors are emulated ("cpu" by default).

    Returns:
        A context manager.

    Example:
        >>> import torch, mixprec as mp
        >>> w = torch.randn(8, 8, dtype=torch.float16)
        >>> with mp.emulate_fp16():
        ...     y = torch.nn.functional.linear(torch.ones(2, 8, dtype=torch.float16), w)
        >>> y.dtype
        torch.float16
    """
    check_mode(enabled, "emulate_fp16(enabled=...)")  # (its message names this argument)
    return emulation_context(device_type, _FP16, enabled)
