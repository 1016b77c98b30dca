"""``ett train`` run as a user runs it (the installed script), watched from outside: its
output, the signals it gets, and what it leaves on the machine once it has exited.

Each job gets a temp folder of its own (``TMPDIR``), so whatever a process of the job puts
in the temp folder is found there, and nothing another test's processes make is; /dev/shm
is shared by the whole machine, so only its entries that name the job, or that are new since
the job started, are the job's. A job's processes are those whose command line names its
temp folder (its config file lives there: torchrun agents, their forked ranks, the side
evaluator), found the way an operator would (tests/procs.py).
"""

from __future__ import annotations

import getpass
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from infra.settings import JobConfig, dump_config
from tests import procs
from tests.factories import ROOT

ETT = Path(sys.executable).with_name("ett")  # the console script of the installed package
SHM = Path("/dev/shm")
# Inductor's machine-wide cache folder: importing TorchRec makes it in the temp folder, and
# every torch program of this user shares it. Not the job's, so not its to remove.
SHARED = frozenset({f"torchinductor_{getpass.getuser()}"})
GONE_WITHIN_S = 30.0  # how long an exited job's processes and shm entries may take to go


class EttTrain:
    """``ett train --config FILE [flags]`` in a new session, its stdout and stderr in files."""

    def __init__(self, config: JobConfig, tmp_path: Path, *flags: str) -> None:
        self.job_id = config.job_id
        self.tmpdir = tmp_path / "tmp"  # the job's TMPDIR
        self.tmpdir.mkdir()
        path = tmp_path / f"{config.job_id}.yaml"
        dump_config(config, path)
        self.out, self.err = tmp_path / "ett.out", tmp_path / "ett.err"
        self.started = time.time()
        self.tmp_before = set(os.listdir(self.tmpdir))
        self.shm_before = set(os.listdir(SHM))
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "TMPDIR": str(self.tmpdir),
        }
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [str(ETT), "train", "--config", str(path), *flags],
                env=env,
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
