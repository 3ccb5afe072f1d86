"""Which kernel runs, by device type and dtype: the one place that decides.

torch's kernels accept different dtypes on different devices, and a branch that only one
device takes is a branch the CPU test suite never runs. So every choice of kernel path that
depends on where the tensors live, or on their dtype, is made here, from the limits written down
in :data:`LIMITS` (read from the kernels' dispatch macros in torch 2.4-2.13 and checked against
torch itself by the tests: the CPU rows on every machine, the CUDA rows on a GPU). Callers ask a
:class:`KernelTable` (the module's :data:`TABLE`) which path to take and call the kernels it
hands out; tests drive a device's branch on the CPU with that device's limits imposed
(:meth:`KernelTable.imposing`), with a fake kernel that refuses what the real one refuses.

The paths:

* **inf/NaN check and unscale** (:meth:`KernelTable.unscale_path`): torch's
  ``_amp_foreach_non_finite_check_and_unscale_`` where it accepts the dtype (one fused pass:
  read, check, write); else ``"inf_norm"``: one ``torch._foreach_norm(ord=inf)`` (the largest
  magnitude of each tensor: inf and NaN propagate, nothing overflows) and one
  ``torch._foreach_mul_``, per group. Both check the values before the multiplication, as
  torch's kernel does.
* **read-only inf/NaN check** (:meth:`KernelTable.check_path`): the fused check kernel with a
  factor of 1 where it accepts the dtype (one launch per group, where one ``torch.aminmax`` per
  tensor launches once per gradient: docs/benchmarks.md has the CPU timings); else
  ``"inf_norm"``.
* **dynamic loss-scale update** (:meth:`KernelTable.scale_update_path`): ``"amp"``, torch's
  ``_amp_update_scale_`` (the one kernel ``torch.amp.GradScaler`` runs), where it takes the
  float32 scale, for a scaler without hysteresis; else ``"where"``, element-wise ops on the 0-d
  state tensors (hysteresis, or a device without the kernel).
* **torch's fused optimizers** (:meth:`KernelTable.fused_optimizer`): ``fused=True`` SGD, Adam
  and AdamW where the device and dtype have a fused kernel.
* **the master step a compiling Trainer turns on** (:meth:`KernelTable.master_step`):
  ``"compile"`` (one compiled pass per parameter) on the CPU; ``"fused"`` (torch's fused
  multi-tensor kernels) elsewhere, where one compiled launch per parameter costs more than it
  saves (docs/benchmarks.md, "nine-linear and transformer on a GPU").
* **the piece a master step works on** (:meth:`KernelTable.step_piece`): the most elements
  whose fp32 values, gradients or widened moments a master step holds at once (fp32 masters'
  gradient buckets, the compact methods' pieces; a larger tensor is stepped a slice at a time):
  1/16 of the model, within a floor and a cap per device type that hold whatever the model's
  size (:data:`STEP_PIECE`: 2^20 on the CPU; on CUDA up to 2^25).
* **the high halves of fp32 words** (:meth:`KernelTable.copies_high_halves`), where a
  stochastic rounding into bf16 keeps its result: a copy of their stride-2 view on CUDA; on the
  CPU, which copies a strided view element by element, the words shifted right by 16 in place
  and narrowed to int16 (the same bits).
* **norm layers fed low-precision activations** (:meth:`KernelTable.norm_reads_low_precision`):
  which norm kernels read bf16/fp16 input with fp32 parameters (see
  :func:`mixprec.casting.takes_low_precision_input`).

A gradient dtype no kernel here accepts (float8, say) is refused with a ``TypeError`` naming it.

Kernels that need no choice: ``torch._foreach_copy_`` (gradients into fp32 scratch, masters
back into 16-bit weights), ``_foreach_zero_`` and ``_foreach_add_`` take every dtype on every
device (torch falls back to one kernel per tensor where its multi-tensor path does not apply).
mixprec calls no ``torch._scaled_mm`` itself: torchao's FP8 and MXFP8 layers do; which GPUs
run them is a compute-capability check (:func:`mixprec.lowbit.backend.check_device`,
:meth:`mixprec.lowbit.mxfp8.MXFP8.native`), not a dtype limit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

__all__ = ["FLOATS", "LIMITS", "KERNELS", "DEVICE_TYPES", "STEP_PIECE", "PIECE_FLOOR",
           "KernelTable", "TABLE"]

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
#: The floating dtypes gradients may have.
FLOATS = (F16, BF16, F32, F64)
#: The device types with rows of their own; any other device type takes the row ``"other"``.
DEVICE_TYPES = ("cpu", "cuda")

#: kernel -> device type (or ``"other"``) -> the dtypes it accepts.
LIMITS: dict[str, dict[str, tuple[torch.dtype, ...]]] = {
    # torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale).
    # CPU (ATen/native/cpu/AmpGradScalerKernels.cpp): AT_DISPATCH_FLOATING_TYPES and
    # AT_DISPATCH_REDUCED_FLOATING_TYPES. CUDA (ATen/native/cuda/AmpKernels.cu):
    # AT_DISPATCH_FLOATING_TYPES_AND_HALF, so bf16 raises NotImplementedError:
    # "_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for 'BFloat16'.
    # found_inf and inv_scale: one-element float32 tensors on the tensors' device.
    "amp_check_and_unscale": {"cpu": FLOATS, "cuda": (F16, F32, F64), "other": ()},
    # torch._fused_sgd_/_fused_adam_/_fused_adamw_ (torch.optim.SGD/Adam/AdamW, fused=True):
    # fp64, fp32, fp16 and bf16 parameters (torch.optim's docs;
    # AT_DISPATCH_FLOATING_TYPES_AND2(Half, BFloat16) in FusedAdamKernel.cu/FusedAdamKernel.cpp);
    # the gradients and state of the masters' dtype. On other devices (MPS: no fp64) mixprec
    # takes the optimizer's own foreach step.
    "fused_optimizer": {"cpu": FLOATS, "cuda": FLOATS, "other": ()},
    # torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, interval):
    # a float32 scale and an int32 tracker (ATen/native/cpu/AmpGradScalerKernels.cpp,
    # ATen/native/cuda/AmpKernels.cu); MPS has one too, not relied on here.
    "amp_update_scale": {"cpu": (F32,), "cuda": (F32,), "other": ()},
    # torch._foreach_norm(tensors, ord=inf): floating dtypes (CUDA:
    # AT_DISPATCH_FLOATING_TYPES_AND2(Half, BFloat16), max_propagate_nan; CPU: one
    # linalg.vector_norm per tensor). An empty tensor has no inf-norm on the CPU: left out.
    # torch._foreach_mul_(tensors, 0-d float32 tensor): floating dtypes, computed in float32
    # (double for fp64) and rounded once. Neither accepts float8 on the CPU.
    "foreach_norm_mul": {"cpu": FLOATS, "cuda": FLOATS, "other": FLOATS},
    # torch.aminmax: floating dtypes on CPU and CUDA (the monitor's range statistics).
    "aminmax": {"cpu": FLOATS, "cuda": FLOATS, "other": ()},
    # Norm kernels that read bf16/fp16 activations with fp32 weight and statistics
    # (torch.batch_norm on CPU and CUDA; torch.layer_norm/group_norm on the CPU only here: on
    # CUDA mixprec casts the input up).
    "batch_norm_low_input": {"cpu": (F16, BF16), "cuda": (F16, BF16), "other": ()},
    "layer_group_norm_low_input": {"cpu": (F16, BF16), "cuda": (), "other": ()},
    # An in-place elementwise op on fp32 tensors with a 16-bit operand (torch._foreach_add_/
    # _foreach_sub_(fp32 list, bf16/fp16 list)) read as it goes, with no copy: CUDA's kernels
    # cast each element as they load it; the CPU's TensorIterator first makes an fp32 copy of
    # the 16-bit operand (allocated and freed per tensor; torch's profiler shows it as
    # aten::to). Where it copies, a master method widens the operand into scratch it is given.
    "mixed_operand_in_place": {"cpu": (), "cuda": (F16, BF16), "other": ()},
    # A copy of the high halves of fp32 words (``words.view(torch.int16)[1::2]``, a stride-2
    # view) into contiguous 16-bit tensors at the speed of a contiguous pass: CUDA's copy kernel
    # reads the words coalesced (4 B read, 2 written an element); the CPU's copies a stride-2
    # source element by element (2^20 elements: 0.53 ms, where shifting the words right by 16
    # in place and narrowing them to int16 takes 0.19-0.25 ms: AMD EPYC, torch 2.13, one
    # thread). Where it does not, the words are shifted and narrowed: the same bits.
    "strided_high_halves": {"cpu": (), "cuda": (F16, BF16), "other": ()},
}

#: The most elements of one piece of a master step, by device type. A piece is 1/16 of the
#: elements the optimizer steps, at least :data:`PIECE_FLOOR` and at most this. The CPU's 2^20
#: (4 MiB of fp32 values) keeps a piece's values in cache from its load through torch's kernel to
#: its store: on the 42M-parameter model of docs/benchmarks.md pieces of 2^19 made split's and
#: stochastic rounding's steps 1-4% slower, and pieces of 2^21 stepped in the same time. On CUDA
#: a piece costs a fixed number of launches and Python calls, which a GPU step feels and a CPU
#: step hardly does, so pieces grow with the model (16 of them, as fp32 masters' buckets were)
#: up to 2^25 (128 MiB of fp32 values; a 1.1B-parameter model: about 35 pieces; chosen by that
#: count, not measured).
STEP_PIECE: dict[str, int] = {"cpu": 1 << 20, "cuda": 1 << 25, "other": 1 << 20}
#: The fewest elements of a piece (4 MiB of fp32 values), the cap allowing.
PIECE_FLOOR = 1 << 20
#: A model's elements are stepped in about this many pieces, between the floor and the cap.
PIECES_PER_MODEL = 16

#: kernel -> the callable the table hands out (a test swaps in a fake through
#: :meth:`KernelTable.imposing`).
KERNELS: dict[str, Callable] = {
    "amp_check_and_unscale": torch._amp_foreach_non_finite_check_and_unscale_,
    "amp_update_scale": torch._amp_update_scale_,
}

_NORM_KINDS = {"batch_norm": "batch_norm_low_input", "layer_norm": "layer_group_norm_low_input",
               "group_norm": "layer_group_norm_low_input"}


@dataclasses.dataclass(frozen=True)
class KernelTable:
    """Kernel paths by (device type, dtype), from ``limits`` (see the module docstring).

    Args:
        limits: kernel -> device type (``"cpu"``, ``"cuda"``, ``"other"``) -> accepted dtypes.
        kernels: kernel -> the callable to run.
        rows: device type -> the device type whose limits it follows (a test imposes CUDA's
            limits on CPU tensors with ``{"cpu": "cuda"}``); unlisted types follow their own.
    """

    limits: Mapping[str, Mapping[str, tuple]] = dataclasses.field(
        default_factory=lambda: LIMITS)
    kernels: Mapping[str, Callable] = dataclasses.field(default_factory=lambda: KERNELS)
    rows: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def row(self, device_type: str) -> str:
        """The row of :data:`LIMITS` that applies to ``device_type``."""
        device_type = self.rows.get(device_type, device_type)
        return device_type if device_type in DEVICE_TYPES else "other"

    def accepts(self, kernel: str, device_type: str, dtype: torch.dtype) -> bool:
        """Whether ``kernel`` runs tensors of ``dtype`` on ``device_type``."""
        return dtype in self.limits[kernel][self.row(device_type)]

    def kernel(self, name: str) -> Callable:
        """The callable behind kernel ``name``."""
        return self.kernels[name]

    def _check_gradient_dtype(self, dtype: torch.dtype, what: str) -> None:
        if dtype not in FLOATS:
            raise TypeError(f"can't {what} gradients of dtype {dtype}: gradients must be one of "
                            f"{', '.join(str(d) for d in FLOATS)}")

    def unscale_path(self, device_type: str, dtype: torch.dtype) -> str:
        """``"amp"`` (torch's fused check-and-unscale kernel) or ``"inf_norm"`` (an inf-norm
        check, then a foreach multiply) for gradients of ``dtype`` on ``device_type``.

        Raises:
            TypeError: ``dtype`` is not a floating dtype gradients may have.
        """
        self._check_gradient_dtype(dtype, "unscale")
        if self.accepts("amp_check_and_unscale", device_type, dtype):
            return "amp"
        return "inf_norm"

    def check_path(self, device_type: str, dtype: torch.dtype) -> str:
        """``"amp"`` (the fused kernel with a factor of 1: one launch per group) or
        ``"inf_norm"`` for a read-only inf/NaN check of gradients of ``dtype`` on
        ``device_type``.

        Raises:
            TypeError: ``dtype`` is not a floating dtype gradients may have.
        """
        self._check_gradient_dtype(dtype, "check")
        if self.accepts("amp_check_and_unscale", device_type, dtype):
            return "amp"
        return "inf_norm"

    def scale_update_path(self, device_type: str, hysteresis: int) -> str:
        """``"amp"`` (torch's ``_amp_update_scale_``, one launch) or ``"where"`` (element-wise
        ops) for a dynamic scale update of a float32 scale on ``device_type``; torch's kernel
        knows no hysteresis (``hysteresis`` > 1 takes ``"where"``)."""
        if hysteresis == 1 and self.accepts("amp_update_scale", device_type, F32):
            return "amp"
        return "where"

    def fused_optimizer(self, device_type: str, dtype: torch.dtype) -> bool:
        """Whether torch's fused SGD/Adam/AdamW kernel steps ``dtype`` tensors on
        ``device_type``."""
        return self.accepts("fused_optimizer", device_type, dtype)

    @staticmethod
    def fused_optimizer_on_shards(optimizer_type: type) -> bool:
        """Whether torch's fused kernel of ``optimizer_type`` steps FSDP2 shards (DTensors):
        DTensor registers a sharding rule for ``_fused_adam_``/``_fused_adamw_``
        (torch/distributed/tensor/_ops/_pointwise_ops.py), none for ``_fused_sgd_`` (it raises
        ``NotImplementedError: Operator aten._fused_sgd_.default does not have a sharding
        strategy registered``)."""
        return optimizer_type in (torch.optim.Adam, torch.optim.AdamW)

    def master_step(self, device_type: str) -> str:
        """The master step a compiling Trainer turns on: ``"compile"`` on the CPU, else
        ``"fused"`` (torch's fused kernels, ``MasterWeightOptimizer(fused="auto")``)."""
        return "compile" if self.row(device_type) == "cpu" else "fused"

    def reads_mixed_operands(self, device_type: str, dtype: torch.dtype) -> bool:
        """Whether an in-place fp32 op reads a ``dtype`` operand on ``device_type`` without an
        fp32 copy of it (else a master method widens it into scratch first)."""
        return self.accepts("mixed_operand_in_place", device_type, dtype)

    def copies_high_halves(self, device_type: str, dtype: torch.dtype) -> bool:
        """Whether the high halves of fp32 words go into ``dtype`` tensors on ``device_type``
        by a copy of their stride-2 view (else the words are shifted right by 16 in place and
        narrowed to int16: the same bits)."""
        return self.accepts("strided_high_halves", device_type, dtype)

    def step_piece(self, device_type: str, elements: int = 0) -> int:
        """The most elements one piece of a master step holds on ``device_type``, for an
        optimizer stepping ``elements`` in all: ``elements / 16``, at least
        :data:`PIECE_FLOOR`, at most the device type's :data:`STEP_PIECE`."""
        return min(STEP_PIECE[self.row(device_type)],
                   max(PIECE_FLOOR, elements // PIECES_PER_MODEL))

    def norm_reads_low_precision(self, kind: str, device_type: str) -> bool:
        """Whether the norm kernel of ``kind`` (``"batch_norm"``, ``"layer_norm"``,
        ``"group_norm"``) reads bf16/fp16 input with fp32 parameters on ``device_type``."""
        return self.accepts(_NORM_KINDS[kind], device_type, BF16)

    def imposing(self, device_type: str, on: str = "cpu",
                 kernels: Mapping[str, Callable] | None = None) -> KernelTable:
        """A table under which tensors on ``on`` take ``device_type``'s paths, with
        ``kernels`` in place of the real ones (for tests: a fake that refuses what the real
        kernel on ``device_type`` refuses)."""
        return KernelTable(self.limits, {**self.kernels, **(kernels or {})},
                           {**self.rows, on: device_type})


#: The table the library consults.
TABLE = KernelTable()
