"""Launch one trainer attempt under torchrun as a subprocess and stream its output.

Kept free of Prefect so the CLI can run a job without an orchestrator; the Prefect task in
tasks/train.py wraps it. The trainer never learns who launched it: it reads its config file,
ETT_ATTEMPT and the environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


def torchrun_command(config_path: str, nproc: int = 1, nnodes: int = 1) -> list[str]:
    """The command line of one attempt. ``--standalone`` picks a free rendezvous port, so
    jobs on one machine never collide; multi-node jobs pass their own rendezvous flags."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    rendezvous = ["--standalone"] if nnodes == 1 else [f"--nnodes={nnodes}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        f"--nproc_per_node={nproc}",
        "--max_restarts=0",  # restarts are the orchestrator's job: it accounts for them
        "-m",
        "trainer",
        "--config",
        config_path,
    ]


@dataclass
class AttemptResult:
    exit_code: int
    started: float
    ended: float
    hung: bool = False


def run_attempt(
    command: list[str],
    env: dict[str, str] | None = None,
    on_line: Callable[[str], None] = lambda line: print(line, end="", flush=True),
    progress_timeout_s: float | None = None,
    is_progress: Callable[[str], bool] = lambda line: " step " in line,
) -> AttemptResult:
    """Run ``command`` to completion, passing each output line to ``on_line``.

    With ``progress_timeout_s``, an attempt that prints no progress line for that long is
    treated as hung: its process group is killed and ``hung`` is set.
    """
    started = time.time()
    proc = subprocess.Popen(
        command,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: we can kill torchrun and workers
    )
    last_progress = [time.monotonic()]

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if is_progress(line):
                last_progress[0] = time.monotonic()
            on_line(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    hung = False
    while proc.poll() is None:
        if progress_timeout_s and time.monotonic() - last_progress[0] > progress_timeout_s:
            hung = True
            kill_group(proc)
            break
        time.sleep(0.2)
    proc.wait()
    reader.join(timeout=5)
    return AttemptResult(exit_code=proc.returncode, started=started, ended=time.time(), hung=hung)


def kill_group(proc: subprocess.Popen[str], grace_s: float = 5.0) -> None:
    """SIGTERM the attempt's process group, SIGKILL it if still alive after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
