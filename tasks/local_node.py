"""One node of an attempt on this host: its torchrun agent, its control folder, its output.

The orchestrator holds one per node when a job's nodes are its own subprocesses, and a node
run (tasks/node_runner.py) holds one for the node it was given on its host: the same code
starts, watches and ends an agent wherever it runs. ``tasks/attempt.py`` combines the nodes
of an attempt into one outcome.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
from typing import Any

from infra import processes
from infra.control import ControlDir, JobState, Progress
from infra.log_lines import LineLevels
from tasks.agent_pool import PooledLauncher, claim

Log = logging.Logger | logging.LoggerAdapter[logging.Logger]


class OutputPump:
    """Reads an agent's output on a thread and logs it, each line at the level it was written
    at (infra/log_lines.py); the sink can be switched (a standby's lines belong to the run that
    promotes it)."""

    def __init__(self, stream: Any, log: Log, prefix: str) -> None:
        self.log, self.prefix = log, prefix
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream: Any) -> None:
        levels = LineLevels()  # each line at its own level, without the child's timestamp
        for line in stream:
            text = line.rstrip()
            if text:
                level, message = levels(text)
                self.log.log(level, "%s%s", self.prefix, message)


class LocalNode:
    """A torchrun agent on this host and the control folder its ranks talk through."""

    def __init__(self, control: ControlDir, proc: subprocess.Popen[str] | PooledLauncher) -> None:
        self.control, self.proc = control, proc
        self.pump: OutputPump | None = None

    @classmethod
    def start(
        cls,
        command: list[str],
        env: dict[str, str],
        control: ControlDir,
        state: JobState,
        standby: bool,
        log: Log,
        prefix: str = "",
        agent_pool: str | None = None,
    ) -> LocalNode:
        """Write the job's ``state`` for the ranks, then start the agent: claimed from the
        agent pool when it can serve (``agent_pool``), else a fresh interpreter."""
        control.write_job_state(state)
        full_env = {**env, **control.env(standby)}
        proc: subprocess.Popen[str] | PooledLauncher | None = None
        if agent_pool:
            proc = claim(agent_pool, command, full_env, log)
        if proc is None:
            proc = subprocess.Popen(
                command,
                env=full_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # its own group: a Ctrl-C of ours is not its signal
            )
        node = cls(control, proc)
        node.pump = OutputPump(proc.stdout, log, prefix)
        return node

    @property
    def pooled(self) -> bool:
        return isinstance(self.proc, PooledLauncher)

    def agent_code(self) -> int | None:
        return self.proc.poll()

    def rank_exits(self) -> list[tuple[int, int | None]]:
        """(pid, exit code or None) of each rank that has started on this node."""
        return list(self.control.ranks().values())

    def progress(self) -> Progress | None:
        return self.control.progress()

    def pids(self) -> list[int]:
        """The processes to follow: the agent (its tree holds the ranks)."""
        return [self.proc.pid]

    def promote(self, state: JobState, command: Any) -> None:
        self.control.write_job_state(state)
        self.control.send(command)

    def end(self, grace_s: float, first: int) -> list[int]:
        """Signal the agent's tree (``first``, SIGKILL after ``grace_s``), then any rank
        whose agent died first; returns the pids signalled."""
        signalled = processes.terminate_tree(self.proc.pid, grace_s, first, reap=self.proc.poll)
        for pid, _ in self.control.ranks().values():
            if processes.pid_alive(pid):
                signalled += processes.terminate_tree(pid, 0.0, signal.SIGKILL)
        return signalled

    def close(self) -> None:
        """Close the control channel (a parked standby exits), reap the agent, join output."""
        self.control.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self.pump is not None:
            self.pump.thread.join(timeout=2)
