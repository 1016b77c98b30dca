"""Which steps the checkpointer saves: the one place the reasons to save are weighed.

- **By step count** (``every_steps: N``): every rank computes the same answer.
- **By the clock** (``every_steps: auto``, ``every_seconds``): only rank 0's clock asks
  (``by_clock``), and a save happens once every rank agreed to it through the per-step
  consensus (trainer/consensus.py), so all ranks save at the same step. The clock is not
  asked at a step the count saves anyway: a second flag would save the next step too.
- **At eval steps** with ``train.eval: async``: the side evaluator reads those checkpoints.
- **Never** a step already saved (or restored from), never the last step (it gets the
  anchor), never with ``checkpoint.mode: off``.

In-memory copies (memory_tier.py) have their own interval, by count or by rank 0's clock
agreed the same way, and are taken at steps the durable tier does not save: a durable save
in ``async_staged`` mode writes the in-memory copy too, from the same staging copy.

The interval itself, and what it costs, is ``interval.py``'s: this module feeds it what the
loop measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import CheckpointTier
from infra.settings import CheckpointMode, EvalMode, JobConfig
from trainer.checkpoint.interval import FailureHistory, IntervalPolicy


class SaveSchedule:
    """One per attempt, from the step training starts at; owned by the checkpointer."""

    def __init__(
        self,
        config: JobConfig,
        ledger: Ledger,
        rank: int,
        start_step: int,
        history: FailureHistory = FailureHistory(),  # noqa: B008 - frozen
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.interval = IntervalPolicy(
            config.checkpoint, config.train.steps, ledger, history, clock=clock
        )
        self.total_steps, self.rank, self.clock = config.train.steps, rank, clock
        self.off = config.checkpoint.mode == CheckpointMode.OFF
        train = config.train
        self.eval_every = train.eval_every if train.eval == EvalMode.ASYNC else 0
        self.start_step = self.last_saved = self.last_copied = start_step
        self.memory = IntervalPolicy(
            config.checkpoint,
            config.train.steps,
            ledger,
            history,
            clock=clock,
            tier=CheckpointTier.MEMORY,
        )
        # A durable save writes the in-memory copy as well only from its staging copy.
        self.saves_copy = config.checkpoint.mode == CheckpointMode.ASYNC_STAGED

    def _by_count(self, step: int) -> bool:
        eval_step = self.eval_every > 0 and step % self.eval_every == 0
        return eval_step or self.interval.due_at(step)

    def by_clock(self, step: int) -> bool:
        """Rank 0's flag for the consensus: its clock says the interval has passed since the
        last save (other ranks never ask: their clocks differ)."""
        if self.rank != 0 or step <= self.last_saved or self._by_count(step):
            return False
        return self.interval.due_by_clock()

    def due(self, step: int, agreed_by_clock: bool) -> bool:
        """Save the state of ``step`` now? ``agreed_by_clock``: every rank agreed to rank 0's
        clock flag."""
        if self.off or not self.last_saved < step < self.total_steps:
            return False
        return agreed_by_clock or self._by_count(step)

    def saved(self, step: int, blocking_s: float) -> None:
        self.last_saved = step
        self.interval.saved(blocking_s)
        if self.saves_copy and not self.memory.off:
            self.last_copied = step
            self.memory.taken_elsewhere()

    # -- the in-memory tier -----------------------------------------------------------------
    def memory_by_clock(self, step: int) -> bool:
        """Rank 0's flag for an in-memory copy: its own interval has passed."""
        if self.rank != 0 or step <= self.last_copied or self._copy_by_count(step):
            return False
        return not self._by_count(step) and self.memory.due_by_clock()

    def _copy_by_count(self, step: int) -> bool:
        return self.memory.due_at(step)

    def memory_due(self, step: int, agreed_by_clock: bool) -> bool:
        """Copy the state of ``step`` to shared memory now (no durable save is due at it)?"""
        if self.memory.off or not self.last_copied < step < self.total_steps:
            return False
        return agreed_by_clock or self._copy_by_count(step)

    def copied(self, step: int, blocking_s: float) -> None:
        self.last_copied = step
        self.memory.saved(blocking_s)

    def restored(self, step: int, after_failure: bool) -> None:
        """Training goes on from ``step`` (committed: not saved again); after a failure
        survived in process, the interval follows the observed MTBF with it counted."""
        self.last_saved = self.last_copied = step
        if after_failure:
            history = self.interval.history.after_failure(self.clock())
            self.interval.failures_seen(history)
            self.memory.failures_seen(history)
