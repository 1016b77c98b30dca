"""The control channel between the orchestrator and the ranks of one attempt on this node.

A folder on local disk (``ETT_CONTROL_DIR`` in the ranks' environment) holds:

- ``rank<L>.fifo``, one named pipe per local rank. The orchestrator opens each for reading
  AND writing and keeps it open for the attempt's life, so a rank's ``read`` blocks (no
  CPU) until a message arrives, and returns end-of-file only when the orchestrator is gone.
  Messages are JSON lines: ``{"cmd": "promote", ...}`` wakes a parked standby. End-of-file
  is the lifeline: a rank whose orchestrator died stops instead of training on unwatched.
- ``progress``, rewritten in place by global rank 0 (one ``pwrite`` per step): the attempt's
  state, its step, its in-process restarts so far and the clock. It is the single source of
  progress for the orchestrator's hang detection and progress display.
- ``rank<L>.pid`` and ``rank<L>.exit``: each rank's pid, written when it starts, and its exit
  code, written as it exits. The orchestrator sees a rank die at once (a rank with a pid and
  no exit code was killed) instead of waiting for torchrun's agent to notice and tear down.
- ``job.json``, the job's state as the attempt starts: its failures so far (every one, the
  ones recovered in process too) and when the job started, from which the attempt's
  checkpoint interval estimates the MTBF. Written before a launch and again right before a
  standby's promotion (a standby started earlier would know an older count): the one way
  both travel to the ranks.

Both sides import this module, so the file names, the formats and the environment variables
(``ENV_*``) live in one place.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

log = logging.getLogger(__name__)

ENV_DIR = "ETT_CONTROL_DIR"
ENV_STANDBY = "ETT_STANDBY"  # "1": initialise, then park until promoted
ENV_ATTEMPT = "ETT_ATTEMPT"  # the attempt number the orchestrator gave this launch
PROGRESS_FILE = "progress"
JOB_STATE_FILE = "job.json"
_PROGRESS_WIDTH = 160  # fixed-size record: a reader never sees a half-shortened line


class Phase(StrEnum):
    """Where an attempt is, as its rank 0 reports it."""

    INIT = "init"
    PARKED = "parked"  # a warm standby, initialised and waiting to be promoted
    TRAINING = "training"
    DONE = "done"


class Command(StrEnum):
    PROMOTE = "promote"


@dataclass(frozen=True)
class JobState:
    """What an attempt must know of the job it continues (``job.json``)."""

    failures: int = 0  # every failure of the job before this attempt, in-process ones too
    started_at: float | None = None  # Unix time the job's first attempt started

    def to_json(self) -> str:
        return json.dumps({"failures": self.failures, "started_at": self.started_at})

    @classmethod
    def from_json(cls, text: str) -> JobState:
        data = json.loads(text)
        started = data.get("started_at")
        return cls(int(data.get("failures", 0)), None if started is None else float(started))


@dataclass(frozen=True)
class Progress:
    phase: Phase
    step: int
    total: int
    t: float  # Unix time of the report
    started: float  # Unix time the trainer process started (its attempt_start)
    restarts: int = 0  # in-process restarts of this attempt so far: failures it survived


def _fifo_name(local_rank: int) -> str:
    return f"rank{local_rank}.fifo"


def _pid_name(local_rank: int) -> str:
    return f"rank{local_rank}.pid"


def _exit_name(local_rank: int) -> str:
    return f"rank{local_rank}.exit"


def encode_progress(
    phase: Phase, step: int, total: int, t: float, started: float, restarts: int = 0
) -> bytes:
    line = (
        f'{{"phase":"{phase}","step":{step},"total":{total},"t":{t!r},"started":{started!r},'
        f'"restarts":{restarts}}}'
    )
    return line.ljust(_PROGRESS_WIDTH).encode()


def decode_progress(raw: bytes) -> Progress | None:
    try:
        rec = json.loads(raw.decode().strip() or "null")
        if rec is None:
            return None
        return Progress(
            Phase(rec["phase"]),
            rec["step"],
            rec["total"],
            rec["t"],
            rec["started"],
            int(rec.get("restarts", 0)),
        )
    except (ValueError, KeyError, TypeError):
        return None


def scratch_dir() -> str | None:
    """Where a rank keeps temp folders that must not outlive its attempt (checkpoint spool,
    compiler cache, restore downloads): inside the attempt's control folder, which the
    orchestrator removes when it ends the attempt, even after a SIGKILL of the rank. None
    (the temp folder) when no orchestrator launched this process, or it removed the folder
    already."""
    path = os.environ.get(ENV_DIR)
    return path if path and os.path.isdir(path) else None


class ControlDir:
    """The orchestrator's end: create the pipes, keep them open, send commands, read progress."""

    def __init__(self, nproc: int, prefix: str = "ett-control-", parent: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix=prefix, dir=parent)  # parent: a node's scratch
        self._fds: list[int] = []
        for local_rank in range(nproc):
            fifo = os.path.join(self.path, _fifo_name(local_rank))
            os.mkfifo(fifo, 0o600)
            # O_RDWR never blocks on a FIFO and keeps a writer present while we live.
            self._fds.append(os.open(fifo, os.O_RDWR))

    def env(self, standby: bool) -> dict[str, str]:
        return {ENV_DIR: self.path, ENV_STANDBY: "1" if standby else "0"}

    def write_job_state(self, state: JobState) -> None:
        """``job.json``, replaced whole (a rank never reads half of it)."""
        tmp = os.path.join(self.path, f".{JOB_STATE_FILE}.{os.getpid()}")
        with open(tmp, "w") as fh:
            fh.write(state.to_json())
        os.replace(tmp, os.path.join(self.path, JOB_STATE_FILE))

    def send(self, cmd: Command, **payload: Any) -> None:
        """One JSON line to every local rank (at most PIPE_BUF bytes: written atomically)."""
        line = (json.dumps({"cmd": str(cmd), **payload}) + "\n").encode()
        for fd in self._fds:
            os.write(fd, line)

    def ranks(self) -> dict[int, tuple[int, int | None]]:
        """local rank -> (pid, exit code or None) of every rank that has started."""
        out = {}
        for local_rank in range(len(self._fds)):
            try:
                with open(os.path.join(self.path, _pid_name(local_rank))) as fh:
                    pid = int(fh.read())
            except (OSError, ValueError):
                continue
            try:
                with open(os.path.join(self.path, _exit_name(local_rank))) as fh:
                    code: int | None = int(fh.read())
            except (OSError, ValueError):
                code = None
            out[local_rank] = (pid, code)
        return out

    def progress(self) -> Progress | None:
        try:
            with open(os.path.join(self.path, PROGRESS_FILE), "rb") as fh:
                return decode_progress(fh.read(_PROGRESS_WIDTH))
        except OSError:
            return None

    def close(self) -> None:
        """Close the pipes (the ranks see end-of-file) and remove the folder."""
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                continue
        self._fds = []
        shutil.rmtree(self.path, ignore_errors=True)


class RankControl:
    """A rank's end: one daemon thread blocks on the rank's pipe and queues its messages;
    end-of-file calls ``on_lost`` (the orchestrator is gone)."""

    def __init__(self, path: str, local_rank: int, standby: bool) -> None:
        self.path, self.standby = path, standby
        self.started = time.time()
        self._messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._on_lost: Callable[[], None] = lambda: None
        self._progress_fd: int | None = None
        fifo = os.path.join(path, _fifo_name(local_rank))
        if not stat.S_ISFIFO(os.stat(fifo).st_mode):
            raise ValueError(f"{fifo} is not a named pipe")
        self._fifo, self.local_rank = fifo, local_rank
        self._write(_pid_name(local_rank), str(os.getpid()))

    def _write(self, name: str, text: str) -> None:
        """Write a small file atomically (rename), so a reader never sees half of it."""
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}")
        with contextlib.suppress(OSError), open(tmp, "w") as fh:
            fh.write(text)
        with contextlib.suppress(OSError):
            os.replace(tmp, os.path.join(self.path, name))

    def record_exit(self, code: int) -> None:
        """The rank is about to exit with ``code``."""
        self._write(_exit_name(self.local_rank), str(int(code)))

    @classmethod
    def from_env(cls, local_rank: int) -> RankControl | None:
        """The channel of this rank, or None when no orchestrator launched it."""
        path = os.environ.get(ENV_DIR)
        if not path:
            return None
        return cls(path, local_rank, os.environ.get(ENV_STANDBY) == "1")

    def start(self, on_lost: Callable[[], None]) -> RankControl:
        self._on_lost = on_lost
        threading.Thread(target=self._read, name="ett-control", daemon=True).start()
        return self

    def _read(self) -> None:
        try:
            with open(self._fifo, "rb", buffering=0) as fh:
                pending = b""
                while chunk := fh.read(4096):
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        try:
                            self._messages.put(json.loads(line))
                        except ValueError:
                            log.warning("ignoring a malformed control message: %r", line[:200])
        except OSError as exc:
            log.warning("control pipe %s failed: %s", self._fifo, exc)
        self._messages.put(None)
        self._on_lost()

    def wait(self, cmd: Command) -> dict[str, Any] | None:
        """Block until ``cmd`` arrives; None if the orchestrator went away first."""
        while True:
            msg = self._messages.get()
            if msg is None:
                self._messages.put(None)  # keep the end visible to later waits
                return None
            if msg.get("cmd") == cmd:
                return msg
            log.warning("ignoring unexpected control message %s", msg)

    def job_state(self) -> JobState:
        """The job's state the orchestrator wrote for this attempt (read after a promotion,
        it is the one written right before it); the defaults when it wrote none."""
        try:
            with open(os.path.join(self.path, JOB_STATE_FILE)) as fh:
                return JobState.from_json(fh.read())
        except (OSError, ValueError):
            return JobState()

    def report(self, phase: Phase, step: int = 0, total: int = 0, restarts: int = 0) -> None:
        """Rank 0 rewrites the progress record in place (one syscall). ``restarts``: the
        attempt's in-process restarts so far, failures the orchestrator would not see."""
        if self._progress_fd is None:
            flags = os.O_WRONLY | os.O_CREAT
            self._progress_fd = os.open(os.path.join(self.path, PROGRESS_FILE), flags, 0o600)
        with contextlib.suppress(OSError):  # the folder is gone: the orchestrator is leaving
            record = encode_progress(phase, step, total, time.time(), self.started, restarts)
            os.pwrite(self._progress_fd, record, 0)
