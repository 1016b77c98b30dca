"""The ``publish`` flow: anchor checkpoint -> validated, registered model, on a CPU worker.

Triggered by the ``ett.checkpoint.anchor.committed`` event (prefect.yaml passes the payload
``{uri, step, job_id, mlflow_run_id, train_flow_run_id}``), or run by hand. Orchestration
only: every stage is a task in tasks/publish.py over publish/ (no torch code here). The
training job never waits for this flow: it ended when its anchor was committed.

In the Prefect UI the run links to its train run and the train run to it (first, so a
publish that fails is linked too), and it shows the gate (candidate against champion,
parity, decision and reason) as a table; it ends with the ``ett.model.published`` event.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from flows.run_names import publish_run_name
from tasks import publish as stages
from tasks.artifacts import link_runs, show_publication
from tasks.events import emit_model_published


def _blank(value: Any) -> Any:
    """Event templating renders a missing payload field as "" or "None"."""
    return None if value in ("", "None", "null") else value


@flow(name="publish", flow_run_name=publish_run_name, log_prints=True)
def publish_flow(
    uri: str,
    step: int | None = None,
    job_id: str | None = None,
    mlflow_run_id: str | None = None,
    settings: dict[str, Any] | None = None,
    train_flow_run_id: str | None = None,
) -> dict[str, Any]:
    """Publish the anchor checkpoint at ``uri``; returns the registered version's summary
    and the gate's decision (``gate``, None when the anchor was published before).

    ``settings`` overrides publish.settings.PublishSettings (calibration_ratio,
    champion_margin, holdout_rows, tracking_uri, ...). ``train_flow_run_id``: the train flow
    run that committed the anchor (the event's payload), linked both ways. Publishing an
    anchor twice returns the version registered the first time.
    """
    logger = get_run_logger()
    train_flow_run_id = _blank(train_flow_run_id)
    link_runs(train_flow_run_id)
    pub = stages.prepare(uri, _blank(step), _blank(job_id), _blank(mlflow_run_id), settings)
    try:
        if pub.result is None:
            stages.load(pub)
            stages.export(pub)
            stages.validate(pub)
            stages.register(pub)
        result = pub.result
        assert result is not None
    finally:
        pub.close()
    assert pub.client is not None  # connected by prepare
    summary = result.to_dict()
    gate = summary["gate"]  # publish/gate.py's GateDecision; None: no decision on record
    show_publication(pub.client.tracking_uri, summary, gate)
    emit_model_published(summary, train_flow_run_id, gate)
    verb = "was already published as" if result.already_published else "published as"
    logger.info(
        "%s %s %s version %s (aliases: %s); %s",
        uri,
        verb,
        result.registered_model,
        result.version,
        ", ".join(result.aliases) or "none",
        "no new gate decision" if gate is None else gate["reason"],
    )
    return summary


if __name__ == "__main__":
    import sys

    publish_flow(uri=sys.argv[1])
