"""Loaded anchor -> an MLflow pyfunc model logged in a "publish" run.

The publish run lives in the training run's experiment (the job config's experiment when
no training run is given) and is nested under the training run (``mlflow.parentRunId``), so
the MLflow UI shows what was published from which training run. The model holds:

    weights.pt          plain tensor state dict (torch.save), loaded with weights_only=True
    model_config.json   the data schema and model hyper-parameters to rebuild the model
    python_model        publish/serving_model.py (models-from-code: nothing pickled)
    code/               the model definition and serving wrapper (SERVING_CODE), so the
                        model loads anywhere its pip requirements are installed

with a signature (dense float, int ids, ``history`` array of long) and an input example.
"""

from __future__ import annotations

import glob
import importlib.metadata
import logging
import os
import shutil
from dataclasses import dataclass

import mlflow
import pandas as pd
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from infra.settings import JobConfig
from publish import serving
from publish.load import AnchorRef, LoadedAnchor, plain_state_dict
from publish.settings import PublishError

log = logging.getLogger(__name__)

MODEL_NAME = "model"
EXAMPLE_ROWS = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The project code the served model imports (publish.serving and what it pulls in): the model
# definition only, never the training loop. tests/publish checks a bare process loads it.
SERVING_CODE = {
    "infra": ("__init__.py", "settings.py"),
    "trainer": (
        "__init__.py",
        "model.py",
        "towers.py",
        "data/__init__.py",
        "data/batch.py",
        "attention/*.py",
    ),
    "publish": ("__init__.py", "serving.py"),
}
# Third-party packages it imports, pinned to this process's versions (never inferred: MLflow
# would load the model in a subprocess to guess). TorchRec is installed without its deps
# (DESIGN.md), so they are listed; whichever FBGEMM build is installed is kept.
_REQUIREMENTS = (
    "torch",
    "fbgemm-gpu-cpu",
    "fbgemm-gpu",
    "torchrec",
    "tensordict",
    "pyre-extensions",
    "torchmetrics",
    "tqdm",
    "mlflow",
    "pandas",
    "numpy",
    "pydantic",
    "pydantic-settings",
    "pyyaml",
)


@dataclass(frozen=True)
class Exported:
    model_uri: str  # models:/m-...
    model_id: str
    publish_run_id: str
    experiment_id: str


def pip_requirements() -> list[str]:
    reqs = []
    for name in _REQUIREMENTS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        reqs.append(f"{name}=={version.split('+')[0]}")
    return reqs


def stage_code(into: str) -> list[str]:
    """Copy SERVING_CODE into ``into``; returns the package folders for ``code_paths``."""
    folders = []
    for package, patterns in SERVING_CODE.items():
        for pattern in patterns:
            for src in sorted(glob.glob(os.path.join(ROOT, package, pattern))):
                dst = os.path.join(into, os.path.relpath(src, ROOT))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copyfile(src, dst)
        folders.append(os.path.join(into, package))
    return folders


def connect(tracking_uri: str) -> MlflowClient:
    """Point this process's MLflow (fluent API and pyfunc loading) at ``tracking_uri``."""
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def check_training_run(client: MlflowClient, run_id: str | None) -> str | None:
    """The training run's experiment id; PublishError when the run does not exist."""
    if not run_id:
        return None
    try:
        return client.get_run(run_id).info.experiment_id
    except MlflowException as exc:
        raise PublishError(f"training run {run_id!r} not found in MLflow: {exc.message}") from exc


def open_publish_run(
    client: MlflowClient, config: JobConfig, ref: AnchorRef, training_run_id: str | None
) -> tuple[str, str]:
    """Create the publish run; returns (run id, experiment id)."""
    experiment_id = check_training_run(client, training_run_id)
    if experiment_id is None:
        found = client.get_experiment_by_name(config.tracking.experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            try:
                experiment_id = client.create_experiment(config.tracking.experiment)
            except MlflowException:  # created meanwhile by another process
                experiment_id = client.get_experiment_by_name(
                    config.tracking.experiment
                ).experiment_id  # type: ignore[union-attr]
    tags = {
        "ett.role": "publish",
        "ett.job_id": ref.manifest.job_id or config.job_id,
        "ett.anchor_key": ref.key,
    }
    if training_run_id:
        tags["mlflow.parentRunId"] = training_run_id
        tags["ett.training_run_id"] = training_run_id
    run = client.create_run(
        experiment_id, run_name=f"publish-{config.job_id}-step{ref.step}", tags=tags
    )
    run_id = run.info.run_id
    client.log_batch(
        run_id,
        params=[
            mlflow.entities.Param(k, str(v))
            for k, v in {
                "anchor_uri": ref.uri,
                "anchor_step": ref.step,
                "anchor_world_size": ref.manifest.world_size,
                "anchor_config_hash": ref.manifest.config_hash,
                "anchor_manifest_sha256": ref.manifest_sha256,
            }.items()
        ],
    )
    return run_id, experiment_id


def export(loaded: LoadedAnchor, example: pd.DataFrame, run_id: str, workdir: str) -> Exported:
    """Log the serving model into the publish run; returns its ``models:/`` URI."""
    data, model_config = loaded.config.data, loaded.config.model
    os.makedirs(workdir, exist_ok=True)
    weights = os.path.join(workdir, "weights.pt")
    torch.save(plain_state_dict(loaded.model), weights)
    config_path = os.path.join(workdir, "model_config.json")
    serving.save_model_config(data, model_config, config_path)
    code = os.path.join(os.path.dirname(serving.__file__), "serving_model.py")
    try:
        with mlflow.start_run(run_id=run_id) as run:
            info = mlflow.pyfunc.log_model(
                name=MODEL_NAME,
                python_model=code,
                artifacts={serving.WEIGHTS: weights, serving.MODEL_CONFIG: config_path},
                code_paths=stage_code(os.path.join(workdir, "code")),
                signature=serving.signature(data),
                input_example=example.head(EXAMPLE_ROWS),
                pip_requirements=pip_requirements(),
                metadata={"anchor_uri": loaded.ref.uri, "anchor_step": loaded.ref.step},
            )
            mlflow.log_artifact(os.path.join(loaded.local_dir, "config.yaml"), "anchor")
            experiment_id = run.info.experiment_id
    except MlflowException as exc:
        raise PublishError(f"exporting {loaded.ref.uri} to MLflow failed: {exc.message}") from exc
    log.info("exported %s as %s (publish run %s)", loaded.ref.uri, info.model_uri, run_id)
    return Exported(info.model_uri, info.model_id, run_id, experiment_id)
