"""``MixprecAccelerator``: an ``accelerate.Accelerator`` whose precision is a
:class:`mixprec.MixedPrecision`.

A loop written for Hugging Face Accelerate gets mixprec's precision by changing the line that
builds the accelerator::

    accelerator = MixprecAccelerator(level="O2", dtype="bf16")   # was Accelerator(...)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    for batch in data:
        accelerator.backward(model(**batch).loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()            # skipped when the gradients overflowed
        optimizer.zero_grad()

Where each of Accelerate's calls lands on the engine:

* ``prepare(model, optimizer, ...)``: the model goes through the engine *before* Accelerate
  wraps it: one process or DDP, ``engine.setup(model, optimizer)`` (at O2 the optimizer becomes
  a :class:`mixprec.MasterWeightOptimizer` over fp32 masters; several ranks first take rank 0's
  fp32 weights, so every rank's masters agree); FSDP2, :func:`mixprec.parallel.fsdp` shards the
  prepared model with the fp32 shards as the masters, and Accelerate keeps it as it is.
  Under DDP the gradients of 16-bit parameters are averaged in fp32 (mixprec's reduce hook).
  Give a model and its optimizers to one ``prepare`` call (the masters need both).
* ``backward(loss)``: the loss times the loss scale (the accelerator's gradient scaler is the
  engine, :class:`EngineGradScaler`).
* ``clip_grad_norm_(model.parameters(), max_norm)`` and ``clip_grad_value_``: the true gradients
  of the optimizer that holds those parameters, clipped by the engine (the global norm across
  ranks under FSDP2); ``unscale_gradients()`` makes them the true ones.
* ``optimizer.step()``: ``engine.step``: checks the gradients (the overflow flag is reduced
  across ranks), steps or skips, updates the scale; ``accelerator.optimizer_step_was_skipped``
  says which, and a prepared scheduler steps only after an applied update.
* ``save_state``/``load_state``: the masters travel in the optimizer's state (``optimizer.bin``
  or FSDP2's sharded ``optimizer_0``, a compact master's remainder or compensation with them),
  the engine's state (policy and scaler) in ``scaler.pt``; a state saved under another policy is
  refused. An FSDP2 state loads at another number of FSDP2 processes, one included. A state is
  written aside and renamed when every rank is done, with the checksums of its files, which
  ``load_state`` checks (``verify=False`` skips them).
* ``unwrap_model(model)``: the prepared model; its ``state_dict()`` holds the fp32 masters, and a
  Hugging Face model's ``save_pretrained`` writes them with a float32 config.

Accelerate's own mixed precision (``mixed_precision="bf16"``, ``ACCELERATE_MIXED_PRECISION``, an
``accelerate config`` choice) is refused beside it: autocast and a GradScaler on top of the
engine would cast and scale twice. DeepSpeed, Megatron-LM, XLA and FSDP1 are refused (their own
optimizer or sharding takes the step out of the engine's hands).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import distenv as env
from .. import vocabulary
from ..engine import engine_for
from ..integrity import save_directory, verify_on_ranks
from ..lowbit.backend import quiet_import
from ..policy import Policy
from ..prepare import policy_of
from ..scaling import owns_gradients
from .gradscaler import EngineGradScaler
from .hosts import (
    fsdp_units,
    lay_out_state,
    reduce_in_fp32,
    refuse_host,
    refused_host,
    setup_for_host,
)

try:
    with quiet_import():
        import accelerate
        from accelerate.optimizer import AcceleratedOptimizer
except ImportError as exc:  # pragma: no cover - the error names the extra
    raise ImportError("mixprec.integrations.accelerate needs accelerate: "
                      "pip install 'mixprec[accelerate]'") from exc

__all__ = ["MixprecAccelerator", "EngineGradScaler", "setup_for_host", "reduce_in_fp32",
           "refused_host", "fsdp_units", "lay_out_state", "accelerate_name"]

def _model_params(optimizer) -> set[int]:
    """ids of the model parameters an (engine-prepared) optimizer steps."""
    to_model = getattr(optimizer, "model_param", None)
    if not (owns_gradients(optimizer) and callable(to_model)):
        to_model = None
    return {id(to_model(p) if to_model else p) for g in optimizer.param_groups
            for p in g["params"]}


def _inner(optimizer):
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


@vocabulary.takes(*vocabulary.PRECISION, *vocabulary.LOOP, *vocabulary.EMULATION)
class MixprecAccelerator(accelerate.Accelerator):
    """An ``accelerate.Accelerator`` whose precision is a :class:`mixprec.MixedPrecision`.

    Takes every keyword argument of ``accelerate.Accelerator`` (``gradient_accumulation_steps``,
    ``fsdp_plugin``, ``kwargs_handlers``, ``project_dir``, ...), plus the precision keywords, or
    a ready engine:

    Args:
        mixed_precision: a :class:`mixprec.MixedPrecision`, e.g.
            ``mp.MixedPrecision(level="O2", dtype="bf16")``, instead of the keywords below
            (with it, they stay at their defaults); None: one built from them. Accelerate's own
            values (``"fp16"``, ``"bf16"``, ``"fp8"``) are refused; ``"no"`` means None.
        {precision keywords}
        emulate_fp16: see :class:`mixprec.autocast`.
        monitor: a :class:`mixprec.PrecisionMonitor` that records the run.

    Attributes:
        engine: the engine; ``.policy`` and ``.scaler`` are its.
        mixed_precision: the precision the model computes in, as Accelerate names it
            (``"bf16"``, ``"fp16"``, ``"fp8"``; ``"no"`` at O0); Accelerate's own setting,
            ``state.mixed_precision``, stays ``"no"`` (see :attr:`mixed_precision`).

    Raises:
        TypeError: ``mixed_precision`` is neither an engine, None nor ``"no"``; an engine with
            precision keywords; positional arguments.
        ValueError: Accelerate's own mixed precision (``mixed_precision="bf16"``, or set by
            ``ACCELERATE_MIXED_PRECISION`` or an accelerate config); DeepSpeed, Megatron-LM,
            XLA or FSDP1.

    Example:
        >>> import torch, mixprec as mp
        >>> accelerator = MixprecAccelerator(level="O2", dtype="bf16", cpu=True)
        >>> net = torch.nn.Linear(4, 2)
        >>> net, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> accelerator.backward(net(torch.randn(8, 4)).float().pow(2).mean())
        >>> opt.step(); accelerator.optimizer_step_was_skipped
        False
    """

    def __init__(self, *args: Any, mixed_precision: Any = None, level: str = vocabulary.LEVEL,
                 dtype: Any = vocabulary.DTYPE, loss_scale: Any = "auto",
                 policy: Policy | None = None,
                 keep_fp32=None, low_precision_ops=(), fp32_ops=(), master=None,
                 state_dtype=None, fp8=None, fp8_modules=None, emulate_fp16="auto",
                 monitor=None, max_consecutive_skips: int | None = 8, **kwargs: Any):
        if args:
            raise TypeError("MixprecAccelerator takes keyword arguments only (Accelerator's "
                            "positional order puts its own mixed_precision among them)")
        if isinstance(mixed_precision, str):
            if mixed_precision != "no":
                raise ValueError(
                    f"mixed_precision={mixed_precision!r} turns on Accelerate's own mixed "
                    f"precision (autocast and GradScaler) on top of mixprec's engine, which would "
                    f"cast and scale twice; pass the precision keywords instead (e.g. "
                    f"level='O2', dtype={mixed_precision!r}) or "
                    f"mixed_precision=mp.MixedPrecision(...)")
            mixed_precision = None
        engine = engine_for(type(self), mixed_precision, level=level, dtype=dtype,
                            loss_scale=loss_scale, policy=policy, keep_fp32=keep_fp32,
                            low_precision_ops=low_precision_ops, fp32_ops=fp32_ops,
                            master=master, state_dtype=state_dtype, fp8=fp8,
                            fp8_modules=fp8_modules, emulate_fp16=emulate_fp16, monitor=monitor,
                            max_consecutive_skips=max_consecutive_skips)
        super().__init__(**kwargs)  # mixed precision from the environment or config: refused
        env.apply_timeout("Accelerate", "kwargs_handlers=[InitProcessGroupKwargs("
                                        "timeout=timedelta(seconds=...))]")
        check_host_precision(self)
        plugin = getattr(self.state, "fsdp_plugin", None)
        refused = refused_host(self.distributed_type, getattr(plugin, "fsdp_version", None))
        if refused:
            refuse_host(refused)
        self.engine = engine
        self.scaler = EngineGradScaler(engine)

    @property
    def mixed_precision(self) -> str:
        """The precision the model computes in, in Accelerate's words: ``"bf16"`` or ``"fp16"``
        (O1-O3, the engine's compute dtype), ``"fp8"`` (``fp8=`` given), ``"no"`` (O0); before
        ``dtype="auto"`` is resolved, what it resolves to on this accelerator's device. A
        script's ``if accelerator.mixed_precision != "no":`` takes its mixed-precision path.
        Accelerate's own switch, ``accelerator.state.mixed_precision``, stays ``"no"``: it is
        what Accelerate reads to autocast and build a GradScaler, which the engine does."""
        engine = self.__dict__.get("engine")
        if engine is None:  # inside Accelerator.__init__: Accelerate's own value
            return self.state.mixed_precision
        return accelerate_name(engine.policy_on(self.device))

    # -- prepare ---------------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """``Accelerator.prepare``, each model (with the optimizers over its parameters, from
        the same call) prepared through the engine first (see the module docstring).

        Raises:
            ValueError: an optimizer over a model this engine prepared in an earlier call,
                at a master-weight policy (the masters need the optimizer at preparation), or
                an optimizer over none of the models given.
        """
        args = list(args)
        models = [i for i, a in enumerate(args) if isinstance(a, nn.Module)
                  and not any(a is m for m in self.engine.models) and policy_of(a) is None]
        optimizers = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)
                      and not isinstance(a, AcceleratedOptimizer)]
        owners = {i: self._owner(args[i], [args[m] for m in models]) for i in optimizers}
        for m in models:
            mine = [i for i in optimizers if owners[i] is args[m]]
            units = fsdp_units(self.state.fsdp_plugin, args[m]) if self.is_fsdp2 else None
            model, opts = setup_for_host(self.engine, args[m], [args[i] for i in mine],
                                         shard=self.is_fsdp2, units=units)
            args[m] = model
            for i, opt in zip(mine, opts):
                args[i] = opt
        # FSDP2: the model comes sharded; Accelerate keeps it and maps the optimizer's
        # parameters onto the same (sharded) ones
        out = super().prepare(*args, device_placement=device_placement)
        out = list(out) if isinstance(out, tuple) else [out]
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_scheduler(self, scheduler):
        """``Accelerator.prepare_scheduler``, the scheduler tied to its own optimizer: Accelerate
        finds it by identity with the optimizer it wraps, which at a master-weight policy is the
        master optimizer around the one the scheduler was built over (it then waited on every
        optimizer: one skipped step held back the schedule of the others)."""
        target = getattr(scheduler, "optimizer", None)
        owner = next((o for o in self._optimizers
                      if getattr(o.optimizer, "inner", None) is target), None)
        if owner is None:
            return super().prepare_scheduler(scheduler)
        every, self._optimizers = self._optimizers, [owner]
        try:
            return super().prepare_scheduler(scheduler)
        finally:
            self._optimizers = every

    def _owner(self, optimizer, models: list[nn.Module]):
        """The model among ``models`` whose parameters ``optimizer`` holds (None: a model
        prepared earlier, refused at a master-weight policy)."""
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for model in models:
            if held & {id(p) for p in model.parameters()}:
                return model
        earlier = [m for m in self.engine.models if held & {id(p) for p in m.parameters()}]
        if earlier and self.engine.policy.master_weights:
            raise ValueError("this optimizer is over a model prepared in an earlier prepare() "
                             "call; at a master-weight policy the engine builds the fp32 masters "
                             "with the optimizer: pass the model and its optimizer to one "
                             "prepare() call")
        if not earlier:
            raise ValueError("this optimizer holds none of the parameters of the models given "
                             "to prepare(); pass the model and its optimizer to one prepare() "
                             "call")
        return None

    def prepare_model(self, model: nn.Module, device_placement=None, evaluation_mode=False):
        """``Accelerator.prepare_model``; under DDP, 16-bit gradients are averaged in fp32."""
        wrapped = super().prepare_model(model, device_placement=device_placement,
                                        evaluation_mode=evaluation_mode)
        handler = getattr(self, "ddp_handler", None)
        if handler is None or str(getattr(handler, "comm_hook", "no")).endswith("no"):
            reduce_in_fp32(wrapped)
        return wrapped

    # -- checkpoints -----------------------------------------------------------------------------
    def save_state(self, output_dir=None, safe_serialization: bool = True, **kwargs):
        """``Accelerator.save_state``, all or nothing: every rank writes into a temporary
        directory (``.NAME.saving`` beside ``output_dir``; with automatic checkpoint naming,
        beside ``checkpoints/``), and when every rank is done the main process writes the
        checksums of its files (``mixprec-checksums.json``) and renames it to its name
        (:func:`mixprec.integrity.save_directory`). A failure on any rank raises on every rank
        and leaves nothing under the name. With automatic naming, the oldest checkpoints beyond
        ``total_limit`` are removed after the save. Save-state pre-hooks see the temporary path.

        Returns:
            The checkpoint directory, as a string.

        Raises:
            ValueError: no ``output_dir`` without automatic checkpoint naming; an automatically
                named checkpoint that exists already.
        """
        config = self.project_configuration
        auto, aside = config.automatic_checkpoint_naming, None
        if auto:
            root = Path(self.project_dir) / "checkpoints"
            path = root / f"checkpoint_{self.save_iteration}"
            if path.exists():
                raise ValueError(f"checkpoint directory {str(path)!r} exists already; set "
                                 f"accelerator.project_configuration.iteration to the iteration "
                                 f"to continue from")
            aside = root.parent / f".checkpoints-{path.name}.saving"  # not among checkpoints/
        elif output_dir is None:
            raise ValueError("save_state() needs output_dir when automatic checkpoint naming "
                             "is off (ProjectConfiguration(automatic_checkpoint_naming=True))")
        else:
            path = Path(output_dir).expanduser()

        def write(tmp: Path) -> None:
            config.automatic_checkpoint_naming = False
            try:
                accelerate.Accelerator.save_state(self, str(tmp), safe_serialization, **kwargs)
            finally:
                config.automatic_checkpoint_naming = auto
        main = self.is_local_main_process if config.save_on_each_node else self.is_main_process
        iteration = config.iteration  # Accelerate counts it in the write: back, on a failure
        try:
            save_directory(path, write, main=main, aside=aside)
        except BaseException:
            config.iteration = iteration
            raise
        if auto and main and config.total_limit is not None:  # the others, oldest first (by
            others = [p for p in _numbered(path.parent) if p != path]  # number, as Accelerate
            for old in others[:max(0, len(others) - max(config.total_limit - 1, 0))]:  # orders
                shutil.rmtree(old)  # them): never the one just written
        return str(path)

    def load_state(self, input_dir=None, *, verify: bool = True, **kwargs):
        """``Accelerator.load_state``, after checking the checksums :meth:`save_state` wrote
        (``verify=False`` skips that, for a checkpoint edited on purpose; one without
        ``mixprec-checksums.json`` loads unchecked). Under FSDP2 each optimizer's state is first
        laid out (:func:`lay_out_state`), so loading the model and then its optimizer restores
        both exactly. A state saved under FSDP2 loads at any number of FSDP2 processes (one
        included).

        Raises:
            ValueError: a file that does not match its checksum, or is missing (the error names
                it); a state saved under FSDP2 (sharded ``pytorch_model_fsdp_0``), given to an
                accelerator without FSDP2.
        """
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            found = _numbered(Path(self.project_dir) / "checkpoints")
            input_dir = str(found[-1]) if found else None
        if input_dir is not None and os.path.isdir(input_dir):
            verify_on_ranks(input_dir, verify=verify)
        if (not self.is_fsdp2 and input_dir is not None
                and os.path.isdir(os.path.join(input_dir, "pytorch_model_fsdp_0"))):
            raise ValueError(f"{str(input_dir)!r} was saved under FSDP2 (its model and optimizer "
                             f"are sharded checkpoints, pytorch_model_fsdp_0 and optimizer_0); "
                             f"Accelerate loads them only under FSDP2: configure fsdp_version=2 "
                             f"(it runs in one process too)")
        if self.is_fsdp2:
            for model, opt in zip(self._models, self._optimizers):
                lay_out_state(model, _inner(opt))
        return super().load_state(input_dir, **kwargs)

    # -- the step --------------------------------------------------------------------------------
    def _engine_optimizers(self, optimizer=None) -> list:
        chosen = self._optimizers if optimizer is None else (
            optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        return [_inner(o) for o in chosen]

    def unscale_gradients(self, optimizer=None) -> None:
        """Make the gradients the true ones (``engine.unscale_``; once per step)."""
        if not self.engine.scaler.is_enabled():
            return
        for opt in self._engine_optimizers(optimizer):
            self.scaler.unscale_(opt)

    def _optimizer_of(self, parameters) -> Any:
        """The prepared optimizer that steps ``parameters``."""
        params = [p for p in parameters if p.requires_grad]
        wanted = {id(p) for p in params}
        found = [o for o in self._engine_optimizers() if wanted & _model_params(o)]
        if len(found) != 1 or not wanted <= _model_params(found[0]):
            raise ValueError(f"clip_grad_norm_/clip_grad_value_ under mixprec clip the "
                             f"parameters of one prepared optimizer (the engine clips what it "
                             f"steps); these {len(params)} parameters belong to {len(found)} "
                             f"prepared optimizer(s) or only partly to one: pass "
                             f"model.parameters() of the model prepared with its optimizer")
        return found[0]

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Clip the true gradients of the optimizer that holds ``parameters`` to ``max_norm``;
        returns their total norm before clipping (a tensor; across ranks under FSDP2)."""
        return self.engine.clip_grad_norm_(self._optimizer_of(parameters), max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value) -> None:
        """Clamp the true gradients of the optimizer that holds ``parameters``."""
        self.engine.clip_grad_value_(self._optimizer_of(parameters), clip_value)


def accelerate_name(policy: Policy) -> str:
    """What Accelerate calls ``policy``'s precision: "fp8" (FP8 GEMMs), "bf16", "fp16", or
    "no" (fp32 compute)."""
    if policy.fp8 is not None:
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(policy.compute_dtype, "no")


def check_host_precision(accelerator) -> None:
    """Refuse an accelerator configured for its own mixed precision (environment or config)."""
    own = accelerator.state.mixed_precision
    if own != "no" or getattr(accelerator, "native_amp", False):
        raise ValueError(f"the accelerator was configured for mixed precision "
                         f"({own!r}, e.g. by ACCELERATE_MIXED_PRECISION "
                         f"or an accelerate config): unset it; the MixedPrecision engine "
                         f"decides the precision")


def _numbered(root: Path) -> list[Path]:
    """The checkpoint directories in ``root``, by the number in their names (as Accelerate's
    automatic naming orders them)."""
    if not root.is_dir():
        return []
    found = [(int(m[0]), p) for p in root.iterdir() if (m := re.findall(r"\d+", p.name))]
    return [p for _, p in sorted(found)]
