"""Fault: the MLflow tracking server goes away while a job runs (issue: MLflow outage).

A real ``mlflow server`` (SQLite backend, artifacts in the session's moto S3) that the test
stops and starts again on the same port, a real Prefect server running the ``train`` flow in
this process, and the fake trainer (tests/fake_trainer.py) behind a gate that holds each
attempt until the test has changed the server's state:

- stopped mid-job: the job's run exists, MLflow stops, attempt 0 crashes (its log fails),
  attempt 1 starts without MLflow, MLflow comes back: at the end of the flow the job's one run
  holds both attempts and the ETT report;
- down for the whole job: the job trains and publishes its anchor anyway; once MLflow is
  back, ``ett report --log JOB`` (the installed script) logs the run, attempts and report.
"""

from __future__ import annotations

import contextvars
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

import flows.train_flow as train_module
from infra.devstack import servers
from infra.settings import JobConfig, dump_config
from infra.tracking import metrics as names
from tests.factories import ROOT, tiny_config, use_launcher, write_dataset

pytestmark = pytest.mark.slow

FAKE = ROOT / "tests" / "fake_trainer.py"
EXPERIMENT = "mlflow-outage"
WAIT_S = 240.0  # a guard against a stuck flow, not a measurement
BOOT_TIMEOUT_S = 240.0  # 2 shared cores: an MLflow server takes 15-30 s to boot here
GATE = """
import os, pathlib, sys, time
gate, attempt = pathlib.Path(sys.argv[1]), os.environ["ETT_ATTEMPT"]
(gate / f"waiting-{attempt}").touch()
parent = os.getppid()
while not (gate / f"go-{attempt}").exists():
    if os.getppid() != parent:  # the orchestrator is gone: never outlive it
        sys.exit(1)
    time.sleep(0.05)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


class MlflowServer:
    """One ``mlflow server`` on a fixed port and state dir, stopped and started at will."""

    def __init__(self, state_dir: Path, s3_endpoint: str) -> None:
        self.state_dir, self.s3_endpoint = state_dir, s3_endpoint
        self.port = servers.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.service: servers.Service | None = None
        self.pids: list[int] = []

    def start(self) -> None:
        if self.service is None:
            self.service = servers.launch(
                "mlflow", self.state_dir, self.port, s3_endpoint=self.s3_endpoint
            )
            servers.wait_ready(self.service, BOOT_TIMEOUT_S)
            self.pids.append(self.service.pid)

    def stop(self) -> None:
        if self.service is not None:
            servers.stop([self.service.pid])
            self.service = None


@pytest.fixture(scope="module")
def mlflow_ctl(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-outage"), s3_server)
    try:
        yield server
    finally:
        server.stop()
        assert not any(servers.group_alive(pid) for pid in server.pids)  # nothing left behind


@pytest.fixture
def gated_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each attempt is the fake trainer, held at start until ``gate/go-<attempt>`` exists."""
    gate = tmp_path / "gate"
    gate.mkdir()
    script = tmp_path / "gate.py"
    script.write_text(GATE)
    use_launcher(monkeypatch, str(script), str(gate), str(FAKE))
    return gate


@pytest.fixture
def quiet_api_logs() -> Iterator[None]:
    # Flow logs stay local: the API log handler would retry against the Prefect server after
    # the session stopped it.
    from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    with temporary_settings(updates={PREFECT_LOGGING_TO_API_ENABLED: False}):
        yield


def _wait_for(what: str, ready: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def _job(tmp_path: Path, job_id: str, mlflow_uri: str) -> tuple[JobConfig, Path]:
    config = tiny_config(
        tmp_path,
        job_id=job_id,
        # No side evaluator: the fake trainer's checkpoints hold no model to evaluate.
        train={"steps": 20, "log_every": 2, "eval": "off"},
        tracking={"mlflow_uri": mlflow_uri, "experiment": EXPERIMENT},
    )
    write_dataset(config)  # the fake trainer reads none, but the flow checks it is there
    path = tmp_path / "job.yaml"
    dump_config(config, path)
    return config, path


class FlowThread(threading.Thread):
    """The train flow, run in this process while the test drives the MLflow server."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.result, self.error = path, None, None
        self.context = contextvars.copy_context()  # Prefect's settings: the test's server

    def run(self) -> None:
        self.context.run(self._run)

    def _run(self) -> None:
        try:
            overrides = {
                "faults": [{"kind": "crash", "step": 8, "attempt": 0}],
                "recovery": {"backoff_s": 0.2, "hang_timeout_s": WAIT_S},
            }
            self.result = train_module.train_flow(config=str(self.path), overrides=overrides)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def outcome(self) -> dict[str, Any]:
        self.join(WAIT_S)
        assert not self.is_alive(), "the train flow did not end"
        assert self.error is None, f"the train flow failed: {self.error!r}"
        assert self.result is not None
        return self.result


def _job_runs(client: MlflowClient, job_id: str) -> list:
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], f"tags.`ett.job_id` = '{job_id}'")


def _attempts(client: MlflowClient, run: Any) -> list[tuple[str, str, str]]:
    children = client.search_runs(
        [run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'"
    )
    return sorted(
        (c.data.tags["ett.attempt"], c.data.tags["ett.outcome"], c.info.status) for c in children
    )


def test_mlflow_stopped_mid_job_and_restarted(
    tmp_path: Path,
    mlflow_ctl: MlflowServer,
    prefect_server: str,
    gated_trainer: Path,
    quiet_api_logs: None,
) -> None:
    mlflow_ctl.start()
    config, path = _job(tmp_path, "outage-mid", mlflow_ctl.url)
    client = MlflowClient(mlflow_ctl.url)
    flow = FlowThread(path)
    flow.start()
    _wait_for("attempt 0 to start", (gated_trainer / "waiting-0").exists)
    # The run is made while MLflow is up, beside the first attempt's start.
    _wait_for("the job's MLflow run", lambda: len(_job_runs(client, config.job_id)) == 1)
    (run_before,) = _job_runs(client, config.job_id)

    mlflow_ctl.stop()
    (gated_trainer / "go-0").touch()  # attempt 0 crashes at step 8; MLflow is down
    _wait_for("attempt 1 to start", (gated_trainer / "waiting-1").exists)
    mlflow_ctl.start()  # recovery went on without MLflow; now it is back
    (gated_trainer / "go-1").touch()
    result = flow.outcome()

    assert result["anchor"]["step"] == 20 and result["failures"] == 1
    (run,) = _job_runs(client, config.job_id)  # one run per job, the one from before
    assert run.info.run_id == run_before.info.run_id == result["mlflow_run_id"]
    assert run.info.status == "FINISHED"
    assert run.data.metrics[names.NUM_FAILURES] == 1.0
    assert run.data.metrics[names.ETT_PCT] == round(result["report"]["ett_pct"], 2)
    assert _attempts(client, run) == [("0", "crash", "FAILED"), ("1", "success", "FINISHED")]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "ett")] == [
        "ett/breakdown.png",
        "ett/buckets.json",
        "ett/report.json",
        "ett/report.md",
        "ett/report.txt",
    ]


def test_job_trained_while_mlflow_was_down_is_logged_by_ett_report_log(
    tmp_path: Path,
    mlflow_ctl: MlflowServer,
    prefect_server: str,
    gated_trainer: Path,
    quiet_api_logs: None,
) -> None:
    mlflow_ctl.stop()
    config, path = _job(tmp_path, "outage-whole", mlflow_ctl.url)
    for attempt in (0, 1):
        (gated_trainer / f"go-{attempt}").touch()
    result = FlowThread(path)
    result.start()
    outcome = result.outcome()
    assert outcome["anchor"]["step"] == 20 and outcome["failures"] == 1  # trained, recovered
    assert outcome["mlflow_run_id"] is None  # nothing reached MLflow

    mlflow_ctl.start()
    ett = Path(sys.executable).with_name("ett")
    proc = subprocess.run(
        [str(ett), "report", config.job_id, "--config", str(path), "--log"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    client = MlflowClient(mlflow_ctl.url)
    (run,) = _job_runs(client, config.job_id)
    assert f"to MLflow run {run.info.run_id}" in proc.stdout
    assert run.info.status == "FINISHED"
    assert run.data.metrics[names.NUM_FAILURES] == 1.0
    assert run.data.metrics[names.ETT_PCT] == round(outcome["report"]["ett_pct"], 2)
    assert _attempts(client, run) == [("0", "crash", "FAILED"), ("1", "success", "FINISHED")]
    # The anchor, logged late with the rest: a LoggedModel of the run at its step.
    (output,) = run.outputs.model_outputs
    assert output.step == 20
    assert client.get_logged_model(output.model_id).name == f"ranker-{config.job_id}-step-20"
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
