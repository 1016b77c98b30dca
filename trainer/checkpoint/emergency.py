"""The save on SIGTERM: the whole of it within ``checkpoint.preemption_budget_s``.

The orchestrator waits at least the budget before a SIGKILL, so everything the save needs
must fit in it: waiting for the checkpoint in flight, the new synchronous save, and knowing
that it committed (rank 0 commits; the other ranks wait for a manifest with this save's
nonce, or for rank 0's failed-marker). What outlives the budget (a thread stuck in an
upload) is abandoned: it cannot commit anything older than the committed checkpoint, and
the process exits.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from infra.accounting.ledger_format import Mark
from infra.settings import CheckpointMode

if TYPE_CHECKING:
    from trainer.checkpoint.checkpointer import Checkpointer

log = logging.getLogger(__name__)


def save_within(checkpointer: Checkpointer, step: int, budget_s: float) -> bool:
    """Save the registered state at ``step`` within ``budget_s`` for the WHOLE of it. True
    when the step is committed (by this save, by the in-flight one, or before: a committed
    step is not saved again) or checkpoints are off; False when the save failed or ran out
    of time. Every rank returns the same answer unless a rank dies or storage fails mid-way.
    Raises RuntimeError when nothing is registered."""
    checkpointer.registered(f"checkpoint at step {step}")
    log.warning("preempted: saving at step %d within %.0f s", step, budget_s)
    if checkpointer.config.checkpoint.mode == CheckpointMode.OFF:
        return True
    deadline = time.monotonic() + budget_s
    inflight = checkpointer.inflight
    try:
        checkpointer.wait_for_inflight(timeout_s=budget_s)
    except TimeoutError:
        assert inflight is not None
        log.error(
            "emergency save at step %d: the checkpoint of step %d is still uploading "
            "after the whole %.0f s budget",
            step,
            inflight.step,
            budget_s,
        )
        checkpointer.abandon(inflight.thread)
        return False
    result: list[bool] = []
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def save_and_confirm() -> None:
        if device is not None:  # the current device is per thread
            torch.cuda.set_device(device)
        checkpointer.save(step, blocking=True)
        result.append(checkpointer.commits.confirm(step, deadline))

    thread = threading.Thread(target=save_and_confirm, name=f"ckpt-emergency-{step}")
    thread.daemon = True
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        log.error("emergency save at step %d ran out of its %.0f s budget", step, budget_s)
        checkpointer.ledger.mark(
            Mark.CHECKPOINT_FAILED, step=step, error="preemption budget exceeded"
        )
        checkpointer.abandon(thread)
        return False
    return bool(result and result[0])
