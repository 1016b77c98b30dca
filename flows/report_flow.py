"""The ``ett-report`` flow: the fleet view of an MLflow experiment as a Prefect artifact.

ETT% per job over time, Time to Start / Time to Recover distributions, lost time per job and
regressions against the trailing median (infra/fleet.py). Deployed in prefect.yaml; run it by
hand or on a schedule. Plots and tables are also written to ``out_dir``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from infra.settings import load_config
from tasks.report import fleet_report


@flow(name="ett-report", log_prints=True)
def ett_report_flow(
    tracking_uri: str | None = None,
    experiment: str | None = None,
    out_dir: str = "runs/fleet",
) -> dict[str, Any]:
    """Summarise every job of ``experiment`` at ``tracking_uri`` (defaults: the job config's
    tracking section, i.e. ETT_TRACKING__* or the embedded defaults)."""
    defaults = load_config().tracking
    return fleet_report(
        tracking_uri or defaults.mlflow_uri, experiment or defaults.experiment, out_dir
    )


if __name__ == "__main__":
    print(ett_report_flow())
