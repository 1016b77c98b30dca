"""The deployments of prefect.yaml as a Prefect user meets them: a real ``prefect server``,
``prefect deploy --all`` and a process worker whose environment sets ETT_* variables.

One ``train`` deployment run, with a SIGKILL injected, whose parameters, run job variables
and worker environment disagree, then the ``publish`` run its anchor event triggers:

- which value wins (the run's job_variables env > the worker's environment > the run's
  parameters > the config file > the defaults), in the flow and in the torchrun ranks;
- flow and task runs named after the job; the ETT table and MLflow link artifacts, and the
  publish run's link to the model version it registered;
- the train run and its publish run linked both ways (link artifacts, the anchor event's and
  the model event's related train run), the publish gate as a table, and artifact keys
  stable per deployment: two jobs, one key, two versions in its history;
- a log without library dumps or torchrun's own traceback, and lines of the ``publish``
  loggers in the publish run's logs (PREFECT_LOGGING_EXTRA_LOGGERS);
- publish runs one at a time (ENQUEUE), and its trigger's name and description;
- ``ett demo`` on this stack publishes once, through the trigger;
- a second run with the same parameters is a new job (issue 27), and a finished job's id is
  refused in one line;
- the pages a user opens, read in headless Chromium (infra/devstack/chromium.py): the MLflow
  run's curves first, its LoggedModel and version, the bucket table; the publish run's gate
  table, the train run's link to its publish run (ETT_SCREENSHOTS=DIR saves them: docs/img).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.sorting import ArtifactSort
from prefect.deployments import run_deployment

from infra import storage
from infra.accounting.ledger_read import read_events
from infra.devstack.chromium import Chromium
from infra.settings import JobConfig, dump_config
from publish.registry import model_id_of
from tasks.events import ANCHOR_EVENT, RESOURCE_PREFIX
from tests.factories import ROOT, tiny_config, write_dataset
from tests.prefect_worker import deployed_worker

pytestmark = pytest.mark.slow

MODEL = "deployments-ranker"
RUN_TIMEOUT_S = 420
WORKER_ENV = {  # the worker machine's say
    "ETT_TRAIN__LOG_EVERY": "4",
    "ETT_CHECKPOINT__EVERY_STEPS": "5",
}
NEW_JOB = re.compile(r"train-\d{8}-\d{6}-[0-9a-f]{4}")  # a run's new job id, and its name
RUN_ENV = {"ETT_CHECKPOINT__EVERY_STEPS": "3"}  # the run's job_variables
OVERRIDES = {  # the run's parameters
    "train": {"steps": 8},
    "checkpoint": {"every_steps": 4},
    "faults": [{"kind": "sigkill", "step": 5, "attempt": 0}],
    "recovery": {"backoff_s": 1.0},
}


@pytest.fixture(scope="module")
def worker(
    prefect_server: str,  # PREFECT_API_URL points at it
    s3_server: str,  # the S3 environment of the worker
    mlflow_server: str,  # the worker's MLflow: publishing never takes it from a checkpoint
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path]:
    """Deployments from prefect.yaml and a process worker with WORKER_ENV; yields its log."""
    env = {**WORKER_ENV, "ETT_TRACKING__MLFLOW_URI": mlflow_server}
    with deployed_worker(tmp_path_factory.mktemp("worker") / "worker.log", env) as log:
        yield log


def _final(flow_run_id: Any, worker_log: Path, timeout_s: float = RUN_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(2)
    raise AssertionError(f"run {flow_run_id} not final; worker:\n{worker_log.read_text()[-6000:]}")


def _publish_runs(job_id: str) -> list[Any]:
    """The ``publish`` deployment's runs for ``job_id``."""
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("publish/publish")
        only = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        runs = client.read_flow_runs(deployment_filter=only)
    return [r for r in runs if r.parameters.get("job_id") == job_id]


def _triggered_publish(job_id: str, worker_log: Path) -> Any:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        if mine := _publish_runs(job_id):
            return _final(mine[0].id, worker_log)
        time.sleep(2)
    raise AssertionError(f"no publish run for {job_id}; worker:\n{worker_log.read_text()[-6000:]}")


def _logs(flow_run_id: Any, page: int = 200) -> list[Any]:
    """Every log line of a flow run and its task runs (the API answers in pages)."""
    only = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    out: list[Any] = []
    with get_client(sync_client=True) as client:
        while batch := client.read_logs(log_filter=only, limit=page, offset=len(out)):
            out += batch
    return out


@dataclass(frozen=True)
class Job:
    config: JobConfig
    train: Any  # the train flow run
    publish: Any  # the publish flow run its anchor event triggered
    mlflow_uri: str
    ui_url: str  # the Prefect UI: the API's URL minus /api


@dataclass(frozen=True)
class Second:
    train: Any  # a second run of the train deployment with the same parameters
    publish: Any  # its publish run
    again: Any  # a run naming the first, finished job: refused


@pytest.fixture(scope="module")
def job(
    worker: Path,
    mlflow_server: str,
    prefect_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Job:
    tmp = tmp_path_factory.mktemp("deployments")
    config = tiny_config(  # what the config file says: no job id, so each run is a new job
        tmp,
        job_id=None,
        storage={"root": f"s3://ett/deployments-{uuid.uuid4().hex[:8]}"},
        # evaluated in the loop at steps 4 and 8: the MLflow run's eval curve (browser tests)
        train={"steps": 30, "log_every": 10, "dense_lr": 0.02, "eval_every": 4, "eval": "inline"},
        checkpoint={"every_steps": 10},
        tracking={"mlflow_uri": mlflow_server, "registered_model": MODEL},
    )
    write_dataset(config)
    dump_config(config, tmp / "job.yaml")
    train = _final(_run_train(tmp / "job.yaml").id, worker)
    assert train.state.is_completed(), f"{train.state}; worker:\n{worker.read_text()[-8000:]}"
    assert NEW_JOB.fullmatch(train.name), train.name  # a new job: the run's name is its id
    config = config.model_copy(update={"job_id": train.name})
    publish = _triggered_publish(train.name, worker)
    return Job(config, train, publish, mlflow_server, prefect_server.removesuffix("/api"))


@pytest.fixture(scope="module")
def second(job: Job, worker: Path) -> Second:
    """The same parameters again (a new job), and the first job's id again (refused)."""
    path = Path(job.train.parameters["config"])
    second_run = _run_train(path)  # the same parameters as the first
    again_run = _run_train(path, job_id=job.config.job_id)  # the finished first job, by id
    again, train = _final(again_run.id, worker), _final(second_run.id, worker)
    assert train.state.is_completed(), f"{train.state}; worker:\n{worker.read_text()[-8000:]}"
    return Second(train, _triggered_publish(train.name, worker), again)


def _run_train(path: Path, **overrides: Any) -> Any:
    """A ``train`` deployment run of the config file at ``path``, with the module's
    parameters and job variables (``overrides`` over OVERRIDES); does not wait."""
    return run_deployment(
        "train/train",
        parameters={"config": str(path), "overrides": {**OVERRIDES, **overrides}},
        job_variables={"env": RUN_ENV},
        timeout=0,
        as_subflow=False,
    )


def _events(name: str, resource_id: str) -> list[Any]:
    """The events ``name`` the server received for the resource (or prefix ``...*``)."""
    resource = (
        {"id_prefix": [resource_id[:-1]]} if resource_id.endswith("*") else {"id": [resource_id]}
    )
    with get_client(sync_client=True) as client:
        response = client.request(
            "POST",
            "/events/filter",
            json={"filter": {"event": {"name": [name]}, "resource": resource}, "limit": 50},
        )
    return list(response.json()["events"])


def _anchor_events(job_id: str) -> list[Any]:
    """The anchor events the server received for ``job_id``'s checkpoints."""
    return _events(ANCHOR_EVENT, f"{RESOURCE_PREFIX}{job_id}")


def _artifacts(key: str, flow_run_id: Any = None) -> list[Any]:
    """Every version of artifact ``key`` (of one flow run), newest first."""
    only = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])) if flow_run_id else None
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            flow_run_filter=only,
            sort=ArtifactSort.CREATED_DESC,
        )


def _artifact(key: str, flow_run_id: Any) -> Any:
    """The flow run's one artifact ``key``."""
    found = _artifacts(key, flow_run_id)
    assert len(found) == 1, (key, flow_run_id, found)
    return found[0]


def test_two_runs_with_the_same_parameters_are_two_jobs_and_a_finished_one_is_refused(
    job: Job, second: Second
) -> None:
    """Issue 27: a second run of the deployment is a job of its own (its ledger, its MLflow
    run, its anchor event, its publish run); the first job's id, finished, is refused in one
    line and announces nothing again."""
    again = second.again
    second_train = second.train
    assert NEW_JOB.fullmatch(second_train.name) and second_train.name != job.train.name
    assert second.publish.state.is_completed(), second.publish.state
    # the refusal: before anything started, in one line naming the job and the way out
    assert again.state.is_failed(), again.state
    message = again.state.message or ""
    assert f"job {job.config.job_id} is finished" in message and "\n" not in message, message
    assert "leave job_id out (or pass a new one) to start a new job" in message
    from mlflow import MlflowClient

    client = MlflowClient(job.mlflow_uri)
    experiment = client.get_experiment_by_name("ett-pipeline").experiment_id
    runs = {
        job_id: client.search_runs(
            [experiment], f"tags.`ett.job_id` = '{job_id}' AND tags.`ett.kind` = 'job'"
        )
        for job_id in (job.config.job_id, second_train.name)
    }
    assert [len(found) for found in runs.values()] == [1, 1], runs
    first_run, second_run_ = (found[0].info.run_id for found in runs.values())
    assert first_run != second_run_
    # one anchor, one event, one publish run: per job, the refused run included; the event
    # names the train run, and the trigger passes it on to the publish run
    for train in (job.train, second_train):
        deadline = time.monotonic() + 30  # the server stores events a moment after it acts
        while not (events := _anchor_events(train.name)) and time.monotonic() < deadline:
            time.sleep(1)
        assert len(events) == 1, (train.name, events)
        (event,) = events
        assert event["payload"]["train_flow_run_id"] == str(train.id)
        related = {r["prefect.resource.id"]: r["prefect.resource.role"] for r in event["related"]}
        assert related[f"prefect.flow-run.{train.id}"] == "flow-run"
        (publish,) = _publish_runs(train.name)
        assert publish.parameters["train_flow_run_id"] == str(train.id)


def test_the_environment_wins_over_run_parameters_which_win_over_the_file(job: Job) -> None:
    """One field per step of the chain: train.steps (the parameters' 8 over the file's 30),
    checkpoint.every_steps (the run's job_variables env 3 over the worker's 5, over the
    parameters' 4, over the file's 10), train.log_every (the worker's 4 over the file's 10)."""
    storage.configure(job.config.storage)
    events = [e for e in read_events(job.config.layout) if e.rank == 0]
    steps = sorted({e.step for e in events if e.name == "train_step"})
    assert steps == list(range(1, 9))  # the parameters' 8, not the file's 30
    committed = sorted({e.step for e in events if e.name == "checkpoint_committed"})
    assert {3, 6, 8} <= set(committed) and not {4, 5, 10} & set(committed)
    messages = [log.message for log in _logs(job.train.id)]
    assert any("step 4/8" in m for m in messages)  # the worker's log_every 4, not the file's 10
    assert not any("step 5/8" in m or "step 10/" in m for m in messages)


def test_runs_are_named_after_the_job(job: Job) -> None:
    job_id = job.config.job_id
    assert job.train.name == job_id  # a new job: named after the deployment, with its time
    assert job.publish.name == f"publish-{job_id}-step-8"
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[job.train.id]))
        )
    names = {r.name for r in runs}
    assert {f"{job_id}-attempt-0", f"{job_id}-attempt-1"} <= names, names


def test_the_train_run_shows_the_ett_table_and_links_mlflow(job: Job) -> None:
    job_id = job.config.job_id
    table = _artifact("ett-buckets-train", job.train.id)  # the deployment's key, not the job's
    link = _artifact("mlflow-run-train", job.train.id)
    assert table.type == "table" and job_id in table.description
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    buckets = {row["bucket"]: row for row in rows}
    assert buckets["effective_training"]["seconds"] > 0 and buckets["recovery"]["seconds"] > 0
    assert link.flow_run_id == job.train.id  # Prefect stores a link as markdown [text](url)
    assert link.data.startswith(f"[MLflow run of job {job_id}]({job.mlflow_uri}/#/experiments/")
    from mlflow import MlflowClient

    run = MlflowClient(job.mlflow_uri).search_runs(
        [MlflowClient(job.mlflow_uri).get_experiment_by_name("ett-pipeline").experiment_id],
        f"tags.`ett.job_id` = '{job_id}' AND tags.`ett.kind` = 'job'",
    )[0]
    assert link.data.endswith(f"/runs/{run.info.run_id}?workflowType=machine_learning)")


def test_the_publish_run_links_the_model_version(job: Job) -> None:
    job_id = job.config.job_id
    link = _artifact("mlflow-model-publish", job.publish.id)
    from mlflow import MlflowClient

    (found,) = MlflowClient(job.mlflow_uri).search_model_versions(
        f"name = '{MODEL}' AND tags.job_id = '{job_id}'"
    )
    version = found.version
    assert link.data == (
        f"[{MODEL} version {version}]({job.mlflow_uri}/#/models/{MODEL}/versions/{version}"
        "?workflowType=machine_learning)"
    )


def test_the_train_run_and_its_publish_run_link_to_each_other(job: Job) -> None:
    """Link artifacts both ways, to the Prefect UI's flow run pages; the publish run made the
    one in the train run, which had ended. The model event names the train run too."""
    to_publish = _artifact("publish-run-train", job.train.id)
    to_train = _artifact("train-run-publish", job.publish.id)
    page = f"{job.ui_url}/runs/flow-run/"
    assert to_publish.data == f"[publish run {job.publish.name}]({page}{job.publish.id})"
    assert to_train.data == f"[train run {job.train.name}]({page}{job.train.id})"
    assert to_publish.task_run_id is None  # no task of the publish run in the train run's tab
    events = _events("ett.model.published", f"ett.model.{MODEL}.*")
    (event,) = [e for e in events if e["payload"]["job_id"] == job.config.job_id]
    related = {r["prefect.resource.id"]: r["prefect.resource.role"] for r in event["related"]}
    assert related[f"prefect.flow-run.{job.train.id}"] == "train-flow-run"
    assert related[f"prefect.flow-run.{job.publish.id}"] == "flow-run"  # Prefect's context


def test_the_publish_run_shows_the_gate_as_a_table(job: Job, second: Second) -> None:
    """The first job's version had no champion to beat; the second job's was compared with
    it. Each table: AUC and log-loss against the champion, parity, decision and reason."""
    from mlflow import MlflowClient

    ml = MlflowClient(job.mlflow_uri)
    for train, publish, champion in (
        (job.train, job.publish, None),
        (second.train, second.publish, "1"),
    ):
        table = _artifact("gate-publish", publish.id)
        rows = {
            row["check"]: row
            for row in (table.data if isinstance(table.data, list) else json.loads(table.data))
        }
        assert list(rows) == ["AUC", "log-loss", "parity (max abs diff)", "decision"]
        (version,) = ml.search_model_versions(f"name = '{MODEL}' AND tags.job_id = '{train.name}'")
        model = ml.get_logged_model(model_id_of(version))  # the gate's numbers are on it
        (auc,) = [m.value for m in model.metrics if re.fullmatch(r"publish\Wholdout_auc", m.key)]
        assert rows["AUC"]["candidate"] == round(auc, 4)
        promoted = version.tags.get("promoted") == "true"
        decision = rows["decision"]
        assert decision["candidate"] == (
            "promoted to champion" if promoted else "kept as candidate"
        )
        assert decision["result"] and table.description.startswith(
            f"{MODEL} version {version.version} "
        )
        assert rows["parity (max abs diff)"]["result"] == "within tolerance"
        if champion is None:
            assert promoted and decision["champion"] == "none"
            assert rows["AUC"]["result"] == "no champion to compare with"
        else:
            assert decision["champion"] == f"v{champion}" and rows["AUC"]["champion"] is not None
            expected = "at least champion - margin" if promoted else "below champion - margin"
            assert rows["AUC"]["result"] == expected


def test_artifact_keys_are_the_deployments_so_two_jobs_are_one_history(
    job: Job, second: Second
) -> None:
    """Prefect's history of a key lists the successive jobs of the train deployment."""
    for key, runs in (
        ("ett-buckets-train", (job.train, second.train)),
        ("mlflow-run-train", (job.train, second.train)),
        ("publish-run-train", (job.train, second.train)),
        ("gate-publish", (job.publish, second.publish)),
        ("mlflow-model-publish", (job.publish, second.publish)),
    ):
        history = [a.flow_run_id for a in _artifacts(key)]
        mine = [run_id for run_id in history if run_id in {r.id for r in runs}]
        assert mine == [runs[1].id, runs[0].id], (key, history)  # newest first
        descriptions = [
            a.description for a in _artifacts(key) if a.flow_run_id in {r.id for r in runs}
        ]
        assert len(set(descriptions)) == 2, descriptions  # each says which job it is about


def test_logs_are_quiet_and_the_publish_loggers_reach_the_run(job: Job) -> None:
    messages = [log.message for log in _logs(job.train.id)]
    # The failure in one line, named; no launcher traceback.
    assert any(m.startswith("attempt 0: sigkill at step") for m in messages), messages
    assert not any("ChildFailedError" in m or "Traceback" in m for m in messages)
    assert not any("planner.stats" in m or "[TBE=" in m for m in messages)  # dumps: DEBUG
    assert job.publish.state.is_completed(), job.publish.state
    publish_loggers = {log.name for log in _logs(job.publish.id)}
    assert {"publish.load", "publish.export"} <= publish_loggers, publish_loggers


def test_publish_runs_one_at_a_time(worker: Path) -> None:
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("publish/publish")
    assert deployment.global_concurrency_limit is not None
    assert deployment.global_concurrency_limit.limit == 1
    assert deployment.concurrency_options.collision_strategy == "ENQUEUE"
    runs = [  # two publishes at once (of nothing: each fails fast after it starts)
        run_deployment(
            "publish/publish",
            parameters={"uri": f"file:///nonexistent/{i}", "job_id": f"enqueue-{i}"},
            timeout=0,
            as_subflow=False,
        )
        for i in range(2)
    ]
    final = [_final(r.id, worker) for r in runs]
    with get_client(sync_client=True) as client:
        waited = [
            any(s.name == "AwaitingConcurrencySlot" for s in client.read_flow_run_states(r.id))
            for r in final
        ]
    assert waited.count(True) >= 1, "neither run waited for the other"
    first, second = sorted(final, key=lambda r: r.start_time)
    assert first.end_time <= second.start_time  # never both running


def test_the_publish_trigger_has_a_name_and_a_description(worker: Path) -> None:
    with get_client(sync_client=True) as client:
        (automation,) = client.read_automations_by_name("publish-anchor-checkpoint")
    assert "anchor checkpoint" in automation.description
    assert automation.trigger.expect == {"ett.checkpoint.anchor.committed"}


def test_demo_on_a_running_stack_lets_the_trigger_publish(
    worker: Path, mlflow_server: str, tmp_path: Path
) -> None:
    """`ett demo` with PREFECT_API_URL set: one publish, the triggered deployment run's."""
    model = "demo-stack-ranker"
    config = tiny_config(
        tmp_path,
        train={"steps": 20, "dense_lr": 0.02},
        tracking={"mlflow_uri": mlflow_server, "registered_model": model},
    )
    dump_config(config, tmp_path / "demo.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ett")), "demo", "--config", "demo.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:] + worker.read_text()[-4000:]
    assert "the anchor event triggers the publish/publish deployment" in proc.stdout
    assert f"published: {model} version 1 (aliases: candidate, champion)" in proc.stdout
    assert "Prefect UI: http://127.0.0.1:" in proc.stdout and "temporary API" not in out
    job_id = re.search(r"training job (demo-\d{8}-\d{6}-[0-9a-f]{4})", proc.stdout).group(1)
    from mlflow import MlflowClient

    versions = MlflowClient(mlflow_server).search_model_versions(f"name = '{model}'")
    assert [v.tags["job_id"] for v in versions] == [job_id]  # published once, not twice


# -- the UIs as a user sees them: headless Chromium (infra/devstack/chromium.py) ---------------
# ETT_SCREENSHOTS=DIR saves each page checked here as DIR/<name>.png as well.
SCREENSHOTS = os.environ.get("ETT_SCREENSHOTS")
TRAINING_VIEW = "?workflowType=machine_learning"
SECTION = re.compile(r"^([^\n]+)\n\(\d+\)\nAdd chart$", re.MULTILINE)  # a chart section's head


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    with Chromium(tmp_path_factory.mktemp("chromium")) as chromium:
        yield chromium


def _show(browser: Chromium, url: str | None, *needles: str, name: str) -> str:
    """Open ``url`` (None: stay on the page); its text once it shows every needle, saved as
    a screenshot if asked."""
    if url is not None:
        browser.open(url)
    text = browser.wait_for_text(*needles, timeout_s=90)
    if SCREENSHOTS:
        time.sleep(2)  # charts animate in
        browser.screenshot(Path(SCREENSHOTS) / f"{name}.png")
    return text


def _mlflow_job_run(job: Job) -> Any:
    from mlflow import MlflowClient

    ml = MlflowClient(job.mlflow_uri)
    experiment = ml.get_experiment_by_name("ett-pipeline").experiment_id
    (run,) = ml.search_runs(
        [experiment], f"tags.`ett.job_id` = '{job.config.job_id}' AND tags.`ett.kind` = 'job'"
    )
    return run


def test_browser_the_mlflow_runs_first_chart_section_is_the_training_curves(
    job: Job, browser: Chromium
) -> None:
    run = _mlflow_job_run(job)
    url = (
        f"{job.mlflow_uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        f"/model-metrics{TRAINING_VIEW}"
    )
    text = _show(browser, url, "Add chart", "loss", "auc", "wall_time", name="mlflow-run-curves")
    sections = SECTION.findall(text)  # MLflow adds an empty "Model metrics" at the end
    assert sections[:3] == ["eval", "train", "wall_time"], sections
    # the whole breakdown: one table among the run's artifacts
    page = url.replace(
        f"/model-metrics{TRAINING_VIEW}", f"/artifacts/ett/buckets.json{TRAINING_VIEW}"
    )
    text = _show(browser, page, "effective_training", "% of wall time", name="mlflow-ett-buckets")
    assert "recovery" in text and "total" in text, text[:2000]


def test_browser_the_mlflow_run_shows_its_logged_model_and_its_version(
    job: Job, browser: Chromium
) -> None:
    from mlflow import MlflowClient

    run = _mlflow_job_run(job)
    ml = MlflowClient(job.mlflow_uri)
    (version,) = ml.search_model_versions(
        f"name = '{MODEL}' AND tags.job_id = '{run.info.run_name}'"
    )
    model = ml.get_logged_model(model_id_of(version))
    assert model.source_run_id == run.info.run_id  # the training run's model, not publish's
    assert model.name.startswith(f"ranker-{job.config.job_id}-step")
    page = f"#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}{TRAINING_VIEW}"
    url = f"{job.mlflow_uri}/{page}"
    text = _show(browser, url, "Logged models", model.name, name="mlflow-run-overview")
    registered = text[text.index("Registered models") :]
    assert f"{MODEL}" in registered and f"v{version.version}" in registered, registered[:500]
    # the version: its decision first, its source the training run
    page = f"#/models/{MODEL}/versions/{version.version}{TRAINING_VIEW}"
    text = _show(
        browser, f"{job.mlflow_uri}/{page}", "promoted to champion", name="mlflow-model-version"
    )
    assert run.info.run_name in text, text[:2000]
    # the model: the eval points of its step and the gate's numbers
    page = f"#/experiments/{run.info.experiment_id}/models/{model.model_id}{TRAINING_VIEW}"
    text = _show(
        browser, f"{job.mlflow_uri}/{page}", model.name, "eval/auc", name="mlflow-logged-model"
    )
    assert "publish/holdout_auc" in text, text[:3000]


def test_browser_the_publish_run_shows_the_gate_table(job: Job, browser: Chromium) -> None:
    gate = _artifact("gate-publish", job.publish.id)
    run_page = f"{job.ui_url}/runs/flow-run/{job.publish.id}"
    browser.open(run_page)
    browser.wait_for_text(job.publish.name, timeout_s=90)
    browser.click_text("Artifacts")
    browser.wait_for_text("gate-publish", "train-run-publish")
    text = _show(
        browser,
        f"{job.ui_url}/artifacts/artifact/{gate.id}",
        "AUC",
        "log-loss",
        "promoted to champion",
        name="prefect-gate-table",
    )
    assert "parity" in text and "candidate" in text and "champion" in text, text[:2000]


def test_browser_the_train_run_links_to_its_publish_run(job: Job, browser: Chromium) -> None:
    link = _artifact("publish-run-train", job.train.id)
    table = _artifact("ett-buckets-train", job.train.id)
    text = _show(
        browser,
        f"{job.ui_url}/artifacts/artifact/{table.id}",
        "effective_training",
        name="prefect-ett-table",
    )
    assert "% of wall time" in text and "recovery" in text, text[:2000]
    browser.open(f"{job.ui_url}/runs/flow-run/{job.train.id}")
    browser.wait_for_text(job.train.name, timeout_s=90)
    browser.click_text("Artifacts")
    _show(
        browser,
        None,
        "publish-run-train",
        name="prefect-train-artifacts",
    )
    _show(
        browser,
        f"{job.ui_url}/artifacts/artifact/{link.id}",
        job.publish.name,
        name="prefect-publish-link",
    )
    href = browser.links().get(f"publish run {job.publish.name}")
    assert href == f"{job.ui_url}/runs/flow-run/{job.publish.id}", browser.links()
    _show(browser, href, job.publish.name, "Completed", name="prefect-publish-run")
