"""Injected failures (crash, SIGKILL, SIGTERM, hang) at a chosen step of a chosen attempt.

Used by the demo, the tests and the benchmarks to exercise recovery for real: the process
really dies, really gets preempted or really stops making progress. ``ETT_FAULT_STEP_DELAY_S``
in a process's environment makes each of its steps that much slower (a slow host): a test
that must act mid-job gets a job that lasts, however fast the machine.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from infra.settings import FaultConfig
from trainer.checkpoint.commit import CheckpointPhase

log = logging.getLogger(__name__)


class InjectedCrash(RuntimeError):
    """Raised by a ``crash`` fault: an ordinary Python exception that kills the attempt."""


# Faults that fire inside the checkpoint of their step, at the named phase.
CHECKPOINT_PHASES = {
    "sigkill_mid_upload": CheckpointPhase.WRITTEN,
    "sigkill_before_manifest": CheckpointPhase.BEFORE_MANIFEST,
    "sigkill_mid_memory_copy": CheckpointPhase.MEMORY_MIDWAY,
}


ENV_STEP_DELAY = "ETT_FAULT_STEP_DELAY_S"


def _step_delay() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_STEP_DELAY, "0") or 0))
    except ValueError:
        log.warning("%s is not a number: ignored", ENV_STEP_DELAY)
        return 0.0


class FaultInjector:
    """Fires the faults of this attempt when the loop reaches their step."""

    def __init__(self, faults: tuple[FaultConfig, ...], attempt: int, rank: int) -> None:
        self.rank = rank
        self.pending = {f.step: f for f in faults if f.attempt == attempt}
        self.step_delay_s = _step_delay()

    def at_step(self, step: int) -> None:
        """Called at the start of each step."""
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        fault = self.pending.get(step)
        if fault is None or fault.kind in CHECKPOINT_PHASES:
            return
        del self.pending[step]
        # A preemption or a crash hits every rank; a lost node (SIGKILL) or a hang hits one.
        if fault.kind in ("sigkill", "hang") and self.rank != 0:
            return
        log.warning("injecting fault %s at step %d", fault.kind, step)
        if fault.kind == "crash":
            raise InjectedCrash(f"injected crash at step {step}")
        if fault.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if fault.kind == "hang":  # stuck, but still talking: output is not progress
            while True:
                log.warning("injected hang at step %d: still here, not stepping", step)
                time.sleep(0.5)

    def at_checkpoint_phase(self, phase: str, step: int) -> None:
        """Called by the checkpointer (possibly from its upload thread)."""
        fault = self.pending.get(step)
        if fault is None or CHECKPOINT_PHASES.get(fault.kind) != phase or self.rank != 0:
            return
        del self.pending[step]
        log.warning("injecting fault %s at step %d (checkpoint phase %s)", fault.kind, step, phase)
        os.kill(os.getpid(), signal.SIGKILL)
