"""Prefect tasks for the ETT accounting of a job: MLflow run, attempts, report.

Tracking is best effort on the training path: an MLflow outage must never stop or fail a
training job (its ledger keeps every number; the report can be logged again later with
``ett report``). The report task itself fails loudly if the ledger cannot be read.
"""

from __future__ import annotations

import re
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from infra import tracking
from infra.ett import EttReport, report_for_job
from infra.ett_report import format_table, to_markdown
from infra.settings import JobConfig
from tasks.logs import logger
from tasks.train import AttemptReport, ledger_cause


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    key = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    return re.sub(r"-{2,}", "-", key)[:100] or "ett"


@task(name="start-tracking", cache_policy=NO_CACHE)
def start_tracking(config: JobConfig) -> str | None:
    """The job's MLflow run id (a resumed job gets its run back); None if MLflow is down."""
    try:
        return tracking.start_job_run(config)
    except Exception as exc:  # noqa: BLE001 - tracking must not stop training
        logger().warning("MLflow tracking unavailable (%s): training continues untracked", exc)
        return None


def log_attempt(run_id: str | None, tracking_uri: str, report: AttemptReport) -> None:
    if run_id is None:
        return
    try:
        tracking.log_attempt(
            run_id,
            report.attempt,
            report.exit_code,
            "success" if not report.failed else ledger_cause(report.outcome),
            report.started,
            report.ended,
            report.last_step,
            tracking_uri=tracking_uri,
        )
    except Exception as exc:  # noqa: BLE001
        logger().warning("could not log attempt %d to MLflow: %s", report.attempt, exc)


# A timeout is a missing report (train_flow runs it with return_state), not a failed job.
@task(name="ett-report", cache_policy=NO_CACHE, timeout_seconds=600)
def report_job(
    job_url: str,
    job_id: str,
    run_id: str | None,
    tracking_uri: str,
    extra_metrics: dict[str, float] | None = None,
    succeeded: bool = True,
) -> dict[str, Any]:
    """Compute the job's ETT report from its ledger, publish it as a Prefect markdown artifact,
    log it to the job's MLflow run (ending the run), and return its headline numbers."""
    log = logger()
    report: EttReport = report_for_job(job_url)
    log.info("ETT report of %s:\n%s", job_id, format_table(report))
    create_markdown_artifact(
        markdown=to_markdown(report),
        key=artifact_key("ett", job_id),
        description=f"ETT breakdown of job {job_id}: {report.ett_pct:.1f}% effective",
    )
    if run_id is not None:
        try:
            tracking.log_job_report(
                run_id,
                report,
                job_url,
                extra_metrics,
                tracking_uri=tracking_uri,
                status="FINISHED" if succeeded else "FAILED",
            )
        except Exception as exc:  # noqa: BLE001
            log.warning("could not log the ETT report to MLflow run %s: %s", run_id, exc)
    return {
        "ett_pct": report.ett_pct,
        "failure_pct": report.failure_pct,
        "idleness_pct": report.idleness_pct,
        "wall_s": report.wall_s,
        "num_failures": report.num_failures,
        "time_to_start_s": report.time_to_start_s,
        "time_to_recover_s": [f.time_to_recover_s for f in report.failures],
        "finished": report.finished,
    }
