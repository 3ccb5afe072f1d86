"""On paper: bytes per rank and gradient traffic per step for a level, a strategy and a world size.

The model counts what stays allocated through a training step, per rank:

* parameters: the model's weights as stored (FSDP: this rank's shard);
* masters: fp32 master copies of 16-bit weights (:class:`mixprec.MasterWeightOptimizer`, O2 in
  one process or under DDP); none under FSDP, whose fp32 shards are the masters; with a compact
  master method its buffers instead (:meth:`mixprec.masters.MasterMethod.master_bytes`:
  ``"split"``'s int16 remainders and ``"kahan"``'s 16-bit compensations, 2 bytes, sharded
  under FSDP, whose shards are then 16-bit; ``"stochastic"`` nothing);
* gradients: one per parameter in the parameter's dtype (FSDP: the reduce-scattered fp32 or
  16-bit shard);
* optimizer state: the optimizer's moments, in the dtype it steps in (fp32 at O0-O2, or the
  ``state_dtype`` given at O2; the 16-bit dtype at O3, where torch's optimizers keep state in the
  parameters' dtype: state made before ``prepare``, as Adagrad makes its sums when constructed,
  is cast to it there).

Not counted: activations, the transient fp32 copies of 16-bit gradients a master step makes, and,
under FSDP, the all-gathered parameters of the unit being computed.

Traffic is what one rank sends per optimizer step with ring collectives: DDP all-reduces every
gradient (``2 (W-1)/W`` of the gradient bytes in the reduce dtype); FSDP all-gathers the
parameters in the forward and again in the backward (``(W-1)/W`` each, in the gather dtype) and
reduce-scatters the gradients (``(W-1)/W`` in the reduce dtype).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import torch

from .. import masters, vocabulary
from ..dtypes import dtype_name, to_dtype
from ..policy import LEVELS, Policy
from .ddp import reduce_dtype_of

__all__ = ["MemoryPlan", "plan", "plan_table", "parse_count", "OPTIMIZER_MOMENTS", "STRATEGIES",
           "COMPACT_OPTIONS"]

#: Moments (state tensors the size of the parameters) each optimizer keeps.
OPTIMIZER_MOMENTS = {"sgd": 0, "momentum": 1, "rmsprop": 1, "adagrad": 1, "lion": 1,
                     "adam": 2, "adamw": 2}
STRATEGIES = ("single", "ddp", "fsdp")
#: (master, state_dtype) pairs of O2 that ``plan_table(compact=True)`` lists.
COMPACT_OPTIONS = tuple((m, s) for m in masters.shorthands() for s in ("fp32", "bf16"))
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text) -> int:
    """A parameter count from ``7e9``, ``7B``, ``350M``, ``1.3b`` or an int.

    Raises:
        ValueError: not a positive count.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", str(text).lower())
        if not m:
            raise ValueError(f"a parameter count must be a number like 7e9, 7B or 350M; "
                             f"got {text!r}")
        value = float(m.group(1)) * _SUFFIX[m.group(2)]
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"a parameter count must be at least 1; got {text!r}")
    return int(round(value))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank and bytes sent per rank per step for one set-up (see the module docstring).

    Attributes:
        params: number of parameters of the model.
        level, dtype, strategy, world, optimizer, reduce_dtype, master, state_dtype: the set-up.
        parameters, masters, gradients, optimizer_state: bytes per rank (``masters`` holds the
            buffers of a compact master method: the split remainder, the Kahan compensation).
        traffic: bytes one rank sends per optimizer step.
    """

    params: int
    level: str
    dtype: str
    strategy: str
    world: int
    optimizer: str
    reduce_dtype: str
    parameters: float
    masters: float
    gradients: float
    optimizer_state: float
    traffic: float
    master: str = "fp32"
    state_dtype: str = "fp32"

    @property
    def is_default_recipe(self) -> bool:
        """True for fp32 masters (or none) with fp32 moments: the levels' own set-up."""
        return not masters.resolve(self.master).compact and self.state_dtype == "fp32"

    @property
    def total(self) -> float:
        """Parameters + masters + gradients + optimizer state, bytes per rank."""
        return self.parameters + self.masters + self.gradients + self.optimizer_state

    @property
    def parameters_and_optimizer(self) -> float:
        """Parameters + masters + optimizer state (what stays when gradients are freed)."""
        return self.parameters + self.masters + self.optimizer_state

    def bytes_per_parameter(self) -> float:
        """``total`` divided by the parameter count (per rank)."""
        return self.total / self.params

    def bytes_per_param(self) -> float:
        """Deprecated alias of :meth:`bytes_per_parameter` (a ``DeprecationWarning``)."""
        warnings.warn("MemoryPlan.bytes_per_param() is deprecated; call bytes_per_parameter()",
                      DeprecationWarning, stacklevel=2)
        return self.bytes_per_parameter()


def _given(policy, level, dtype) -> Policy:
    """``policy=``, which comes instead of ``level``/``dtype``."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a mixprec.Policy; got {type(policy).__name__}")
    vocabulary.check_policy_alone(policy, level, dtype, "plan")
    return policy


def _check(level, strategy: str, world: int, optimizer: str) -> tuple:
    if level is not None and (not isinstance(level, str) or level.upper() not in LEVELS):
        raise ValueError(f"level must be one of {', '.join(map(repr, LEVELS))}; got {level!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}; "
                         f"got {strategy!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an integer >= 1; got {world!r}")
    if strategy == "single" and world != 1:
        raise ValueError(f"strategy 'single' runs one process; got world={world} (use 'ddp' or "
                         f"'fsdp' for more)")
    opt = str(optimizer).lower()
    if opt not in OPTIMIZER_MOMENTS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_MOMENTS)}; "
                         f"got {optimizer!r}")
    return level and level.upper(), strategy, opt


@vocabulary.takes("level", "dtype", "policy", "master", "state_dtype", "reduce_dtype", differs={
    "level": ("O2", "the level a memory plan is usually asked about: 16-bit weights with masters"),
    "dtype": ("bf16", '"auto" has no device to resolve on: a plan is for the cluster you name, '
                      "not this machine")})
def plan(params, *, level: str = vocabulary.Default("O2"), dtype=vocabulary.Default("bf16"),
         strategy: str = "fsdp", world: int = 1,
         optimizer: str = "adamw", reduce_dtype="fp32", policy: Policy | None = None,
         master=None, state_dtype=None) -> MemoryPlan:
    """Bytes per rank and gradient traffic per step of one set-up, on paper.

    Of the precision keywords, ``plan`` takes those that change the bytes it counts: ``level``,
    ``dtype`` ("fp32" makes every level fp32), ``policy``, ``master`` and ``state_dtype``
    (master-weight levels only). It counts every parameter alike, so the per-layer ones
    (``keep_fp32``, ``fp8``, ``fp8_modules``), which need the model, and those that change no
    stored tensor (the op lists, ``loss_scale``, ``max_consecutive_skips``, ``emulate_fp16``,
    ``monitor``, ``compile``) are absent; ``reduce_dtype`` sets the gradient traffic.

    Args:
        params: the parameter count (an int or ``"7B"``-style text).
        {precision keywords}
        strategy: "single", "ddp" or "fsdp".
        world: number of ranks (1 for "single").
        optimizer: one of :data:`OPTIMIZER_MOMENTS`.

    Returns:
        A :class:`MemoryPlan`.

    Raises:
        ValueError: any unknown or out-of-range argument; ``policy`` with ``level``/``dtype``.
        TypeError: a ``policy`` that is not a :class:`mixprec.Policy`.

    Example:
        >>> p = plan("7B", level="O2", strategy="fsdp", world=64)
        >>> round(p.total / 2**30, 2)  # GiB per rank
        1.63
    """
    n = parse_count(params)
    if policy is None:
        level, strategy, opt = _check(level, strategy, world, optimizer)
        try:
            low_dt = to_dtype(dtype)
        except (TypeError, ValueError):
            low_dt = None
        if low_dt not in (to_dtype("fp32"), to_dtype("bf16"), to_dtype("fp16")):
            why = (" ('auto' has no device to resolve on: a plan is for the cluster you name)"
                   if isinstance(dtype, str) and dtype.strip().lower() == "auto" else "")
            raise ValueError(f"plan's dtype must be 'bf16', 'fp16' or 'fp32' (or their torch "
                             f"dtypes); got {dtype!r}{why}")
        policy = Policy.from_level(level, low_dt, warn=False)
    else:
        _, strategy, opt = _check(None, strategy, world, optimizer)
        policy = _given(policy, level, dtype)
        level, low_dt = policy.level or "custom", policy.compute_dtype
    reduce = reduce_dtype_of(reduce_dtype)
    shard = world if strategy == "fsdp" else 1
    changes = {k: v for k, v in (("master", master), ("state_dtype", state_dtype))
               if v is not None}
    if changes:
        try:
            policy = policy.replace(**changes, level=policy.level)
        except ValueError as exc:
            if policy.master_weights:
                raise
            raise ValueError(f"master={master!r} and state_dtype={state_dtype!r} apply to a "
                             f"master-weight level with a 16-bit dtype (O2); got {level} with "
                             f"{dtype_name(low_dt)}") from exc
    gather = policy.param_dtype.itemsize            # what the forward reads
    kept = policy.master.master_bytes(gather) if policy.master_weights else 0
    stored = gather
    if strategy == "fsdp" and policy.master_weights and not policy.master.compact:
        stored, kept = 4, 0                          # fp32 shards, gathered in the 16-bit dtype
    step_bytes = (policy.state_dtype.itemsize if policy.master_weights
                  else gather)                       # the optimizer state's dtype
    per_param = {"parameters": stored, "masters": kept, "gradients": stored,
                 "optimizer_state": OPTIMIZER_MOMENTS[opt] * step_bytes}
    ring = (world - 1) / world
    traffic = {"single": 0.0, "ddp": 2 * ring * n * reduce.itemsize,
               "fsdp": ring * n * (2 * gather + reduce.itemsize)}[strategy]
    return MemoryPlan(n, level, dtype_name(low_dt), strategy, world, opt, dtype_name(reduce),
                      **{k: v * n / shard for k, v in per_param.items()}, traffic=traffic,
                      master=str(policy.master), state_dtype=dtype_name(policy.state_dtype))


def plan_table(params, *, dtype="bf16", world: int = 8, optimizer: str = "adamw",
               reduce_dtype="fp32", compact: bool = False) -> list[MemoryPlan]:
    """Plans for every strategy and level: "single" at one rank, "ddp"/"fsdp" at ``world``;
    with ``compact``, also O2 with each master and state dtype of :data:`COMPACT_OPTIONS` whose
    method holds ``dtype`` weights (fp16: no split or stochastic rows)."""
    low = to_dtype(dtype)
    held = tuple((m, s) for m, s in COMPACT_OPTIONS
                 if not masters.resolve(m).dtypes or low not in (torch.float16, torch.bfloat16)
                 or low in masters.resolve(m).dtypes)
    rows = []
    for strategy in STRATEGIES:
        for level in LEVELS:
            options = held if compact and level == "O2" else (("fp32", "fp32"),)
            for master, state_dtype in options:
                rows.append(plan(params, level=level, dtype=dtype, strategy=strategy,
                                 world=1 if strategy == "single" else world,
                                 optimizer=optimizer, reduce_dtype=reduce_dtype, master=master,
                                 state_dtype=state_dtype))
    return rows
