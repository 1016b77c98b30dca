"""The ``train`` flow: a training job as a sequence of attempts that survives failures.

    config -> [attempt 0] -crash-> promote standby -> [attempt 1] -preempted-> [attempt 2]
    -ok-> anchor event (publishing starts on its own) -> ETT report -> done

The attempt lifecycle (launch, watch, classify, retry, warm standby, side evaluator) is
tasks/attempts.py and tasks/job.py; each attempt shows up here as a task run. The trainer
resumes from the newest committed checkpoint by itself. Preemptions (exit 83) and the first
failure of a kind relaunch at once; the same failure repeating backs off exponentially from
``backoff_s``. A bad config or data (exit 2, 88), an incompatible checkpoint (exit 84) or a
job id held by another job (exit 89) is not retried.

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
from infra.accounting.ledger import next_attempt
from infra.control import Phase, Progress
from tasks.artifacts import show_job
from tasks.attempts import LaunchSpec, RetryPolicy
from tasks.events import emit_anchor_committed, find_anchor
from tasks.job import run_job, timeouts_for
from tasks.logs import logger
from tasks.report import artifact_key, log_attempt, report_job, start_tracking
from tasks.train import ProgressThrottle, prepare_job, watch_in_task


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
    nnodes: int = 1,
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
        nproc: trainer processes (ranks) per node.
        nnodes: nodes; on one machine each is its own torchrun agent, joined by c10d
            rendezvous on loopback.
        max_failures: failures (crash, lost worker, hang) survived; one more fails the job.
        backoff_s: wait before relaunching after the same kind of failure happened twice in a
            row; doubles per repeat (capped at 300 s). Preemptions and the first failure of a
            kind relaunch at once.
        hang_timeout_s: an attempt that makes no training step for this long is killed as
            hung (before its first step, the startup timeout applies: at least 300 s).
        faults: injected failures for tests and demos, e.g.
            [{"kind": "sigkill", "step": 300, "attempt": 0}] (see infra.settings.FaultConfig).
    Returns: job id and URL, attempts, anchor, MLflow run id and the ETT headline numbers.
    """
    flow_started = time.time()
    scheduling = (min(_expected_start(flow_started), flow_started), flow_started)
    log = logger()
    job, config_path = prepare_job(config, overrides, faults)
    try:  # from here on, whatever happens, the ranks' copy of the config goes
        storage.configure(job.storage)  # this process reads the job's ledger too
        first = next_attempt(job.job_url)
        if first:
            log.info(
                "job %s has %d earlier attempt(s): continuing its numbering", job.job_id, first
            )
        # MLflow's run is made while the first attempt starts (its imports take seconds).
        tracking = start_tracking.submit(job)
        progress_id = create_progress_artifact(
            progress=0.0,
            key=artifact_key("train-progress", job.job_id),
            description=f"Steps done of job {job.job_id} ({job.train.steps} steps)",
        )
        context = contextvars.copy_context()  # progress arrives on the watch thread
        throttle = ProgressThrottle(
            lambda pct: context.run(update_progress_artifact, artifact_id=progress_id, progress=pct)
        )

        def on_progress(progress: Progress) -> None:
            if progress.phase == Phase.TRAINING:
                throttle(progress.step, progress.total)

        spec = LaunchSpec(config_path, nproc=nproc, nnodes=nnodes)
        outcome = run_job(
            job,
            spec,
            RetryPolicy(max_failures=max_failures, backoff_s=backoff_s),
            timeouts_for(job, hang_timeout_s),
            first,
            log=log,
            run_attempt=watch_in_task,
            on_progress=on_progress,
            on_attempt=lambda r: log_attempt(tracking.result(), job.tracking.mlflow_uri, r),
            scheduling=scheduling,
        )
    finally:
        shutil.rmtree(os.path.dirname(config_path), ignore_errors=True)  # the ranks' copy
    run_id = tracking.result()
    anchor = find_anchor(job.job_url) if outcome.succeeded else None
    event_id = None
    if anchor is not None:
        update_progress_artifact(artifact_id=progress_id, progress=100.0)
        event_id = emit_anchor_committed(anchor, job.job_id, run_id)
    elif outcome.succeeded:
        log.warning(
            "job %s succeeded without an anchor checkpoint (checkpoint.mode off?): nothing "
            "to publish",
            job.job_id,
        )

    extra = {
        "ett.num_preemptions": float(outcome.preemptions),
        "ett.max_failures": float(max_failures),
    }
    report_state = report_job(job, run_id, extra, outcome.succeeded, return_state=True)
    report = report_state.result(raise_on_failure=False) if report_state.is_completed() else None
    if report is None:
        log.warning("no ETT report for %s: %s", job.job_id, report_state.message)
    show_job(job.job_url, job.job_id, run_id, job.tracking.mlflow_uri)
    if not outcome.succeeded:
        logged = "ETT report logged" if report is not None else "no ETT report"
        raise TrainingFailed(f"job {job.job_id} failed: {outcome.message} ({logged})")
    ett = f"{report['ett_pct']:.1f}%" if report else "unknown"
    log.info("job %s %s; ETT %s", job.job_id, outcome.message, ett)
    return {
        "job_id": job.job_id,
        "job_url": job.job_url,
        "mlflow_run_id": report["mlflow_run_id"] if report else run_id,
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
