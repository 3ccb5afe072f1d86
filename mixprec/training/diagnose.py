"""Why did a step overflow? Re-run its last micro-batch under the non-finite tracer.

``Trainer(diagnose_overflow=True)`` calls :func:`diagnose_overflow` after a skipped step: the
re-run changes no state (RNG, buffers and gradients are restored), each distinct first cause is
logged once (WARNING) and recorded in ``History.overflows``, and later overflows with the same
cause only count ``repeats`` (one INFO line each).
"""

from __future__ import annotations

import logging

import torch

from .. import debug
from . import state as ts

__all__ = ["diagnose_overflow"]

log = logging.getLogger("mixprec")


def diagnose_overflow(trainer) -> None:
    """Trace the trainer's last micro-batch and record the first non-finite value's cause."""
    rng = ts.capture_rng()
    buffers = {k: v.clone() for k, v in trainer.model.named_buffers()}
    scale = trainer.history.loss_scale[-1]
    try:
        with debug.trace_nonfinite(trainer.model) as tracer:
            loss, _ = trainer.forward_loss(trainer.last_batch)
            (loss * scale).backward()
        found = tracer.report
    finally:
        trainer.optimizer.zero_grad(set_to_none=True)
        ts.restore_rng(rng)
        with torch.no_grad():
            for k, v in trainer.model.named_buffers():
                v.copy_(buffers[k])
    cause = "none" if found is None else (
        f"{found.first.phase} {found.first.module} {found.first.op}")
    history, step = trainer.history, trainer.state.global_step
    seen = next((e for e in history.overflows if e["cause"] == cause), None)
    if seen is not None:  # the same first cause again: count it, say it in one line
        seen["repeats"] += 1
        log.info("mixprec: step %d overflowed at loss scale %g; same first cause as step %d "
                 "(%s), %d repeat(s)", step, scale, seen["step"], cause, seen["repeats"])
        return
    report = {"step": step, "scale": scale, "cause": cause, "repeats": 0,
              "report": str(found) if found is not None else "no non-finite value on re-run"}
    history.overflows.append(report)
    log.warning("mixprec: step %d overflowed at loss scale %g; first non-finite values:\n%s"
                "\n(later overflows with this first cause are counted, not repeated)",
                step, scale, report["report"])
