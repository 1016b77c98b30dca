"""The ``train`` flow on the session's real Prefect server, with the fake trainer:
attempts as tasks, the anchor event (captured), the artifacts, MLflow and the failure path.

Only the launcher is swapped (the fake trainer instead of torchrun + trainer); the launcher,
the ledger, the ETT report and MLflow tracking (SQLite) are real.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.client.schemas.sorting import ArtifactSort
from prefect.events.clients import AssertingEventsClient
from prefect.events.worker import EventsWorker

import flows.train_flow as train_module
from flows.report_flow import ett_report_flow
from infra import storage
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Mark
from infra.preflight import PreflightError
from infra.settings import dump_config
from infra.tracking import metrics as names
from tasks.events import ANCHOR_EVENT
from tasks.job_identity import JobFinished
from tasks.report import artifact_key
from tests.factories import tiny_config, use_launcher, write_dataset

FAKE = str(Path(__file__).resolve().parents[1] / "fake_trainer.py")
# No side evaluator: the fake trainer's checkpoints hold no model to evaluate (it would wait
# for its anchor's evaluation until EVAL_FINISH_TIMEOUT_S).
FAKE_TRAIN = {"steps": 20, "log_every": 2, "eval": "off"}
pytestmark = pytest.mark.slow


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[EventsWorker]:
    worker = EventsWorker.instance(AssertingEventsClient)
    monkeypatch.setattr(EventsWorker, "instance", lambda *_: worker)
    yield worker
    worker.drain()


@pytest.fixture
def fake_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    use_launcher(monkeypatch, FAKE)


def _anchor_events(worker: EventsWorker) -> list:
    worker.drain()
    client = AssertingEventsClient.last
    assert client is not None
    return [e for e in client.events if e.event == ANCHOR_EVENT]


def _artifact(key: str, flow_run_id: Any = None):
    """The flow run's artifact ``key`` (keys are stable per flow: every job's run has one),
    the newest of any run without ``flow_run_id``."""
    only = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])) if flow_run_id else None
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            flow_run_filter=only,
            sort=ArtifactSort.CREATED_DESC,
        )
    assert found, f"no artifact {key} in flow run {flow_run_id}"
    return found[0]


def test_train_flow_recovers_emits_anchor_and_reports(
    tmp_path: Path, prefect_server: str, events: EventsWorker, fake_trainer: None
) -> None:
    config = tiny_config(tmp_path, job_id="flow-ok", train=FAKE_TRAIN)
    write_dataset(config)  # the fake trainer reads none, but the flow checks it is there
    path = tmp_path / "job.yaml"
    dump_config(config, path)
    faults = [{"kind": "crash", "step": 8, "attempt": 0}]

    overrides = {"faults": faults, "recovery": {"backoff_s": 0.5}}
    result = train_module.train_flow(config=str(path), overrides=overrides)

    assert result["failures"] == 1 and result["preemptions"] == 0
    assert result["anchor"]["step"] == 20
    assert result["report"]["num_failures"] == 1 and result["report"]["finished"]
    anchor_events = _anchor_events(events)
    assert len(anchor_events) == 1
    event = anchor_events[0]
    assert event.resource.id == "ett.checkpoint.flow-ok"
    assert event.payload == {
        "uri": result["anchor"]["uri"],
        "step": 20,
        "job_id": "flow-ok",
        "mlflow_run_id": result["mlflow_run_id"],
        "train_flow_run_id": result["flow_run_id"],  # the publish run links back to it
    }
    flow_run_ids = {r.id for r in event.related if r.role == "flow-run"}
    assert flow_run_ids == {f"prefect.flow-run.{result['flow_run_id']}"}

    # The failed attempt's task run says why: its Failed state, as sent to the server.
    failed = [
        (e.payload["task_run"]["name"], e.payload["validated_state"]["message"])
        for e in AssertingEventsClient.last.events  # type: ignore[union-attr]
        if e.event == "prefect.task-run.Failed"
    ]
    assert failed == [("flow-ok-attempt-0", "attempt 0 failed: crash at step 7 (CRASH (1))")]

    progress = _artifact("train-progress-train", result["flow_run_id"])  # the flow's key
    assert progress.type == "progress" and float(progress.data) == 100.0
    markdown = _artifact("ett-train", result["flow_run_id"])
    assert "ETT report" in markdown.data and "Number of Failures | 1" in markdown.data

    ml = MlflowClient(config.tracking.mlflow_uri)
    run = ml.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics[names.NUM_FAILURES] == 1.0
    children = ml.search_runs(
        [run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'"
    )
    assert sorted(c.data.tags["ett.outcome"] for c in children) == ["crash", "success"]


def test_train_flow_fails_clearly_and_still_reports(
    tmp_path: Path, prefect_server: str, events: EventsWorker, fake_trainer: None
) -> None:
    config = tiny_config(tmp_path, job_id="flow-bad", train=FAKE_TRAIN)
    write_dataset(config)
    path = tmp_path / "job.yaml"
    dump_config(config, path)
    faults = [{"kind": "crash", "step": 3, "attempt": a} for a in range(2)]

    overrides = {"faults": faults, "recovery": {"max_failures": 1, "backoff_s": 0.1}}
    state = train_module.train_flow(config=str(path), overrides=overrides, return_state=True)

    assert state.is_failed()
    with pytest.raises(train_module.TrainingFailed, match="2 failures exceed max_failures=1"):
        state.result()
    assert _anchor_events(events) == []  # nothing to publish
    markdown = _artifact("ett-train", state.state_details.flow_run_id)
    assert "Number of Failures | 2" in markdown.data
    ml = MlflowClient(config.tracking.mlflow_uri)
    exp = ml.get_experiment_by_name(config.tracking.experiment)
    runs = ml.search_runs([exp.experiment_id], "tags.`ett.job_id` = 'flow-bad'")
    assert [r.info.status for r in runs] == ["FAILED"]
    assert runs[0].data.metrics[names.NUM_FAILURES] == 2.0

    fleet = ett_report_flow(
        tracking_uri=config.tracking.mlflow_uri, experiment=config.tracking.experiment
    )
    assert fleet["jobs"] == 1 and fleet["mlflow_run_id"]
    plots = ml.list_artifacts(fleet["mlflow_run_id"], "fleet")  # in MLflow, not on local disk
    assert {"fleet/ett_trend.png", "fleet/fleet.md"} <= {a.path for a in plots}
    assert "flow-bad" in _artifact(artifact_key("ett-fleet", config.tracking.experiment)).data


def test_train_flow_refuses_a_config_naming_no_data_before_any_attempt(
    tmp_path: Path, prefect_server: str, fake_trainer: None
) -> None:
    """What the config names is checked first (infra/preflight.py): the flow run fails with
    the one line that ``ett train`` prints, and no attempt is launched."""
    config = tiny_config(tmp_path, job_id="flow-no-data")  # its data was never generated
    path = tmp_path / "job.yaml"
    dump_config(config, path)

    state = train_module.train_flow(config=str(path), return_state=True)

    assert state.is_failed()
    with pytest.raises(PreflightError) as caught:
        state.result()
    line = str(caught.value)
    assert line.startswith(f"data.url ({config.data.url}): no parquet shards"), line
    assert line in state.message and "\n" not in line
    assert not (tmp_path / "store" / "jobs" / "flow-no-data").exists()  # no attempt, no ledger


def test_a_run_without_job_id_is_a_new_job_its_id_again_is_refused_and_resume_continues(
    tmp_path: Path, prefect_server: str, events: EventsWorker, fake_trainer: None
) -> None:
    """A flow call without job_id: a new job named after the flow and the time (the run's
    name); its id again: refused in one line, its anchor not announced again; ``resume``:
    the newest unfinished job the flow started, and the run renamed after it."""
    config = tiny_config(tmp_path, job_id=None, train=FAKE_TRAIN)
    write_dataset(config)
    path = tmp_path / "job.yaml"
    dump_config(config, path)

    first = train_module.train_flow(config=str(path))
    job_id = first["job_id"]
    assert re.fullmatch(r"train-\d{8}-\d{6}-[0-9a-f]{4}", job_id), job_id
    again = train_module.train_flow(
        config=str(path), overrides={"job_id": job_id}, return_state=True
    )
    assert again.is_failed()
    with pytest.raises(JobFinished, match=f"^job {job_id} is finished"):
        again.result()
    assert "\n" not in str(again.message)

    killed = config.model_copy(update={"job_id": "train-20261201-100000-aaaa"})  # older
    storage.configure(killed.storage)
    with Ledger(killed.layout, attempt=0, rank=0, role="orchestrator") as ledger:
        ledger.mark(Mark.FAILURE, step=3, cause="sigkill", exit_code=-9)
    state = train_module.train_flow(config=str(path), resume=True, return_state=True)
    assert state.result()["job_id"] == killed.job_id
    assert [a.split(":")[0] for a in state.result()["attempts"]] == ["attempt 1"]
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(state.state_details.flow_run_id)
    assert run.name == killed.job_id  # renamed from train-resume
    announced = [e.payload["job_id"] for e in _anchor_events(events)]
    assert sorted(announced) == sorted([job_id, killed.job_id])  # once per anchor


def test_the_jobs_ledger_is_read_once_at_the_end_of_a_flow_run(
    tmp_path: Path,
    prefect_server: str,
    events: EventsWorker,
    fake_trainer: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ETT artifacts, the MLflow run and the flow's result all render one JobSummary:
    every read of the job's ledger through storage is counted, and there is one."""
    reads: list[str] = []
    real_call = storage.call

    def counting(what: str, fn: Any) -> Any:
        if what.startswith("read ") and "/ledger" in what:
            reads.append(what)
        return real_call(what, fn)

    monkeypatch.setattr(storage, "call", counting)
    config = tiny_config(tmp_path, job_id="read-once", train=FAKE_TRAIN)
    write_dataset(config)
    path = tmp_path / "job.yaml"
    dump_config(config, path)
    overrides = {"faults": [{"kind": "crash", "step": 8, "attempt": 0}]}
    result = train_module.train_flow(config=str(path), overrides=overrides)
    assert result["report"]["num_failures"] == 1  # the summary reached the flow's result...
    table = _artifact("ett-buckets-train", result["flow_run_id"])
    assert table.type == "table"  # ...the UI
    run = MlflowClient(config.tracking.mlflow_uri).get_run(result["mlflow_run_id"])
    assert run.data.metrics[names.NUM_FAILURES] == 1.0  # ...and MLflow
    assert reads == [f"read {config.layout.ledger}"]
