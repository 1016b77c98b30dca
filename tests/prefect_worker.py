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
from collections.abc import Iterator
from pathlib import Path

from tests.factories import ROOT

PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "ett-local"
DEPLOYMENTS = ("train/train", "retrain/retrain", "publish/publish", "ett-report/ett-report")


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
    """`prefect work-pool create ett-local --type process`, without a CLI start-up."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    pool = WorkPoolCreate(
        name=POOL, type="process", base_job_template=ProcessWorker.get_default_base_job_template()
    )
    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
        client.create_work_pool(pool)


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
        out = prefect_cli("deploy", "--all")
        for name in DEPLOYMENTS:
            assert name in out, out
        yield log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
