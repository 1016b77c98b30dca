"""The ``train`` flow: a training job as a sequence of attempts that survives failures.

    config -> [attempt 0] -crash-> promote standby -> [attempt 1] -preempted-> [attempt 2]
    -ok-> anchor event (publishing starts on its own) -> ETT report -> done

Orchestration only: the job is tasks/orchestrator.py's (attempts, standby, retries, side
evaluator); each attempt is a task run here, and the flow run's artifacts and MLflow run
come from tasks/training.py's observer. Everything a job does is its config: ``config`` (a
file) and ``overrides`` (nested sections, e.g. ``{"launch": {"nproc": 2}, "recovery":
{"max_failures": 5}}``), the ETT_* environment over both.

When the job succeeds, the flow emits ``ett.checkpoint.anchor.committed`` for its anchor
checkpoint and finishes without waiting for publishing. The ETT report goes to MLflow and to
the flow run's artifacts whether the job succeeded or not.
"""

from __future__ import annotations

import time
from typing import Any
from uuid import UUID

from prefect import flow
from prefect.runtime import flow_run

from flows.run_names import new_job_naming, train_run_name, train_run_name_of
from tasks import training
from tasks.events import emit_anchor_committed, find_anchor
from tasks.logs import logger
from tasks.orchestrator import Orchestrator


class TrainingFailed(RuntimeError):
    """The job gave up (max_failures exceeded, or a failure that a relaunch cannot fix)."""


def _scheduling() -> tuple[float, float]:
    """When the flow run was expected to start (its schedule) and when it did."""
    started = time.time()
    try:
        expected = flow_run.get_scheduled_start_time().timestamp()
    except Exception:  # noqa: BLE001 - outside a flow run
        expected = started
    return min(expected, started), started


def _name_the_run(job_id: str) -> None:
    """A run that resumes an older job (its name was made before the job was known) takes
    that job's name."""
    name = train_run_name_of(job_id)
    try:
        run_id = flow_run.get_id()
        if run_id is None or flow_run.get_name() == name:
            return
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.update_flow_run(UUID(run_id), name=name)
    except Exception as exc:  # noqa: BLE001 - a name is a label
        logger().debug("could not rename the flow run to %s: %s", name, exc)


@flow(name="train", flow_run_name=train_run_name, log_prints=True)
def train_flow(
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Train one job to completion, relaunching failed attempts.

    Args:
        config: job config file (YAML/TOML); the embedded defaults when None.
        overrides: nested sections merged over the file, e.g. {"train": {"steps": 50}},
            {"launch": {"nproc": 2}}, {"recovery": {"max_failures": 5}}, {"faults":
            [{"kind": "sigkill", "step": 300, "attempt": 0}]} (ETT_* variables win over both).
            Without ``job_id`` in either, the run is a new job, named after the deployment
            and the time (the run's name); a ``job_id`` of an unfinished job continues it,
            of a finished one is refused (tasks/job_identity.py).
        resume: continue the newest unfinished job this deployment started.
    Returns: job id and URL, this flow run's id, attempts, anchor, MLflow run id and the ETT
        headline numbers.
    """
    scheduling = _scheduling()
    job = training.plan(config, overrides, resume, **new_job_naming())
    assert job.job_id is not None  # resolved by plan
    _name_the_run(job.job_id)
    observer = training.FlowObserver(job)
    with Orchestrator(job, observer, logger(), scheduling) as orchestrator:
        for attempt in orchestrator:
            training.watch(orchestrator, attempt)
    assert orchestrator.result is not None
    outcome, report = orchestrator.result.outcome, observer.report
    anchor = find_anchor(job.layout) if outcome.succeeded else None
    flow_run_id = flow_run.get_id()  # the publish run links back to this run
    event_id = (
        None
        if anchor is None
        else emit_anchor_committed(anchor, job.job_id, observer.run_id, flow_run_id)
    )
    if outcome.succeeded and anchor is None:
        logger().warning(
            "job %s succeeded without an anchor checkpoint: nothing to publish", job.job_id
        )
    logged = "ETT report logged" if report is not None else "no ETT report"
    if not outcome.succeeded:
        raise TrainingFailed(f"job {job.job_id} failed: {outcome.message} ({logged})")
    ett = f"{report['ett_pct']:.1f}%" if report else "unknown"
    logger().info("job %s %s; ETT %s", job.job_id, outcome.message, ett)
    return {
        "job_id": job.job_id,
        "job_url": job.layout.url,
        "flow_run_id": flow_run_id,
        "mlflow_run_id": report["mlflow_run_id"] if report else observer.run_id,
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
