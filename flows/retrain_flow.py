"""The ``retrain`` flow (cron-scheduled in prefect.yaml): train the next data window, warm.

1. The window: the newest complete date partition ``dt=YYYY-MM-DD`` under ``data_root``
   (complete = it holds ``_meta.json`` or ``_SUCCESS``, written last by the producer;
   ``ett generate --daily N`` writes synthetic ones, infra/daily_windows.py). No complete window,
   or the newest one trained already: the run ends, Completed, saying so (nothing to do is
   not a failure of a scheduled run).
2. The warm start: the current champion of the registered model (MLflow alias ``champion``)
   was registered from its anchor's LoggedModel, whose param ``anchor_uri`` names the
   checkpoint (publish/registry.anchor_uri_of); it becomes ``checkpoint.warm_start``. No
   champion: a cold start.
3. Training: the ``train`` flow as a subflow, job id ``<job_prefix>-<YYYY-MM-DD>``. A window
   whose job started but never committed its anchor resumes that job.
4. Promotion is not decided here: the anchor event triggers ``publish``, which compares the
   new model with the champion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from flows.run_names import retrain_run_name
from flows.train_flow import train_flow
from infra import daily_windows, storage
from infra.settings import load_config
from tasks.events import find_anchor
from tasks.logs import logger

CHAMPION_ALIAS = "champion"
IO_TIMEOUT_S = 120  # a listing of the data root, a registry lookup


@dataclass(frozen=True)
class Window:
    date: str
    url: str


@task(name="latest-window", cache_policy=NO_CACHE, timeout_seconds=IO_TIMEOUT_S)
def latest_window(data_root: str) -> Window | None:
    """The newest complete ``dt=YYYY-MM-DD`` partition under ``data_root``; None if none."""
    found = [
        Window(m.group(1), storage.join(data_root, name))
        for name in storage.listdir(data_root)
        if (m := daily_windows.PARTITION.fullmatch(name))
    ]
    for window in sorted(found, key=lambda w: w.date, reverse=True):
        if any(storage.exists(storage.join(window.url, m)) for m in daily_windows.COMPLETE_MARKERS):
            return window
        logger().warning(
            "skipping incomplete partition %s (no %s yet)",
            window.url,
            " or ".join(daily_windows.COMPLETE_MARKERS),
        )
    return None


@task(
    name="champion-anchor",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    timeout_seconds=IO_TIMEOUT_S,
)
def champion_anchor(tracking_uri: str, registered_model: str) -> str | None:
    """The anchor checkpoint URI of the model's champion version, None if there is none."""
    from mlflow.exceptions import MlflowException

    from infra.tracking.client import client as mlflow_client
    from publish.registry import ANCHOR_PARAM, anchor_uri_of

    client = mlflow_client(tracking_uri)
    try:
        version = client.get_model_version_by_alias(registered_model, CHAMPION_ALIAS)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            logger().info("no champion of %s yet: cold start", registered_model)
            return None
        raise
    uri = anchor_uri_of(client, version)
    if not uri:
        logger().warning(
            "champion %s v%s names no %s (its model's param or its tag): cold start",
            registered_model,
            version.version,
            ANCHOR_PARAM,
        )
        return None
    logger().info("champion %s v%s: warm start from %s", registered_model, version.version, uri)
    return uri


def _nothing_to_do(message: str, **result: Any) -> State:
    """A Completed run whose message says why nothing was trained."""
    logger().info("%s", message)
    return Completed(message=message, data={"trained": False, "message": message, **result})


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, section by section."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


@flow(name="retrain", flow_run_name=retrain_run_name, log_prints=True)
def retrain_flow(
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    data_root: str = daily_windows.DEFAULT_ROOT,
    job_prefix: str | None = None,
) -> dict[str, Any] | State:
    """Train on the newest window of ``data_root``, warm-started from the champion.

    ``config`` and ``overrides`` are the ``train`` flow's (``launch``, ``recovery``, any
    section); the window's job id, data URL and warm start are set over them. ``job_prefix``
    defaults to the config's job id, else ``retrain``; the job is ``<prefix>-<date>``.
    Without a new window the run ends Completed with a message (``trained: False``)."""
    base = load_config(config, **(overrides or {}))
    storage.configure(base.storage)
    window = latest_window(data_root)
    if window is None:
        return _nothing_to_do(
            f"no complete dt=YYYY-MM-DD window under {data_root}: nothing to train "
            "(write synthetic ones with `ett generate --daily N`)"
        )
    job_id = f"{job_prefix or base.job_id or 'retrain'}-{window.date}"
    anchor = find_anchor(base.model_copy(update={"job_id": job_id}).layout)
    if anchor is not None:
        return _nothing_to_do(
            f"no new window: the newest, {window.date}, was trained already by job {job_id} "
            f"(anchor {anchor.uri})",
            window=window.date,
            job_id=job_id,
        )
    warm = champion_anchor(base.tracking.mlflow_uri, base.tracking.registered_model)
    window_overrides: dict[str, Any] = {"job_id": job_id, "data": {"url": window.url}}
    if warm is not None:
        window_overrides["checkpoint"] = {"warm_start": warm}
    logger().info(
        "retraining %s on %s (%s)",
        job_id,
        window.url,
        f"warm from {warm}" if warm else "cold start",
    )
    result = train_flow(config=config, overrides=_merged(overrides or {}, window_overrides))
    return {
        **result,
        "trained": True,
        "window": window.date,
        "data_url": window.url,
        "warm_start": warm,
    }
