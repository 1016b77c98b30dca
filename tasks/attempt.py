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

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from infra import processes
from infra.accounting import clocks
from infra.control import ENV_ATTEMPT, Command, ControlDir, JobState, Phase, Progress
from infra.exit_codes import ExitCode, Outcome, name_of
from infra.settings import JobConfig
from tasks.local_node import LocalNode, Log, OutputPump

POLL_S = 0.05  # how often a watched attempt is looked at (a file read and a waitpid)
TRACK_EVERY_S = 1.0  # how often its process tree is listed (a /proc scan)
LOCAL_ADDRESS = "localhost"  # what the nodes of a job on this host advertise to each other
# SIGTERM -> SIGKILL: the trainer's emergency checkpoint gets its budget, plus this margin.
GRACE_MARGIN_S = 5.0


# -- what to launch ----------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchSpec:
    """How every attempt of a job is started: the config file the ranks read, ranks per node
    and nodes. Several nodes join through c10d rendezvous at a store the orchestrator hosts
    (tasks/rendezvous.py), so the rendezvous outlives any node."""

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

    def command(
        self, node_rank: int = 0, rendezvous: str | None = None, run_id: str = "", address: str = ""
    ) -> list[str]:
        """The agent command of one node: standalone for one node; else joining the c10d
        store at ``rendezvous`` (host:port, hosted elsewhere: ``is_host=false``) as
        ``node_rank``, advertising ``address`` to the other nodes."""
        base = [
            sys.executable,
            *self.launcher,
            f"--nproc-per-node={self.nproc}",
            "--max-restarts=0",
        ]  # restarts are the orchestrator's: it accounts for them
        tail = [*self.program, "--config", self.config_path]
        if self.nnodes == 1:
            return [*base, "--standalone", *tail]
        if rendezvous is None:
            raise ValueError(f"{self.nnodes} nodes need a rendezvous endpoint")
        rdzv = [
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous}",
            f"--rdzv-id={run_id}",
            "--rdzv-conf=is_host=false",
        ]
        local = [f"--local-addr={address}"] if address else []
        return [*base, *rdzv, *local, f"--node-rank={node_rank}", *tail]


class Node(Protocol):
    """One node of an attempt, wherever it runs: a local agent (tasks/local_node.py) or a
    node run on another host (tasks/remote_node.py)."""

    pump: OutputPump | None

    @property
    def pooled(self) -> bool: ...
    def agent_code(self) -> int | None: ...
    def rank_exits(self) -> list[tuple[int, int | None]]: ...
    def progress(self) -> Progress | None: ...
    def pids(self) -> list[int]: ...
    def promote(self, state: JobState, command: Command) -> None: ...
    def end(self, grace_s: float, first: int) -> list[int]: ...
    def close(self) -> None: ...


# -- one attempt's processes ---------------------------------------------------------------------
class AttemptProcess:
    """The nodes of one attempt. ``spawn`` starts them on this host; ``poll`` tells when they
    are done; ``end`` ends them."""

    _ended = False  # set once end() has run to its end

    def __init__(self, number: int, standby: bool, spec: LaunchSpec, log: Log) -> None:
        self.number, self.standby, self.spec = number, standby, spec
        self.spawned = clocks.wall()  # the ledger's clock: these times go into it
        self.promoted_at: float | None = None
        self.nodes: list[Node] = []
        self.log = log
        self.tree = processes.TreeTracker()  # every process of the attempt, ever seen

    @property
    def pooled(self) -> int:
        """Launchers claimed from an agent pool."""
        return sum(node.pooled for node in self.nodes)

    @property
    def pumps(self) -> list[OutputPump]:
        return [node.pump for node in self.nodes if node.pump is not None]

    @classmethod
    def spawn(
        cls,
        spec: LaunchSpec,
        number: int,
        standby: bool,
        env: dict[str, str],
        state: JobState,
        log: Log,
        rendezvous: str | None = None,
    ) -> AttemptProcess:
        """Launch attempt ``number`` on this host, every node an agent of its own (a
        ``standby`` parks once initialised), its ranks starting from the job's ``state``;
        several nodes join at ``rendezvous``."""
        attempt = cls(number, standby, spec, log)
        base_env = {
            **os.environ,
            "PYTHONPATH": processes.repo_pythonpath(os.environ.get("PYTHONPATH")),
            **spec.env,
            **env,
            ENV_ATTEMPT: str(number),
        }
        run_id = f"ett-attempt{number}-{os.getpid()}"
        commands = [
            spec.command(n, rendezvous, run_id, LOCAL_ADDRESS if spec.nnodes > 1 else "")
            for n in range(spec.nnodes)
        ]
        kind = "standby" if standby else "attempt"
        try:
            for node, command in enumerate(commands):
                prefix = f"[{kind} {number} node {node}] " if spec.nnodes > 1 else ""
                control = ControlDir(spec.nproc, prefix=f"ett-a{number}-")
                try:
                    started = LocalNode.start(
                        command, base_env, control, state, standby, log, prefix, spec.agent_pool
                    )
                except BaseException:
                    control.close()
                    raise
                attempt.nodes.append(started)
        except BaseException:  # interrupted half-way: what started, and its folders, go
            attempt.end(0.0, preempt=False)
            raise
        pooled = f" ({attempt.pooled} launcher(s) from the agent pool)" if attempt.pooled else ""
        log.info("%s %d started%s: %s", kind, number, pooled, " ".join(commands[0]))
        return attempt

    # -- looking at it ---------------------------------------------------------------------
    def progress(self) -> Progress | None:
        """Rank 0's progress record, from whichever node holds global rank 0: c10d orders
        ranks by the agents' addresses (and pids), not by node rank."""
        return next((p for node in self.nodes if (p := node.progress()) is not None), None)

    def poll(self) -> int | None:
        """The attempt's exit code once it is over, None while it runs.

        Over means: every agent exited (0 when all succeeded), or one agent failed (the
        other nodes cannot go on without it), or a rank died of anything but a preemption
        (its code from its exit file, 128 + SIGKILL when it left none), or every rank has
        exited: the ranks' own records tell before torchrun's agents have noticed and torn
        down. Preempted ranks may still be checkpointing: the attempt waits for all of them.
        A node on another host tells its agent's code only (tasks/remote_node.py).
        """
        codes = [node.agent_code() for node in self.nodes]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if codes and all(c == 0 for c in codes):
            return 0
        ranks = [r for node in self.nodes for r in node.rank_exits()]
        ended = [(pid, code) for pid, code in ranks if not processes.pid_alive(pid)]
        for _, code in ended:
            if code not in (0, ExitCode.PREEMPTED):
                return 128 + signal.SIGKILL if code is None else code
        if ranks and len(ended) == self.spec.nproc * self.spec.nnodes:
            return next((code for _, code in ended if code), 0)
        return None

    def track(self) -> None:
        """Remember the attempt's processes (ranks, their children) while they are ours."""
        self.tree.scan([pid for node in self.nodes for pid in node.pids()])

    # -- acting on it ----------------------------------------------------------------------
    def promote(self, state: JobState) -> None:
        """Wake a parked standby: it restores the newest committed checkpoint and trains,
        from the job's ``state`` now (it was spawned knowing an older one)."""
        self.promoted_at = clocks.wall()
        for node in self.nodes:
            node.promote(state, Command.PROMOTE)

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
        for node in self.nodes:
            signalled += node.end(grace_s, first)
        signalled += self.tree.end()  # children of ranks: reparented, but tracked
        for node in self.nodes:
            node.close()
        self._ended = True
        return signalled

    def release(self, grace_s: float = 2.0) -> list[int]:
        """A standby that will not be promoted: its pipes close (it exits on its own), and
        whatever is left after ``grace_s`` is killed."""
        for node in self.nodes:
            if isinstance(node, LocalNode):
                node.control.close()
        deadline = time.monotonic() + grace_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self.end(0.0, preempt=False)


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
        return f"attempt {self.attempt}: {self._how()}"

    def reason(self) -> str:
        """Why a failed attempt ended, in one line: its task run's state message."""
        return f"attempt {self.attempt} failed: {self._how()}"

    def _how(self) -> str:
        where = f" at step {self.last_step}" if self.last_step is not None else " before step 1"
        return f"{self.outcome}{where} ({name_of(self.exit_code)})"


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

    def fresh(progress: Progress | None) -> bool:
        # A promoted standby's record says "parked" until it reports again: not news. (A
        # cold attempt's record is new: its time, maybe another host's clock, is not asked.)
        return progress is not None and (
            attempt.promoted_at is None or progress.t >= start or last is not None
        )

    last_change = time.monotonic()
    first_step_by = time.monotonic() + timeouts.startup_s
    next_scan = 0.0
    while (code := attempt.poll()) is None:
        now = time.monotonic()
        if now >= next_scan:
            attempt.track()
            next_scan = now + TRACK_EVERY_S
        progress = attempt.progress()
        if fresh(progress) and (
            last is None or (progress.phase, progress.step) != (last.phase, last.step)
        ):
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
    # The last steps may have landed since the last look; an attempt that ended before the
    # first look at all (a fast failure under load) is known only from this read.
    final = attempt.progress()
    if fresh(final) and (last is None or final.t >= last.t):
        last = final
    return code, False, last
