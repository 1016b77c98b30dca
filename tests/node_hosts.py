"""Node runs without Prefect, for fast tests of a job across "hosts" (tasks/remote_node.py).

``SubprocessNodeRuns`` places each node run as a subprocess (``python -m tests.node_hosts``,
which runs tasks/node_runner.py exactly as the ``train-node`` flow does) on one of a few
"hosts": a loopback address it advertises (127.0.0.2, 127.0.0.3, ...) and a scratch folder
of its own. Like a process worker started with ``--limit 1``, a host runs one node run at a
time; a node run submitted while every host is busy waits for one to free. The real thing,
through a Prefect server and its workers, is tests/reliability/test_multi_host.py.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from infra import processes
from infra.node_protocol import ENV_ADVERTISE, ENV_SCRATCH
from tests import procs

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Host:
    address: str  # what it advertises: 127.0.0.N
    scratch: Path


def hosts(count: int, under: Path | None = None) -> list[Host]:
    """``count`` hosts on loopback, 127.0.0.2 up, each with a scratch folder: ``under``
    /host{n}, or by default a short folder in the temp folder, removed when this process
    exits. A node run binds its agent pool's socket in its scratch folder, and a test's own
    folder under pytest-xdist (``.../popen-gw1/test_a_node_run_killed_mid_job0``) pushed
    that path past the 107 bytes a Unix socket may have: the pool was unusable and each node
    started a fresh launcher instead, which is not what the multi-host tests mean to run."""
    out = []
    for n in range(count):
        if under is None:
            scratch = Path(tempfile.mkdtemp(prefix=f"ett-h{n}-"))
            atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        else:
            scratch = under / f"host{n}"
            scratch.mkdir(parents=True, exist_ok=True)
        out.append(Host(f"127.0.0.{n + 2}", scratch))
    return out


class SubprocessNodeRuns:
    """``NodeRuns`` whose runs are subprocesses on ``hosts``, one at a time per host.

    ``seams`` go to the NodeRunner (``launcher``, ``env``: a fake trainer); ``env`` is every
    host's environment beside its address and scratch."""

    def __init__(
        self, layout_url: str, hosts: list[Host], env: dict[str, str], seams: dict | None = None
    ) -> None:
        self.url, self.hosts, self.env = layout_url, hosts, env
        self.seams = seams or {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.submitted: dict[str, float] = {}  # key -> Unix time of its submission
        self.placed: dict[str, Host] = {}
        self.pending: list[str] = []
        self.cancelled: set[str] = set()
        self.down: set[Host] = set()  # hosts gone: nothing is placed on them
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._placer = threading.Thread(target=self._place_pending, daemon=True)
        self._placer.start()

    def submit(self, key: str) -> str:
        self.submitted[key] = time.time()
        with self._lock:
            self.pending.append(key)
            self._place()
        return key

    def _free_host(self) -> Host | None:
        busy = {self.placed[k] for k, p in self.procs.items() if p.poll() is None}
        return next((h for h in self.hosts if h not in busy | self.down), None)

    def _place(self) -> None:
        while self.pending and (host := self._free_host()) is not None:
            key = self.pending.pop(0)
            env = {
                **os.environ,
                **self.env,
                ENV_ADVERTISE: host.address,
                ENV_SCRATCH: str(host.scratch),
                "PYTHONPATH": processes.repo_pythonpath(os.environ.get("PYTHONPATH")),
            }
            cmd = [sys.executable, "-m", "tests.node_hosts", self.url, key, json.dumps(self.seams)]
            log = open(host.scratch / f"{key}.log", "wb")  # noqa: SIM115 - the child's
            self.procs[key] = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
            self.placed[key] = host

    def _place_pending(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                self._place()

    def gone(self, run_id: str) -> str | None:
        proc = self.procs.get(run_id)
        if proc is None or proc.poll() is None:
            return None
        if run_id in self.cancelled:
            return "CANCELLED"
        return "COMPLETED" if proc.returncode == 0 else "CRASHED"

    def cancel(self, run_id: str) -> None:
        with self._lock:
            self.cancelled.add(run_id)
            if run_id in self.pending:
                self.pending.remove(run_id)
            proc = self.procs.get(run_id)
        if proc is not None and proc.poll() is None:
            processes.terminate_tree(proc.pid, 10.0, signal.SIGTERM, reap=proc.poll)

    def kill(self, run_id: str) -> None:
        """SIGKILL a node run from outside, as a host lost would."""
        os.kill(self.procs[run_id].pid, signal.SIGKILL)

    def lose_host(self, run_id: str) -> Host:
        """The host of ``run_id`` gone: every process on it SIGKILLed from outside (the node
        run, its agents, its ranks: all carry the host's scratch folder), and nothing placed
        there until ``return_host``. Returns the host."""
        host = self.placed[run_id]
        with self._lock:
            self.down.add(host)
        self.kill(run_id)
        for pid in procs.carrying(**{ENV_SCRATCH: str(host.scratch)}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return host

    def return_host(self, host: Host) -> None:
        """``host`` is back: a node run waiting for a host may be placed on it."""
        with self._lock:
            self.down.discard(host)
            self._place()

    def log(self, run_id: str) -> str:
        return (self.placed[run_id].scratch / f"{run_id}.log").read_text(errors="replace")

    def close(self) -> None:
        """End every node run still running (the orchestrator released them already)."""
        self._stop.set()
        self._placer.join(timeout=5)
        for proc in self.procs.values():
            if proc.poll() is None:
                processes.terminate_tree(proc.pid, 5.0, signal.SIGTERM, reap=proc.poll)


def _main() -> int:
    from infra import storage
    from infra.job_layout import JobLayout
    from tasks.node_runner import NodeRunner

    url, key, seams = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    storage.configure(None)
    if "launcher" in seams:
        seams["launcher"] = tuple(seams["launcher"])
    runner = NodeRunner(JobLayout.at(url), key, logging.getLogger(f"node {key}"), **seams)
    signal.signal(signal.SIGTERM, lambda *_: runner.stop())
    return runner.run()


if __name__ == "__main__":
    sys.exit(_main())
