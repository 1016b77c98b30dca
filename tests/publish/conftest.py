"""A real anchor checkpoint written by a 2-process training job, and the servers to publish to.

``trained_job`` (session): a tiny synthetic data set, ``python -m torch.distributed.run
--nproc_per_node 2 -m trainer`` to step 20 (checkpoints at 10 and the anchor at 20, on
local disk), the anchor copied to the moto S3 bucket (so publishing downloads it), and an
MLflow "training run" to link the published version to.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra import storage
from infra.accounting.ledger_read import read_events
from infra.settings import JobConfig
from tests.factories import run_trainer, tiny_config, write_dataset

log = logging.getLogger(__name__)

JOB_ID = "pub2"
REGISTERED_MODEL = "ranker-publish-test"
STEPS = 20


@dataclass(frozen=True)
class TrainedJob:
    config: JobConfig
    job_url: str  # file://
    anchor_url: str  # file://, from the trainer's anchor_committed mark
    s3_anchor_url: str  # the same files in s3://ett
    step10_url: str  # a committed, non-anchor checkpoint of the same job
    training_run_id: str
    tracking_uri: str
    registered_model: str


def _copy_tree(src_url: str, dst_url: str) -> None:
    local = storage.local_path(src_url)
    assert local is not None
    for name in sorted(os.listdir(local)):
        storage.put_file(os.path.join(local, name), storage.join(dst_url, name))


@pytest.fixture(scope="session")
def trained_job(
    tmp_path_factory: pytest.TempPathFactory, mlflow_server: str, s3_server: str
) -> TrainedJob:
    tmp: Path = tmp_path_factory.mktemp("publish-job")
    config = tiny_config(
        tmp,
        job_id=JOB_ID,
        train={"steps": STEPS, "dense_lr": 0.02, "eval_every": 0, "log_every": 5},
        checkpoint={"mode": "async_staged", "every_steps": 10, "keep_latest_k": 3},
        tracking={
            "mlflow_uri": mlflow_server,
            "experiment": "publish-tests",
            "registered_model": REGISTERED_MODEL,
        },
    )
    t0 = time.perf_counter()
    write_dataset(config)
    t1 = time.perf_counter()
    proc = run_trainer(config, tmp, nproc=2, timeout=600)
    log.info("trained_job: data %.1f s, 2-rank training %.1f s", t1 - t0, time.perf_counter() - t1)
    if proc.returncode != 0:
        pytest.fail(
            f"2-process training failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    anchors = [e for e in read_events(config.layout) if e.name == "anchor_committed"]
    assert anchors, "the trainer committed no anchor checkpoint"
    anchor_url = anchors[-1].attrs["url"]
    s3_anchor = f"s3://ett/jobs/{JOB_ID}/checkpoints/{anchor_url.rstrip('/').rsplit('/', 1)[-1]}"
    _copy_tree(anchor_url, s3_anchor)

    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("publish-tests")
    experiment_id = (
        experiment.experiment_id if experiment else client.create_experiment("publish-tests")
    )
    run = client.create_run(experiment_id, run_name=f"train-{JOB_ID}")
    client.set_terminated(run.info.run_id, "FINISHED")
    return TrainedJob(
        config=config,
        job_url=config.layout.url,
        anchor_url=anchor_url,
        s3_anchor_url=s3_anchor,
        step10_url=storage.join(config.layout.url, "checkpoints", "step-000000010"),
        training_run_id=run.info.run_id,
        tracking_uri=mlflow_server,
        registered_model=REGISTERED_MODEL,
    )
