"""Trainer attempts for the fault tests: under torchrun, as the orchestrator launches them,
with their output in a file a test can watch while they run.

torchrun starts each rank in a session of its own, so killing torchrun's process group
leaves the ranks running: ``Trainer.kill`` finds every process of the attempt by its config
file on the command line, and ``assert_gone`` checks that none is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra import processes, storage
from infra.job_layout import JobLayout, step_dir_name
from infra.settings import JobConfig, dump_config
from tests.factories import ROOT, tiny_config, trainer_command


def job_config(tmp_path: Path, data_url: str, steps: int, **sections: Any) -> JobConfig:
    """A tiny eager job on ``data_url``: checkpoints every 5 steps, async_staged."""
    checkpoint = {"mode": "async_staged", "every_steps": 5, "keep_latest_k": 3}
    return tiny_config(
        tmp_path,
        job_id=sections.pop("job_id", "faulty"),
        data={"url": data_url},
        train={"steps": steps, "eval_every": 0, "eval_rows": 256, "log_every": 5, "compile": False},
        checkpoint={**checkpoint, **sections.pop("checkpoint", {})},
        **sections,
    )


def step_folder(job_url: str, step: int) -> str:
    return storage.join(JobLayout.at(job_url).checkpoints, step_dir_name(step))


def s3_root() -> str:
    return f"s3://ett/{uuid.uuid4().hex[:12]}"


class Trainer:
    """One attempt: ``torchrun ... -m trainer --config FILE`` in a new session."""

    def __init__(
        self, config: JobConfig, tmp_path: Path, nproc: int = 1, env: dict[str, str] | None = None
    ) -> None:
        self.name = f"{config.job_id}-{uuid.uuid4().hex[:6]}"
        path = tmp_path / f"{self.name}.yaml"
        self.config_path = str(path)
        dump_config(config, path)
        self.log = tmp_path / f"{self.name}.log"
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                trainer_command(path, nproc=nproc),
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(tmp_path),
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, chars: int = 4000) -> str:
        return self.output()[-chars:]

    def wait(self, timeout: float = 300) -> int:
        """The trainer's own exit code: the launcher exits with the first failed rank's."""
        return self.proc.wait(timeout=timeout)

    def wait_until(self, what: str, check: Callable[[], bool], timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if self.proc.poll() is not None:
                raise AssertionError(f"the trainer exited before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s:\n{self.tail()}")
            time.sleep(0.05)

    def processes(self) -> list[int]:
        """Live processes of this attempt: torchrun and its ranks."""
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            pid = int(cmdline.parent.name)
            with contextlib.suppress(OSError):
                if self.config_path in cmdline.read_text() and processes.pid_alive(pid):
                    found.append(pid)
        return found

    def kill(self) -> None:
        """SIGKILL the whole attempt: torchrun and every rank."""
        for pid in [self.proc.pid, *self.processes()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def assert_gone(self) -> None:
        """No process of the attempt is left (callers end it first)."""
        deadline = time.monotonic() + 30
        while left := self.processes():
            assert time.monotonic() < deadline, f"processes of {self.name} outlived it: {left}"
            time.sleep(0.1)


def run_to_end(
    config: JobConfig, tmp_path: Path, nproc: int = 1, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run one attempt to its end: (the trainer's exit code, its output)."""
    trainer = Trainer(config, tmp_path, nproc, env)
    try:
        return trainer.wait(), trainer.output()
    finally:
        if trainer.proc.poll() is None:
            trainer.kill()
        trainer.assert_gone()
