"""In-process restart: a Python exception inside a training step, recovered without a new process.

A crash in a step (a bad batch, a transient library error) need not cost a relaunch: every
rank catches it, the ranks agree through the job's store (not a collective: a rank that did
not fail may be blocked inside one), the newest committed checkpoint is loaded back into
model, optimizer and RNG, the data loader is put back at that checkpoint's position, and the
loop goes on from there. The steps since that checkpoint are redone, exactly as after a
relaunch, so a run with an in-process restart ends bit-identical to one without a failure.

It escalates to a process failure (the exception propagates, the attempt exits with a crash
and the orchestrator promotes the standby) when:

- not every rank reaches the agreement within ``recovery.agree_timeout_s`` (a rank is stuck
  in a collective, or died),
- the previous in-process restart was less than ``recovery.in_process_window_s`` ago (the
  same failure is coming back: a process restart may clear what this one cannot),
- ``recovery.in_process_restart`` is off, or nothing was ever committed to restore.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch.distributed as dist

from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Mark, ResumeHow
from infra.settings import JobConfig
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.distributed import DistEnv

log = logging.getLogger(__name__)


class InProcessRestart:
    """Owns the decision and the mechanics; one per attempt."""

    def __init__(
        self, config: JobConfig, env: DistEnv, ledger: Ledger, checkpointer: Checkpointer
    ) -> None:
        self.config, self.env, self.ledger = config, env, ledger
        self.checkpointer = checkpointer
        self.generation = 0  # agreements started (the store keys' namespace)
        self.restarts = 0  # exceptions recovered from: failures the attempt survived
        self.last: float | None = None

    def recover(self, exc: BaseException, failed_step: int) -> int:
        """Restore the newest committed state in place (model, optimizer, RNG and the data
        position: every state the checkpointer saves); returns the step training goes on
        from. Re-raises ``exc`` to escalate."""
        rec = self.config.recovery
        now, failed_at = time.time(), self.ledger.clock()
        if not rec.in_process_restart:
            raise exc
        if self.last is not None and now - self.last < rec.in_process_window_s:
            log.error(
                "a second exception %.1f s after the last in-process restart (window %.0f s): "
                "failing the attempt",
                now - self.last,
                rec.in_process_window_s,
            )
            raise exc
        log.warning("step %d failed (%s): restarting in process", failed_step, exc)
        if not self._agree(rec.agree_timeout_s):
            log.error("not every rank reached the in-process restart: failing the attempt")
            raise exc
        self.last = now
        try:
            self.checkpointer.wait_for_inflight(timeout_s=rec.agree_timeout_s)
        except TimeoutError:
            log.error("the in-flight checkpoint is still uploading: failing the attempt")
            raise exc from None
        resume = self.checkpointer.restore(ResumeHow.IN_PROCESS)
        if resume.url is None:
            log.error("nothing committed to restore in process: failing the attempt")
            raise exc
        # Marked once restored (an escalated exception is a process failure, not an in-process
        # restart), at the time the step failed: the recovery starts there.
        self.ledger.mark(
            Mark.IN_PROCESS_RESTART,
            step=failed_step,
            t=failed_at,
            error=f"{type(exc).__name__}: {exc}"[:300],
        )
        self.restarts += 1
        return resume.step

    def _agree(self, timeout_s: float) -> bool:
        """Every rank writes its key to the job's store and waits for all the others'."""
        self.generation += 1
        if self.env.world_size == 1:
            return True
        store = dist.distributed_c10d._get_default_store()
        prefix = f"ett/in_process_restart/{self.generation}"
        store.set(f"{prefix}/{self.env.rank}", str(self.ledger.attempt))
        keys = [f"{prefix}/{r}" for r in range(self.env.world_size)]
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
            return True
        except RuntimeError as exc:  # DistStoreError (a RuntimeError) on timeout
            log.error("in-process restart agreement timed out: %s", exc)
            return False
