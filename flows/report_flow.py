"""The ``ett-report`` flow: the fleet view of an MLflow experiment, in Prefect and MLflow.

ETT% per job over time, Time to Start / Time to Recover distributions, lost time per job and
regressions against the trailing median (infra/whatif/fleet.py). The summary is a markdown artifact
of the flow run; the plots and tables go to an MLflow run of the experiment (``ett.kind =
fleet``) that the flow run links to. Deployed in prefect.yaml; run it by hand or on a schedule.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.run_names import report_run_name
from infra.settings import load_config
from tasks.fleet import fleet_report_task


@flow(name="ett-report", flow_run_name=report_run_name, log_prints=True)
def ett_report_flow(
    tracking_uri: str | None = None,
    experiment: str | None = None,
) -> dict[str, Any]:
    """Summarise every job of ``experiment`` at ``tracking_uri`` (defaults: the job config's
    tracking section, i.e. ETT_TRACKING__* or the embedded defaults)."""
    defaults = load_config().tracking
    return fleet_report_task(tracking_uri or defaults.mlflow_uri, experiment or defaults.experiment)


if __name__ == "__main__":
    print(ett_report_flow())
