"""The ``train`` flow's steps in the Prefect UI: the plan, each attempt a task run, and what
the flow shows while the job runs and when it ends.

The job itself (attempts, standby, retries) is tasks/orchestrator.py's, Prefect-free; this
module gives its steps a place in the UI: ``plan`` (Failed with the one line naming a bad
field), one ``<job>-attempt-<n>`` task run per attempt (Completed on success, Failed with how
it ended otherwise), and a ``FlowObserver`` that turns the job's progress, attempts and end
into the flow run's artifacts and its MLflow run.
"""

from __future__ import annotations

import contextvars
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed, State

from infra import processes, storage
from infra.control import Phase, Progress
from infra.log_lines import LineLevels
from infra.naming import attempt_run_name
from infra.settings import JobConfig
from tasks.artifacts import show_job
from tasks.attempt import AttemptProcess, AttemptReport
from tasks.logs import logger
from tasks.orchestrator import JobObserver, JobResult, Orchestrator, plan_job
from tasks.report import log_attempt, report_job, stable_key, start_tracking


class AttemptFailed(RuntimeError):
    """Raised by the attempt task so the Prefect UI shows the attempt failed; carries the report."""

    def __init__(self, report: AttemptReport) -> None:
        super().__init__(report.reason())
        self.report = report


@task(name="plan-job", cache_policy=NO_CACHE, timeout_seconds=300)
def plan(
    config: str | None,
    overrides: dict[str, Any] | None = None,
    resume: bool = False,
    name: str = "train",
    when: float | None = None,
    salt: str | None = None,
) -> JobConfig:
    """The job's resolved config with its job id, checked before any attempt
    (tasks/orchestrator.plan_job; ``name``, ``when``, ``salt``: how a new job is named)."""
    return plan_job(config, overrides, name, resume, when, salt)


@task(name="train-attempt", cache_policy=NO_CACHE)
def watch_attempt(job: Orchestrator, attempt: AttemptProcess) -> AttemptReport | State:
    """Watch one attempt to its end: Completed on success, Failed (AttemptFailed) otherwise."""
    job.log = logger()  # this task run's logs show the attempt's output
    for pump in attempt.pumps:
        pump.log = job.log
    report = job.watch(attempt)
    if report.failed:
        return Failed(message=report.reason(), data=AttemptFailed(report))
    return report


def watch(job: Orchestrator, attempt: AttemptProcess) -> None:
    """The attempt as the task run ``<job>-attempt-<n>``; its report is the job's."""
    assert job.config.job_id is not None  # resolved by plan
    named = watch_attempt.with_options(
        task_run_name=attempt_run_name(job.config.job_id, attempt.number)
    )
    state = named(job, attempt, return_state=True)
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        if not isinstance(error, AttemptFailed):
            raise RuntimeError(f"attempt {attempt.number} could not be watched: {error}")


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


class FlowObserver(JobObserver):
    """The flow run's view of its job: a progress artifact, each attempt logged to MLflow in
    the background, and at the end the ETT report (artifacts, MLflow) from its summary."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self._tracking = start_tracking.submit(config)  # MLflow's run, beside attempt 0
        self._progress_id = create_progress_artifact(
            progress=0.0,
            key=stable_key("train-progress"),
            description=f"Steps done of job {config.job_id} ({config.train.steps} steps)",
        )
        context = contextvars.copy_context()  # progress arrives on the watch thread
        self._throttle = ProgressThrottle(
            lambda pct: context.run(
                update_progress_artifact, artifact_id=self._progress_id, progress=pct
            )
        )
        self.report: dict[str, Any] | None = None  # the headline numbers, once the job ended

    @property
    def run_id(self) -> str | None:
        """The job's MLflow run (None while MLflow is down)."""
        return self._tracking.result()

    def progress(self, progress: Progress) -> None:
        if progress.phase == Phase.TRAINING:
            self._throttle(progress.step, progress.total)

    def attempt_ended(self, report: AttemptReport) -> None:
        log_attempt(self.run_id, self.config.tracking.mlflow_uri, report)

    def job_ended(self, result: JobResult) -> None:
        outcome, summary = result.outcome, result.summary
        if outcome.succeeded:
            update_progress_artifact(artifact_id=self._progress_id, progress=100.0)
        if summary is None:
            return
        self.report = report_job(self.config, summary, self.run_id, None, outcome.succeeded)
        show_job(summary, self.run_id, self.config.tracking.mlflow_uri)


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
    levels = LineLevels()  # each line at its own level, without the child's timestamp
    for line in (proc.stdout + proc.stderr).splitlines():
        level, text = levels(line)
        log.log(level, "%s", text)
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
