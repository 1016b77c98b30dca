"""What a flow run shows in the Prefect UI besides its logs: the ETT buckets as a table
artifact, links to the MLflow pages of the run and model version it produced, the links
between a train run and the publish runs of its anchor, and the publish gate as a table.

Keys are stable per deployment (tasks.report.stable_key: ``ett-buckets-train``,
``mlflow-model-publish``), never per job, so Prefect's history of a key lists successive
jobs; the description names the job.

Best effort, like all tracking on the training path: an artifact that cannot be made is a
warning in the log, never a failed job. Links are only made for an MLflow server (http[s])
and a Prefect server with a UI: a local SQLite store or a temporary API has no page.
Prefect 3.9 stores a link artifact as markdown, ``[text](url)`` (type ``markdown``: neither
Prefect UI has a link type), so the descriptions here say "Link to ...".
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any
from urllib.parse import quote
from uuid import UUID

from prefect import task
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra.accounting.summary import JobSummary
from infra.tracking.run_metadata import redact_url
from publish.gate import GateDecision
from tasks.logs import logger
from tasks.report import artifact_key, stable_key

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
        key=stable_key("ett-buckets"),
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
        key=stable_key("mlflow-run"),
        description=f"Link to job {job_id}'s MLflow run: metrics, ETT breakdown and ledger",
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
        key=stable_key("mlflow-model"),
        description=f"Link to the model version published from job {job_id}: metrics, lineage",
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


# -- a train run and its publish runs, linked both ways ------------------------------------
def flow_run_url(flow_run_id: str | UUID) -> str | None:
    """The Prefect UI's page of a flow run (``<PREFECT_UI_URL>/runs/flow-run/<id>``, the UI
    URL being the API's minus ``/api``), or None without a configured server."""
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=str(flow_run_id)) or None


def link_markdown(url: str, text: str) -> str:
    """A link artifact's data as Prefect stores it (prefect.artifacts.LinkArtifact)."""
    return f"[{text}]({url})"


def _scope_of(client: Any, run: Any) -> str:
    """``tasks.report.run_scope`` of another flow run: the deployment of the run or of its
    nearest parent that has one (a train subflow of a retrain run: ``retrain``), else its
    flow's name."""
    current = run
    for _ in range(8):  # a parent chain this deep is not ours
        if current.deployment_id is not None:
            return str(client.read_deployment(current.deployment_id).name)
        if current.parent_task_run_id is None:
            break
        parent = client.read_task_run(current.parent_task_run_id)
        current = client.read_flow_run(parent.flow_run_id)
    return str(client.read_flow(run.flow_id).name)


@task(name="link-train-and-publish", cache_policy=NO_CACHE, timeout_seconds=IO_TIMEOUT_S)
def link_train_and_publish(train_flow_run_id: str) -> tuple[str, str] | None:
    """Two link artifacts: in this (publish) flow run, ``train-run-<scope>`` to the train
    run whose anchor it publishes; in that train run, ``publish-run-<its scope>`` to this run
    (made through the API for the other run: the train run ended before the anchor event
    started this one). Returns both URLs, None (nothing made) without a Prefect UI."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.runtime import flow_run

    publish_id, publish_name = flow_run.get_id(), flow_run.get_name()
    train_url = flow_run_url(train_flow_run_id)
    publish_url = flow_run_url(publish_id) if publish_id else None
    if train_url is None or publish_url is None:
        logger().info("no Prefect UI to link the train and publish runs on")
        return None
    with get_client(sync_client=True) as client:
        train = client.read_flow_run(UUID(str(train_flow_run_id)))
        create_link_artifact(
            link=train_url,
            link_text=f"train run {train.name}",
            key=stable_key("train-run"),
            description="Link to the train flow run whose anchor checkpoint this run publishes",
        )
        client.create_artifact(
            ArtifactCreate(
                key=artifact_key("publish-run", _scope_of(client, train)),
                type="markdown",
                data=link_markdown(publish_url, f"publish run {publish_name}"),
                description=(
                    f"Link to the publish flow run of this job's anchor ({publish_name}): "
                    "the gate's decision and the registered model version"
                ),
                flow_run_id=train.id,
            )
        )
    return train_url, publish_url


def link_runs(train_flow_run_id: str | None) -> None:
    """The train and publish runs linked both ways (see ``link_train_and_publish``); never
    raises: a link is a convenience, the publish goes on without it."""
    if not train_flow_run_id:
        logger().info("no train flow run to link to (a publish by hand)")
        return
    try:
        link_train_and_publish(train_flow_run_id)
    except Exception as exc:  # noqa: BLE001
        logger().warning("no links between train run %s and this run: %s", train_flow_run_id, exc)


# -- the publish gate as a table -----------------------------------------------------------
GATE_KEYS = tuple(f.name for f in fields(GateDecision))  # PublishResult.gate's keys


def _num(value: Any, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


def _sig(value: Any) -> float | None:
    return None if value is None else float(f"{float(value):.3g}")


def gate_decision(gate: dict[str, Any]) -> str:
    """``promoted to champion`` or ``kept as candidate``."""
    return "promoted to champion" if gate["promoted"] else "kept as candidate"


ALREADY = "already published: an earlier publish run registered this anchor"


def gate_rows(gate: dict[str, Any] | None, already_published: bool = False) -> list[dict[str, Any]]:
    """The gate as table rows: AUC and log-loss of the candidate against the champion, the
    champion margin, the parity check against its tolerance, the decision and its reason
    (AUC and log-loss rounded to 4 places, parity to 3 significant digits). An anchor
    published before made no new decision: its reason says so, after the earlier decision
    when that one is known; with none, one row says so."""
    columns = ("check", "candidate", "champion", "margin or tolerance", "result")
    if gate is None:
        return [dict(zip(columns, ("decision", None, None, None, ALREADY), strict=True))]
    auc, champion_auc, margin = gate["candidate_auc"], gate["champion_auc"], gate["margin"]
    if gate["champion_version"] is None:
        auc_result = "no champion to compare with"
    elif champion_auc is None:
        auc_result = "champion not re-scored"
    else:  # the gate's own comparison (publish/registry.should_promote), not redone here
        promoted = gate["promoted"]
        auc_result = "at least champion - margin" if promoted else "below champion - margin"
    reason = f"{ALREADY}; then: {gate['reason']}" if already_published else gate["reason"]
    parity, tolerance = gate["parity_max_abs_diff"], gate["parity_tolerance"]
    within = parity is not None and parity == parity and parity <= tolerance
    champion = f"v{gate['champion_version']}" if gate["champion_version"] else "none"
    rows = (
        ("AUC", _num(auc), _num(champion_auc), margin, auc_result),
        (
            "log-loss",
            _num(gate["candidate_logloss"]),
            _num(gate["champion_logloss"]),
            None,
            "lower is better; not gated",
        ),
        (
            "parity (max abs diff)",
            _sig(parity),
            None,
            tolerance,
            "within tolerance" if within else "exceeds tolerance",
        ),
        ("decision", gate_decision(gate), champion, None, reason),
    )
    return [dict(zip(columns, row, strict=True)) for row in rows]


def gate_summary(
    gate: dict[str, Any] | None, name: str, version: str, already_published: bool = False
) -> str:
    """One line: ``ranker version 3 promoted to champion: AUC 0.7812 vs 0.7765 (v2)``,
    ``... kept as candidate: ...``, or ``... was already published: no new gate decision``."""
    if gate is None or already_published:
        return f"{name} version {version} was already published: no new gate decision"
    versus = (
        f" vs {gate['champion_auc']:.4f} (v{gate['champion_version']})"
        if gate["champion_auc"] is not None
        else " (no champion scored)"
    )
    auc = gate["candidate_auc"]
    return f"{name} version {version} {gate_decision(gate)}: AUC {auc:.4f}{versus}"


@task(name="gate-table-artifact", cache_policy=NO_CACHE, timeout_seconds=IO_TIMEOUT_S)
def gate_table_artifact(gate: dict[str, Any] | None, result: dict[str, Any]) -> str:
    """The publish gate (``gate_rows``) as the table artifact ``gate-<scope>``."""
    already = bool(result["already_published"])
    name, version = result["registered_model"], result["version"]
    return str(
        create_table_artifact(
            table=gate_rows(gate, already),
            key=stable_key("gate"),
            description=gate_summary(gate, name, version, already),
        )
    )


def show_publication(
    tracking_uri: str, result: dict[str, Any], gate: dict[str, Any] | None
) -> None:
    """The publish run's artifacts: the link to the model version and the gate table;
    never raises: the version is registered already, a missing artifact must not fail it."""
    name, version = result["registered_model"], result["version"]
    try:
        mlflow_model_link(tracking_uri, name, version, result["job_id"])
    except Exception as exc:  # noqa: BLE001
        logger().warning("no link to %s version %s: %s", name, version, exc)
    try:
        gate_table_artifact(gate, result)
    except Exception as exc:  # noqa: BLE001
        logger().warning("no gate table for %s version %s: %s", name, version, exc)
