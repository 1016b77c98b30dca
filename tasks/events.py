"""The anchor checkpoint and the Prefect event that hands it to publishing.

Contract (docs/events.md): event ``ett.checkpoint.anchor.committed``, resource id
``ett.checkpoint.<job_id>``, payload ``{uri, step, job_id, mlflow_run_id}``. The ``publish``
deployment's trigger in prefect.yaml matches ``ett.checkpoint.*`` and templates its
parameters from the payload. Emitting is fire-and-forget: training never waits for publishing.
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


def anchor_payload(anchor: Anchor, job_id: str, mlflow_run_id: str | None) -> dict[str, Any]:
    return {
        "uri": anchor.uri,
        "step": anchor.step,
        "job_id": job_id,
        "mlflow_run_id": mlflow_run_id,
    }


@task(name="emit-anchor-committed", cache_policy=NO_CACHE)
def emit_anchor_committed(anchor: Anchor, job_id: str, mlflow_run_id: str | None) -> str | None:
    """Emit the anchor event; returns the event id, None when Prefect dropped it (emit_event
    swallows errors and returns None, e.g. with events disabled), which is logged loudly."""
    log = logger()
    event = emit_event(
        event=ANCHOR_EVENT,
        resource=anchor_resource(job_id),
        payload=anchor_payload(anchor, job_id, mlflow_run_id),
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
