"""The ``train`` flow: a training job as a sequence of attempts that survives failures.

    config -> [attempt 0] -crash-> backoff -> [attempt 1] -preempted-> [attempt 2] -ok->
    anchor event (publishing starts on its own) -> ETT report -> done

Each attempt is a task (tasks/train.py) that runs the trainer under torchrun, streams its log
here and writes the orchestrator's ledger spans. The trainer resumes from the newest committed
checkpoint by itself. Preemptions (exit 83) relaunch at once and are not counted against
``max_failures``; crashes, lost workers (SIGKILL) and hangs back off exponentially from
``backoff_s``. A bad config (exit 2) or an incompatible checkpoint (exit 84) is not retried.

When the last attempt succeeds, the flow emits ``ett.checkpoint.anchor.committed`` for the
anchor checkpoint and finishes without waiting for publishing. The ETT report is logged to
MLflow and as a markdown artifact whether the job succeeded or not.
"""

from __future__ import annotations

import contextvars
import os
import shutil
import time
from typing import Any

from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.runtime import flow_run

from flows.run_names import train_run_name
from infra import storage
from tasks.artifacts import show_job
from tasks.events import emit_anchor_committed, find_anchor
from tasks.launch import torchrun_command
from tasks.report import artifact_key, log_attempt, report_job, start_tracking
from tasks.train import (
    AttemptFailed,
    AttemptReport,
    ProgressThrottle,
    RetryPolicy,
    attempt_task,
    logger,
    next_attempt,
    prepare_job,
    run_attempts,
)


class TrainingFailed(RuntimeError):
    """The job gave up (max_failures exceeded, or a failure that a relaunch cannot fix)."""


def _expected_start(fallback: float) -> float:
    """When the flow run was expected to start (its schedule), as Unix seconds."""
    try:
        return flow_run.get_scheduled_start_time().timestamp()
    except Exception:  # noqa: BLE001 - outside a flow run
        return fallback


@flow(name="train", flow_run_name=train_run_name, log_prints=True)
def train_flow(
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    nproc: int = 1,
    max_failures: int = 3,
    backoff_s: float = 10.0,
    hang_timeout_s: float = 600.0,
    faults: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train one job to completion, relaunching failed attempts.

    Args:
        config: job config file (YAML/TOML); the embedded defaults when None.
        overrides: nested sections merged over the file, e.g. {"train": {"steps": 50}}
            (ETT_* environment variables still win, as everywhere).
        nproc: trainer processes (ranks) per attempt, on this machine.
        max_failures: failures (crash, lost worker, hang) survived; one more fails the job.
        backoff_s: wait before relaunching after the first failure; doubles per failure
            (capped at 300 s). Preemptions relaunch at once.
        hang_timeout_s: an attempt with no progress line for this long is killed as hung.
            Before its first step any output line counts as progress, but the silent
            start (interpreter, torch import, torchrun) counts against it too: keep it well
            above that (15-60 s on a 2-core machine, more with compilation).
        faults: injected failures for tests and demos, e.g.
            [{"kind": "sigkill", "step": 300, "attempt": 0}] (see infra.settings.FaultConfig).
    Returns: job id and URL, attempts, anchor, MLflow run id and the ETT headline numbers.
    """
    flow_started = time.time()
    scheduling = (min(_expected_start(flow_started), flow_started), flow_started)
    log = logger()
    job, config_path = prepare_job(config, overrides, faults)
    storage.configure(job.storage)  # this process reads the job's ledger too
    run_id = start_tracking(job)
    first = next_attempt(job.job_url)
    if first:
        log.info("job %s has %d earlier attempt(s): continuing its numbering", job.job_id, first)
    progress_id = create_progress_artifact(
        progress=0.0,
        key=artifact_key("train-progress", job.job_id),
        description=f"Steps done of job {job.job_id} ({job.train.steps} steps)",
    )
    context = contextvars.copy_context()  # the log pump thread reports with this run's client
    on_step = ProgressThrottle(
        lambda pct: context.run(update_progress_artifact, artifact_id=progress_id, progress=pct)
    )
    command = torchrun_command(config_path, nproc=nproc)

    def launch(attempt: int) -> AttemptReport:
        state = attempt_task.with_options(task_run_name=f"{job.job_id}-attempt-{attempt}")(
            job.job_url,
            command,
            attempt,
            hang_timeout_s,
            None,
            on_step,
            scheduling if attempt == first else None,
            return_state=True,
        )
        if state.is_completed():
            return state.result()
        error = state.result(raise_on_failure=False)
        if isinstance(error, AttemptFailed):
            return error.report
        raise RuntimeError(f"attempt {attempt} could not be run: {error}")

    policy = RetryPolicy(max_failures=max_failures, backoff_s=backoff_s)
    try:
        outcome = run_attempts(
            launch,
            first,
            policy,
            on_attempt=lambda r: log_attempt(run_id, job.tracking.mlflow_uri, r),
        )
    finally:
        shutil.rmtree(os.path.dirname(config_path), ignore_errors=True)  # the ranks' copy
    anchor = find_anchor(job.job_url) if outcome.succeeded else None
    event_id = None
    if anchor is not None:
        update_progress_artifact(artifact_id=progress_id, progress=100.0)
        event_id = emit_anchor_committed(anchor, job.job_id, run_id)
    elif outcome.succeeded:
        log.warning(
            "job %s succeeded without an anchor checkpoint (checkpoint.mode off?): "
            "nothing to publish",
            job.job_id,
        )

    extra = {
        "ett.num_preemptions": float(outcome.preemptions),
        "ett.max_failures": float(max_failures),
    }
    report_state = report_job(
        job.job_url,
        job.job_id,
        run_id,
        job.tracking.mlflow_uri,
        extra,
        outcome.succeeded,
        return_state=True,
    )
    report = report_state.result(raise_on_failure=False) if report_state.is_completed() else None
    if report is None:
        log.warning("no ETT report for %s: %s", job.job_id, report_state.message)
    show_job(job.job_url, job.job_id, run_id, job.tracking.mlflow_uri)
    if not outcome.succeeded:
        logged = "ETT report logged" if report is not None else "no ETT report"
        raise TrainingFailed(f"job {job.job_id} failed: {outcome.message} ({logged})")
    log.info(
        "job %s %s; ETT %s",
        job.job_id,
        outcome.message,
        f"{report['ett_pct']:.1f}%" if report else "unknown",
    )
    return {
        "job_id": job.job_id,
        "job_url": job.job_url,
        "mlflow_run_id": run_id,
        "message": outcome.message,
        "attempts": [a.describe() for a in outcome.attempts],
        "failures": outcome.failures,
        "preemptions": outcome.preemptions,
        "anchor": None if anchor is None else {"uri": anchor.uri, "step": anchor.step},
        "anchor_event_id": event_id,
        "report": report,
    }


if __name__ == "__main__":
    import sys

    train_flow(config=sys.argv[1] if len(sys.argv) > 1 else None)
