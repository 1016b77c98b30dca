"""End to end against the real local stack: S3 (moto), an MLflow server, a Prefect server.

``prefect deploy --all`` from prefect.yaml, a ``prefect worker start --pool ett-local``
subprocess, and the real trainer under torchrun on a tiny data set (~30 steps):

1. the ``train`` deployment with an injected SIGKILL and a preemption recovers twice, commits
   the anchor and emits the anchor event; the ``publish`` deployment runs BY ITSELF from its
   trigger and registers a model version with aliases in MLflow; training ended first, and
   the job's ETT report shows 2 failures, a Time to Recover per failure, and a training
   shutdown that does not include publishing;
2. the ``retrain`` deployment has its cron schedule on the server, and a run of it picks the
   newest complete data window and warm-starts from the champion's anchor.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterStartTime,
    LogFilter,
    LogFilterTextSearch,
)
from prefect.deployments import run_deployment

from infra import storage
from infra.accounting.ett import report_for_job
from infra.accounting.ledger_read import read_events
from infra.settings import dump_config
from publish import registry
from tests.factories import tiny_config, write_dataset
from tests.prefect_worker import deployed_worker

pytestmark = pytest.mark.slow

MODEL = "e2e-ranker"
RUN_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def worker(
    prefect_server: str,  # noqa: F811
    s3_server: str,  # noqa: F811
    mlflow_server: str,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path]:
    """Deployments from prefect.yaml and a process worker; yields the worker's log file."""
    env = {"ETT_TRACKING__MLFLOW_URI": mlflow_server}  # publishing uses the worker's MLflow
    with deployed_worker(tmp_path_factory.mktemp("worker") / "worker.log", env) as log:
        yield log


def _config(tmp_path: Path, job_id: str, mlflow_uri: str, **sections: Any):
    return tiny_config(
        tmp_path,
        job_id=job_id,
        storage={"root": f"s3://ett/e2e-{uuid.uuid4().hex[:8]}"},
        train={"steps": 30, "log_every": 5, "eval_every": 0, "eval_rows": 512},
        checkpoint={"mode": "async_staged", "every_steps": 5, "keep_latest_k": 3},
        tracking={"mlflow_uri": mlflow_uri, "registered_model": MODEL},
        **sections,
    )


def _run(name: str, parameters: dict[str, Any], worker_log: Path):
    flow_run = run_deployment(
        name, parameters=parameters, timeout=RUN_TIMEOUT_S, poll_interval=2, as_subflow=False
    )
    assert flow_run.state is not None and flow_run.state.is_completed(), (
        f"{name} ended {flow_run.state}; worker log:\n{worker_log.read_text()[-8000:]}"
    )
    return flow_run


def _publish_run_for(job_id: str, since: Any, worker_log: Path, timeout_s: float = 300):
    """The publish flow run triggered for ``job_id``, once it is final."""
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["publish"])),
                flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since)),
            )
            mine = [r for r in runs if r.parameters.get("job_id") == job_id]
            if mine and mine[0].state is not None and mine[0].state.is_final():
                return mine[0]
            time.sleep(2)
    raise AssertionError(
        f"no finished publish run for {job_id} within {timeout_s} s; "
        f"worker log:\n{worker_log.read_text()[-8000:]}"
    )


def _scheduled_runs(deployment_id: Any, timeout_s: float = 90) -> list[Any]:
    """Future runs the server's scheduler made for a deployment (its loop runs every ~60 s)."""
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["retrain"]))
            )
            found = [
                r
                for r in runs
                if r.deployment_id == deployment_id
                and r.state is not None
                and r.state.is_scheduled()
            ]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(3)


def test_train_recovers_and_publishing_runs_from_the_trigger(
    tmp_path: Path,
    worker: Path,
    mlflow_server: str,  # noqa: F811
) -> None:
    config = _config(tmp_path, "e2e-train", mlflow_server)
    write_dataset(config)
    path = tmp_path / "job.yaml"
    dump_config(config, path)
    faults = [
        {"kind": "sigkill", "step": 12, "attempt": 0},
        {"kind": "sigterm", "step": 22, "attempt": 1},
    ]

    overrides = {"faults": faults, "recovery": {"backoff_s": 1.0}}
    train = _run("train/train", {"config": str(path), "overrides": overrides}, worker)
    publish = _publish_run_for(config.job_id, train.start_time, worker)

    assert publish.state.is_completed(), publish.state
    assert train.end_time < publish.end_time  # training did not wait for publishing
    storage.configure(config.storage)
    events = read_events(config.layout)
    anchor = next(e for e in events if e.name == "anchor_committed")
    assert anchor.step == 30
    assert publish.parameters["uri"] == anchor.attrs["url"]

    ml = MlflowClient(mlflow_server)
    version = ml.get_model_version_by_alias(MODEL, "champion")
    assert registry.anchor_uri_of(ml, version) == anchor.attrs["url"]
    assert {"candidate", "champion"} <= set(version.aliases)
    # The version was registered from the LoggedModel the train flow made for its anchor: a
    # model of the job's run at the anchor's step, with the trainer's eval at that step.
    (job_run,) = ml.search_runs(
        [ml.get_experiment_by_name(config.tracking.experiment).experiment_id],
        f"tags.`ett.job_id` = '{config.job_id}' and tags.`ett.kind` = 'job'",
    )
    model = ml.get_logged_model(registry.model_id_of(version))
    assert model.name == f"ranker-{config.job_id}-step-30"
    assert model.source_run_id == version.run_id == job_run.info.run_id
    assert [(o.model_id, o.step) for o in job_run.outputs.model_outputs] == [(model.model_id, 30)]
    on_model = {(m.key, m.step): m.value for m in model.metrics}
    assert ("publish/holdout_auc", 0) in on_model
    # The run's eval points at the anchor's step, if the side evaluator scored it in time.
    run_id = job_run.info.run_id
    at_anchor = {
        (h.key, h.step): h.value
        for key in ("eval/auc", "eval/logloss")
        for h in ml.get_metric_history(run_id, key)
        if h.step == 30
    }
    assert {k: v for k, v in on_model.items() if k[0].startswith("eval/")} == at_anchor

    report = report_for_job(config.layout)
    assert report.num_failures == 2
    assert [f.cause for f in report.failures] == ["sigkill", "preempted"]
    assert all(f.resumed_at is not None and f.time_to_recover_s > 0 for f in report.failures)
    shutdown = [e for e in events if e.name == "shutdown" and e.rank == 0]
    assert shutdown and max(e.end for e in shutdown) < publish.start_time.timestamp()
    assert report.start_time + report.wall_s < publish.start_time.timestamp()


def test_retrain_is_scheduled_and_warm_starts_from_the_champion(
    tmp_path: Path,
    worker: Path,
    mlflow_server: str,  # noqa: F811
) -> None:
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("retrain/retrain")
    crons = [getattr(s.schedule, "cron", None) for s in deployment.schedules if s.active]
    assert crons == ["0 2 * * *"]

    ml = MlflowClient(mlflow_server)
    champion = ml.get_model_version_by_alias(MODEL, "champion")  # from the test above
    anchor_uri = registry.anchor_uri_of(ml, champion)
    config = _config(tmp_path, "e2e-retrain", mlflow_server)
    root = tmp_path / "daily"
    write_dataset(
        config.model_copy(
            update={"data": config.data.model_copy(update={"url": f"file://{root}/dt=2026-11-29"})}
        )
    )
    (root / "dt=2026-11-28").mkdir()
    (root / "dt=2026-11-28" / "_SUCCESS").touch()  # complete, but older
    (root / "dt=2026-11-30").mkdir()
    (root / "dt=2026-11-30" / "part-00000.parquet").touch()  # still being written
    path = tmp_path / "job.yaml"
    dump_config(config, path)

    retrain = _run(
        "retrain/retrain",
        {
            "config": str(path),
            "data_root": f"file://{root}",
            "job_prefix": "e2e-retrain",
            "overrides": {"recovery": {"backoff_s": 1.0}},
        },
        worker,
    )
    job_id = "e2e-retrain-2026-11-29"
    publish = _publish_run_for(job_id, retrain.start_time, worker)
    assert publish.state.is_completed(), publish.state
    # the train subflow's artifact keys are its parent deployment's, and so is the key of
    # the link the publish run left in it: the history of a key is the daily retrains'
    train_run = publish.parameters["train_flow_run_id"]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[train_run]))
        )
        assert client.read_flow_run(train_run).parent_task_run_id is not None  # a subflow
    assert {"ett-buckets-retrain", "publish-run-retrain"} <= {a.key for a in artifacts}

    with get_client(sync_client=True) as client:
        query = LogFilterTextSearch(query="warm-started")
        logs = client.read_logs(log_filter=LogFilter(text=query))
    assert any(f"warm-started the model from {anchor_uri}" in log.message for log in logs), [
        log.message for log in logs
    ]
    assert _scheduled_runs(deployment.id), "the scheduler service made no retrain run"
    # publishing decided: the retrained model is the candidate (champion if not worse)
    candidate = ml.get_model_version_by_alias(MODEL, "candidate")
    assert candidate.tags["job_id"] == job_id and candidate.version != champion.version
