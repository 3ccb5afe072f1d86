"""The Trainer's exact resume: :class:`TrainState` (its counters and positions), RNG snapshots,
data-loader generators, model signatures, checkpoint files.

A checkpoint file is written atomically and carries the checksum of its content, checked on load
(:mod:`mixprec.integrity`: also the temporaries an interrupted save leaves, and how they are
removed).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..engine_checks import check_policy
from ..integrity import atomic_save, check_seal, seal

CHECKPOINT_FORMAT = "mixprec.trainer/3"   # /3: the content's checksum sealed in
_UNSEALED_FORMAT = "mixprec.trainer/2"    # written before checksums; loads unchecked


@dataclasses.dataclass
class TrainState:
    """Where a Trainer stands: what a checkpoint needs to continue exactly.

    Attributes:
        global_step: optimizer steps taken (skipped ones included).
        epoch: epochs completed.
        batch_in_epoch: micro-batches consumed in the current epoch.
        epoch_loss: sum and count of the finite step losses of the current epoch.
        epoch_start_rng: RNG states from just before the current epoch's ``iter()``.
        pending_loader_rng: loader RNG states a resumed run applies at its next epoch start.
        data: the data ``fit`` iterates (not saved).
    """

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    epoch_loss: list = dataclasses.field(default_factory=lambda: [0.0, 0])
    epoch_start_rng: dict | None = None
    pending_loader_rng: dict | None = None
    data: object = dataclasses.field(default=None, repr=False, compare=False)

    def new_epoch(self) -> None:
        """Reset the position within the epoch."""
        self.batch_in_epoch, self.epoch_start_rng, self.epoch_loss = 0, None, [0.0, 0]

    def add_loss(self, loss: float) -> None:
        """Count a finite step loss into the epoch's mean."""
        self.epoch_loss = [self.epoch_loss[0] + loss, self.epoch_loss[1] + 1]

    def state_dict(self) -> dict:
        """The counters (plain data; the RNG states are saved per rank beside them)."""
        return {"global_step": self.global_step, "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch, "epoch_loss": list(self.epoch_loss)}

    def load_state_dict(self, counters: dict, epoch_start_rng: dict | None, rng: dict) -> None:
        """Restore :meth:`state_dict` and the RNG states: ``rng`` (the saved global and loader
        states) is applied now, and to the loader when the next epoch starts."""
        self.global_step, self.epoch = counters["global_step"], counters["epoch"]
        self.batch_in_epoch = counters["batch_in_epoch"]
        self.epoch_loss = list(counters["epoch_loss"])
        self.epoch_start_rng = epoch_start_rng
        restore_rng(rng)
        self.pending_loader_rng = rng if rng["loader"] is not None else None


def loader_generators(data) -> list[torch.Generator]:
    """The distinct ``torch.Generator`` objects a DataLoader draws its order and seeds from."""
    found: list[torch.Generator] = []
    candidates = [getattr(data, "generator", None)]
    batch_sampler = getattr(data, "batch_sampler", None)
    for holder in (getattr(data, "sampler", None), getattr(batch_sampler, "sampler", None)):
        candidates.append(getattr(holder, "generator", None))
    for gen in candidates:
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def _numpy_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _set_numpy_state(state: dict) -> None:
    np.random.set_state((state["name"], state["keys"].numpy().astype(np.uint32), state["pos"],
                         state["has_gauss"], state["cached_gaussian"]))


def capture_rng(data=None) -> dict:
    """The global RNG states (torch, CUDA, numpy, python) and those of ``data``'s generators."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": _numpy_state(),
        "python": random.getstate(),
        "loader": [g.get_state() for g in loader_generators(data)] if data is not None else None,
    }


def restore_rng(state: dict, data=None, *, loader: bool = True, globals_: bool = True) -> None:
    """Set the states captured by :func:`capture_rng` (the loader's only when ``data`` is given)."""
    if globals_:
        torch.set_rng_state(state["torch"])
        if state["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        _set_numpy_state(state["numpy"])
        random.setstate(state["python"])
    if loader and data is not None and state.get("loader") is not None:
        gens = loader_generators(data)
        if len(gens) != len(state["loader"]):
            raise ValueError(f"the data loader has {len(gens)} torch.Generator(s) but the "
                             f"checkpoint recorded {len(state['loader'])}: resume with a "
                             f"DataLoader built the same way (e.g. DataLoader(..., "
                             f"shuffle=True, generator=g))")
        for gen, gstate in zip(gens, state["loader"]):
            gen.set_state(gstate)


def model_signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every entry of the model's state_dict."""
    return [(k, tuple(v.shape), str(v.dtype)) for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor)]


def signature_mismatch(saved, current) -> str | None:
    """A one-line description of the first difference between two signatures, or None."""
    saved = [tuple(x) if not isinstance(x, tuple) else x for x in saved]
    saved_map = {name: (tuple(shape), dt) for name, shape, dt in saved}
    cur_map = {name: (tuple(shape), dt) for name, shape, dt in current}
    missing = [n for n in cur_map if n not in saved_map]
    extra = [n for n in saved_map if n not in cur_map]
    if missing or extra:
        return f"keys differ (missing from checkpoint: {missing[:3]}, unexpected: {extra[:3]})"
    for name, (shape, dt) in cur_map.items():
        if saved_map[name] != (shape, dt):
            return (f"{name!r} is {saved_map[name][1]} {list(saved_map[name][0])} in the "
                    f"checkpoint but {dt} {list(shape)} in this model")
    return None


def write_checkpoint(state: dict, path) -> None:
    """Write a Trainer checkpoint file: ``state`` sealed with its checksum, atomically."""
    atomic_save(seal(state), path)


def read_checkpoint(path, *, verify: bool = True) -> dict:
    """Load and check a Trainer checkpoint (tensors on the CPU); ``verify=False`` skips the
    checksum (for a file edited on purpose)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {str(path)!r}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors come in many types
        raise ValueError(f"{str(path)!r} is not a readable mixprec Trainer checkpoint: "
                         f"{exc}") from exc
    formats = (CHECKPOINT_FORMAT, _UNSEALED_FORMAT)
    if not isinstance(ckpt, dict) or ckpt.get("format") not in formats:
        raise ValueError(f"{str(path)!r} is not a mixprec Trainer checkpoint (expected format "
                         f"{CHECKPOINT_FORMAT!r})")
    check_seal(ckpt, path, verify=verify, required=ckpt["format"] == CHECKPOINT_FORMAT)
    return {k: v for k, v in ckpt.items() if k != "sha256"}


# ----------------------------------------------------------------- Trainer checkpoints
def module_of(trainer) -> nn.Module:
    """The trainer's model without its ``DistributedDataParallel`` wrapper (plain names)."""
    strategy = getattr(trainer, "strategy", None)
    return trainer.model if strategy is None else strategy.unwrap(trainer.model)


def trainer_meta(trainer) -> dict:
    """What :meth:`mixprec.Trainer.save` writes besides the model and optimizer tensors."""
    precision = trainer.engine.state_dict()
    return {
        "format": CHECKPOINT_FORMAT,
        "policy": precision["policy"],
        "signature": model_signature(module_of(trainer)),
        "scaler": precision["scaler"],
        "scheduler": None if trainer.scheduler is None else trainer.scheduler.state_dict(),
        "optimizer_class": _optimizer_class(trainer),
        "counters": trainer.state.state_dict(),  # the RNG states: below, per rank
        "history": trainer.history.state_dict(),
        "rng": capture_rng(trainer.state.data),
        "epoch_start_rng": trainer.state.epoch_start_rng,
        "metrics": metric_states(trainer),  # under ddp/fsdp: per rank, like the RNG states
        "monitor": precision.get("monitor"),  # its step count and loss window
    }


def metric_states(trainer) -> dict:
    """Each metric's accumulated state, by name (an epoch resumed mid-way counts every batch
    once)."""
    return {m.name: m.state_dict() for m in trainer.metrics}


def trainer_state(trainer) -> dict:
    """Everything :meth:`mixprec.Trainer.save` writes."""
    return {**trainer_meta(trainer), "model": module_of(trainer).state_dict(),
            "optimizer": trainer.optimizer.state_dict()}


def _states(trainer) -> dict:
    states = {"model": module_of(trainer).state_dict(), "optimizer": trainer.optimizer.state_dict(),
              "scaler": trainer.scaler.state_dict()}
    if trainer.scheduler is not None:
        states["scheduler"] = trainer.scheduler.state_dict()
    return states


def _load_states(trainer, states: dict) -> None:
    module_of(trainer).load_state_dict(states["model"])
    trainer.optimizer.load_state_dict(states["optimizer"])
    trainer.scaler.load_state_dict(states["scaler"])
    if trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(states["scheduler"])


def _optimizer_class(trainer) -> str:
    """The qualified name of the user's optimizer (inside a master optimizer)."""
    opt = getattr(trainer.optimizer, "inner", trainer.optimizer)
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def check_compatible(trainer, ckpt: dict, path) -> None:
    """Refuse a checkpoint from another policy, model or set-up (scheduler or not, another
    optimizer class: torch would load its groups and fail at the first step)."""
    where = f"checkpoint {str(path)!r}"
    saved = ckpt.get("optimizer_class")  # (none in a checkpoint written before it was saved)
    if saved is not None and saved != _optimizer_class(trainer):
        raise ValueError(f"{where} holds the state of a {saved} and this trainer steps a "
                         f"{_optimizer_class(trainer)}: make the trainer with the optimizer the "
                         f"checkpoint was saved from")
    check_policy(ckpt["policy"], trainer.engine.policy, where)
    diff = signature_mismatch(ckpt["signature"], model_signature(module_of(trainer)))
    if diff:
        raise ValueError(f"{where} was saved from a different model: {diff}")
    if (ckpt["scheduler"] is None) != (trainer.scheduler is None):
        saved = "no" if ckpt["scheduler"] is None else "a"
        have = "no scheduler" if trainer.scheduler is None else "a scheduler"
        raise ValueError(f"{where} has {saved} scheduler state but this trainer has {have}")


def restore_progress(trainer, ckpt: dict) -> None:
    """Counters, history and RNG states of a checkpoint (after its tensors were loaded)."""
    trainer.history.load_state_dict(ckpt["history"])
    trainer.state.load_state_dict(ckpt["counters"], ckpt["epoch_start_rng"], ckpt["rng"])
    monitor = trainer.engine.monitor
    if monitor is not None and ckpt.get("monitor") is not None:
        monitor.load_state_dict(ckpt["monitor"])
    saved = ckpt.get("metrics") or {}  # (none in a checkpoint written before they were saved)
    for m in trainer.metrics:
        m.reset()
        if m.name in saved:
            m.load_state_dict(saved[m.name])


def load_trainer_state(trainer, ckpt: dict, path) -> None:
    """Restore ``ckpt`` into ``trainer``, all or nothing."""
    check_compatible(trainer, ckpt, path)
    backup = copy.deepcopy(_states(trainer))
    try:
        _load_states(trainer, ckpt)
    except Exception as exc:
        _load_states(trainer, backup)
        raise ValueError(f"could not load checkpoint {str(path)!r} ({exc}); the trainer is "
                         f"unchanged") from exc
    restore_progress(trainer, ckpt)


def epoch_iterator(st: TrainState, data):
    """``iter(data)``, positioned where the epoch of ``st`` left off (replaying its shuffle)."""
    if st.batch_in_epoch == 0:
        if st.pending_loader_rng is not None:
            restore_rng(st.pending_loader_rng, data, globals_=False)
        st.pending_loader_rng = None
        st.epoch_start_rng = capture_rng(data)
        return iter(data)
    now, st.pending_loader_rng = capture_rng(), None
    restore_rng(st.epoch_start_rng, data)
    it = iter(data)
    for i in range(st.batch_in_epoch):
        if next(it, None) is None:
            raise ValueError(f"train_data has only {i} batches but the run stopped after batch "
                             f"{st.batch_in_epoch} of this epoch: resume on the same data")
    restore_rng(now, loader=False)
    return it
