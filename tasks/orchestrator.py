"""A training job from its config to its summary: attempts, retries, the warm standby and the
side evaluator, and every process ended. No Prefect here: ``ett train`` runs ``run`` and the
``train`` flow runs the same ``Orchestrator``, watching each attempt in a task run of its own::

    config = plan_job(path, overrides)             # resolved, checked before anything starts
    with Orchestrator(config, observer) as job:    # the lease, the ranks' config, attempt 0
        for attempt in job:                        # until success, a fatal failure, no budget
            job.watch(attempt)                     # to its end: classified, in the ledger
    job.result                                     # the outcome, and the ledger read once

**Retry policy** (``recovery`` section): tasks/retry_policy.py decides, after each attempt,
whether the job goes on and how long it waits first.

**Warm standby** (``recovery.standby``). Once an attempt has made its first step, the next one
is spawned as a standby: it initialises (imports, process group, model, compile cache and
warm-up; on a GPU host the model and the warm-up wait for the promotion, see
``recovery.standby_park``), parks on its control pipe and costs no CPU. When the running
attempt fails, the standby is promoted (it restores the newest committed checkpoint and trains)
and a new one starts behind it once the promoted attempt steps. A standby never needed is
released. One that dies while it waits is marked ``standby_lost`` in the ledger (never the
job's startup or failure) and another is started behind it; after ``MAX_STANDBY_LOSSES`` in a
row the job goes on without one. **Attempt numbers are never reused**: every launch, cold or
standby, takes the next one, so one attempt's ledger files hold one process group's events.

The job's lease (infra/lease.py) is held for the whole job, so a second job with the same
job id refuses to start. Every process started here is ended here: on success, failure,
cancellation or interruption (the running attempt is then preempted, with the grace to
checkpoint), or an exception. The side evaluator (``train.eval: async``) starts once the job
trains and its standby parked, so it does not compete with their start for the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from infra import memory_tier, storage
from infra.accounting import clocks
from infra.accounting.ledger import Ledger, next_attempt, recover_orphaned_spools
from infra.accounting.ledger_format import Mark, Span
from infra.accounting.ledger_read import domains_ahead
from infra.accounting.summary import JobSummary
from infra.control import JobState, Phase, Progress
from infra.exit_codes import Outcome, name_of, outcome_of
from infra.lease import JobLease, acquire_job_lease
from infra.node_protocol import advertise_address
from infra.preflight import preflight
from infra.settings import (
    CheckpointMode,
    EvalMode,
    JobConfig,
    config_yaml,
    dump_config,
    load_config,
)
from tasks import health, job_identity
from tasks.attempt import (
    LOCAL_ADDRESS,
    AttemptProcess,
    AttemptReport,
    LaunchSpec,
    Timeouts,
    watch,
)
from tasks.capacity import Capacity
from tasks.local_node import Log
from tasks.node_runs import WorkPoolNodeRuns
from tasks.remote_node import NodeFleet, NodeRuns, RemoteNode
from tasks.rendezvous import RendezvousHost
from tasks.retry_policy import JobOutcome, RetryPolicy
from tasks.side_evaluator import SideEvaluator

MAX_STANDBY_LOSSES = 3  # standbys lost in a row before the job goes on without one
CAPACITY_POLL_S = 0.5  # how often a launch waiting for lost rank slots looks again
EVAL_FINISH_TIMEOUT_S = 300.0  # after training, for the side evaluator to evaluate the anchor


def plan_job(
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    name: str = "train",
    resume: bool = False,
    when: float | None = None,
    salt: str | None = None,
) -> JobConfig:
    """The job's config, resolved (embedded defaults < file < ``overrides`` < ETT_*
    environment), given its job id (tasks/job_identity.py: a new one, named after ``name``,
    unless the config names an unfinished job or ``resume`` asks for one), and checked
    against the world before anything starts (infra/preflight.py): ConfigError,
    PreflightError, JobFinished or NothingToResume, each one line."""
    job = load_config(config, **(overrides or {}))
    storage.configure(job.storage)
    preflight(job)
    return job_identity.resolve(job, name, resume, when, salt)


@dataclass(frozen=True)
class JobResult:
    """How a job ended, and its summary (None when its ledger could not be read)."""

    outcome: JobOutcome
    summary: JobSummary | None


class JobObserver:
    """What a caller sees of a running job; every method is optional. The orchestrator calls
    them from the thread that watches the attempt."""

    def progress(self, progress: Progress) -> None:
        """Rank 0 reported a new step or phase."""

    def attempt_ended(self, report: AttemptReport) -> None:
        """An attempt is over and classified."""

    def job_ended(self, result: JobResult) -> None:
        """The job is over: every process ended, its ledger read."""


class Orchestrator:
    """One job's attempts, from the first to its outcome (the module docstring)."""

    def __init__(
        self,
        config: JobConfig,
        observer: JobObserver | None = None,
        log: Log | None = None,
        scheduling: tuple[float, float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        **launch_seams: Any,
    ) -> None:
        self.config, self.layout = config, config.layout
        self.observer = observer or JobObserver()
        self.log: Log = log or logging.getLogger("ett.orchestrator")
        self.scheduling = scheduling  # the flow run's expected -> actual start
        self.sleep = sleep
        self.timeouts = Timeouts.of(config)
        self._node_runs: NodeRuns | None = launch_seams.pop("node_runs", None)  # tests
        self._launch_seams = launch_seams  # env, launcher, program: tests
        self.started_at = clocks.wall()
        self.result: JobResult | None = None
        self._reports: list[AttemptReport] = []
        self._outcome: JobOutcome | None = None
        self._current: AttemptProcess | None = None
        self._standby: AttemptProcess | None = None
        self._standby_losses = 0  # in a row, since a standby was last promoted
        self._last_lost: tuple[int, float] | None = None  # the last standby lost, and when
        self.policy = RetryPolicy(config.recovery)
        self.capacity = Capacity(config.launch.nproc)  # this host's rank slots, some lost
        self.health: health.HealthMonitor | None = None  # what marks them lost (or back)
        self._slots = tuple(range(config.launch.nproc))  # the running attempt's
        self._growing = False  # the smaller attempt was asked to commit and end: slots back
        self._recovered_in_process = 0
        self._settled = False
        self._lease: JobLease | None = None
        self._folder: str | None = None  # the ranks' config, a temp folder of this process
        self._rendezvous: RendezvousHost | None = None  # several nodes' c10d store
        self._fleet: NodeFleet | None = None  # the node runs of a job on a work pool
        self._clock_attrs: dict[str, object] = {}  # for the first orchestrator ledger file
        async_eval = config.train.eval == EvalMode.ASYNC
        self._async_eval = async_eval and config.checkpoint.mode != CheckpointMode.OFF

    # -- the job's life -------------------------------------------------------------------
    def __enter__(self) -> Orchestrator:
        """Take the job's lease, hand the ranks the resolved config (and keep it in the job's
        folder), launch attempt 0 (or the next number of a job run before). Raises JobLocked
        while another job holds the id."""
        self.first_attempt = next_attempt(self.layout)
        self._numbers = itertools.count(self.first_attempt)
        if self.first_attempt:
            self.log.info(
                "job %s has %d earlier attempt(s): continuing its numbering",
                self.config.job_id,
                self.first_attempt,
            )
        self._lease = acquire_job_lease(self.layout)
        try:
            self._folder = tempfile.mkdtemp(prefix=f"ett-{self.config.job_id}-")
            path = os.path.join(self._folder, "job.yaml")
            dump_config(self.config, path)
            storage.write_text(self.layout.config, config_yaml(self.config))  # the job's record
            self.spec = LaunchSpec.of(self.config, path, **self._launch_seams)
            self._launched = self.spec  # every slot's: a smaller attempt's is derived from it
            pool = self.config.launch.work_pool
            if self.spec.nnodes > 1:
                self._rendezvous = RendezvousHost(advertise_address() if pool else LOCAL_ADDRESS)
            if pool or self._node_runs is not None:
                runs = self._node_runs or WorkPoolNodeRuns(pool or "", self.layout)
                self._fleet = NodeFleet(self.config, runs, self.log)
                self._fleet.start()
            self.evaluator = SideEvaluator(path, self.log)
            if self.first_attempt:
                self._measure_clocks()
            self._current = self._spawn(standby=False)
            if self._fleet is None and self.spec.nnodes == 1:  # this host's slots: checked
                self.health = health.monitor(self.config, self.capacity, self.spec.env, self.log)
        except BaseException:
            self._cleanup()
            raise
        return self

    def __iter__(self) -> Iterator[AttemptProcess]:
        """Each attempt to watch, in turn, until the job's outcome is decided."""
        while self._current is not None and self._outcome is None:
            attempt = self._current
            yield attempt
            if not self._reports or self._reports[-1].attempt != attempt.number:
                raise RuntimeError(f"attempt {attempt.number} was not watched to its end")
            attempt.end(self.timeouts.grace_s, preempt=False)  # what is left of it
            self._outcome = self.policy.decide(self._reports)
            if self._outcome is None:
                self._current = self._next(self._reports[-1])  # None: too few ranks left

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """End every process; then read the ledger once for the summary."""
        if exc is not None and self._current is not None:  # cancelled, interrupted: it saves
            self._current.end(self.timeouts.grace_s, preempt=True)
        outcome = self._outcome
        if outcome is None:
            why = f"stopped: {type(exc).__name__}" if exc is not None else "stopped"
            outcome = JobOutcome(False, why, tuple(self._reports))
        if outcome.succeeded and self._async_eval:
            self.evaluator.finish(EVAL_FINISH_TIMEOUT_S)
        self._cleanup()
        summary = None
        try:
            summary = JobSummary.read(self.layout)
        except Exception as exc_:  # noqa: BLE001 - the outcome stands without its report
            self.log.warning("no ETT report for job %s: %s", self.config.job_id, exc_)
        self.result = JobResult(outcome, summary)
        try:
            self.observer.job_ended(self.result)
        except Exception as exc_:  # noqa: BLE001 - showing the job must not lose its result
            self.log.warning("could not show the end of job %s: %s", self.config.job_id, exc_)

    def _cleanup(self) -> None:
        """Standby released, the running attempt ended, the evaluator stopped, the lease
        released, the ranks' config and the job's in-memory copies removed, whatever fails
        on the way."""
        try:
            self.release_standby()
            if self._current is not None:
                self._current.end(self.timeouts.grace_s, preempt=False)
        finally:
            if self.health is not None:
                self.health.close()
            if hasattr(self, "evaluator"):
                self.evaluator.stop()
            if self._fleet is not None:
                self._fleet.close()
            if self._rendezvous is not None:
                self._rendezvous.close()
            if self._lease is not None:
                self._lease.release()
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
            # The job's in-memory checkpoint copies on this host: its attempts are over. A
            # SIGKILLed orchestrator's are the job's state still: its next run may restore
            # from them, and removes them when it ends.
            memory_tier.remove_segments(self.layout)

    # -- one attempt ------------------------------------------------------------------------
    def watch(self, attempt: AttemptProcess) -> AttemptReport:
        """Watch one attempt to its end, classify it, and write the orchestrator's share of
        the ledger (its launch, its failure). The flow calls it inside a task run."""
        first = attempt.number == self.first_attempt
        ledger = Ledger(
            self.layout,
            attempt=attempt.number,
            rank=0,
            role="orchestrator",
            clock_attrs=self._clock_attrs if first else None,
        )
        try:
            if self.scheduling is not None and first:
                ledger.record_span(Span.SCHEDULING, *self.scheduling)
            code, hung, last = watch(attempt, self.timeouts, lambda p: self._progress(p))
            ended = clocks.wall()
            if code:  # its ranks' unsent ledger events wait in their spools on this node
                recover_orphaned_spools(self.layout)
            started = attempt.promoted_at or attempt.spawned
            reached = last.started if last is not None else None
            if attempt.promoted_at is None:  # a cold start: launcher and imports until the trainer
                ledger.record_span(
                    Span.LAUNCHER_INIT,
                    attempt.spawned,
                    reached if reached is not None else ended,
                    reached_trainer=reached is not None,
                    pooled=attempt.pooled,
                )
            outcome = Outcome.HANG if hung else outcome_of(code)
            report = AttemptReport(
                attempt=attempt.number,
                outcome=outcome,
                exit_code=code,
                started=started,
                ended=ended,
                last_step=last.step if last is not None and last.phase != Phase.INIT else None,
                total_steps=last.total if last is not None and last.total else None,
                from_standby=attempt.promoted_at is not None,
                reached_trainer_s=None if reached is None else max(reached - started, 0.0),
                restarts_in_process=last.restarts if last is not None else 0,
            )
            if report.failed:
                ledger.mark(
                    Mark.FAILURE, step=report.last_step, t=ended, cause=str(outcome), exit_code=code
                )
        except BaseException:  # cancelled (Prefect's TerminationSignal), interrupted
            ledger.mark(Mark.FAILURE, cause=str(Outcome.CANCELLED), exit_code=None)
            raise
        finally:
            ledger.close()
        self._reports.append(report)
        self._recovered_in_process += report.restarts_in_process
        self.observer.attempt_ended(report)
        return report

    def _progress(self, progress: Progress) -> None:
        self._check_standby()
        self._grow_back(progress)
        self._grow_back_nodes(progress)
        if progress.phase == Phase.TRAINING:
            if self._wants_standby and self._standby is None:
                self._standby = self._spawn(standby=True)
            if not self._settled:
                standby = self._standby.progress() if self._standby is not None else None
                if not self._wants_standby or (
                    standby is not None and standby.phase == Phase.PARKED
                ):
                    self._settled = True
                    if self._async_eval:
                        self.evaluator.start()
        self.observer.progress(progress)

    # -- what next ---------------------------------------------------------------------------
    def _next(self, report: AttemptReport) -> AttemptProcess | None:
        """The next attempt: the standby, promoted, or a cold launch under a new number, on
        as many ranks as the host has left (None, the job's outcome set: fewer than
        ``recovery.min_ranks``)."""
        delay = self.policy.delay_s(self._reports)
        if delay > 0:
            self.log.warning("%s; relaunching in %.1f s", report.describe(), delay)
            self.sleep(delay)
        if self._fleet is not None:  # a job on a work pool: its node runs, not this host's slots
            return self._next_on_nodes(report)
        slots = self._ranks_for_next()
        if slots is None:
            return None
        self._growing = False
        self._check_standby()  # a standby that died meanwhile is lost, not promoted
        standby, self._standby = self._standby, None
        if slots != self._slots:  # resized: a standby of the old slots cannot serve
            if standby is not None:
                standby.release()
                standby = None
            self.log.warning(
                "%s; relaunching on %d of %d ranks (slots %s), resharded from the newest commit",
                report.describe(),
                len(slots),
                self.capacity.launched,
                ",".join(map(str, slots)),
            )
            self._slots, launched = slots, self._launched
            cuda = health.cuda_host(self.config)  # its ranks see only the usable devices
            env = health.attempt_env(launched.env, slots, self.capacity.launched, cuda)
            self.spec = dataclasses.replace(launched, nproc=len(slots), env=env)
            return self._spawn(standby=False)
        if standby is not None:
            how = f"promoting standby attempt {standby.number}"
        elif self._last_lost is not None:
            number, lost_at = self._last_lost
            when = time.strftime("%H:%M:%S", time.localtime(lost_at))
            how = f"relaunching cold (standby attempt {number} lost at {when})"
        else:
            how = "relaunching cold"
        self.log.warning("%s; %s (%s)", report.describe(), how, self.policy.describe())
        if standby is None:
            return self._spawn(standby=False)
        standby.promote(self._job_state())
        self._standby_losses = 0
        return standby

    def _grow_back(self, progress: Progress) -> None:
        """An attempt running smaller than the host's slots now allow: preempt it (SIGTERM to
        its launcher: it commits a durable checkpoint at its step boundary and exits), so the
        next attempt relaunches at the larger size from that commit."""
        attempt = self._current
        if (
            self._growing
            or attempt is None
            or self._fleet is not None
            or progress.phase != Phase.TRAINING
            or self.config.checkpoint.mode == CheckpointMode.OFF
            or self.spec.nproc >= self.capacity.ranks
        ):
            return
        self._growing = True
        self.log.warning(
            "%d rank slots usable again: attempt %d (%d ranks) checkpoints and ends, the job "
            "relaunches on %d ranks from that commit",
            self.capacity.ranks,
            attempt.number,
            self.spec.nproc,
            self.capacity.ranks,
        )
        for node in attempt.nodes:
            for pid in node.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    def _ranks_for_next(self) -> tuple[int, ...] | None:
        """The next attempt's rank slots: every slot, once the lost ones return within
        ``recovery.wait_for_capacity_s``; else the usable ones, if at least ``min_ranks``
        (else None, and the job fails with one line saying so). The health check probes
        every slot first; its thread probes the lost ones again while this waits."""
        if self.health is not None:
            self.health.check_all()
        launched = self.capacity.launched
        minimum = self.config.recovery.min_ranks or launched
        left = self._after_capacity_wait(
            lambda: self.capacity.ranks, launched, minimum, "rank slots", "min_ranks"
        )
        return None if left is None else self.capacity.usable

    def _after_capacity_wait(
        self, usable: Callable[[], int], launched: int, minimum: int, unit: str, knob: str
    ) -> int | None:
        """What ``usable`` counts once it is back to ``launched`` or
        ``recovery.wait_for_capacity_s`` has passed, if at least ``minimum``; else None, and
        the job fails with one line naming the numbers and ``recovery.<knob>``."""
        wait_s = self.config.recovery.wait_for_capacity_s
        left = usable()
        if left < launched:
            self.log.warning(
                "%d of %d %s lost: waiting up to %.0f s for them to return",
                launched - left,
                launched,
                unit,
                wait_s,
            )
        waited = 0.0
        while left < launched and waited < wait_s:
            step = min(CAPACITY_POLL_S, wait_s - waited)
            self.sleep(step)
            waited += step
            left = usable()
        if left >= minimum:
            return left
        self._outcome = JobOutcome(
            False,
            f"capacity lost: {left} of {launched} {unit} left after {wait_s:g} s, "
            f"recovery.{knob} is {minimum}",
            tuple(self._reports),
        )
        self.log.error("%s", self._outcome.message)
        return None

    # -- a job on a work pool: fewer nodes, and back ---------------------------------------
    def _next_on_nodes(self, report: AttemptReport) -> AttemptProcess | None:
        """The next attempt of a job on a work pool, cold on parked node runs: on fewer nodes
        than it was launched with after a lost node with no spare (``recovery.min_nodes``),
        resharded from the newest commit; on more once they park again (None, the job's
        outcome set: fewer than ``min_nodes`` left)."""
        assert self._fleet is not None
        nodes = self._nodes_for_next()
        if nodes is None:
            return None
        self._growing = False
        if nodes != self.spec.nnodes:
            self.log.warning(
                "%s; relaunching on %d of %d nodes, resharded from the newest commit",
                report.describe(),
                nodes,
                self._fleet.nnodes,
            )
            self.spec = dataclasses.replace(self.spec, nnodes=nodes)
        else:
            self.log.warning("%s; relaunching cold (%s)", report.describe(), self.policy.describe())
        return self._spawn(standby=False)

    def _nodes_for_next(self) -> int | None:
        """The next attempt's nodes: ``launch.nnodes`` once that many node runs are parked
        (the survivors, a spare, a replacement) within ``recovery.wait_for_capacity_s``;
        else as many as are parked, if at least ``min_nodes`` (else None, and the job fails
        in one line). ``min_nodes`` null: never fewer, the launch waits for a replacement
        up to ``startup_timeout_s`` as it always did."""
        fleet = self._fleet
        assert fleet is not None
        launched, minimum = fleet.nnodes, self.config.recovery.min_nodes
        if minimum is None:
            return launched
        return self._after_capacity_wait(
            lambda: min(fleet.parked(), launched), launched, minimum, "nodes", "min_nodes"
        )

    def _grow_back_nodes(self, progress: Progress) -> None:
        """A job on a work pool training on fewer nodes than it was launched with, once a
        node run parks beside it (the replacement placed, the lost host back): preempt the
        attempt (each of its node runs SIGTERMs its launch: the trainer commits a durable
        checkpoint at its step boundary and exits), so the next attempt relaunches on more
        nodes from that commit (``_next_on_nodes``)."""
        fleet, attempt = self._fleet, self._current
        if (
            fleet is None
            or attempt is None
            or self._growing
            or progress.phase != Phase.TRAINING
            or self.config.checkpoint.mode == CheckpointMode.OFF
            or self.spec.nnodes >= fleet.nnodes
            or (idle := fleet.parked()) == 0
        ):
            return
        self._growing = True
        self.log.warning(
            "%d more node run(s) parked: attempt %d (on %d of %d nodes) checkpoints and ends, "
            "the job relaunches on %d nodes from that commit",
            idle,
            attempt.number,
            self.spec.nnodes,
            fleet.nnodes,
            min(fleet.nnodes, self.spec.nnodes + idle),
        )
        for node in attempt.nodes:
            if isinstance(node, RemoteNode):
                node.preempt(self.timeouts.grace_s)

    # -- the standby -------------------------------------------------------------------------
    @property
    def _wants_standby(self) -> bool:
        """A job on a work pool keeps spare nodes instead (a standby is one host's)."""
        if self._fleet is not None:
            return False
        return self.config.recovery.standby and self._standby_losses < MAX_STANDBY_LOSSES

    def _check_standby(self) -> None:
        """A standby that died while it waited: mark it lost in the ledger (its own attempt
        number, the orchestrator's file) and forget it; ``_progress`` starts another."""
        standby = self._standby
        if standby is None or (code := standby.poll()) is None:
            return
        self._standby = None
        seen = standby.progress()
        parked = seen is not None and seen.phase == Phase.PARKED
        lost_at = clocks.wall()
        standby.end(0.0, preempt=False)
        cause = str(outcome_of(code))
        with Ledger(self.layout, attempt=standby.number, rank=0, role="orchestrator") as ledger:
            ledger.mark(Mark.STANDBY_LOST, t=lost_at, cause=cause, exit_code=code, parked=parked)
        self._standby_losses += 1
        self._last_lost = (standby.number, lost_at)
        again = (
            "starting another"
            if self._wants_standby
            else f"{MAX_STANDBY_LOSSES} lost in a row: going on without a standby"
        )
        self.log.warning(
            "standby attempt %d lost while %s (%s); %s",
            standby.number,
            "parked" if parked else "starting",
            name_of(code),
            again,
        )

    def release_standby(self) -> None:
        """A standby that will not be promoted: close its pipes (it exits) and end it."""
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.release()

    # -- launching ---------------------------------------------------------------------------
    def _job_state(self) -> JobState:
        """Every failure so far, in-process ones included: what the next attempt's
        checkpoint interval estimates the MTBF from (``max_failures`` counts only the ones
        that ended an attempt)."""
        return JobState(self.policy.failures + self._recovered_in_process, self.started_at)

    def _spawn(self, standby: bool) -> AttemptProcess:
        assert self._lease is not None
        rendezvous = None if self._rendezvous is None else self._rendezvous.endpoint
        number, env = next(self._numbers), self._lease.env()
        if self._fleet is not None:  # parked node runs on the pool's hosts
            wait_s = self.config.recovery.startup_timeout_s
            attempt = AttemptProcess(number, False, self.spec, self.log)
            state, nnodes = self._job_state(), self.spec.nnodes
            attempt.nodes.extend(
                self._fleet.launch(number, state, env, rendezvous or "", wait_s, nnodes)
            )
            return attempt
        return AttemptProcess.spawn(
            self.spec, number, standby, env, self._job_state(), self.log, rendezvous
        )

    def _measure_clocks(self) -> None:
        """A resumed job: another host whose ledger ends in this host's future runs ahead
        (infra/accounting/clocks.py); say so, and record it for the report."""
        ahead = domains_ahead(self.layout)
        if ahead:
            self._clock_attrs = {"ahead": ahead}
        for domain, bound in ahead.items():
            self.log.warning(
                "the ledger of host %s ends %.1f s in this host's future: its clock runs "
                "ahead; the report moves its events back",
                clocks.label(domain),
                bound,
            )


def run(config: JobConfig, observer: JobObserver | None = None, **kwargs: Any) -> JobResult:
    """Run the job to its outcome (``ett train``, tests); ``kwargs`` go to Orchestrator."""
    with Orchestrator(config, observer, **kwargs) as job:
        for attempt in job:
            job.watch(attempt)
    assert job.result is not None
    return job.result
