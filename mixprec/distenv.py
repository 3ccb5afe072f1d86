"""Where this process stands in a ``torch.distributed`` run: rank, world size, the process group.

Reads an initialised default process group when there is one, else the environment ``torchrun``
sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), else a single process. :func:`init_from_env`
creates the default group from that environment when none exists (gloo on CPU; ``cpu:gloo,
cuda:nccl`` with CUDA, the device taken from ``LOCAL_RANK``) and destroys it at interpreter exit;
a group someone else created is never destroyed.

Exiting cleanly: gloo runs each collective on a worker thread, and that thread lets go of the
collective's tensors only after the caller's ``wait()`` has returned. Letting go of a tensor that
Python has seen takes the GIL, and a thread that asks for the GIL once the interpreter is
finalizing is ended by CPython in the middle of a destructor: the process aborts ("terminate
called without an active exception", SIGABRT). While the main thread keeps running Python, such a
worker waits up to the GIL's switch interval (5 ms), so a script that ends within a few
milliseconds of its last collective can lose that race. ``destroy_process_group()`` does not
prevent it: gloo's ``shutdown()`` does nothing, and its threads are joined only when the last
reference to the backend goes, which DDP and FSDP modules hold until finalization. :func:`settle`
sleeps, the GIL released, until the workers are done; the Trainer calls it when ``fit`` returns,
and mixprec calls it at interpreter exit once it has used a process group (before destroying a
group it created).
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import time
import warnings
from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["ddp_of", "in_ddp", "world_size", "rank", "is_fsdp", "unwrap", "local_rank",
           "is_main_process", "is_initialized", "launched_by_torchrun", "init_from_env", "device",
           "timeout",
           "require_group", "settle", "TORCHRUN_HINT", "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV",
           "SETTLE_GRACE_S", "agree", "apply_timeout", "TimeoutNotAppliedWarning"]

#: Seconds a collective may wait for the other ranks before it raises (unless overridden).
DEFAULT_TIMEOUT_S = 600.0
#: Environment variable that overrides :data:`DEFAULT_TIMEOUT_S` (seconds).
TIMEOUT_ENV = "MIXPREC_DIST_TIMEOUT"

TORCHRUN_HINT = ("launch the script with torchrun, e.g. `torchrun --nproc-per-node 2 train.py`, "
                 "or call torch.distributed.init_process_group() before building the Trainer")

#: Seconds :func:`settle` keeps the GIL released at least (four GIL switch intervals).
SETTLE_GRACE_S = 0.02
_SETTLE_SLICE_S = 0.001   # one sleep: the GIL is dropped and taken again around each
_SETTLE_TIMEOUT_S = 1.0   # the longest settle() waits for a tensor a collective still holds

_created_here = False
_exit_hook = False


def is_initialized() -> bool:
    """True when torch.distributed is available and its default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer; got {value!r}") from None


def launched_by_torchrun() -> bool:
    """True when the environment carries a launcher's ``WORLD_SIZE`` and ``RANK``."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def world_size() -> int:
    """Number of processes: the default group's size, else ``WORLD_SIZE``, else 1."""
    if is_initialized():
        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1)


def rank() -> int:
    """This process's global rank: from the default group, else ``RANK``, else 0."""
    if is_initialized():
        return dist.get_rank()
    return _env_int("RANK", 0)


def local_rank() -> int:
    """This process's rank on its machine (``LOCAL_RANK``, else the global rank)."""
    return _env_int("LOCAL_RANK", rank())


def is_main_process() -> bool:
    """True on global rank 0 (and in a single process): the rank that prints and writes files."""
    return rank() == 0


def device() -> torch.device:
    """The device this rank trains on: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def timeout() -> datetime.timedelta:
    """The collective timeout for groups mixprec creates (:data:`TIMEOUT_ENV` or 10 minutes)."""
    raw = os.environ.get(TIMEOUT_ENV)
    seconds = DEFAULT_TIMEOUT_S
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds < float("inf"):
            raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds; got {raw!r}")
    return datetime.timedelta(seconds=seconds)


def init_from_env(timeout_s: float | None = None) -> bool:
    """Create the default process group from torchrun's environment, unless one exists.

    Backend: gloo on a CPU-only machine; ``"cpu:gloo,cuda:nccl"`` with CUDA (after
    ``torch.cuda.set_device(LOCAL_RANK)``). The collective timeout is ``timeout_s``, else
    ``$MIXPREC_DIST_TIMEOUT`` seconds, else 10 minutes: a rank whose peers stopped answering
    raises after that long instead of waiting forever. A group created here is destroyed at
    interpreter exit, after :func:`settle`; an existing group is left alone.

    Args:
        timeout_s: the collective timeout in seconds (None: see above).

    Returns:
        True when this call created the group; False when one already existed or the
        environment names no launcher (``WORLD_SIZE``/``RANK`` unset).

    Raises:
        RuntimeError: torch.distributed is not available in this torch build.
        ValueError: malformed launcher environment variables or timeout.
    """
    global _created_here
    if is_initialized() or not launched_by_torchrun():
        return False
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    limit = timeout() if timeout_s is None else datetime.timedelta(seconds=float(timeout_s))
    if limit.total_seconds() <= 0:
        raise ValueError(f"timeout_s must be positive; got {timeout_s!r}")
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=limit, rank=rank(), world_size=world_size())
    _created_here = True
    _register_exit_hook()
    return True


class TimeoutNotAppliedWarning(UserWarning):
    """:data:`TIMEOUT_ENV` is set, and the process groups a host made could not be given it."""


def apply_timeout(host: str, own_setting: str) -> bool:
    """Give the process groups a host made (Lightning's strategy, Accelerate) the collective
    timeout of :data:`TIMEOUT_ENV`, when it is set: a rank whose peers stopped answering then
    raises after that long, as in a group mixprec creates, instead of after the host's default
    (30 minutes for Lightning, Accelerate and the Hugging Face ``Trainer``). Every group of
    this process is given it (a device mesh's too). Unset, the host's timeout stands.

    Args:
        host: who made the groups, for the warning.
        own_setting: the host's own timeout setting, which the warning points to.

    Returns:
        True when the groups were given the timeout; False when the variable is unset, no
        group exists, or mixprec created the default group (it has the timeout already).

    Warns:
        TimeoutNotAppliedWarning: the variable is set and this torch or backend cannot change
            a group's timeout once made; it names the host's own setting.

    Raises:
        ValueError: a malformed :data:`TIMEOUT_ENV`.
    """
    if not os.environ.get(TIMEOUT_ENV) or not is_initialized() or _created_here:
        return False
    limit = timeout()
    try:
        c10d = dist.distributed_c10d
        groups = [g for g in c10d._world.pg_map if not c10d._rank_not_in_group(g)]
        for group in groups or [dist.group.WORLD]:
            c10d._set_pg_timeout(limit, group)
    except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
        warnings.warn(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]} does not apply to the process "
                      f"group {host} made ({type(exc).__name__}: {exc}): a rank whose peers stop "
                      f"answering waits for {host}'s own timeout; set {own_setting}",
                      TimeoutNotAppliedWarning, stacklevel=3)
        return False
    return True


def settle(tensors: Iterable[torch.Tensor] = (), grace_s: float = SETTLE_GRACE_S) -> None:
    """Sleep, the GIL released, until the collectives' worker threads have let go of their work.

    Call it after the last collective of a process (the Trainer does when ``fit`` returns, and
    mixprec does at interpreter exit): a gloo worker that still holds a finished collective's
    tensors needs the GIL to release them, and aborts the process if the interpreter is already
    finalizing by then (see the module docstring). Sleeps at least ``grace_s`` seconds in 1 ms
    slices, and longer (up to 1 s) while a tensor of ``tensors`` is still held by a collective.
    It is local: no collective, nothing to match on the other ranks.

    Args:
        tensors: tensors this process passed to its last collectives (held by nothing else).
        grace_s: the shortest time to sleep, in seconds.
    """
    tensors = list(tensors)
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        held = any(_held_elsewhere(t) for t in tensors)
        if elapsed >= _SETTLE_TIMEOUT_S or (elapsed >= grace_s and not held):
            return
        time.sleep(_SETTLE_SLICE_S)


def _held_elsewhere(tensor: torch.Tensor) -> bool:
    """True while C++ (a collective's work object) holds ``tensor`` besides its Python object."""
    use_count = getattr(tensor, "_use_count", None)
    return use_count is not None and use_count() > 1


def _register_exit_hook() -> None:
    global _exit_hook
    if not _exit_hook:
        atexit.register(_at_exit)
        _exit_hook = True


def _at_exit() -> None:
    """Let the workers finish (:func:`settle`); destroy the default group if mixprec created it."""
    global _created_here
    settle()
    if _created_here and is_initialized():
        dist.destroy_process_group()
    _created_here = False


def require_group(what: str) -> None:
    """Make sure a default process group exists (creating it from torchrun's environment).

    Also arranges for :func:`settle` to run at interpreter exit (for a group the user created
    too, which is never destroyed).

    Raises:
        ValueError: no group and no launcher environment; the message shows the torchrun command.
    """
    init_from_env()
    if not is_initialized():
        raise ValueError(f"{what} needs torch.distributed: no process group exists and this "
                         f"process was not started by a launcher (WORLD_SIZE/RANK unset); "
                         f"{TORCHRUN_HINT}")
    _register_exit_hook()


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank when ``what`` failed on any, so that none waits for the others (a
    collective: every rank of the default group calls it; without a group of several ranks it
    raises ``error``, if any).

    Raises:
        BaseException: ``error`` itself, on the rank where it happened.
        RuntimeError: on the other ranks, naming each rank's error.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    message = "" if error is None else f"rank {rank()}: {type(error).__name__}: {error}"
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    if error is not None:
        raise error
    failed = [m for m in messages if m]
    if failed:
        raise RuntimeError(f"{what} failed on another rank: {'; '.join(failed)}")


def is_fsdp(model) -> bool:
    """True when ``model`` was sharded with FSDP2's ``fully_shard``.

    Does not import FSDP (about 0.8 s): a model can only be sharded once it was imported.
    """
    fsdp_module = sys.modules.get("torch.distributed.fsdp")
    return fsdp_module is not None and isinstance(model, fsdp_module.FSDPModule)


def ddp_of(model):
    """The ``DistributedDataParallel`` that ``model`` is, or that ``torch.compile``'s wrapper
    holds; else None."""
    while type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        model = model._orig_mod  # (duck-typed: no torch._dynamo import here)
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


def in_ddp(model) -> bool:
    """Whether ``model`` is, or wraps, a ``DistributedDataParallel`` (:func:`ddp_of`)."""
    return ddp_of(model) is not None


def unwrap(model):
    """The user's module inside ``DistributedDataParallel`` and ``torch.compile``'s
    ``OptimizedModule`` wrappers (either order), else ``model`` itself: plain names."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod  # (duck-typed: no torch._dynamo import here)
        else:
            return model
