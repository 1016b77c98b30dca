"""Prefect tasks for publishing: each one stage of publish.pipeline.Publication.

The stages pass one in-process Publication object along (a torch model, a holdout frame):
results are never persisted or cached (NO_CACHE). Every stage that talks to MLflow retries
with exponential backoff (10, 20, 40 s, plus jitter) when the error is not a refusal, so a
short MLflow outage delays a publish instead of failing it: each stage is safe to repeat (a
repeated export opens a new publish run and the failed one is marked FAILED; registration is
idempotent, one version per anchor key). A PublishError (corrupt anchor, failed validation)
is final.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from publish.pipeline import Publication, PublishResult
from publish.settings import PublishError

# A stage that hangs (an upload to a stuck MLflow) would hold the publish deployment's one
# concurrency slot, and every later anchor would wait behind it.
STAGE_TIMEOUT_S = 1800


def _transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry unless the stage refused on purpose."""
    try:
        state.result()
    except PublishError:
        return False
    except Exception:  # noqa: BLE001 - a network or server error: worth a retry
        return True
    return False


RETRIES = {
    "retries": 3,
    "retry_delay_seconds": exponential_backoff(backoff_factor=10),
    "retry_jitter_factor": 0.5,
    "retry_condition_fn": _transient,
}


@task(name="publish-prepare", cache_policy=NO_CACHE, timeout_seconds=STAGE_TIMEOUT_S, **RETRIES)
def prepare(
    uri: str,
    step: int | None,
    job_id: str | None,
    mlflow_run_id: str | None,
    settings: dict[str, Any] | None = None,
) -> Publication:
    """Read + check the manifest and config; find an earlier publish of this anchor."""
    return Publication.start(uri, step, job_id, mlflow_run_id, settings)


@task(name="publish-load", cache_policy=NO_CACHE, timeout_seconds=STAGE_TIMEOUT_S)
def load(pub: Publication) -> Publication:
    pub.load()  # storage retries its own reads
    return pub


@task(name="publish-export", cache_policy=NO_CACHE, timeout_seconds=STAGE_TIMEOUT_S, **RETRIES)
def export(pub: Publication) -> Publication:
    pub.export()
    return pub


@task(name="publish-validate", cache_policy=NO_CACHE, timeout_seconds=STAGE_TIMEOUT_S, **RETRIES)
def validate(pub: Publication) -> Publication:
    pub.validate()
    return pub


@task(name="publish-register", cache_policy=NO_CACHE, timeout_seconds=STAGE_TIMEOUT_S, **RETRIES)
def register(pub: Publication) -> PublishResult:
    return pub.register()
