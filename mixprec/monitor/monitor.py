"""``mp.PrecisionMonitor``: a precision run recorded over time.

Given as ``monitor=`` to :class:`mixprec.MixedPrecision` (and so to ``mp.Trainer``, the
Lightning plugin and ``MixprecTrainer``'s engine), it records every ``every``-th optimizer step
(the first included) and hands the scalars to its writers:

* ``mixprec/loss`` (the mean loss over the steps since the last record), ``mixprec/loss_scale``
  (the scale the recorded step ran at), ``mixprec/skipped_steps`` (steps skipped so far for
  inf/NaN gradients), ``mixprec/grad_norm`` (the true, unscaled, pre-clip gradient norm);
  :meth:`PrecisionMonitor.close` adds ``mixprec/steps`` (the steps run) and the final
  ``mixprec/skipped_steps`` at the last step, when it was not a recorded one;
* per watched layer N: ``mixprec/N/grad_underflow``, ``mixprec/N/act_amax``,
  ``mixprec/N/act_headroom`` and ``mixprec/N/weight_update_lost`` (see
  :mod:`mixprec.monitor.statistics` for what each measures), and for an FP8 layer
  ``mixprec/N/fp8_input_scale`` and ``mixprec/N/fp8_weight_scale`` (``fmax / amax``: the
  tensorwise scale its casts use).

Under FSDP each rank measures its own shards and its own part of the batch; at a recorded step
the ranks' parts are combined (:mod:`mixprec.monitor.ranks`: norms as the root of the summed
squares, fractions from summed counts, amax as the maximum, the loss as the mean), so every rank
records what one process would for the whole model and the global batch, and rank 0 writes it.

Cost: between recorded steps, one device add per loss (no host sync) and no hooks at all; the
forward hooks that read activations exist only during a recorded step. A recorded step measures
the gradients, steps an fp32 copy of the optimizer over the watched parameters (the intended
update) and reads everything with one host sync (under FSDP, after one ``all_gather`` of the
ranks' partial statistics).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import nn

from .. import formats
from ..distenv import is_main_process
from ..engine_checks import EngineObserver
from ..fp8.convert import fp8_modules
from ..scaling.unscale import total_norm
from ..shards import local, replicated
from .ranks import RankReduction, lost_fraction, mesh_of
from .statistics import UpdateProbe, gradient_pairs, output_amax, underflow_counts
from .writers import as_writers

__all__ = ["PrecisionMonitor"]

_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


class PrecisionMonitor(EngineObserver):
    """Record a mixed-precision run every few steps: loss scale, skips, gradient norm, and per
    layer gradient underflow, activation range and the update lost to rounding.

    Args:
        every: record every ``every``-th optimizer step (steps 0, every, 2*every, ...).
        layers: which modules to watch: None (every module that holds parameters itself), or
            qualified names, ``fnmatch`` patterns (``"h.*.mlp.c_proj"``) and module types.
        writers: where the scalars go: :class:`mixprec.monitor.TensorBoardWriter`,
            :class:`mixprec.monitor.JSONLWriter`, or any object with ``write(step, scalars)``
            and ``close()``; one writer or a list of them. Only the main process writes.

    Attributes:
        records: every recorded step's scalars (a dict with ``"step"``), in order.
        step: the index of the next optimizer step.

    Raises:
        ValueError: ``every`` is not a positive integer; a name or pattern in ``layers``
            matches no module (raised when the model is set up).
        TypeError: ``writers`` neither a writer nor a list of writers; a writer without
            ``write``/``close``; a bad ``layers`` entry.

    Example:
        >>> import torch, mixprec as mp
        >>> model = torch.nn.Linear(4, 2)
        >>> amp = mp.MixedPrecision("O2", "bf16", monitor=mp.PrecisionMonitor(every=1))
        >>> model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> amp.backward(model(torch.randn(8, 4)).float().pow(2).mean())
        >>> amp.step(opt)
        True
        >>> amp.monitor.records[0]["mixprec/model/weight_update_lost"]
        0.0
    """

    def __init__(self, every: int = 50, layers=None, writers: Iterable = ()):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer; got {every!r}")
        self.every = every
        self._patterns = _check_layers(layers)
        self.writers = as_writers(writers)
        self.records: list[dict] = []
        self.step = 0
        self._engine = None
        self._layers: dict[str, nn.Module] = {}
        self._params: dict[str, list[torch.Tensor]] = {}
        self._fp8: set[str] = set()
        self._hooks: list = []
        self._loss: torch.Tensor | None = None
        self._window = 0
        self._loss_resumed: float | None = None  # a checkpoint's loss sum, until the next loss
        self._clipped: dict[int, torch.Tensor] = {}  # a hand clip's norm, until the step
        self._measured: dict[int, dict] = {}  # underflow counts taken before an unscale/clip
        self._closed_at = 0  # the step count of the last closing record
        self._reset_step()

    def __repr__(self) -> str:
        return (f"PrecisionMonitor(every={self.every}, layers={len(self._layers)}, "
                f"writers={self.writers!r})")

    @property
    def recording(self) -> bool:
        """True while the current step is one that is recorded."""
        return self.step % self.every == 0

    @property
    def layer_names(self) -> list[str]:
        """The qualified names of the watched layers."""
        return list(self._layers)

    # -- what the engine calls -------------------------------------------------------------------
    def watch(self, model: nn.Module, engine) -> None:
        """Watch ``model``'s layers for ``engine`` (called by the engine's ``setup``/``adopt``)."""
        if self._engine is not None and engine is not self._engine:
            raise RuntimeError("this PrecisionMonitor already records another MixedPrecision "
                               "run; give each run its own monitor")
        self._engine = engine
        prefix = f"model{len(engine.models) - 1}." if len(engine.models) > 1 else ""
        found = _select(model, self._patterns)
        self._layers.update({prefix + name: m for name, m in found.items()})
        self._params.update({prefix + name: _own_parameters(m) for name, m in found.items()})
        fp8 = set(fp8_modules(model))
        self._fp8.update(prefix + name for name in found if name in fp8)
        self._disarm()
        if self.recording:
            self._arm()

    def observe_loss(self, loss) -> None:
        """Add a loss to the window's sum (on the device; no host sync)."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
            value = loss.detach().float().reshape(())
            if self._loss is None and self._loss_resumed is not None:  # (on the loss's device)
                self._loss = torch.tensor(self._loss_resumed, dtype=torch.float32,
                                          device=value.device)
                self._loss_resumed = None
            self._loss = value if self._loss is None else self._loss + value.to(self._loss.device)

    def clipped(self, optimizer, norm: torch.Tensor) -> None:
        """``optimizer``'s gradients were clipped by hand (``amp.clip_grad_norm_``: the hosts'
        clips go through it); ``norm`` is their true 2-norm before the clip, which the step's
        record reports (its gradients, clipped, no longer have it)."""
        self._clipped[id(optimizer)] = norm

    def measure_underflow(self, optimizer) -> None:
        """Count the gradients below the smallest normal now, as the backward left them, before
        an unscale or a clip changes them (a recorded step only; the step's record takes these
        counts)."""
        self._measured[id(optimizer)] = self._underflow_of(optimizer, gradient_pairs(optimizer))

    def _underflow_of(self, optimizer, grads: dict) -> dict:
        """Per layer, ``[values below the smallest normal at the loss scale, nonzero values]``
        of the gradients as held, at the scale they carry from the backward (a clip does not
        enter: it changes no 16-bit gradient the backward stored)."""
        scaler = self._engine.scaler
        smallest = formats.get(self._engine.policy.compute_dtype).min_normal
        scale = scaler.scale_tensor if scaler.is_enabled() else torch.ones(
            (), device=scaler.scale_tensor.device)
        carried = scaler.carried_scale(optimizer)
        counts = {}
        for name, held in self._params.items():
            params = [p for p in held if p in grads]
            if params:
                counts[name] = underflow_counts(
                    [grads[p] for p in params if not grads[p].is_sparse], carried, scale,
                    smallest)
        return counts

    def before_step(self, optimizer, norm: torch.Tensor | None) -> None:
        """Measure ``optimizer``'s gradients and step an fp32 probe (a recorded step only)."""
        if norm is None:
            norm = self._clipped.pop(id(optimizer), None)
        scaler = self._engine.scaler
        carried = scaler.carried_factor(optimizer)
        self._scale = scaler.scale_tensor.detach().clone() if scaler.is_enabled() else None
        grads = gradient_pairs(optimizer)
        dense = [g for g in grads.values() if not g.is_sparse]
        mesh = mesh_of(grads)
        sharded = mesh is not None
        self._mesh = mesh if self._mesh is None else self._mesh
        if norm is not None:  # the clip's norm: the whole model's (FSDP: replicated)
            self._norm_sq.append(replicated(norm).float().pow(2))
        else:  # over this rank's shards under FSDP: the ranks' squares add up
            norm = total_norm(dense, 2.0, scaler.scale_tensor.device)
            if carried is not None:
                norm = norm / carried.to(norm.device)
            (self._shard_norm_sq if sharded else self._norm_sq).append(norm.float().pow(2))
        mine = {name: [p for p in held if p in grads] for name, held in self._params.items()}
        mine = {name: params for name, params in mine.items() if params}
        measured = self._measured.pop(id(optimizer), None)
        for name, counts in (measured if measured is not None
                             else self._underflow_of(optimizer, grads)).items():
            self._underflow[name] = self._underflow.get(name, 0) + counts
        self._probes[id(optimizer)] = UpdateProbe(optimizer, mine, carried)

    def after_step(self, optimizer, stepped: bool) -> None:
        """The update each layer lost, when ``optimizer`` stepped (a recorded step only)."""
        probe = self._probes.pop(id(optimizer), None)
        if probe is not None and stepped:
            self._lost.update(probe.sums())

    def state_dict(self) -> dict:
        """What a checkpoint keeps (a host sync): the step count, and the loss summed over the
        steps since the last record (``loss_sum``, ``loss_steps``), so that a resumed run's
        first record averages what the uninterrupted run's does."""
        return {"step": self.step, "loss_steps": self._window,
                "loss_sum": (float(self._loss) if self._loss is not None
                             else self._loss_resumed)}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (a checkpoint that holds ``step`` alone, as written
        before the loss window was kept, resumes its count)."""
        self.resume_at(state["step"], state.get("loss_sum"), state.get("loss_steps", 0))

    def resume_at(self, step: int, loss_sum: float | None = None, loss_steps: int = 0) -> None:
        """Continue counting from ``step`` (a resumed run: the step its checkpoint was saved
        at), so that it records at the steps the uninterrupted run records at; ``loss_sum``
        over ``loss_steps`` steps since the last record carry on into the next one.

        Raises:
            ValueError: ``step`` or ``loss_steps`` is not an integer >= 0.
        """
        for name, value in (("step", step), ("loss_steps", loss_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
        self.step = step
        self._loss, self._window = None, loss_steps
        self._loss_resumed = None if loss_sum is None else float(loss_sum)
        self._disarm()
        if self.recording:
            self._arm()

    def end_step(self, applied: bool) -> None:
        """Close the step: record it when it is a recorded one, then move on."""
        self._clipped = {}
        self._window += 1
        if self.recording and self._engine is not None:
            self._record()
        self.step += 1
        if self.recording:
            self._arm()

    def close(self) -> None:
        """Write the run's closing count, remove the hooks and close the writers.

        A closing record at the last step holds ``mixprec/steps`` (the steps run) and
        ``mixprec/skipped_steps``, so that a report counts every step, not only those up to
        the last record (a :class:`~mixprec.monitor.JSONLWriter` adds it to the last step's
        object when that step was recorded)."""
        self._disarm()
        if self.step > self._closed_at and self._engine is not None and is_main_process():
            # (also when the last step was a recorded one: the count says the run was closed)
            self._closed_at = self.step
            closing = {"mixprec/steps": float(self.step),
                       "mixprec/skipped_steps": float(self._engine.scaler.skipped_steps)}
            for w in self.writers:
                w.write(self.step - 1, closing)
        # the loss too: a monitor used again averaged the closed window's sum over the new
        # window's steps
        self._loss, self._window, self._loss_resumed = None, 0, None
        for w in self.writers:
            w.close()

    # -- recording -------------------------------------------------------------------------------
    def _record(self) -> None:
        self._disarm()
        scalars: dict = {"step": self.step}
        names, values = [], []
        ranks = self._combine()

        def put(name: str, value) -> None:
            scalars[name] = None  # keeps the order; device values are filled in below
            if isinstance(value, torch.Tensor):
                names.append(name)
                values.append(value)
            else:
                scalars[name] = float(value)

        if "loss" in ranks:
            put("mixprec/loss", ranks["loss"].value)
        put("mixprec/loss_scale", self._scale if self._scale is not None else 1.0)
        put("mixprec/skipped_steps", self._engine.scaler.skipped_steps)
        if "norm_sq" in ranks:
            put("mixprec/grad_norm", ranks["norm_sq"].value.sqrt())
        fmax = formats.get(self._engine.policy.compute_dtype).max
        for name in self._layers:
            counts = ranks.get(("underflow", name))
            if counts is not None:
                counts = counts.value
                put(f"mixprec/{name}/grad_underflow", counts[0] / counts[1].clamp(min=1))
            amax = ranks.get(("amax", name))
            if amax is not None:
                amax = amax.value
                put(f"mixprec/{name}/act_amax", amax)
                put(f"mixprec/{name}/act_headroom",
                    torch.log2(fmax / amax.double().clamp(min=1e-300)).float())
            lost = ranks.get(("lost", name))
            if lost is not None:
                put(f"mixprec/{name}/weight_update_lost", lost_fraction(lost.value))
            for key in self._fp8_scales.get(name, {}):
                put(f"mixprec/{name}/fp8_{key}_scale", ranks[("fp8", name, key)].value)
        if values:
            device = values[0].device
            numbers = torch.stack([v.detach().to(device, torch.float64).reshape(())
                                   for v in values]).tolist()  # the one host sync
            scalars.update(zip(names, numbers))
        self.records.append(scalars)
        if is_main_process():
            plain = {k: v for k, v in scalars.items() if k != "step"}
            for w in self.writers:
                w.write(self.step, plain)
        self._loss, self._window, self._loss_resumed = None, 0, None
        self._reset_step()

    def _combine(self) -> dict:
        """The step's statistics, combined over the ranks when they were measured on shards
        (one collective; see :mod:`mixprec.monitor.ranks`), else this rank's own."""
        reduction = RankReduction.over(self._mesh)
        out = {}
        loss = self._loss
        if loss is None and self._loss_resumed is not None:  # (no loss seen since a resume)
            loss = torch.tensor(self._loss_resumed, dtype=torch.float32)
        if loss is not None:
            out["loss"] = reduction.add(loss / self._window, "mean")
        if self._norm_sq or self._shard_norm_sq:
            first = (self._norm_sq or self._shard_norm_sq)[0]
            whole = sum((n.double().to(first.device) for n in self._norm_sq),
                        torch.zeros((), dtype=torch.float64, device=first.device))
            shards = sum((n.double().to(first.device) for n in self._shard_norm_sq),
                         torch.zeros((), dtype=torch.float64, device=first.device))
            out["norm_sq"] = _Sum(whole, reduction.add(shards, "sum"))
        for name, counts in self._underflow.items():
            out[("underflow", name)] = reduction.add(counts, "sum")
        for name, amax in self._amax.items():
            out[("amax", name)] = reduction.add(amax, "max")
        for name, sums in self._lost.items():
            out[("lost", name)] = reduction.add(sums, "sum")
        for name, scales in self._fp8_scales.items():
            for key, value in scales.items():
                out[("fp8", name, key)] = reduction.add(value, "min")
        reduction.run()
        return out

    def _reset_step(self) -> None:
        self._norm_sq: list[torch.Tensor] = []         # whole-model norms (squared)
        self._shard_norm_sq: list[torch.Tensor] = []   # this rank's shards' norms (squared)
        self._mesh = None   # the device mesh of sharded parameters (FSDP), else None
        self._underflow: dict[str, torch.Tensor] = {}
        self._amax: dict[str, torch.Tensor] = {}
        self._lost: dict[str, torch.Tensor] = {}
        self._fp8_scales: dict[str, dict[str, torch.Tensor]] = {}
        self._probes: dict[int, UpdateProbe] = {}
        self._scale = None

    # -- forward hooks, only during a recorded step ----------------------------------------------
    def _arm(self) -> None:
        if self._hooks:
            return
        for name, module in self._layers.items():
            self._hooks.append(module.register_forward_hook(self._hook(name)))

    def _disarm(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, name: str):
        fp8 = name in self._fp8

        def hook(module, args, output):
            if not torch.is_grad_enabled():  # an evaluation between steps: not the step's
                return                       # forward (an activation checkpoint's recompute
            amax = output_amax(output)       # runs with grad enabled)
            if amax is not None:
                prev = self._amax.get(name)
                self._amax[name] = amax if prev is None else torch.maximum(prev, amax)
            if fp8:
                self._fp8_scales[name] = _fp8_scales(module, args)
        return hook


def _fp8_scales(module: nn.Module, args) -> dict[str, torch.Tensor]:
    out = {}
    inputs = output_amax(args[0]) if args else None
    if inputs is not None:
        out["input"] = _FP8_MAX / inputs.clamp(min=1e-12)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):  # FSDP: this rank's shard (the ranks take the min)
        mine = local(weight.detach())
        amax = (mine.abs().amax().float() if mine.numel()
                else torch.zeros((), dtype=torch.float32, device=mine.device))
        out["weight"] = _FP8_MAX / amax.clamp(min=1e-12)
    return out


class _Sum:
    """A whole-model squared norm plus the ranks' summed shard squares (``value``)."""

    def __init__(self, whole: torch.Tensor, shards):
        self.whole, self.shards = whole, shards

    @property
    def value(self) -> torch.Tensor:
        return (self.whole + self.shards.value.to(self.whole.device)).float()


def _own_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The parameters a layer holds itself, or, for a container, all of its parameters."""
    own = list(module.parameters(recurse=False))
    return own or list(module.parameters())


def _check_layers(layers) -> list | None:
    if layers is None:
        return None
    if isinstance(layers, str) or isinstance(layers, type):
        layers = [layers]
    try:
        layers = list(layers)
    except TypeError:
        raise TypeError(f"layers must be None or a list of qualified names, patterns and module "
                        f"types; got {type(layers).__name__}") from None
    for entry in layers:
        if not (isinstance(entry, str) or (isinstance(entry, type)
                                           and issubclass(entry, nn.Module))):
            raise TypeError(f"layers holds qualified names, patterns and nn.Module types; got "
                            f"{entry!r}")
    return layers


def _select(model: nn.Module, patterns: list | None) -> dict[str, nn.Module]:
    """The watched modules of ``model``: those holding parameters themselves, filtered."""
    owners = {name or "model": m for name, m in model.named_modules()
              if any(True for _ in m.parameters(recurse=False))}
    if patterns is None:
        return owners
    chosen = {}
    named = {name or "model": m for name, m in model.named_modules()}
    for entry in patterns:
        if isinstance(entry, str):
            hits = {n: m for n, m in named.items() if n == entry or fnmatch.fnmatchcase(n, entry)}
        else:
            hits = {n: m for n, m in owners.items() if isinstance(m, entry)}
        if not hits:
            shown = ", ".join(list(owners)[:8])
            raise ValueError(f"layers entry {entry!r} matches no module of this model; its "
                             f"layers with parameters include: {shown}")
        chosen.update(hits)
    return chosen
