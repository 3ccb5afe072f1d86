"""Lightning checkpoints of the compact master methods that resume bitwise under every
strategy :class:`~mixprec.integrations.lightning.MixprecPrecision` runs under.

``ModelParallelStrategy`` (FSDP2) saves through torch's distributed state-dict functions: a
one-file checkpoint (``save_distributed_checkpoint=False``) gathers every optimizer state to
rank 0, and resuming from it broadcasts each state from rank 0 to the ranks' shards; a sharded
one writes each rank's shards. Two things would keep such a resume from being bitwise:

* ``master="split"``: gloo (the CPU backend) has no int16 collectives. The compact optimizer
  itself gives its int16 remainder as int32 in its ``state_dict``, sharded or not, and narrows
  it back on load (``mixprec.optim.compact_state``), so one-file and sharded checkpoints
  resume bitwise, also in one process, and a one-process checkpoint resumes at several ranks:
  nothing Lightning-specific is needed.
* ``master="kahan"``: Lightning loads an FSDP2 model one sub-module at a time, then, before
  loading the optimizer's state, steps the optimizer once with zero gradients and a zero
  learning rate so that its state exists (torch's ``set_optimizer_state_dict``). That step
  adds each weight's compensation to it: a compensation left from before the load (the
  initial weights') would move the loaded weight. A prepared model's sub-modules set their
  pairs from the loaded values when loaded alone (``mixprec.statedict``), as the model does
  when loaded whole: nothing Lightning-specific is needed either.

The plugin's own state carries every rank's RNG states (:func:`rank_rng_states`): Lightning
saves none, and a model with dropout resumes exactly only when each rank continues from its own.

Under ``ModelParallelStrategy`` the checkpoint's ``state_dict`` of a compact master method
holds the 16-bit weights (in fp32); the remainder or compensation that makes each an exact
or near-fp32 master is in the optimizer state (``mp.fp32_state_dict(model, optimizer)`` joins
them).
"""

from __future__ import annotations

import torch.distributed as dist

from .. import distenv as env
from ..training.state import capture_rng, restore_rng

__all__ = ["rank_rng_states", "restore_rank_rng"]


def rank_rng_states() -> list[dict]:
    """Every rank's global RNG states (:func:`mixprec.training.state.capture_rng`), in rank
    order; gathered under a process group of several ranks (a collective)."""
    mine = capture_rng()
    if not env.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def restore_rank_rng(states: list[dict]) -> None:
    """Set this rank's RNG states from :func:`rank_rng_states` (rank ``r`` takes entry ``r``
    modulo their number).

    Raises:
        ValueError: not a list of RNG states.
    """
    if not isinstance(states, list) or not states or not all(isinstance(s, dict) for s in states):
        raise ValueError(f"the plugin's RNG states are a list of one dict per rank; got "
                         f"{type(states).__name__}")
    restore_rng(states[env.rank() % len(states)])
