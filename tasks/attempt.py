"""One attempt of a training job: its processes, and the watch that ends when they do.

An **attempt** is one launch of the trainer: ``python -m trainer.launch`` (torchrun's agent
with the ranks forked from it, trainer/launch.py), one agent per node, each with a control
channel (infra/control.py): a pipe per rank for commands and the lifeline, the job's state
the attempt starts from, and a progress record that rank 0 rewrites at every step. From the
moment it is spawned until nothing of it is left, an attempt is an ``AttemptProcess``.

**Watch.** Progress comes from the progress record only: the step and the phase. An attempt
that makes no step for ``recovery.hang_timeout_s`` (or has not made its first step
``recovery.startup_timeout_s`` after it started or was promoted) is hung: its whole process
tree is ended (SIGTERM, then SIGKILL after a grace that is never below the trainer's
preemption budget). **Classify**: the launcher exits with the first failed rank's code, so
the outcome is ``infra.exit_codes.outcome_of(code)``, or HANG when the watch killed it.

What to do next (promote a standby, relaunch, give up) is the orchestrator's
(tasks/orchestrator.py). No Prefect here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infra import processes
from infra.accounting import clocks
from infra.control import ENV_ATTEMPT, Command, ControlDir, JobState, Phase, Progress
from infra.exit_codes import ExitCode, Outcome, name_of
from infra.settings import JobConfig
from tasks.agent_pool import PooledLauncher, claim

POLL_S = 0.05  # how often a watched attempt is looked at (a file read and a waitpid)
TRACK_EVERY_S = 1.0  # how often its process tree is listed (a /proc scan)
RENDEZVOUS_HOST = "127.0.0.1"
# SIGTERM -> SIGKILL: the trainer's emergency checkpoint gets its budget, plus this margin.
GRACE_MARGIN_S = 5.0

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
    agent_pool: str | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.nnodes < 1:
            raise ValueError(f"need nproc >= 1 and nnodes >= 1, got {self.nproc}, {self.nnodes}")

    @classmethod
    def of(cls, config: JobConfig, config_path: str, **seams: Any) -> LaunchSpec:
        """The launch of ``config`` (its ``launch`` section), the ranks reading
        ``config_path``; ``seams``: ``env``, ``launcher``, ``program`` (tests)."""
        launch = config.launch
        return cls(config_path, launch.nproc, launch.nnodes, agent_pool=launch.agent_pool, **seams)

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
        cls,
        spec: LaunchSpec,
        number: int,
        standby: bool,
        env: dict[str, str],
        state: JobState,
        log: Log,
    ) -> AttemptProcess:
        """Launch attempt ``number`` (a ``standby`` parks once initialised), its ranks
        starting from the job's ``state`` (written to their control folders first)."""
        attempt = cls(number, standby, spec, log)
        base_env = {
            **os.environ,
            "PYTHONPATH": processes.repo_pythonpath(os.environ.get("PYTHONPATH")),
            **spec.env,
            **env,
            ENV_ATTEMPT: str(number),
        }
        for control in attempt.controls:
            control.write_job_state(state)
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
    def promote(self, state: JobState) -> None:
        """Wake a parked standby: it restores the newest committed checkpoint and trains,
        from the job's ``state`` now (it was spawned knowing an older one)."""
        self.promoted_at = clocks.wall()
        for control in self.controls:
            control.write_job_state(state)
            control.send(Command.PROMOTE)

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
    """When the watch calls an attempt hung, and how long its tree gets after SIGTERM."""

    hang_s: float  # no new step for this long: hung
    startup_s: float  # no first step this long after start or promotion: hung
    grace_s: float  # SIGTERM -> SIGKILL; at least the trainer's preemption budget

    @classmethod
    def of(cls, config: JobConfig) -> Timeouts:
        rec = config.recovery
        grace = config.checkpoint.preemption_budget_s + GRACE_MARGIN_S
        return cls(rec.hang_timeout_s, rec.startup_timeout_s, grace)


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
