"""The fleet report as a Prefect task: the summary as a markdown artifact, its plots and
tables in an MLflow run of the experiment, linked from the flow run.

The plots go to MLflow, not to the worker's disk: a worker is a shared machine whose files
nobody browses, and the next report on another worker would not find them. The report run
is tagged ``ett.kind = fleet``, so the fleet view never counts it as a job.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from infra import fleet, fleet_report
from infra.tracking import KIND_TAG
from tasks.artifacts import mlflow_run_url
from tasks.logs import logger
from tasks.report import artifact_key

FLEET_KIND = "fleet"
TIMEOUT_S = 600  # reads every job run of the experiment, then logs four plots


def log_fleet_run(summary: fleet.FleetSummary, tracking_uri: str) -> tuple[str, str] | None:
    """An MLflow run holding the fleet view (plots, markdown, JSON, fleet totals); returns
    (experiment id, run id), None when the experiment has no reported job yet."""
    from mlflow import MlflowClient

    if not summary.jobs:
        return None
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(summary.experiment)
    assert experiment is not None  # it holds the jobs just read
    run = client.create_run(
        experiment.experiment_id,
        run_name=f"fleet-report-{time.strftime('%Y%m%d-%H%M%S')}",
        tags={KIND_TAG: FLEET_KIND},
    )
    run_id = run.info.run_id
    figs = fleet_report.figures(summary)
    try:
        for name, fig in figs.items():
            client.log_figure(run_id, fig, f"fleet/{name}.png")
    finally:
        fleet_report.close(figs)
    client.log_text(run_id, fleet_report.to_markdown(summary), "fleet/fleet.md")
    client.log_text(run_id, fleet_report.format_fleet(summary), "fleet/fleet.txt")
    client.log_dict(run_id, summary.to_dict(), "fleet/fleet.json")
    totals = summary.stats["totals"]
    for key in ("jobs", "fleet_ett_pct", "failures"):
        client.log_metric(run_id, f"fleet.{key}", float(totals[key]))
    client.log_metric(run_id, "fleet.regressions", float(len(summary.regressions)))
    client.set_terminated(run_id)
    return experiment.experiment_id, run_id


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
    logged = log_fleet_run(summary, tracking_uri)
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
