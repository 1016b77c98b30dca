"""Flow run names that say what a run is about, instead of Prefect's random "exuberant-owl".

Prefect calls these when a flow run starts (``@flow(flow_run_name=...)``) and reads the
run's parameters from ``prefect.runtime``. A name is a label: whatever goes wrong while
working one out, the run gets a plain name and goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.runtime import flow_run

from infra import naming

log = logging.getLogger(__name__)


def _parameters() -> dict[str, Any]:
    try:
        return dict(flow_run.get_parameters() or {})
    except Exception:  # noqa: BLE001 - outside a flow run
        return {}


def _job_id(parameters: dict[str, Any]) -> str | None:
    """The job id the parameters resolve to (config file, overrides, ETT_* environment)."""
    from infra.settings import load_config

    try:
        return load_config(parameters.get("config"), **(parameters.get("overrides") or {})).job_id
    except Exception as exc:  # noqa: BLE001 - the flow itself reports a bad config
        log.debug("no job id for the run name: %s", exc)
        return None


def new_job_naming() -> dict[str, Any]:
    """How this flow run names a new job (``infra.settings.new_job_id``'s arguments): its
    deployment's name, else its flow's (``tasks.report.run_scope``), its scheduled start
    and its id's first hex digits, so the run name and the flow's body give the job the same
    id, and a retry of the run continues that job instead of starting another."""
    from tasks.report import run_scope

    try:
        name = run_scope()
        when = flow_run.get_scheduled_start_time().timestamp()
        salt = str(flow_run.get_id() or "").replace("-", "")[:4] or None
    except Exception:  # noqa: BLE001 - outside a flow run
        return {"name": "train", "when": None, "salt": None}
    return {"name": name, "when": when, "salt": salt}


def train_run_name_of(job_id: str) -> str:
    """``train-<job id>``, or the id itself when it already says so (a new job's id starts
    with the deployment's name: ``train-20261205-083412-3f9a``)."""
    return job_id if job_id.startswith("train-") else f"train-{job_id}"


def train_run_name() -> str:
    """``train-<job id>``: the id the parameters name, else the new job's (flows/train_flow.py
    renames a run that resumes an older job)."""
    from infra.settings import new_job_id

    parameters = _parameters()
    job_id = _job_id(parameters)
    if job_id is None and parameters.get("resume"):
        return "train-resume"
    return train_run_name_of(job_id or new_job_id(**new_job_naming()))


def retrain_run_name() -> str:
    """``retrain-<prefix>-<scheduled date>``: the day's run of a job prefix."""
    parameters = _parameters()
    prefix = parameters.get("job_prefix") or _job_id({"config": parameters.get("config")})
    try:
        day = flow_run.get_scheduled_start_time().strftime("%Y-%m-%d")
    except Exception:  # noqa: BLE001 - outside a flow run
        day = None
    return "-".join(p for p in ("retrain", prefix, day) if p)


def report_run_name() -> str:
    """``ett-report-<experiment>``."""
    experiment = _parameters().get("experiment")
    if not experiment:
        from infra.settings import load_config

        try:
            experiment = load_config().tracking.experiment
        except Exception:  # noqa: BLE001
            experiment = None
    return f"ett-report-{experiment}" if experiment else "ett-report"


def publish_run_name() -> str:
    """``publish-<job id>-step-<step>`` (the anchor's folder name when those are unknown)."""
    parameters = _parameters()
    job_id, step = parameters.get("job_id"), parameters.get("step")
    if job_id not in (None, "", "None") and step not in (None, "", "None"):
        return naming.publish_run_name(str(job_id), step)
    uri = str(parameters.get("uri") or "").rstrip("/")
    return f"publish-{uri.rsplit('/', 1)[-1]}" if uri else "publish"
