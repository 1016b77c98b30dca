"""The side evaluator of a job (``train.eval: async``): started, watched and ended here.

``python -m trainer.checkpoint_evaluator`` evaluates the job's committed checkpoints at eval steps,
and the anchor, on the CPU beside training, so the loop never waits for evaluation. Its stdin is its
lifeline: closing it (or this process dying) stops it. No Prefect here.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from infra import processes
from tasks.local_node import Log, OutputPump


class SideEvaluator:
    """One evaluator process for a job; started once the job trains."""

    def __init__(self, config_path: str, log: Log) -> None:
        self.config_path, self.log = config_path, log
        self.proc: subprocess.Popen[str] | None = None
        self._pump: OutputPump | None = None

    def start(self) -> None:
        if self.proc is not None:
            return
        pythonpath = processes.repo_pythonpath(os.environ.get("PYTHONPATH"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.checkpoint_evaluator", "--config", self.config_path],
            env={**os.environ, "PYTHONPATH": pythonpath},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._pump = OutputPump(self.proc.stdout, self.log, "[evaluator] ")
        self.log.info("side evaluator started (pid %d)", self.proc.pid)

    def finish(self, timeout_s: float) -> int | None:
        """The job succeeded: let it evaluate the anchor (it exits by itself), then stop it.
        Returns its exit code, None if it had to be stopped."""
        if self.proc is None:
            return None
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        code = self.proc.poll()
        if code is None:
            self.log.warning("side evaluator still busy after %.0f s: stopping it", timeout_s)
        self.stop()
        return code

    def stop(self) -> None:
        """Close its lifeline; kill it if it does not leave within a few seconds."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        processes.terminate_tree(proc.pid, grace_s=2.0, reap=proc.poll)
        if self._pump is not None:
            self._pump.thread.join(timeout=2)
