"""The deployments of prefect.yaml and a real process worker, for tests against a real
Prefect server (``prefect_server`` in tests/servers.py points PREFECT_API_URL at it).

    with deployed_worker(log_path, {"ETT_TRAIN__STEPS": "40"}):   # the worker's environment
        run_deployment("train/train", ...)

The worker runs in its own process group and is stopped (SIGTERM, then SIGKILL) on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.factories import ROOT

PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "ett-local"
NODE_POOL = "ett-nodes"  # prefect.yaml's pool of train-node runs (docs/multi-host.md)
DEPLOYMENTS = (
    "train/train",
    "train-node/train-node",
    "retrain/retrain",
    "publish/publish",
    "ett-report/ett-report",
)


def prefect_cli(*args: str, timeout: float = 300) -> str:
    """``prefect --no-prompt ARGS`` from the repository root; its stdout."""
    proc = subprocess.run(
        [PREFECT, "--no-prompt", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, f"prefect {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def create_pool() -> None:
    """`prefect work-pool create ett-local --type process` (and ett-nodes), without a CLI
    start-up."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    with get_client(sync_client=True) as client:
        for name in (POOL, NODE_POOL):
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_work_pool(
                    WorkPoolCreate(name=name, type="process", base_job_template=template)
                )


@contextlib.contextmanager
def deployed_worker(log: Path, env: dict[str, str] | None = None) -> Iterator[Path]:
    """`prefect deploy --all` and `prefect worker start --pool ett-local` with ``env`` added
    to this process's environment; yields the worker's log file."""
    create_pool()
    full_env = {
        **os.environ,
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **(env or {}),
    }
    with open(log, "wb") as fh:  # the worker boots while the flows are deployed
        proc = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", POOL],
            cwd=ROOT,
            env=full_env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deploy()
        yield log
    finally:
        end_workers([proc])


def deploy() -> None:
    """`prefect deploy --all` from prefect.yaml, its pools created first."""
    create_pool()
    out = prefect_cli("deploy", "--all")
    for name in DEPLOYMENTS:
        assert name in out, out


@contextlib.contextmanager
def node_workers(
    hosts: list,
    env: dict[str, str],
    log_dir: Path,
    host_env: dict[int, dict[str, str]] | None = None,
) -> Iterator[list]:
    """One `prefect worker start --pool ett-nodes --limit 1` per host (tests/node_hosts.py
    Host: the address it advertises, its scratch folder), as on a cluster of machines; each
    in its own process group, ended (SIGTERM, then SIGKILL) on exit. ``env`` goes to every
    host, ``host_env[n]`` to host n alone. Yields the workers."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for n, host in enumerate(hosts):
            worker_env = {
                **os.environ,
                "PREFECT_WORKER_QUERY_SECONDS": "1",
                "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                **env,
                **(host_env or {}).get(n, {}),
                "ETT_ADVERTISE_ADDRESS": host.address,
                "ETT_SCRATCH_DIR": str(host.scratch),
            }
            with open(log_dir / f"worker-{n}.log", "wb") as fh:
                cmd = [PREFECT, "worker", "start", "--pool", NODE_POOL, "--limit", "1"]
                cmd += ["--name", f"host-{n}"]
                procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=ROOT,
                        env=worker_env,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        yield procs
    finally:
        end_workers(procs)


def end_workers(procs: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM each worker's process group, then SIGKILL what is left after ``grace_s``.
    A Prefect 3.9 worker asked to stop did not exit within 30 s here, even running nothing;
    the tests have checked by then that the flow runs it started are over."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
