"""The anchor checkpoint and the Prefect event that hands it to publishing.

Contract (docs/events.md): event ``ett.checkpoint.anchor.committed``, resource id
``ett.checkpoint.<job_id>``, related resource the train flow run (``prefect.flow-run.<id>``,
role ``flow-run``), payload ``{uri, step, job_id, mlflow_run_id, train_flow_run_id}``. The
``publish`` deployment's trigger in prefect.yaml matches ``ett.checkpoint.*`` and templates
its parameters from the payload. Emitting is fire-and-forget: training never waits for
publishing. The publish flow answers with ``ett.model.published``, related to the same
train flow run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from infra.checkpoint_manifest import committed_checkpoints
from infra.job_layout import JobLayout
from tasks.logs import logger

ANCHOR_EVENT = "ett.checkpoint.anchor.committed"
RESOURCE_PREFIX = "ett.checkpoint."


@dataclass(frozen=True)
class Anchor:
    uri: str
    step: int
    committed_at: float  # the manifest's creation time (Unix seconds)


def find_anchor(layout: JobLayout) -> Anchor | None:
    """The job's newest committed checkpoint whose manifest says ``anchor``, or None.

    Read from the manifests, the commit itself, not from the ledger: the ledger is
    accounting, and a ledger that could not be stored must not lose a trained model.
    """
    for ckpt in committed_checkpoints(layout):  # newest first
        if ckpt.manifest.anchor:
            return Anchor(uri=ckpt.url, step=ckpt.step, committed_at=ckpt.manifest.created)
    return None


def anchor_resource(job_id: str) -> dict[str, str]:
    return {"prefect.resource.id": f"{RESOURCE_PREFIX}{job_id}", "prefect.resource.name": job_id}


def anchor_payload(
    anchor: Anchor, job_id: str, mlflow_run_id: str | None, train_flow_run_id: str | None = None
) -> dict[str, Any]:
    return {
        "uri": anchor.uri,
        "step": anchor.step,
        "job_id": job_id,
        "mlflow_run_id": mlflow_run_id,
        "train_flow_run_id": train_flow_run_id,
    }


def flow_run_related(flow_run_id: str | None, role: str) -> list[dict[str, str]]:
    """The flow run as an event's related resource (the event feed links to its page)."""
    if not flow_run_id:
        return []
    return [
        {"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": role}
    ]


@task(name="emit-anchor-committed", cache_policy=NO_CACHE)
def emit_anchor_committed(
    anchor: Anchor, job_id: str, mlflow_run_id: str | None, train_flow_run_id: str | None = None
) -> str | None:
    """Emit the anchor event; returns the event id, None when Prefect dropped it (emit_event
    swallows errors and returns None, e.g. with events disabled), which is logged loudly.
    ``train_flow_run_id``: the train flow run that committed it, which the publish run links
    back to (a related resource with Prefect's own role ``flow-run``, and in the payload for
    the trigger's parameters)."""
    log = logger()
    event = emit_event(
        event=ANCHOR_EVENT,
        resource=anchor_resource(job_id),
        payload=anchor_payload(anchor, job_id, mlflow_run_id, train_flow_run_id),
        related=flow_run_related(train_flow_run_id, "flow-run"),
    )
    if event is None:
        log.error(
            "the %s event for %s was NOT emitted (events disabled or no events client): "
            "publish it by hand: prefect deployment run publish/publish -p uri=%s",
            ANCHOR_EVENT,
            anchor.uri,
            anchor.uri,
        )
        return None
    log.info(
        "emitted %s for %s (step %d): publishing runs on its own",
        ANCHOR_EVENT,
        anchor.uri,
        anchor.step,
    )
    return str(event.id)


MODEL_EVENT = "ett.model.published"
MODEL_RESOURCE_PREFIX = "ett.model."


def emit_model_published(
    result: dict[str, Any], train_flow_run_id: str | None, gate: dict[str, Any] | None
) -> str | None:
    """``ett.model.published`` for a publish that registered (or found) a version: resource
    ``ett.model.<name>.<version>``, related to the train flow run (role ``train-flow-run``)
    and the job's checkpoint; the publish flow run itself comes from Prefect's context.
    Best effort, like the anchor event: returns the event id or None."""
    name, version = result["registered_model"], result["version"]
    event = emit_event(
        event=MODEL_EVENT,
        resource={
            "prefect.resource.id": f"{MODEL_RESOURCE_PREFIX}{name}.{version}",
            "prefect.resource.name": f"{name} version {version}",
        },
        related=[
            *flow_run_related(train_flow_run_id, "train-flow-run"),
            {
                "prefect.resource.id": f"{RESOURCE_PREFIX}{result['job_id']}",
                "prefect.resource.role": "checkpoint",
            },
        ],
        payload={
            "registered_model": name,
            "version": version,
            "aliases": list(result.get("aliases") or []),
            "already_published": bool(result.get("already_published")),
            "promoted": bool(result.get("promoted")),
            "anchor_uri": result["anchor_uri"],
            "job_id": result["job_id"],
            "train_flow_run_id": train_flow_run_id,
            "reason": None if gate is None else gate.get("reason"),
        },
    )
    return None if event is None else str(event.id)
