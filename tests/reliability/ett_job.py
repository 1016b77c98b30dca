"""``ett train`` run as a user runs it (the installed script), watched from outside: its
output, the signals it gets, and what it leaves on the machine once it has exited.

Each job gets a temp folder of its own (``TMPDIR``), so whatever a process of the job puts
in the temp folder is found there, and nothing another test's processes make is; /dev/shm
is shared by the whole machine, so only its entries that name the job, or that are new since
the job started, are the job's. A job's processes are those whose command line names its
temp folder (its config file lives there: torchrun agents, their forked ranks, the side
evaluator), found the way an operator would (tests/procs.py); one attempt's by a marker in
their environment and the ``ETT_ATTEMPT`` the orchestrator gives each launch.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from infra import storage
from infra.settings import JobConfig, dump_config
from tests import procs
from tests.factories import ROOT
from tests.procs import MARKER

ETT = Path(sys.executable).with_name("ett")  # the console script of the installed package
SHM = Path("/dev/shm")
# Inductor's machine-wide cache folder: importing TorchRec makes it in the temp folder, and
# every torch program of this user shares it. Not the job's, so not its to remove.
SHARED = frozenset({f"torchinductor_{getpass.getuser()}"})
GONE_WITHIN_S = 30.0  # how long an exited job's processes and shm entries may take to go


class EttTrain:
    """``ett train --config FILE [flags]`` in a new session, its stdout and stderr in files."""

    def __init__(
        self, config: JobConfig, tmp_path: Path, *flags: str, env: dict[str, str] | None = None
    ) -> None:
        self.config = config
        self.job_id = config.job_id
        self.marker = uuid.uuid4().hex
        self.tmpdir = tmp_path / "tmp"  # the job's TMPDIR
        self.tmpdir.mkdir()
        path = tmp_path / f"{config.job_id}.yaml"
        dump_config(config, path)
        self.out, self.err = tmp_path / "ett.out", tmp_path / "ett.err"
        self.started = time.time()
        self.tmp_before = set(os.listdir(self.tmpdir))
        self.shm_before = set(os.listdir(SHM))
        full_env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "TMPDIR": str(self.tmpdir),
            MARKER: self.marker,
            **(env or {}),
        }
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [str(ETT), "train", "--config", str(path), *flags],
                env=full_env,
                stdout=out,
                stderr=err,
                cwd=str(tmp_path),
                start_new_session=True,  # a signal is sent to it alone, as a test decides
            )

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def output(self) -> str:
        return self.stdout() + self.stderr()

    def wait_for(self, text: str, count: int = 1, timeout: float = 120) -> None:
        """Until stdout or stderr holds ``text`` ``count`` times; AssertionError if ``ett``
        exits or ``timeout`` passes first (a generous bound for 2 shared cores)."""
        deadline = time.monotonic() + timeout
        while self.output().count(text) < count:
            assert self.proc.poll() is None, f"ett exited before {text!r}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout} s:\n{self.tail()}"
            time.sleep(0.05)

    def wait_until(self, what: str, check: Callable[[], bool], timeout: float = 240) -> None:
        """Until ``check()`` holds (e.g. a ledger line appeared); AssertionError if ``ett``
        exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while not check():
            assert self.proc.poll() is None, f"ett exited before {what}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {what} in {timeout} s:\n{self.tail()}"
            time.sleep(0.02)

    def ledger_says(self, name: str, mark: str) -> bool:
        """Whether ledger file ``name`` (``trainer-attempt001-rank000.jsonl``) holds a
        ``mark`` line: read as text, as ``tail -f`` would."""
        path = Path(storage.local_path(self.config.layout.url) or "", "ledger", name)
        try:
            return f'"name":"{mark}"' in path.read_text(errors="replace")
        except OSError:
            return False

    def attempt(self, number: int) -> list[int]:
        """Live processes of one attempt (its torchrun agent and ranks)."""
        return procs.carrying(**{MARKER: self.marker, "ETT_ATTEMPT": str(number)})

    def kill(self, number: int, ranks_only: bool = False, sig: int = signal.SIGKILL) -> list[int]:
        """Signal an attempt's processes from outside: all of them, or only its ranks (a
        forked rank keeps its agent's command line and environment: it is the child)."""
        pids = self.attempt(number)
        if ranks_only:
            pids = [p for p in pids if p not in procs.launchers(pids)]
        assert pids, f"attempt {number} has no process to signal:\n{self.tail()}"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def signal(self, sig: signal.Signals) -> None:
        """``sig`` to the ``ett`` process alone, as ``kill`` or a terminal's Ctrl-C would."""
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def tail(self, chars: int = 4000) -> str:
        return self.output()[-chars:]

    def processes(self) -> list[int]:
        """Live processes of the job (not ``ett`` itself once it has exited)."""
        return procs.mentioning(str(self.tmpdir))

    def new_shm(self) -> list[str]:
        """Entries of /dev/shm that name the job or appeared since it started."""
        found = []
        for name in set(os.listdir(SHM)) - self.shm_before:
            try:
                born = (SHM / name).stat().st_ctime
            except OSError:  # gone meanwhile
                continue
            if self.job_id in name or born >= self.started - 1:
                found.append(name)
        return sorted(found)

    def new_tmp(self) -> list[str]:
        return sorted(set(os.listdir(self.tmpdir)) - self.tmp_before - SHARED)

    def assert_left_nothing(self) -> None:
        """Once ``ett`` has exited: no process of the job, nothing new in its temp folder
        or in /dev/shm. Processes and shm entries get a moment to go (an exiting process
        is still listed); what is still there after it was left behind."""
        assert self.proc.poll() is not None, "ett is still running"
        deadline = time.monotonic() + GONE_WITHIN_S
        while self.processes() or self.new_shm():
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        left = {"processes": self.processes(), "tmp": self.new_tmp(), "/dev/shm": self.new_shm()}
        assert not any(left.values()), f"the job left {left}:\n{self.tail()}"

    def end(self) -> None:
        """After a test: nothing of the job keeps running, whatever the test found."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
