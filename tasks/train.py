"""Prefect tasks of a training job: prepare it, make sure its data exists, watch an attempt.

The attempt lifecycle itself (launch, watch, classify, retry, standby) is Prefect-free in
tasks/attempts.py and tasks/job.py; this module only gives its steps a place in the Prefect
UI: each attempt is a task run, Completed on success and Failed otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed, State

from infra import processes, storage
from infra.preflight import preflight
from infra.settings import JobConfig, dump_config, load_config
from tasks.attempts import AttemptProcess, AttemptReport, JobRunner
from tasks.logs import logger


class AttemptFailed(RuntimeError):
    """Raised by the attempt task so the Prefect UI shows the attempt failed; carries the report."""

    def __init__(self, report: AttemptReport) -> None:
        super().__init__(report.describe())
        self.report = report


@task(name="train-attempt", task_run_name="attempt-{attempt.number}", cache_policy=NO_CACHE)
def attempt_task(runner: JobRunner, attempt: AttemptProcess) -> AttemptReport | State:
    """Watch one attempt to its end: Completed on success, Failed (AttemptFailed) otherwise."""
    runner.log = logger()  # this task run's logs show the attempt's output
    for pump in attempt.pumps:
        pump.log = runner.log
    report = runner.watch_attempt(attempt)
    if report.failed:
        return Failed(message=report.describe(), data=AttemptFailed(report))
    return report


def watch_in_task(runner: JobRunner, attempt: AttemptProcess) -> AttemptReport:
    """``run_attempt`` for tasks/job.run_job: the attempt as a task run, its report back."""
    job_id = runner.job_url.rstrip("/").rsplit("/", 1)[-1]
    named = attempt_task.with_options(task_run_name=f"{job_id}-attempt-{attempt.number}")
    state = named(runner, attempt, return_state=True)
    if state.is_completed():
        return state.result()
    error = state.result(raise_on_failure=False)
    if isinstance(error, AttemptFailed):
        return error.report
    raise RuntimeError(f"attempt {attempt.number} could not be watched: {error}")


@task(name="prepare-job", cache_policy=NO_CACHE, timeout_seconds=300)
def prepare_job(
    config: str | None,
    overrides: dict[str, Any] | None = None,
    faults: list[dict[str, Any]] | None = None,
) -> tuple[JobConfig, str]:
    """Load and validate the job config (file + overrides + ETT_* env), add the injected
    faults, check what it names (infra/preflight.py: PreflightError, one line, before any
    attempt starts), and write the effective config for the trainer's ranks; returns
    (config, path)."""
    extra = dict(overrides or {})
    if faults is not None:
        extra["faults"] = list(faults)
    job = load_config(config, **extra)
    storage.configure(job.storage)
    preflight(job)
    folder = tempfile.mkdtemp(prefix=f"ett-{job.job_id}-")
    path = os.path.join(folder, "job.yaml")
    dump_config(job, path)
    return job, path


@task(name="ensure-data", cache_policy=NO_CACHE, timeout_seconds=3600)
def ensure_data(config_path: str, data_url: str) -> bool:
    """Generate the synthetic data set with ``ett generate`` unless ``data_url`` holds one;
    returns whether it generated. (Flows never import the trainer: the CLI is a subprocess.)"""
    if storage.exists(storage.join(data_url, "_meta.json")):
        return False
    log = logger()
    log.info("no data set at %s: generating it", data_url)
    cmd = [sys.executable, "-m", "flows.cli", "generate", "--config", config_path]
    env = {**os.environ, "PYTHONPATH": processes.repo_pythonpath(os.environ.get("PYTHONPATH"))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    for line in (proc.stdout + proc.stderr).splitlines():
        log.info("%s", line)
    complete = storage.exists(storage.join(data_url, "_meta.json"))  # written last
    if proc.returncode != 0 and not complete:
        raise RuntimeError(f"`ett generate` failed with exit code {proc.returncode}")
    if proc.returncode != 0:
        log.warning(
            "`ett generate` exited %d after writing a complete data set at %s",
            proc.returncode,
            data_url,
        )
    return True


class ProgressThrottle:
    """Calls ``update(pct)`` at most every ``every_s`` seconds (and always at 100%)."""

    def __init__(self, update: Callable[[float], Any], every_s: float = 2.0) -> None:
        self.update, self.every_s = update, every_s
        self._last = 0.0
        self._lock = threading.Lock()

    def __call__(self, step: int, total: int) -> None:
        pct = 100.0 * step / max(total, 1)
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.every_s and pct < 100.0:
                return
            self._last = now
        self.update(pct)
