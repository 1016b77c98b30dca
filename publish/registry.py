"""MLflow Model Registry: one version per anchor, aliases ``candidate`` and ``champion``.

A version is registered from the anchor's LoggedModel (``mlflow.register_model`` of
``models:/<model_id>``: the checkpoint's model on the training run, made by
infra/tracking/logged_models.py), so MLflow sets the lineage itself: the version's source run
is the model's source run (the training run), and the model lists its versions (tag
``mlflow.modelVersions``): the training run's page shows its model and its version.

A version carries five tags (``VERSION_TAGS``): ``anchor_key``, ``publish_status``,
``promoted``, ``job_id``, ``step``. What else identifies the anchor (its URI, manifest checksum,
world size, the training and publish runs) is in the LoggedModel's params, the gate's decision
in its tag ``ett.gate``; the description's first line says the decision.

Idempotency: every version carries ``anchor_key`` (anchor URI + manifest checksum). A
publish first searches for it; a version whose ``publish_status`` is ``complete`` means the
anchor is published and nothing is done. A version left incomplete (a publisher died between
creating it and setting its aliases) is completed, not duplicated. Two publishers never race
on one anchor: the ``publish`` deployment runs one flow run at a time (a concurrency limit
with the ENQUEUE strategy in prefect.yaml), so the next one finds the version complete.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlflow
import numpy as np
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

log = logging.getLogger(__name__)

CANDIDATE, CHAMPION = "candidate", "champion"
KEY_TAG, STATUS_TAG, COMPLETE = "anchor_key", "publish_status", "complete"
PROMOTED_TAG, JOB_TAG, STEP_TAG = "promoted", "job_id", "step"
VERSION_TAGS = (KEY_TAG, STATUS_TAG, PROMOTED_TAG, JOB_TAG, STEP_TAG)
ANCHOR_PARAM = "anchor_uri"  # on the version's LoggedModel (older versions: a version tag)
READY_TIMEOUT_S = 300  # a new version's registration (copying the model) must finish by then


@dataclass(frozen=True)
class ChampionScore:
    version: str | None  # None: there is no champion yet
    auc: float | None
    error: str | None = None
    logloss: float | None = None


def model_id_of(version: ModelVersion) -> str | None:
    """The LoggedModel a version was registered from (MLflow keeps it in ``source``,
    ``models:/<model_id>``; ``version.model_id`` stays empty on an OSS registry)."""
    if version.model_id:
        return version.model_id
    rest = (version.source or "").removeprefix("models:/")
    return rest if rest != version.source and rest and "/" not in rest else None


def versions_for_key(client: MlflowClient, name: str, key: str) -> list[ModelVersion]:
    """Versions of ``name`` published from this anchor, oldest first."""
    found = client.search_model_versions(f"name = '{name}' AND tags.{KEY_TAG} = '{key}'")
    return sorted(found, key=lambda v: int(v.version))


def published_version(client: MlflowClient, name: str, key: str) -> ModelVersion | None:
    """The complete version for this anchor, if it was published already."""
    try:
        found = versions_for_key(client, name, key)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return next((v for v in found if v.tags.get(STATUS_TAG) == COMPLETE), None)


def ensure_registered_model(client: MlflowClient, name: str) -> None:
    try:
        client.get_registered_model(name)
        return
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    try:
        client.create_registered_model(
            name, description="Ranking model published from anchor checkpoints (ETT pipeline)."
        )
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def champion(client: MlflowClient, name: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def score_champion(client: MlflowClient, name: str, scorer: Any) -> ChampionScore:
    """Re-evaluate the current champion with ``scorer(model_uri) -> (auc, logloss)`` (on the
    holdout rows the new model was validated on); an unscorable champion is reported, not
    raised."""
    current = champion(client, name)
    if current is None:
        return ChampionScore(None, None)
    try:
        auc, logloss = scorer(f"models:/{name}@{CHAMPION}")
    except Exception as exc:  # noqa: BLE001 - another schema, missing artifacts, ...
        log.warning("could not re-evaluate champion %s v%s: %s", name, current.version, exc)
        first = (str(exc).splitlines() or [""])[0]
        return ChampionScore(current.version, None, f"{type(exc).__name__}: {first}"[:300])
    return ChampionScore(current.version, float(auc), logloss=float(logloss))


def should_promote(auc: float, champ: ChampionScore, margin: float) -> bool:
    if champ.version is None:
        return True
    if champ.auc is None or not np.isfinite(champ.auc):
        return False  # cannot show the new model is not worse
    return auc >= champ.auc - margin


def register(
    client: MlflowClient,
    name: str,
    key: str,
    model_id: str,
    tags: dict[str, str],
    promote: bool,
    description: str,
) -> tuple[ModelVersion, bool]:
    """Create (or complete) the version for this anchor, set aliases, mark it complete.
    ``tags``: ``job_id`` and ``step`` (the version's other tags are set here).

    Returns (version, created): ``created`` is False when the anchor was published already.
    """
    extra = set(tags) - {JOB_TAG, STEP_TAG}
    if extra:
        raise ValueError(f"a version carries only {VERSION_TAGS}: not {sorted(extra)}")
    ensure_registered_model(client, name)
    existing = versions_for_key(client, name, key)
    done = next((v for v in existing if v.tags.get(STATUS_TAG) == COMPLETE), None)
    if done is not None:
        return done, False
    all_tags = {**tags, KEY_TAG: key, PROMOTED_TAG: str(promote).lower()}
    if existing:
        version = existing[0]
        log.info("completing %s version %s left by an interrupted publish", name, version.version)
        for k, v in all_tags.items():
            client.set_model_version_tag(name, version.version, k, v)
    else:
        # Waits until the version is READY (await_registration_for); raises if it failed.
        version = mlflow.register_model(
            f"models:/{model_id}", name, await_registration_for=READY_TIMEOUT_S, tags=all_tags
        )
    client.update_model_version(name, version.version, description=description)
    client.set_registered_model_alias(name, CANDIDATE, version.version)
    if promote:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    client.set_model_version_tag(name, version.version, STATUS_TAG, COMPLETE)
    return client.get_model_version(name, version.version), True


def anchor_uri_of(client: MlflowClient, version: ModelVersion) -> str | None:
    """The anchor checkpoint a version was published from: its LoggedModel's ``anchor_uri``
    param (a version published before those existed: its ``anchor_uri`` tag); None if
    neither says."""
    model_id = model_id_of(version)
    if model_id:
        try:
            uri = client.get_logged_model(model_id).params.get(ANCHOR_PARAM)
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            uri = None
        if uri:
            return uri
    return (version.tags or {}).get(ANCHOR_PARAM) or None
