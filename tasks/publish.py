"""Prefect tasks for publishing: each one stage of publish.pipeline.Publication.

The stages pass one in-process Publication object along (a torch model, a holdout frame):
results are never persisted or cached (NO_CACHE), and retries go only where a stage is safe
to repeat. Registration is idempotent (one version per anchor key), so it retries on
transient MLflow errors; a PublishError (corrupt anchor, failed validation) is final.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

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


@task(name="publish-prepare", cache_policy=NO_CACHE, timeout_seconds=STAGE_TIMEOUT_S)
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
    pub.load()
    return pub


@task(name="publish-export", cache_policy=NO_CACHE, timeout_seconds=STAGE_TIMEOUT_S)
def export(pub: Publication) -> Publication:
    pub.export()
    return pub


@task(name="publish-validate", cache_policy=NO_CACHE, timeout_seconds=STAGE_TIMEOUT_S)
def validate(pub: Publication) -> Publication:
    pub.validate()
    return pub


@task(
    name="publish-register",
    cache_policy=NO_CACHE,
    timeout_seconds=STAGE_TIMEOUT_S,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=_transient,
)
def register(pub: Publication) -> PublishResult:
    return pub.register()
