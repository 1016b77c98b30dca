"""The fleet report as a Prefect task: the summary as a markdown artifact, its plots and
tables in an MLflow run of the experiment, linked from the flow run.

The plots go to MLflow, not to the worker's disk: a worker is a shared machine whose files
nobody browses, and the next report on another worker would not find them. There is one
report run per experiment (tag ``ett.kind = fleet``, so the fleet view never counts it as a
job): each report adds a point to its fleet metrics and replaces its files.
"""

from __future__ import annotations

import tempfile
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from infra.tracking import metrics as names
from infra.tracking.mlflow_runs import log_fleet_report
from infra.whatif import fleet, fleet_report
from tasks.artifacts import mlflow_run_url
from tasks.logs import logger
from tasks.report import artifact_key

TIMEOUT_S = 600  # reads every job run of the experiment, then logs four plots


def _log_to_mlflow(summary: fleet.FleetSummary, tracking_uri: str) -> tuple[str, str] | None:
    """The fleet view (plots, markdown, text, JSON, fleet totals) in the experiment's fleet
    run (infra.tracking.mlflow_runs.log_fleet_report); returns (experiment id, run id), None when
    the
    experiment has no reported job yet. The files only pass through a temporary folder."""
    from infra.tracking.client import client as mlflow_client

    if not summary.jobs:
        return None
    totals = summary.stats["totals"]
    metrics = {f"{names.FLEET}{key}": float(totals[key]) for key in ("jobs", "failures")}
    metrics[f"{names.FLEET}ett_pct"] = names.percent(totals["fleet_ett_pct"])
    metrics[f"{names.FLEET}regressions"] = float(len(summary.regressions))
    with tempfile.TemporaryDirectory(prefix="ett-fleet-") as tmp:
        files = fleet_report.write_files(summary, tmp)
        run_id = log_fleet_report(tracking_uri, summary.experiment, files, metrics)
    experiment_id = mlflow_client(tracking_uri).get_run(run_id).info.experiment_id
    return experiment_id, run_id


@task(name="fleet-report", cache_policy=NO_CACHE, timeout_seconds=TIMEOUT_S)
def fleet_report_task(tracking_uri: str, experiment: str) -> dict[str, Any]:
    """The fleet view of an experiment: markdown artifact, MLflow run with the plots, and a
    link artifact to that run (when MLflow has a web UI)."""
    log = logger()
    summary = fleet.fleet_summary(tracking_uri, experiment)
    log.info("%s", fleet_report.format_fleet(summary))
    create_markdown_artifact(
        markdown=fleet_report.to_markdown(summary),
        key=artifact_key("ett-fleet", experiment),
        description=f"Fleet ETT of experiment {experiment}: {len(summary.jobs)} job(s)",
    )
    logged = _log_to_mlflow(summary, tracking_uri)
    url = mlflow_run_url(tracking_uri, *logged) if logged else None
    if url:
        create_link_artifact(
            link=url,
            link_text=f"Fleet plots of {experiment} in MLflow",
            key=artifact_key("ett-fleet-plots", experiment),
            description="ETT trend, Time to Start / Recover distributions, lost time per job",
        )
    return {
        "jobs": len(summary.jobs),
        "in_progress": list(summary.in_progress),
        "regressions": [r.message for r in summary.regressions],
        "fleet_ett_pct": summary.stats["totals"]["fleet_ett_pct"],
        "mlflow_run_id": logged[1] if logged else None,
        "mlflow_url": url,
    }
