"""What a flow run shows in the Prefect UI besides its logs: the ETT buckets as a table
artifact, and links to the MLflow pages of the run and model version it produced.

Best effort, like all tracking on the training path: an artifact that cannot be made is a
warning in the log, never a failed job. Links are only made for an MLflow server (http[s]);
a local SQLite store has no page to link to.
"""

from __future__ import annotations

from urllib.parse import quote

from prefect import task
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra.accounting.summary import JobSummary
from infra.tracking.run_metadata import redact_url
from tasks.logs import logger
from tasks.report import artifact_key

IO_TIMEOUT_S = 120  # a ledger read or an MLflow lookup; more means the service is stuck
# MLflow's UI (3.x) opens every page in its GenAI view unless the URL or the browser's last
# choice says otherwise; the experiment's kind tag does not decide it. Links made here open
# the run and model pages in the model-training view (breadcrumb "Runs", not "Evaluations").
TRAINING_VIEW = "?workflowType=machine_learning"


def mlflow_ui(tracking_uri: str) -> str | None:
    """The base URL of the MLflow UI for a tracking URI (without credentials), or None."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return redact_url(tracking_uri).rstrip("/")


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    base = mlflow_ui(tracking_uri)
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}{TRAINING_VIEW}" if base else None


def mlflow_model_version_url(tracking_uri: str, name: str, version: str) -> str | None:
    base = mlflow_ui(tracking_uri)
    return (
        f"{base}/#/models/{quote(name, safe='')}/versions/{version}{TRAINING_VIEW}"
        if base
        else None
    )


@task(name="ett-table-artifact", cache_policy=NO_CACHE, timeout_seconds=IO_TIMEOUT_S)
def ett_table_artifact(summary: JobSummary) -> str:
    """The job's wall-time buckets (seconds, % of W) as a Prefect table artifact."""
    report, job_id = summary.report, summary.layout.job_id
    pct = report.bucket_pct()
    rows = [
        {"bucket": bucket, "seconds": round(secs, 3), "% of wall time": round(pct[bucket], 2)}
        for bucket, secs in report.buckets.items()
    ]
    rows.append({"bucket": "total", "seconds": round(report.wall_s, 3), "% of wall time": 100.0})
    artifact = create_table_artifact(
        table=rows,
        key=artifact_key("ett-buckets", job_id),
        description=(
            f"Wall time of job {job_id} by bucket: ETT {report.ett_pct:.1f}%, idleness "
            f"{report.idleness_pct:.1f}%, failure {report.failure_pct:.1f}%"
        ),
    )
    return str(artifact)


@task(name="mlflow-run-link", cache_policy=NO_CACHE, timeout_seconds=IO_TIMEOUT_S)
def mlflow_run_link(tracking_uri: str, run_id: str, job_id: str) -> str | None:
    """A link artifact to the job's MLflow run; None (and nothing made) without a UI."""
    if mlflow_ui(tracking_uri) is None:
        logger().info("MLflow at %s has no web UI to link to", redact_url(tracking_uri))
        return None
    from infra.tracking.client import client as mlflow_client

    experiment_id = mlflow_client(tracking_uri).get_run(run_id).info.experiment_id
    url = mlflow_run_url(tracking_uri, experiment_id, run_id)
    assert url is not None
    create_link_artifact(
        link=url,
        link_text=f"MLflow run of job {job_id}",
        key=artifact_key("mlflow-run", job_id),
        description="Metrics, ETT breakdown and ledger of this job in MLflow",
    )
    return url


@task(name="mlflow-model-link", cache_policy=NO_CACHE, timeout_seconds=IO_TIMEOUT_S)
def mlflow_model_link(tracking_uri: str, name: str, version: str, job_id: str) -> str | None:
    """A link artifact to a registered model version; None (nothing made) without a UI."""
    url = mlflow_model_version_url(tracking_uri, name, version)
    if url is None:
        return None
    create_link_artifact(
        link=url,
        link_text=f"{name} version {version}",
        key=artifact_key("mlflow-model", job_id),
        description=f"The model version published from job {job_id}: metrics, lineage",
    )
    return url


def show_job(summary: JobSummary, run_id: str | None, tracking_uri: str) -> None:
    """The ETT table and the MLflow link of a finished (or failed) job; never raises."""
    log = logger()
    job_id = summary.layout.job_id
    try:
        ett_table_artifact(summary)
    except Exception as exc:  # noqa: BLE001 - a missing artifact must not fail the job
        log.warning("no ETT table artifact for %s: %s", job_id, exc)
    if run_id is None:
        return
    try:
        mlflow_run_link(tracking_uri, run_id, job_id)
    except Exception as exc:  # noqa: BLE001
        log.warning("no link to MLflow run %s: %s", run_id, exc)


def show_model_version(tracking_uri: str, name: str, version: str, job_id: str) -> None:
    """The link to the model version a publish registered (or found); never raises: the
    version is registered already, a missing link must not fail the publish."""
    try:
        mlflow_model_link(tracking_uri, name, version, job_id)
    except Exception as exc:  # noqa: BLE001
        logger().warning("no link to %s version %s: %s", name, version, exc)
