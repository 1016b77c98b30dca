"""The attempt lifecycle of a training job: launch -> watch -> classify -> retry, with a warm
standby. No Prefect here: the flow (flows/train_flow.py, through tasks/train.py) and ``ett
train`` run the same code.

An **attempt** is one launch of the trainer: ``python -m trainer.launch`` (torchrun's agent
with the ranks forked from it, trainer/launch.py), one agent per node, each with a control
channel (infra/control.py): a pipe per rank for commands and the lifeline, and a progress
record that rank 0 rewrites at every step. From the moment it is spawned until nothing of it
is left, an attempt is an ``AttemptProcess``.

**Watch.** Progress comes from the progress record only: the step and the phase. An attempt
that makes no step for ``hang_timeout_s`` (or has not made its first step
``startup_timeout_s`` after it started or was promoted) is hung: its whole process tree is
ended (SIGTERM, then SIGKILL after ``grace_s``, which is never below the trainer's preemption
budget). **Classify**: the launcher exits with the first failed rank's code, so the outcome is
``infra.exit_codes.outcome_of(code)``, or HANG when the orchestrator killed it.

**Warm standby.** Once an attempt has made its first step, the next attempt is spawned as a
standby: it initialises (imports, process group, model, compile cache and warm-up), parks on
its control pipe and costs no CPU. When the running attempt fails, the standby is promoted
(it restores the newest committed checkpoint and trains) and a new standby starts behind it
once the promoted attempt steps. A standby that is never needed is released (its pipes close)
and ended. A standby that dies while it waits is marked ``standby_lost`` in the ledger (never
the job's startup or failure), and another is started behind it; after
``MAX_STANDBY_LOSSES`` in a row the job goes on without one.

**Attempt numbers are never reused.** Every launch, cold or standby, takes the next number,
so one attempt's ledger files hold one process group's events only.

**Retry policy.** Preemptions and the first failure of a kind relaunch at once; the same kind
failing again backs off exponentially (flap protection). Preemptions do not count towards
``max_failures``. Fatal outcomes (bad config or data, incompatible checkpoint, job locked)
stop the job.

The job's lease (infra/lease.py) is held for the whole run, so a second job with the same
job id refuses to start. Every process started here is ended here: on success, failure,
cancellation (the flow run is
cancelled: the running attempt is preempted, with ``grace_s`` to checkpoint) or an exception.

One module on purpose: launch, watch, classify and retry share the attempt's processes and
its standby, and the lifecycle reads top to bottom here; the control channel, process-tree
ending and exit codes are in infra/ (control.py, processes.py, exit_codes.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from infra import processes
from infra.accounting import clocks
from infra.accounting.ledger import Ledger, Mark, Span, domains_ahead, recover_orphaned_spools
from infra.agent_protocol import ENV_POOL
from infra.control import Command, ControlDir, Phase, Progress
from infra.exit_codes import ExitCode, Outcome, name_of, outcome_of
from infra.lease import acquire_job_lease
from tasks.agent_pool import PooledLauncher, claim

POLL_S = 0.05  # how often a watched attempt is looked at (a file read and a waitpid)
TRACK_EVERY_S = 1.0  # how often its process tree is listed (a /proc scan)
RENDEZVOUS_HOST = "127.0.0.1"
MAX_STANDBY_LOSSES = 3  # standbys lost in a row before the job goes on without one

Log = logging.Logger | logging.LoggerAdapter[logging.Logger]


# -- what to launch ----------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchSpec:
    """How every attempt of a job is started: the config file the ranks read, ranks per node
    and nodes. Several nodes on one machine each get their own torchrun agent, joined by
    c10d rendezvous on loopback (a real multi-node job runs one agent per machine with the
    same flags; see prefect.yaml)."""

    config_path: str
    nproc: int = 1
    nnodes: int = 1
    env: dict[str, str] = field(default_factory=dict)
    # The launcher's command before its flags (tests put a stand-in for the trainer here),
    # and the program it runs on every rank.
    launcher: tuple[str, ...] = ("-m", "trainer.launch")
    program: tuple[str, ...] = ("-m", "trainer")
    # A warm agent pool's socket (tasks/agent_pool.py): launchers are claimed from it when
    # it can serve them, else started fresh.
    agent_pool: str | None = field(default_factory=lambda: os.environ.get(ENV_POOL) or None)

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.nnodes < 1:
            raise ValueError(f"need nproc >= 1 and nnodes >= 1, got {self.nproc}, {self.nnodes}")

    def commands(self, rendezvous_port: int, run_id: str) -> list[list[str]]:
        """One command line per node."""
        base = [
            sys.executable,
            *self.launcher,
            f"--nproc-per-node={self.nproc}",
            "--max-restarts=0",
        ]  # restarts are the orchestrator's: it accounts for them
        if self.nnodes == 1:
            return [[*base, "--standalone", *self.program, "--config", self.config_path]]
        rdzv = [
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={RENDEZVOUS_HOST}:{rendezvous_port}",
            f"--rdzv-id={run_id}",
        ]
        return [
            [*base, *rdzv, f"--node-rank={n}", *self.program, "--config", self.config_path]
            for n in range(self.nnodes)
        ]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((RENDEZVOUS_HOST, 0))
        return int(sock.getsockname()[1])


# -- one attempt's processes ---------------------------------------------------------------------
class OutputPump:
    """Reads an agent's output on a thread and logs it; the sink can be switched (a standby's
    lines belong to the run that promotes it)."""

    def __init__(self, stream: Any, log: Log, prefix: str) -> None:
        self.log, self.prefix = log, prefix
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream: Any) -> None:
        for line in stream:
            text = line.rstrip()
            if text:
                self.log.info("%s%s", self.prefix, text)


class AttemptProcess:
    """The launcher processes (one per node) of one attempt, their control channels and
    output. ``spawn`` starts them; ``poll`` tells when they are done; ``end`` ends them."""

    _ended = False  # set once end() has run to its end

    def __init__(self, number: int, standby: bool, spec: LaunchSpec, log: Log) -> None:
        self.number, self.standby, self.spec = number, standby, spec
        self.controls = [
            ControlDir(spec.nproc, prefix=f"ett-a{number}-") for _ in range(spec.nnodes)
        ]
        self.spawned = clocks.wall()  # the ledger's clock: these times go into it
        self.promoted_at: float | None = None
        self.procs: list[subprocess.Popen[str] | PooledLauncher] = []
        self.pooled = 0  # launchers claimed from the agent pool
        self.pumps: list[OutputPump] = []
        self.log = log
        self.tree = processes.TreeTracker()  # every process of the attempt, ever seen

    @classmethod
    def spawn(
        cls, spec: LaunchSpec, number: int, standby: bool, env: dict[str, str], log: Log
    ) -> AttemptProcess:
        attempt = cls(number, standby, spec, log)
        base_env = {
            **os.environ,
            "PYTHONPATH": processes.repo_pythonpath(os.environ.get("PYTHONPATH")),
            **spec.env,
            **env,
            "ETT_ATTEMPT": str(number),
        }
        commands = spec.commands(_free_port(), f"ett-attempt{number}-{os.getpid()}")
        try:
            attempt._launch(commands, base_env, log)
        except BaseException:  # interrupted half-way: what started, and its folders, go
            attempt.end(0.0, preempt=False)
            raise
        kind = "standby" if standby else "attempt"
        pooled = f" ({attempt.pooled} launcher(s) from the agent pool)" if attempt.pooled else ""
        log.info("%s %d started%s: %s", kind, number, pooled, " ".join(commands[0]))
        return attempt

    def _launch(self, commands: list[list[str]], base_env: dict[str, str], log: Log) -> None:
        """One launcher per node: claimed from the agent pool when it can serve, else new."""
        spec = self.spec
        for node, (command, control) in enumerate(zip(commands, self.controls, strict=True)):
            node_env = {**base_env, **control.env(self.standby)}
            proc: subprocess.Popen[str] | PooledLauncher | None = None
            if spec.agent_pool:
                proc = claim(spec.agent_pool, command, node_env, log)
                self.pooled += proc is not None
            if proc is None:
                proc = subprocess.Popen(
                    command,
                    env=node_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,  # its own group: a Ctrl-C of ours is not its signal
                )
            self.procs.append(proc)
            prefix = f"[attempt {self.number}{' standby' if self.standby else ''} node {node}] "
            self.pumps.append(OutputPump(proc.stdout, log, prefix if spec.nnodes > 1 else ""))

    # -- looking at it ---------------------------------------------------------------------
    def progress(self) -> Progress | None:
        """Rank 0's progress record (node 0 holds global rank 0)."""
        return self.controls[0].progress()

    def poll(self) -> int | None:
        """The attempt's exit code once it is over, None while it runs.

        Over means: every agent exited (0 when all succeeded), or one agent failed (the
        other nodes cannot go on without it), or a rank died of anything but a preemption
        (its code from its exit file, 128 + SIGKILL when it left none), or every rank has
        exited: the ranks' own records tell before torchrun's agents have noticed and torn
        down. Preempted ranks may still be checkpointing: the attempt waits for all of them.
        """
        codes = [p.poll() for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        ranks = [r for control in self.controls for r in control.ranks().values()]
        ended = [(pid, code) for pid, code in ranks if not processes.pid_alive(pid)]
        for _, code in ended:
            if code not in (0, ExitCode.PREEMPTED):
                return 128 + signal.SIGKILL if code is None else code
        if ranks and len(ended) == self.spec.nproc * self.spec.nnodes:
            return next((code for _, code in ended if code), 0)
        return None

    def track(self) -> None:
        """Remember the attempt's processes (ranks, their children) while they are ours."""
        self.tree.scan([p.pid for p in self.procs])

    # -- acting on it ----------------------------------------------------------------------
    def promote(self, **payload: Any) -> None:
        """Wake a parked standby: it restores the newest committed checkpoint and trains."""
        self.promoted_at = clocks.wall()
        for control in self.controls:
            control.send(Command.PROMOTE, **payload)

    def end(self, grace_s: float, preempt: bool) -> list[int]:
        """End every process of the attempt. ``preempt``: SIGTERM first (the trainer
        checkpoints and exits), SIGKILL after ``grace_s``; else SIGKILL at once (after a
        failure the newest committed checkpoint is where the job resumes anyway). Closes the
        control channels and reaps the launchers. Returns the pids signalled. Once it has
        run to its end, a later call does nothing (those pids may be another's by then); one
        that was interrupted halfway runs again in full."""
        if self._ended:
            return []
        first = signal.SIGTERM if preempt else signal.SIGKILL
        signalled: list[int] = []
        for proc in self.procs:
            signalled += processes.terminate_tree(proc.pid, grace_s, first, reap=proc.poll)
        # Ranks whose agent died first, children of ranks: reparented, but tracked.
        for control in self.controls:
            for pid, _ in control.ranks().values():
                if processes.pid_alive(pid):
                    signalled += processes.terminate_tree(pid, 0.0, signal.SIGKILL)
        signalled += self.tree.end()
        self._close()
        self._ended = True
        return signalled

    def release(self, grace_s: float = 2.0) -> list[int]:
        """A standby that will not be promoted: its pipes close (it exits on its own), and
        whatever is left after ``grace_s`` is killed."""
        for control in self.controls:
            control.close()
        deadline = time.monotonic() + grace_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self.end(0.0, preempt=False)

    def _close(self) -> None:
        for control in self.controls:
            control.close()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for pump in self.pumps:
            pump.thread.join(timeout=2)


# -- watching ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttemptReport:
    """What became of one attempt (times are Unix seconds)."""

    attempt: int
    outcome: Outcome
    exit_code: int
    started: float  # spawned (cold) or promoted (standby)
    ended: float
    last_step: int | None = None
    total_steps: int | None = None
    from_standby: bool = False
    reached_trainer_s: float | None = None  # started -> the trainer's first report
    restarts_in_process: int = 0  # exceptions it recovered from without a new process

    @property
    def failed(self) -> bool:
        return self.outcome.failed

    @property
    def fatal(self) -> bool:
        return self.outcome.fatal

    def describe(self) -> str:
        where = f" at step {self.last_step}" if self.last_step is not None else " before step 1"
        return f"attempt {self.attempt}: {self.outcome}{where} ({name_of(self.exit_code)})"


@dataclass(frozen=True)
class Timeouts:
    hang_s: float = 600.0  # no new step for this long: hung
    startup_s: float = 900.0  # no first step this long after start/promotion: hung
    grace_s: float = 60.0  # SIGTERM -> SIGKILL; at least the trainer's preemption budget


def watch(
    attempt: AttemptProcess,
    timeouts: Timeouts,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[int, bool, Progress | None]:
    """Follow an attempt until it ends; kill it when hung. Returns (exit code, hung, the
    last progress seen)."""
    start = attempt.promoted_at or attempt.spawned
    last: Progress | None = None
    last_change = time.monotonic()
    first_step_by = time.monotonic() + timeouts.startup_s
    next_scan = 0.0
    while (code := attempt.poll()) is None:
        now = time.monotonic()
        if now >= next_scan:
            attempt.track()
            next_scan = now + TRACK_EVERY_S
        progress = attempt.progress()
        # A promoted standby's record says "parked" until it reports again: not news.
        fresh = progress is not None and (progress.t >= start or last is not None)
        if fresh and (last is None or (progress.phase, progress.step) != (last.phase, last.step)):
            if last is None or progress.phase != last.phase:
                attempt.track()
            last, last_change = progress, now
            if on_progress is not None:
                on_progress(progress)
        stepping = last is not None and last.phase == Phase.TRAINING
        if (stepping and now - last_change > timeouts.hang_s) or (
            not stepping and now > first_step_by
        ):
            attempt.log.error(
                "attempt %d made no progress for %.0f s: ending it as hung",
                attempt.number,
                timeouts.hang_s if stepping else timeouts.startup_s,
            )
            attempt.end(timeouts.grace_s, preempt=True)
            return attempt.poll() or -9, True, last
        time.sleep(POLL_S)
    final = attempt.progress()  # the last steps may have landed since the last look
    if final is not None and last is not None and final.t >= last.t:
        last = final
    return code, False, last


# -- retry policy --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RetryPolicy:
    """How many failures a job survives and how long it waits before relaunching.

    Preemptions relaunch at once and do not count towards ``max_failures``
    (``max_preemptions`` only stops an endless preemption loop). A failure of a new kind also
    relaunches at once; the same kind failing again waits ``backoff_s``, doubling with each
    repeat up to ``backoff_max_s``: a failure that keeps coming back is not retried in a
    tight loop."""

    max_failures: int = 3
    backoff_s: float = 10.0
    backoff_max_s: float = 300.0
    max_preemptions: int = 20

    def delay_s(self, outcome: Outcome, repeats: int) -> float:
        """Wait before relaunching after ``outcome``, the ``repeats``-th time in a row."""
        if outcome == Outcome.PREEMPTED or repeats < 1 or self.backoff_s <= 0:
            return 0.0
        return min(self.backoff_s * 2 ** (repeats - 1), self.backoff_max_s)


@dataclass(frozen=True)
class JobOutcome:
    succeeded: bool
    message: str
    attempts: tuple[AttemptReport, ...]

    @property
    def failures(self) -> int:
        return sum(1 for a in self.attempts if a.outcome.counts_as_failure)

    @property
    def preemptions(self) -> int:
        return sum(1 for a in self.attempts if a.outcome == Outcome.PREEMPTED)

    def to_dict(self) -> dict[str, Any]:
        return {
            "succeeded": self.succeeded,
            "message": self.message,
            "attempts": [asdict(a) for a in self.attempts],
        }


# -- the job -------------------------------------------------------------------------------------
@dataclass
class JobRunner:
    """Runs a job's attempts to success, a fatal failure, or the end of the retry budget.

    ``run_attempt`` watches one attempt to its end and returns its report (``watch_attempt``
    by default; the flow wraps it in a Prefect task). ``on_attempt`` sees every report.
    """

    job_url: str
    spec: LaunchSpec
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    timeouts: Timeouts = field(default_factory=Timeouts)
    standby: bool = True
    first_attempt: int = 0
    log: Log = field(default_factory=lambda: logging.getLogger("ett.orchestrator"))
    on_progress: Callable[[Progress], None] | None = None
    on_attempt: Callable[[AttemptReport], None] | None = None
    # Once: the job trains and its standby (if any) is parked. Side work starts here, so it
    # does not compete with the start of training or of the standby for the CPU.
    on_settled: Callable[[], None] | None = None
    scheduling: tuple[float, float] | None = None  # the flow run's expected -> actual start
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        self.job_started_at = clocks.wall()
        self._numbers = itertools.count(self.first_attempt)  # never reused (module docstring)
        self._standby: AttemptProcess | None = None
        self._standby_losses = 0  # in a row, since a standby was last promoted
        self._last_lost: tuple[int, float] | None = None  # the last standby lost, and when
        self._failures = 0
        self._recovered_in_process = 0
        self._settled = False
        self._lease_env: dict[str, str] = {}
        self._clock_attrs: dict[str, object] = {}  # for the first orchestrator ledger

    # -- spawning ----------------------------------------------------------------------------
    def _spawn(self, standby: bool) -> AttemptProcess:
        env = {
            **self._lease_env,
            "ETT_JOB_FAILURES": str(self.observed_failures),
            "ETT_JOB_STARTED_AT": repr(self.job_started_at),
        }
        return AttemptProcess.spawn(self.spec, next(self._numbers), standby, env, self.log)

    @property
    def observed_failures(self) -> int:
        """Every failure of the job so far, the ones recovered in process included: what the
        next attempt's checkpoint interval estimates the MTBF from. (``max_failures`` counts
        only the failures that ended an attempt.)"""
        return self._failures + self._recovered_in_process

    @property
    def _wants_standby(self) -> bool:
        return self.standby and self._standby_losses < MAX_STANDBY_LOSSES

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
        with Ledger(self.job_url, attempt=standby.number, rank=0, role="orchestrator") as ledger:
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

    def _progress(self, attempt: AttemptProcess, progress: Progress) -> None:
        self._check_standby()
        if progress.phase == Phase.TRAINING:
            if self._wants_standby and self._standby is None:
                self._standby = self._spawn(standby=True)
            if not self._settled:
                standby = self._standby.progress() if self._standby is not None else None
                if not self._wants_standby or (
                    standby is not None and standby.phase == Phase.PARKED
                ):
                    self._settled = True
                    if self.on_settled is not None:
                        self.on_settled()
        if self.on_progress is not None:
            self.on_progress(progress)

    def watch_attempt(self, attempt: AttemptProcess) -> AttemptReport:
        """Watch one attempt to its end and write the orchestrator's share of the ledger."""
        first = attempt.number == self.first_attempt
        ledger = Ledger(
            self.job_url,
            attempt=attempt.number,
            rank=0,
            role="orchestrator",
            clock_attrs=self._clock_attrs if first else None,
        )
        try:
            if self.scheduling is not None and first:
                ledger.record_span(Span.SCHEDULING, *self.scheduling)
            code, hung, last = watch(attempt, self.timeouts, lambda p: self._progress(attempt, p))
            ended = clocks.wall()
            if code:  # its ranks' unsent ledger events wait in their spools on this node
                recover_orphaned_spools(self.job_url)
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
            return report
        except BaseException:  # cancelled (Prefect's TerminationSignal), interrupted
            ledger.mark(
                Mark.FAILURE, cause=str(Outcome.PREEMPTED), exit_code=None, outcome="cancelled"
            )
            raise
        finally:
            ledger.close()

    # -- the loop ----------------------------------------------------------------------------
    def run(
        self, run_attempt: Callable[[AttemptProcess], AttemptReport] | None = None
    ) -> JobOutcome:
        """Launch attempts until one succeeds, one fails fatally, or the policy gives up."""
        run_attempt = run_attempt or self.watch_attempt
        reports: list[AttemptReport] = []
        preemptions = repeats = 0
        # One job id, one job: held for the whole job, checked by every trainer group of it
        # (an attempt and its standby). Raises JobLocked while another job holds it.
        lease = acquire_job_lease(self.job_url)
        self._lease_env = lease.env()
        try:
            if self.first_attempt:  # a resumed job: hosts whose ledger ends in our future
                ahead = domains_ahead(self.job_url)
                if ahead:
                    self._clock_attrs = {"ahead": ahead}
                    for domain, bound in ahead.items():
                        self.log.warning(
                            "the ledger of host %s ends %.1f s in this host's future: its "
                            "clock runs ahead; the report moves its events back",
                            domain,
                            bound,
                        )
            current = self._spawn(standby=False)
        except BaseException:
            lease.release()
            raise
        try:
            while True:
                try:
                    report = run_attempt(current)
                except BaseException:  # cancelled: the attempt may still checkpoint
                    current.end(self.timeouts.grace_s, preempt=True)
                    raise
                current.end(self.timeouts.grace_s, preempt=False)  # what is left of it
                reports.append(report)
                self._recovered_in_process += report.restarts_in_process
                if self.on_attempt is not None:
                    self.on_attempt(report)
                if report.outcome == Outcome.SUCCESS:
                    return JobOutcome(
                        True,
                        f"succeeded on attempt {report.attempt} after "
                        f"{self._failures} failure(s) and {preemptions} "
                        "preemption(s)",
                        tuple(reports),
                    )
                if report.fatal:
                    return JobOutcome(
                        False,
                        f"{report.describe()}: not retried, a relaunch cannot fix it",
                        tuple(reports),
                    )
                last = reports[-2].outcome if len(reports) > 1 else None
                repeats = repeats + 1 if last == report.outcome else 0
                if report.outcome == Outcome.PREEMPTED:
                    preemptions += 1
                    if preemptions > self.policy.max_preemptions:
                        return JobOutcome(
                            False,
                            f"preempted {preemptions} times, more than "
                            f"max_preemptions={self.policy.max_preemptions}",
                            tuple(reports),
                        )
                else:
                    self._failures += 1
                    if self._failures > self.policy.max_failures:
                        return JobOutcome(
                            False,
                            f"{self._failures} failures exceed "
                            f"max_failures={self.policy.max_failures}; last "
                            f"{report.describe()}",
                            tuple(reports),
                        )
                delay = self.policy.delay_s(report.outcome, repeats)
                current = self._next(report, delay)
        finally:
            # Whatever ended the loop (an interrupt may have landed inside the normal end of
            # an attempt): nothing of the job's attempts is left, and the lease goes last.
            try:
                current.end(0.0, preempt=False)
                self.release_standby()
            finally:
                lease.release()

    def _next(self, report: AttemptReport, delay: float) -> AttemptProcess:
        """The next attempt: the standby, promoted, or a cold launch under a new number."""
        if delay > 0:
            self.log.warning("%s; relaunching in %.1f s", report.describe(), delay)
            self.sleep(delay)
        self._check_standby()  # a standby that died meanwhile is lost, not promoted
        standby, self._standby = self._standby, None
        if standby is not None:
            how = f"promoting standby attempt {standby.number}"
        elif self._last_lost is not None:
            number, lost_at = self._last_lost
            when = time.strftime("%H:%M:%S", time.localtime(lost_at))
            how = f"relaunching cold (standby attempt {number} lost at {when})"
        else:
            how = "relaunching cold"
        failures = f"failures {self._failures}/{self.policy.max_failures}"
        self.log.warning("%s; %s (%s)", report.describe(), how, failures)
        if standby is None:
            return self._spawn(standby=False)
        standby.promote(
            failures=self.observed_failures,
            job_started_at=self.job_started_at,
            attempt=standby.number,
        )
        self._standby_losses = 0
        return standby

    def release_standby(self) -> None:
        """A standby that will not be promoted: close its pipes (it exits) and end it."""
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.release()
