"""A job whose truth is known: a ledger written step by step by a trainer that behaves as the
simulator's model says, with failures at given wall times.

It is a second, independent implementation of the model (discrete steps and events, not the
replay's continuous cycles), so checking the replay against it tests the replay, and the
calculator sits in between exactly as it does for a real job.

Behaviour, all times in seconds from the job's start:
- attempt 0 spends ``startup_s`` (a launcher_init span) before its first step;
- steps take ``step_s`` (or ``step_s_by_attempt[attempt]``: a machine busier in one attempt),
  with ``gap_s`` of nothing between them (the "other" bucket);
- after every ``every`` steps (not after the last) a checkpoint first waits for the previous
  upload to commit, then blocks ``blocking_s``; it commits ``upload_s`` after the blocking;
- a failure at time f: a lossy one (crash, sigkill, hang) kills the attempt at f: steps and
  spans not finished by f are not written, uploads not committed by f are lost; a preemption
  finishes the current step, saves synchronously (``blocking_s``) and exits. The next attempt
  takes its first step ``restart_s[cause]`` after the orchestrator saw the attempt end and
  resumes after the newest committed step;
- the last step is followed by a ``shutdown_s`` span with the anchor save (``blocking_s``)
  nested at its start, then job_end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from infra.accounting.ledger import Ledger
from infra.job_layout import JobLayout

T0 = 1_700_000_000.0


@dataclass(frozen=True)
class Plan:
    steps: int = 100
    step_s: float = 1.0
    step_s_by_attempt: Mapping[int, float] = field(default_factory=dict)
    every: int = 10
    blocking_s: float = 0.5
    upload_s: float = 0.0
    startup_s: float = 5.0
    restart_s: Mapping[str, float] = field(
        default_factory=lambda: {"crash": 7.0, "sigkill": 6.0, "preempted": 3.0}
    )
    shutdown_s: float = 2.0
    gap_s: float = 0.0
    failures: tuple[tuple[float, str], ...] = ()  # (wall time, cause), in time order


@dataclass
class Truth:
    """What the job did, counted by the writer itself."""

    wall_s: float = 0.0
    wasted_steps: int = 0
    checkpoints: int = 0
    lost_uploads: int = 0


def write_modeled_job(job_url: str, plan: Plan) -> Truth:
    """Write the job's ledger (orchestrator and rank 0, every attempt); return its truth."""
    truth = Truth()
    failures = list(plan.failures)
    committed, t, launch_s, attempt = 0, 0.0, plan.startup_s, 0
    while True:
        fail_at, cause = failures[0] if failures else (float("inf"), "")
        run = _Attempt(job_url, attempt, plan, truth, fail_at, lossy=cause != "preempted")
        run.orch.record_span("launcher_init", T0 + t, T0 + t + launch_s)
        run.tr.mark("attempt_start", t=T0 + t + launch_s)
        ended = run.train(committed, t + launch_s)
        if ended is None:
            truth.wall_s = run.now
            return truth
        committed = run.committed
        truth.wasted_steps += run.step - committed
        run.tr.close()
        run.orch.mark("failure", step=run.step, t=T0 + ended, cause=cause)
        run.orch.close()
        failures.pop(0)
        t, launch_s, attempt = ended, plan.restart_s[cause], attempt + 1


class _Attempt:
    """One attempt's trainer loop, shaped like trainer/train.py's: preemption check at the
    top, the step, the periodic checkpoint."""

    def __init__(
        self, url: str, attempt: int, plan: Plan, truth: Truth, fail_at: float, lossy: bool
    ) -> None:
        clock = lambda: T0  # noqa: E731 - every time is given explicitly
        self.orch = Ledger(JobLayout.at(url), attempt=attempt, role="orchestrator", clock=clock)
        self.tr = Ledger(JobLayout.at(url), attempt=attempt, clock=clock)
        self.plan, self.truth, self.fail_at, self.lossy = plan, truth, fail_at, lossy
        self.step_s = plan.step_s_by_attempt.get(attempt, plan.step_s)
        self.pending: tuple[int, float] | None = None  # in-flight upload: (step, commit time)
        self.committed = self.step = 0
        self.now = 0.0

    def _reach(self, until: float) -> bool:
        """Move the clock to ``until`` unless a lossy failure strikes first."""
        if self.lossy and until > self.fail_at:
            return False
        self.now = until
        return True

    def _commit_pending(self, upto: float) -> None:
        if self.pending and self.pending[1] <= upto:
            self.tr.mark("checkpoint_committed", step=self.pending[0], t=T0 + self.pending[1])
            self.committed, self.pending = self.pending[0], None

    def _save(self, start: float) -> bool:
        """Wait for the in-flight upload, block, then commit (at once or after the upload)."""
        p = self.plan
        if self.pending:
            if not self._reach(max(self.now, self.pending[1])):
                return False
            self._commit_pending(self.now)
        if not self._reach(self.now + p.blocking_s):
            return False
        self.tr.record_span("checkpoint_blocking", T0 + start, T0 + self.now, step=self.step)
        self.truth.checkpoints += 1
        if p.upload_s == 0 or not self.lossy and self.now >= self.fail_at:
            self.tr.mark("checkpoint_committed", step=self.step, t=T0 + self.now)
            self.committed = self.step
        else:
            self.pending = (self.step, self.now + p.upload_s)
        return True

    def train(self, resume: int, first_step_at: float) -> float | None:
        """Run to the end (None) or to the failure; returns when the attempt ended."""
        p = self.plan
        self.committed = self.step = resume
        self.now = first_step_at
        while self.step < p.steps:
            if not self.lossy and self.now >= self.fail_at:  # preempted: save, exit
                self.fail_at = self.now  # the exit save commits at once
                self._save(self.now)
                self._commit_pending(self.now)
                return self.now
            start = self.now
            if not self._reach(start + self.step_s):
                return self._die()
            self.step += 1
            self.tr.record_span("train_step", T0 + start, T0 + self.now, step=self.step)
            self._commit_pending(self.now)
            if self.step % p.every == 0 and self.step < p.steps and not self._save(self.now):
                return self._die()
            if not self._reach(self.now + p.gap_s):
                return self._die()
        start = self.now  # the anchor save, nested in the shutdown: waits, blocks, commits
        if self.pending:
            self.now = max(self.now, self.pending[1])
            self._commit_pending(self.now)
        self.tr.record_span(
            "checkpoint_blocking", T0 + start, T0 + self.now + p.blocking_s, step=self.step
        )
        self.tr.mark("checkpoint_committed", step=self.step, t=T0 + self.now + p.blocking_s)
        self.now += p.shutdown_s
        self.tr.record_span("shutdown", T0 + start, T0 + self.now, step=self.step)
        self.tr.mark("job_end", step=self.step, t=T0 + self.now)
        self.tr.close()
        self.orch.close()
        return None

    def _die(self) -> float:
        """A lossy failure at fail_at: what was uploaded by then counts, the rest is lost."""
        self._commit_pending(self.fail_at)
        if self.pending:
            self.truth.lost_uploads += 1
        return self.fail_at
