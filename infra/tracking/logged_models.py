"""A job's anchor checkpoints as MLflow 3 LoggedModels of its training run.

MLflow 3's convention for deep learning: the checkpoints a training run produces are
LoggedModels of that run, each at its step, with the run's evaluation metrics at that step
linked to it. Here each anchor checkpoint becomes ``ranker-<job_id>-step-<N>``:

- source run: the job's training run, and a model output of it at step N (the run's page
  lists it under "Logged models", its registered versions under "Registered models");
- params: what identifies the checkpoint (``anchor_uri``, ``anchor_key``, the manifest's
  sha256, world size, job id, step, training run id; publishing adds ``publish_run_id``);
- metrics: the trainer's ``eval/auc`` and ``eval/logloss`` at step N (logged with the model's
  id), publishing adds its gate's ``publish/*``;
- until publishing logs the served model into it (publish/export.py), the model is marked
  external (``mlflow.model.isExternal``: its weights are the checkpoint, on the job's storage)
  and READY.

The flow side creates them when it logs the job (infra/tracking/mlflow_runs.log_job_report),
never the trainer ranks: training never waits on MLflow. Publishing finds the same model (by
name and ``anchor_key``) or, for a checkpoint nobody logged (published by hand, or its job was
logged while MLflow was down), creates it the same way. Two creators at once both keep the
oldest and delete their own, so an anchor ends with one model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.entities import LoggedModel, LoggedModelOutput, LoggedModelStatus, Metric
from mlflow.utils import mlflow_tags

from infra import storage
from infra.checkpoint_manifest import MANIFEST, CheckpointError, Manifest, committed_checkpoints
from infra.job_layout import JobLayout
from infra.naming import step_label
from infra.tracking.run_metadata import redact_url, source_tags

MODEL_TYPE = "ranker"
JOB_ID_TAG = "ett.job_id"
KEY_PARAM = "anchor_key"
PUBLISH_RUN_PARAM = "publish_run_id"
TRAINING_RUN_PARAM = "training_run_id"
SEARCH_PAGE = 100


def anchor_key(uri: str, manifest_sha256: str) -> str:
    """Identity of an anchor checkpoint: URI + manifest checksum (a checkpoint rewritten at
    the same URL gets a new key). Registry versions and LoggedModels are found by it."""
    text = f"{uri.rstrip('/')}\n{manifest_sha256}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_name(job_id: str, step: int) -> str:
    """``ranker-<job_id>-step-<N>``, the step spelled as in every run name (MLflow refuses
    dots in a model name)."""
    return f"{MODEL_TYPE}-{job_id.replace('.', '_')}-{step_label(step)}"


@dataclass(frozen=True)
class CheckpointModel:
    """What a LoggedModel of an anchor checkpoint is made from."""

    job_id: str
    step: int
    uri: str
    manifest_sha256: str
    world_size: int

    @property
    def key(self) -> str:
        return anchor_key(self.uri, self.manifest_sha256)

    @property
    def name(self) -> str:
        return model_name(self.job_id, self.step)

    def params(self, training_run_id: str | None) -> dict[str, str]:
        params = {
            "anchor_uri": redact_url(self.uri.rstrip("/")),
            KEY_PARAM: self.key,
            "anchor_manifest_sha256": self.manifest_sha256,
            "anchor_world_size": str(self.world_size),
            "job_id": self.job_id,
            "step": str(self.step),
        }
        if training_run_id:
            params[TRAINING_RUN_PARAM] = training_run_id
        return params

    def description(self, training_run_id: str | None) -> str:
        run = f"training run `{training_run_id}`" if training_run_id else "no training run"
        return (
            f"Anchor checkpoint of job `{self.job_id}` at step {self.step}: "
            f"`{redact_url(self.uri)}` ({run}). Its weights are the checkpoint until publishing "
            "logs the served model here; `eval/*` are the trainer's holdout metrics at this "
            "step, `publish/*` the publish gate's."
        )


def checkpoint_model(uri: str, manifest_text: str, job_id: str | None = None) -> CheckpointModel:
    """The model of the checkpoint at ``uri`` from its manifest's text (the checksum is of
    the text: the same bytes publish/load.py checks)."""
    manifest = Manifest.from_json(manifest_text, storage.join(uri, MANIFEST))
    return CheckpointModel(
        job_id=manifest.job_id or job_id or "",
        step=manifest.step,
        uri=uri.rstrip("/"),
        manifest_sha256=hashlib.sha256(manifest_text.encode()).hexdigest(),
        world_size=manifest.world_size,
    )


def anchors(layout: JobLayout) -> list[CheckpointModel]:
    """The job's committed anchor checkpoints, oldest first (a job has one per finished run;
    retention keeps anchors)."""
    out = []
    for ckpt in reversed(committed_checkpoints(layout)):
        if not ckpt.manifest.anchor:
            continue
        try:
            text = storage.read_text(storage.join(ckpt.url, MANIFEST))
            out.append(checkpoint_model(ckpt.url, text, layout.job_id))
        except (OSError, CheckpointError):
            continue  # removed or rewritten since it was listed: not a model to log
    return out


def find_model(ml: MlflowClient, experiment_id: str, ckpt: CheckpointModel) -> LoggedModel | None:
    """The oldest live LoggedModel of this checkpoint (its name and anchor key), or None."""
    found, token = [], None
    while True:
        page = ml.search_logged_models(
            [experiment_id],
            filter_string=f"name = '{ckpt.name}'",
            max_results=SEARCH_PAGE,
            page_token=token,
        )
        found += [m for m in page if m.params.get(KEY_PARAM) == ckpt.key]
        token = page.token
        if not token:
            break
    return min(found, key=lambda m: (m.creation_timestamp, m.model_id), default=None)


def _link_output(ml: MlflowClient, run_id: str, model_id: str, step: int) -> None:
    """The model as an output of ``run_id`` at ``step``, once."""
    outputs = ml.get_run(run_id).outputs
    logged = {o.model_id for o in (outputs.model_outputs if outputs else None) or []}
    if model_id not in logged:
        ml.log_outputs(run_id, [LoggedModelOutput(model_id, step)])


def ensure_model(
    ml: MlflowClient,
    experiment_id: str,
    ckpt: CheckpointModel,
    training_run_id: str | None,
    source_run_id: str | None = None,
    code: str = "flows/train_flow.py",
) -> LoggedModel:
    """The checkpoint's LoggedModel, found or created, and an output of its source run
    (``source_run_id``, by default the training run) at its step. ``code``: the source that
    made it (the model page's "Logged from")."""
    source = source_run_id or training_run_id
    model = find_model(ml, experiment_id, ckpt)
    if model is None:
        tags = {
            JOB_ID_TAG: ckpt.job_id,
            mlflow_tags.MLFLOW_RUN_NOTE: ckpt.description(training_run_id),
            mlflow_tags.MLFLOW_MODEL_IS_EXTERNAL: "true",
            **source_tags(code),
        }
        created = ml.create_logged_model(
            experiment_id,
            name=ckpt.name,
            source_run_id=source,
            tags=tags,
            params=ckpt.params(training_run_id),
            model_type=MODEL_TYPE,
        )
        ml.finalize_logged_model(created.model_id, LoggedModelStatus.READY)
        model = find_model(ml, experiment_id, ckpt) or created
        if model.model_id != created.model_id:  # another creator was first: keep theirs
            ml.delete_logged_model(created.model_id)
    if source:
        _link_output(ml, source, model.model_id, ckpt.step)
    return model


def link_metrics(
    ml: MlflowClient,
    run_id: str,
    model: LoggedModel,
    step: int,
    curves: Sequence[Metric],
    dataset: tuple[str, str] | None = None,
) -> int:
    """Link the run's eval points at ``step`` (``curves``: the run's metrics) to ``model``,
    with their dataset ``(name, digest)``; the run's own points stay as they are (same key,
    value, step and time). Returns how many were linked."""
    name, digest = dataset if dataset else (None, None)
    linked = [
        Metric(
            m.key,
            m.value,
            m.timestamp,
            m.step,
            model_id=model.model_id,
            dataset_name=name,
            dataset_digest=digest,
        )
        for m in curves
        if m.step == step
    ]
    if linked:
        ml.log_batch(run_id, metrics=linked)
    return len(linked)
