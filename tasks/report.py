"""Prefect tasks for the ETT accounting of a job: MLflow run, attempts, report.

Tracking never holds up training: an MLflow outage must not stop, fail or slow a job (its
ledger keeps every number). Attempts are logged on a background thread, so a relaunch never
waits for MLflow; at the end of the flow the job is logged whole from its ledger, which also
fills in whatever an outage kept out (a job that started while MLflow was down included). If
MLflow is still down then, ``ett report --log JOB`` logs it later. The report task itself fails
loudly if the ledger cannot be read.
"""

from __future__ import annotations

import contextvars
import re
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from infra.accounting.report import to_markdown
from infra.accounting.summary import JobSummary
from infra.settings import JobConfig
from infra.tracking import mlflow_runs
from tasks.attempt import AttemptReport
from tasks.logs import logger

# How long the end of a flow waits for attempt logs still in flight (each call is bounded by
# infra.tracking.client.HTTP_DEFAULTS; this only caps a long queue behind a hung server).
PENDING_WAIT_S = 60.0

_background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ett-tracking")
_pending: list[Future[None]] = []


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    key = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    return re.sub(r"-{2,}", "-", key)[:100] or "ett"


def run_scope() -> str:
    """What this flow run's artifact keys are stable under: its deployment's name (a subflow
    takes its parent's), else its flow's, else ``train`` outside a flow run. A key names the
    kind of artifact and this scope, never the job, so the Prefect UI's history of one key
    (Artifacts > ``ett-buckets-train``) lists the successive jobs of a deployment."""
    from prefect.runtime import deployment, flow_run

    try:
        return str(deployment.get_name() or flow_run.get_flow_name() or "train")
    except Exception:  # noqa: BLE001 - outside a flow run
        return "train"


def stable_key(kind: str, scope: str | None = None) -> str:
    """``<kind>-<scope>``, e.g. ``ett-buckets-train``: see ``run_scope`` (the default)."""
    return artifact_key(kind, scope or run_scope())


@task(name="start-tracking", cache_policy=NO_CACHE)
def start_tracking(config: JobConfig) -> str | None:
    """The job's MLflow run id (a re-run job gets its run back); None if MLflow is down."""
    try:
        return mlflow_runs.start_job_run(config)
    except Exception as exc:  # noqa: BLE001 - tracking must not stop training
        logger().warning(
            "MLflow unavailable (%s): training continues; the job is logged from its ledger "
            "at the end of the flow",
            exc,
        )
        return None


def log_attempt(run_id: str | None, tracking_uri: str, report: AttemptReport) -> None:
    """Queue one attempt for MLflow and return at once: the next attempt never waits for it."""
    if run_id is None:
        return  # logged from the ledger at the end of the flow
    log = logger()  # the caller's run logger
    context = contextvars.copy_context()  # ...and Prefect settings, on the background thread

    def send() -> None:
        try:
            mlflow_runs.log_attempt(run_id, report, tracking_uri=tracking_uri)
        except Exception as exc:  # noqa: BLE001 - filled in at the end of the flow
            log.warning("could not log attempt %d to MLflow: %s", report.attempt, exc)

    _pending.append(_background.submit(context.run, send))


def _drain_pending(timeout_s: float = PENDING_WAIT_S) -> None:
    _, late = wait(list(_pending), timeout=timeout_s)
    _pending[:] = list(late)


# A timeout is a missing report (the flow goes on without it), not a failed job.
@task(name="ett-report", cache_policy=NO_CACHE, timeout_seconds=600)
def report_job(
    config: JobConfig,
    summary: JobSummary,
    run_id: str | None,
    extra_metrics: dict[str, float] | None = None,
    succeeded: bool = True,
) -> dict[str, Any]:
    """Publish the job's ETT report as a Prefect markdown artifact, log the job to MLflow
    (its run ends), and return its headline numbers and run id."""
    log = logger()
    report = summary.report
    create_markdown_artifact(
        markdown=to_markdown(report, summary.mfu),
        key=stable_key("ett"),
        description=f"ETT breakdown of job {config.job_id}: {report.ett_pct:.1f}% effective",
    )
    _drain_pending()
    try:
        run_id, _ = mlflow_runs.log_job(
            config, summary, run_id, succeeded=succeeded, extra_metrics=extra_metrics
        )
    except Exception as exc:  # noqa: BLE001 - the ledger keeps everything for later
        log.warning(
            "could not log job %s to MLflow (%s); once it is back: ett report --log %s",
            config.job_id,
            exc,
            config.job_id,
        )
    return {
        "ett_pct": report.ett_pct,
        "failure_pct": report.failure_pct,
        "idleness_pct": report.idleness_pct,
        "wall_s": report.wall_s,
        "num_failures": report.num_failures,
        "time_to_start_s": report.time_to_start_s,
        "time_to_recover_s": [f.time_to_recover_s for f in report.failures],
        "finished": report.finished,
        "mlflow_run_id": run_id,
    }
