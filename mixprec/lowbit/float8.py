"""``Float8``: FP8 GEMMs with torchao's ``Float8Linear`` recipes (per-tensor or per-row scales).

* ``"tensorwise"``: one dynamic scale per tensor; the output gradient in e5m2; FSDP2 can
  all-gather the weights in FP8 (one byte per value);
* ``"rowwise"``: one scale per row (power-of-two), e4m3 everywhere;
* ``"rowwise_gw_hp"``: rowwise, with the weight gradient's GEMM in high precision.

GEMM dimensions must be multiples of 16 (FP8 tensor cores need it; a CPU does not enforce it,
so mixprec checks it everywhere). The layers are torchao's ``Float8Linear`` (and mixprec's
``Float8Conv1D`` for Hugging Face's Conv1D): see :mod:`mixprec.lowbit.float8_layers`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from . import backend
from .base import LowBitFormat, register
from .fp8sim import float8_matmul
from .stats import LayerStats, scaled_fractions

__all__ = ["Float8", "RECIPES"]

#: mixprec's recipe names -> torchao's ``Float8LinearRecipeName`` values.
RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise",
           "rowwise_gw_hp": "rowwise_with_gw_hp"}
_AXES = {"input": -1, "weight": 0, "grad_output": -1}  # rowwise: the axis each role scales along


@dataclasses.dataclass(frozen=True, eq=False)
class Float8(LowBitFormat):
    """FP8 GEMMs through torchao's ``Float8Linear`` (``pip install mixprec[fp8]``).

    Args:
        recipe: "tensorwise" (one scale per tensor), "rowwise" (one per row), or
            "rowwise_gw_hp" (rowwise; the weight gradient's GEMM in high precision).

    Example:
        >>> Float8("rowwise") == "rowwise", str(Float8())
        (True, 'tensorwise')
    """

    recipe: str = "tensorwise"

    name: ClassVar[str] = "float8"
    block: ClassVar[int] = 16
    advisor_format: ClassVar[str] = "fp8_e4m3"
    bits_per_value: ClassVar[float] = 8.0

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"Float8's recipe must be one of {', '.join(map(repr, RECIPES))}; "
                             f"got {self.recipe!r}")

    @property
    def rowwise(self) -> bool:
        return self.recipe != "tensorwise"

    @property
    def weight_grad_in_fp8(self) -> bool:
        return self.recipe != "rowwise_gw_hp"

    def describe(self) -> str:
        return "FP8 GEMMs"

    # -- preparing ---------------------------------------------------------------------------
    def require(self) -> None:
        backend.require()

    def check_device(self, device) -> None:
        backend.check_device(device)

    def config(self, *, all_gather: bool = False):
        """torchao's ``Float8LinearConfig`` of the recipe (``all_gather``: FSDP2 gathers the
        weights in FP8; the tensorwise recipe only)."""
        if all_gather and self.rowwise:
            raise ValueError(f"FP8 all-gather needs the 'tensorwise' recipe; got "
                             f"{self.recipe!r}")
        return backend.float8_config(RECIPES[self.recipe], all_gather=all_gather)

    def shape_filter(self):
        """torchao's filter of the layers too small to gain from FP8 on an H100 (the
        rowwise_gw_hp recipe uses the rowwise rule)."""
        return backend.shape_filter(RECIPES["rowwise" if self.rowwise else "tensorwise"])

    def convert(self, model, names: tuple[str, ...]) -> None:
        from . import float8_layers  # optional: imports torchao
        float8_layers.convert(model, names, self)

    def before_sharding(self, model, names: list[str]) -> list[str]:
        """Tensorwise: torchao's FSDP2 float8 all-gather for the layers' weights."""
        if self.rowwise:
            return []
        from . import float8_layers  # optional: imports torchao
        return float8_layers.cast_weights_for_all_gather(model, names, self.config(all_gather=True))

    # -- measuring ---------------------------------------------------------------------------
    def recorder(self, module):
        cfg = module.config
        casts = {"input": cfg.cast_config_input, "weight": cfg.cast_config_weight,
                 "grad_output": cfg.cast_config_grad_output}
        return LayerStats({role: c.target_dtype for role, c in casts.items()},
                          {role: _AXES[role] if c.scaling_granularity.name == "AXISWISE"
                           else None for role, c in casts.items()},
                          cfg.round_scales_to_power_of_2)

    @classmethod
    def for_advisor(cls, fp8_recipe: str) -> Float8:
        return cls(fp8_recipe)

    def measured_by(self, measured: LowBitFormat) -> bool:
        """A measurement of ``measured`` covers this format: the same recipe, or rowwise for
        rowwise_gw_hp (the same forward and input-gradient GEMMs; the weight gradient's GEMM in
        high precision is more exact, not less)."""
        return self == measured or (self.recipe == "rowwise_gw_hp" and measured == "rowwise")

    def unmeasured(self, measured: LowBitFormat) -> str:
        base = "rowwise" if self.rowwise else "tensorwise"
        return (f"fp8={self.recipe!r}, but this advice measured the {str(measured)!r} recipe: "
                f"the two scale differently, so its FP8 verdicts do not carry over. Use "
                f"fp8={str(measured)!r}, or measure the recipe: mp.advise(..., "
                f"fp8={base!r})")

    def simulate(self, x, w_t):
        return float8_matmul(x, w_t, self.rowwise, self.weight_grad_in_fp8)

    def ranges(self, x, w_t, grad) -> dict[str, tuple]:
        e4m3 = torch.float8_e4m3fn
        tensors = {"input": (x, e4m3), "weight": (w_t, e4m3),
                   "grad_output": (grad, e4m3 if self.rowwise else torch.float8_e5m2)}
        return {role: scaled_fractions(t, dtype, _AXES[role] if self.rowwise else None,
                                       self.rowwise)
                for role, (t, dtype) in tensors.items() if t is not None}


register(Float8, {recipe: {"recipe": recipe} for recipe in RECIPES})
