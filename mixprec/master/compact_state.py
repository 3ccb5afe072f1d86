"""The state of a :class:`~mixprec.master.compact.CompactMasterOptimizer` and its
``state_dict()`` hooks.

Compact masters draw the keys of their stochastic roundings (Kahan compensations, stochastic
weights, bf16 moments) from a generator whose state travels in ``state_dict()`` (in the first
parameter entry of ``state``, key ``"rounding_generator"``, so DCP and FSDP2 carry it too), so
a resumed run continues bitwise.

The optimizer steps the model's own parameters: ``param_groups`` hold them (no masters), and
``state`` is keyed by them, with the Kahan compensation under ``state[p]["compensation"]`` (in
the weight's dtype) or the split remainder under ``state[p]["remainder"]`` (int16), so torch's,
DCP's and FSDP2's state-dict machinery carry it like any moment.
fp32 parameters in the groups (norm layers kept in fp32) are stepped by the inner optimizer as
they are. ``state_dtype="bf16"`` stores the moments in bf16 (:mod:`mixprec.master.states`).
"""

from __future__ import annotations

from . import states

__all__ = ["save_pending", "load_generator", "share_with_inner"]


def save_pending(optimizer, state: dict) -> dict:
    """state_dict post-hook: buffers not yet in the state (no step taken) are saved too, so a
    checkpoint taken before the first step resumes exactly."""
    if not optimizer._pending:
        return state
    index, start = {}, 0
    for group in optimizer.param_groups:  # torch's numbering: first occurrence, group by group
        for i, p in enumerate(group["params"], start):
            index.setdefault(id(p), i)
        start += len(group["params"])
    for p, comp in optimizer._pending.items():
        entry = state["state"].setdefault(index[id(p)], {})
        entry.setdefault(optimizer._buffer_key, comp)
    return state


def load_generator(optimizer) -> None:
    """load_state_dict post-hook: the rounding generator continues from the saved state."""
    states.restore_generator(optimizer, optimizer.rounding)


def share_with_inner(optimizer) -> None:
    """load_state_dict post-hook: torch made new groups and state; the inner optimizer shares
    them again."""
    optimizer.inner.param_groups = optimizer.param_groups
    optimizer.inner.state = optimizer.state
    optimizer._rebuild()
    optimizer.drop_master_grads()
