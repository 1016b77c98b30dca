"""Finding a job's processes from outside, as an operator with ``ps`` would: by what their
command lines and environments say (Linux /proc), never by asking the code under test. For
the tests and benchmarks that kill a job's processes or check that none is left."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from infra import processes

MARKER = "ETT_TEST_JOB_MARKER"  # in the environment of every process a test's job starts


def mentioning(*needles: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains every one of ``needles``."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        mine = all(needle.encode() in cmdline for needle in needles)
        if mine and processes.pid_alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def parent(pid: int) -> int:
    """The parent of ``pid``; 0 once ``pid`` is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def launchers(pids: list[int]) -> list[int]:
    """Those of ``pids`` whose parent is not among them. Forked ranks keep their torchrun
    agent's command line, so of a job's processes these are the agents."""
    return [p for p in pids if parent(p) not in pids]


def env_var(pid: int, name: str) -> str | None:
    """``name`` in the environment ``pid`` started with; None if unset or ``pid`` is gone."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{name}=".encode()
    return next((e[len(prefix) :].decode() for e in env if e.startswith(prefix)), None)


def carrying(**env: str) -> list[int]:
    """Live (non-zombie) processes whose start environment has every ``NAME=value`` of
    ``env``: a test marks the processes it starts (a variable their children inherit) and
    finds them, or an attempt of them (``ETT_ATTEMPT``), from outside."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        mine = all(env_var(pid, name) == value for name, value in env.items())
        if mine and processes.pid_alive(pid):
            found.append(pid)
    return found


def end_leftovers(timeout: float = 15.0, **env: str) -> list[int]:
    """Wait up to ``timeout`` for the processes carrying ``env`` to end; SIGKILL those left
    and return them (a test asserts the list empty: nothing of it outlives the run)."""
    deadline = time.monotonic() + timeout
    while carrying(**env) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = carrying(**env)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left
