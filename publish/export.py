"""Loaded anchor -> an MLflow pyfunc model logged into the anchor's LoggedModel.

The anchor's LoggedModel is the training run's (``ranker-<job>-step-<N>``, made when the job
was logged: infra/tracking/logged_models.py); a checkpoint nobody logged gets it made here, the
same way, on the training run (or on the publish run when no training run is known). The
served model's files go into that LoggedModel, so the training run's page shows the model and,
once registered, its version. The publish run holds the gate: it lives in the training run's
experiment (the job config's experiment when no training run is known), is nested under the
training run (``mlflow.parentRunId``), lists the model as its input and logs the gate's
metrics with the model's id. The model holds:

    weights.pt          plain tensor state dict (torch.save), loaded with weights_only=True
    model_config.json   the data schema and model hyper-parameters to rebuild the model
    python_model        publish/serving_model.py (models-from-code: nothing pickled)
    code/               the model definition and serving wrapper (SERVING_CODE), so the
                        model loads anywhere its pip requirements are installed
    artifacts/fbgemm_gpu-<v>+cpu-py3-none-any.whl   see below

with a signature (dense float, int ids, ``history`` array of long) and an input example.

Its environment installs on a CPU machine. TorchRec's metadata requires ``fbgemm-gpu``, the
CUDA build, which does not even import without CUDA; the CPU build is another distribution,
``fbgemm-gpu-cpu``, providing the same ``fbgemm_gpu`` module. pip has no per-requirement
``--no-deps``, so the model carries a metadata-only wheel named ``fbgemm-gpu`` (no files; it
requires ``fbgemm-gpu-cpu`` of the same version) and lists it by path: pip then satisfies
TorchRec's requirement with it and installs the CPU build. MLflow installs a model's
requirements from inside the model's folder, so the path resolves wherever the model goes.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import importlib.metadata
import logging
import os
import shutil
import zipfile
from dataclasses import dataclass

import mlflow
import pandas as pd
import torch
from mlflow import MlflowClient
from mlflow.entities import LoggedModel, LoggedModelInput, Param
from mlflow.exceptions import MlflowException
from mlflow.utils import mlflow_tags

from infra.naming import publish_run_name
from infra.settings import JobConfig
from infra.tracking import logged_models, mlflow_runs
from infra.tracking import metrics as names
from infra.tracking.client import client, ensure_experiment
from infra.tracking.run_metadata import source_tags
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
    "infra": ("__init__.py", "settings.py", "config_sources.py", "job_layout.py", "urls.py"),
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
# Third-party packages the served model imports, pinned to this process's versions (never
# inferred: MLflow would load the model in a subprocess to guess). TorchRec's own needs are
# listed because it is installed without its dependencies here; FBGEMM is handled apart (see
# the module docstring).
_REQUIREMENTS = (
    "torch",
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
FBGEMM_BUILDS = ("fbgemm-gpu-cpu", "fbgemm-gpu")  # whichever this process has
SHIM_ARTIFACT = "fbgemm_gpu_cpu_shim"


@dataclass(frozen=True)
class Exported:
    model_uri: str  # models:/m-...
    model_id: str
    publish_run_id: str
    experiment_id: str


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def fbgemm_version() -> str:
    """The version of the FBGEMM build this process runs (CPU or CUDA)."""
    for name in FBGEMM_BUILDS:
        if version := _installed(name):
            return version
    raise PublishError("neither fbgemm-gpu-cpu nor fbgemm-gpu is installed: cannot pin FBGEMM")


def fbgemm_shim(into: str, version: str) -> str:
    """Write the metadata-only ``fbgemm-gpu`` wheel (see the module docstring); returns its
    path. Deterministic: the same version gives the same bytes."""
    dist = f"fbgemm_gpu-{version}+cpu"
    metadata = (
        "Metadata-Version: 2.1\n"
        "Name: fbgemm-gpu\n"
        f"Version: {version}+cpu\n"
        "Summary: Metadata only: satisfies torchrec's fbgemm-gpu requirement with the CPU "
        "build, fbgemm-gpu-cpu, which provides the fbgemm_gpu module.\n"
        f"Requires-Dist: fbgemm-gpu-cpu=={version}\n"
    )
    wheel = (
        "Wheel-Version: 1.0\nGenerator: ett-pipeline\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files = {f"{dist}.dist-info/METADATA": metadata, f"{dist}.dist-info/WHEEL": wheel}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    os.makedirs(into, exist_ok=True)
    path = os.path.join(into, f"{dist}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in files.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), text)
    return path


def pip_requirements(shim_path: str) -> list[str]:
    """The model's requirements: ``_REQUIREMENTS`` pinned, the CPU FBGEMM build and the
    shim (by its path inside the model, ``artifacts/<wheel>``)."""
    reqs = [f"{name}=={v}" for name in _REQUIREMENTS if (v := _installed(name))]
    reqs.insert(1, f"fbgemm-gpu-cpu=={fbgemm_version()}")
    reqs.insert(2, f"artifacts/{os.path.basename(shim_path)}")
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
    """Point this process's MLflow (fluent API and pyfunc loading) at ``tracking_uri``, with
    every HTTP call bounded (infra.tracking.client.client)."""
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    return client(tracking_uri)


def check_training_run(client: MlflowClient, run_id: str | None) -> str | None:
    """The training run's experiment id; PublishError when the run does not exist."""
    if not run_id:
        return None
    try:
        return client.get_run(run_id).info.experiment_id
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise  # MLflow unavailable: worth a retry, not a refusal
        raise PublishError(f"training run {run_id!r} not found in MLflow: {exc.message}") from exc


def find_training_run(client: MlflowClient, config: JobConfig, job_id: str) -> str | None:
    """The job's run, looked up by job id when the caller did not name it (the job started
    while MLflow was down, say, and its run was made at its end)."""
    exp = client.get_experiment_by_name(config.tracking.experiment)
    run = mlflow_runs.find_job_run(client, exp.experiment_id, job_id) if exp else None
    return run.info.run_id if run is not None else None


def _description(config: JobConfig, ref: AnchorRef, rows: int) -> str:
    return (
        f"Publishing of `{ref.uri}` (step {ref.step}) of job `{config.job_id}`.\n\n"
        f"- `{names.PUBLISH}*`: the publish gate, on the first {rows} holdout rows (dataset "
        f"`holdout[:{rows}]`), the rows the champion is re-scored on. The training run's "
        f"`{names.EVAL_AUC}` uses the first {config.train.eval_rows} rows of the same "
        "split: a larger sample, so the two differ by sampling noise.\n"
        f"- `{names.PUBLISH}parity_max_abs_diff`: the exported model against the trainer's own "
        "forward pass on those rows.\n"
        "- The model it published is the anchor's LoggedModel of the training run (this run's "
        "input)."
    )


def open_publish_run(
    client: MlflowClient,
    config: JobConfig,
    ref: AnchorRef,
    training_run_id: str | None,
    holdout_rows: int,
) -> tuple[str, str]:
    """Create the publish run; returns (run id, experiment id)."""
    experiment_id = check_training_run(client, training_run_id) or ensure_experiment(
        client, config.tracking.experiment, client.tracking_uri
    )
    tags = {
        mlflow_runs.KIND_TAG: "publish",
        mlflow_runs.PARENT_JOB_TAG: ref.manifest.job_id or config.job_id,
        "ett.anchor_key": ref.key,
        mlflow_tags.MLFLOW_RUN_NOTE: _description(config, ref, holdout_rows),
        **source_tags("flows/publish_flow.py"),
    }
    if training_run_id:
        tags[mlflow_tags.MLFLOW_PARENT_RUN_ID] = training_run_id
        tags["ett.training_run_id"] = training_run_id
    run = client.create_run(
        experiment_id, run_name=publish_run_name(config.job_id, ref.step), tags=tags
    )
    run_id = run.info.run_id
    params = {
        "anchor_uri": ref.uri,
        "anchor_step": ref.step,
        "anchor_world_size": ref.manifest.world_size,
        "anchor_config_hash": ref.manifest.config_hash,
        "anchor_manifest_sha256": ref.manifest_sha256,
    }
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
    return run_id, experiment_id


def checkpoint_model(
    client: MlflowClient,
    ref: AnchorRef,
    job_id: str,
    experiment_id: str,
    training_run_id: str | None,
    publish_run_id: str,
) -> LoggedModel:
    """The anchor's LoggedModel (found, or made on the training run, else on the publish
    run), listed as the publish run's input."""
    ckpt = logged_models.CheckpointModel(
        job_id=job_id,
        step=ref.step,
        uri=ref.uri,
        manifest_sha256=ref.manifest_sha256,
        world_size=ref.manifest.world_size,
    )
    model = logged_models.ensure_model(
        client,
        experiment_id,
        ckpt,
        training_run_id,
        source_run_id=training_run_id or publish_run_id,
        code="flows/publish_flow.py",
    )
    client.log_inputs(publish_run_id, models=[LoggedModelInput(model.model_id)])
    return model


def export(
    ml: MlflowClient,
    loaded: LoadedAnchor,
    example: pd.DataFrame,
    run_id: str,
    workdir: str,
    model: LoggedModel,
) -> Exported:
    """Log the serving model into the anchor's LoggedModel ``model`` (the anchor's config
    goes to the publish run ``run_id``); returns its ``models:/`` URI. An MLflow error
    propagates as itself (the flow retries it); only a bad model is a PublishError."""
    data, model_config = loaded.config.data, loaded.config.model
    os.makedirs(workdir, exist_ok=True)
    weights = os.path.join(workdir, "weights.pt")
    torch.save(plain_state_dict(loaded.model), weights)
    config_path = os.path.join(workdir, "model_config.json")
    serving.save_model_config(data, model_config, config_path)
    shim = fbgemm_shim(os.path.join(workdir, "wheels"), fbgemm_version())
    code = os.path.join(os.path.dirname(serving.__file__), "serving_model.py")
    code_dir = os.path.join(workdir, "code")
    shutil.rmtree(code_dir, ignore_errors=True)  # a retried export stages afresh
    # No active run: the model is the training run's, at its step (ensure_model linked it);
    # an active publish run would make it that run's output as well.
    info = mlflow.pyfunc.log_model(
        name=MODEL_NAME,
        model_id=model.model_id,
        python_model=code,
        artifacts={
            serving.WEIGHTS: weights,
            serving.MODEL_CONFIG: config_path,
            SHIM_ARTIFACT: shim,
        },
        code_paths=stage_code(code_dir),
        signature=serving.signature(data),
        input_example=example.head(EXAMPLE_ROWS),
        pip_requirements=pip_requirements(shim),
        metadata={"anchor_uri": loaded.ref.uri, "anchor_step": loaded.ref.step},
    )
    ml.log_artifact(run_id, os.path.join(loaded.local_dir, "config.yaml"), "anchor")
    experiment_id = ml.get_run(run_id).info.experiment_id
    log.info("exported %s as %s (publish run %s)", loaded.ref.uri, info.model_uri, run_id)
    return Exported(info.model_uri, info.model_id, run_id, experiment_id)
