"""A bounded MLflow client, and the experiment a job logs to.

Every call builds its own client for one tracking URI and its registry (nothing global), and
every HTTP call is bounded (``bound_http_calls``): a dead tracking server costs a job seconds, not
MLflow's default of minutes of retries.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

# The experiment's kind, read by MLflow's UI (3.x) to choose its layout; without it an
# experiment with no runs yet opens as a GenAI project (traces overview).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
# Every tracking HTTP call: give up after this many seconds without an answer, retry this
# often with this backoff factor (urllib3: 0, 2, 4 s ...). MLflow's defaults (120 s, 7
# retries, factor 2) let one call to a dead server stall a job for minutes. An operator's
# own MLFLOW_HTTP_REQUEST_* variables win.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


def bound_http_calls() -> None:
    """Bound every MLflow HTTP call of this process (see HTTP_DEFAULTS). MLflow reads these
    variables on each request, so this also reaches clients made before it."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


def client(tracking_uri: str) -> MlflowClient:
    """A client for ``tracking_uri``, whose model registry it also uses, with bounded calls.

    The registry is named explicitly: otherwise MlflowClient takes the process-global one,
    which publishing sets (``mlflow.set_registry_uri``), so a later client in the same
    process would read another server's registry."""
    bound_http_calls()
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def ensure_experiment(ml: MlflowClient, name: str, tracking_uri: str) -> str:
    """The experiment's id, created (or restored) if needed and marked as model training."""
    exp = ml.get_experiment_by_name(name)
    if exp is None:
        location = None
        if tracking_uri.startswith("sqlite:///"):
            # MLflow would put artifacts in ./mlruns of whatever directory the caller runs in
            # (Prefect workers run flows in temp dirs): keep them next to the database instead.
            db = Path(tracking_uri[len("sqlite:///") :]).resolve()
            location = (db.parent / "mlartifacts").as_uri()
        try:
            return ml.create_experiment(
                name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING}
            )
        except MlflowException:  # created meanwhile by another process
            exp = ml.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        ml.restore_experiment(exp.experiment_id)
    if EXPERIMENT_KIND_TAG not in exp.tags:  # a user's own choice is kept
        ml.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    return exp.experiment_id
