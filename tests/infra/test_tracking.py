"""infra/tracking/mlflow_runs.py against a real SQLite MLflow store, with ETT reports from hand-made
ledgers (the outage path against a real ``mlflow server`` is in
tests/reliability/test_mlflow_outage.py).

One store per module; each test uses its own job ids. Creating MLflow's tables runs all of its
schema migrations (5-20 s here), so ``sqlite_store`` copies an empty, migrated database made once
per MLflow version and kept in pytest's cache (or the session's tmp dir without a cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import threading
from dataclasses import replace
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus
from mlflow.exceptions import MlflowException

from infra import storage
from infra.accounting.ett import report_for_job
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_read import read_events
from infra.accounting.report import format_table
from infra.accounting.summary import JobSummary
from infra.checkpoint_manifest import MANIFEST, Manifest
from infra.job_layout import JobLayout, step_dir_name
from infra.settings import JobConfig
from infra.tracking import client as mlflow_client
from infra.tracking import metrics as names
from infra.tracking import mlflow_runs, run_metadata
from infra.tracking.logged_models import anchor_key
from tests.factories import tiny_config

SECRET = "FAKE-SECRET-do-not-log-7f3a9c"
KEY_ID = "FAKEKEYID-4e1b"
T0 = 1_700_000_000.0
EVAL_ROWS = 512


def loss_at(step: int, attempt: int) -> float:
    """A recognisable loss: which attempt ran a step shows in its value."""
    return round(1.0 / step + 0.5 * attempt, 6)


def auc_at(step: int, attempt: int) -> float:
    return round(0.5 + step / 1000 + 0.01 * attempt, 6)


def write_job(
    job_url: str,
    t0: float = T0,
    startup_s: float = 10.0,
    steps: int = 20,
    step_s: float = 1.0,
    ckpt_every: int = 5,
    blocking_s: float = 0.25,
    fail_after: int | None = None,
    restart_s: float = 8.0,
    eval_every: int = 0,
) -> None:
    """A job's ledger (orchestrator + trainer, rank 0): startup, steps with checkpoints, and
    optionally a SIGKILL right after step ``fail_after``; the next attempt needs ``restart_s``
    from the death to its first step and resumes from the last checkpoint. Each step records
    its loss (``loss_at``), an eval every ``eval_every`` steps its AUC (``auc_at``)."""
    clock = lambda: t0  # noqa: E731 - all times are explicit
    attempt, t = 0, t0
    orch = Ledger(JobLayout.at(job_url), attempt=0, role="orchestrator", clock=clock)
    tr = Ledger(JobLayout.at(job_url), attempt=0, clock=clock)
    orch.record_span("scheduling", t, t + 0.2 * startup_s)
    tr.record_span("device_init", t + 0.2 * startup_s, t + 0.5 * startup_s)
    tr.record_span("pre_train", t + 0.5 * startup_s, t + startup_s)
    t += startup_s
    step, last_ckpt = 1, 0
    while step <= steps:
        tr.record_span("train_step", t, t + step_s, step=step, loss=loss_at(step, attempt))
        t += step_s
        if eval_every and step % eval_every == 0:
            auc = auc_at(step, attempt)
            tr.record_span("eval", t, t + 0.5, step=step, auc=auc, logloss=1 - auc, rows=EVAL_ROWS)
            t += 0.5
        if step % ckpt_every == 0:
            tr.record_span("checkpoint_blocking", t, t + blocking_s, step=step)
            t += blocking_s
            tr.mark("checkpoint_committed", step=step, t=t)
            last_ckpt = step
        if attempt == 0 and step == fail_after:
            tr.close()
            orch.mark("failure", step=step, t=t + 0.5, cause="sigkill", exit_code=-9)
            orch.close()
            attempt = 1
            orch = Ledger(JobLayout.at(job_url), attempt=1, role="orchestrator", clock=clock)
            tr = Ledger(JobLayout.at(job_url), attempt=1, clock=clock)
            orch.record_span("scheduling", t + 0.5, t + 2.0)
            tr.record_span("pre_train", t + 2.0, t + restart_s)
            tr.mark("resume", step=last_ckpt, t=t + restart_s)
            t += restart_s
            step = last_ckpt + 1
            continue
        step += 1
    tr.record_span("shutdown", t, t + 1.0)
    tr.mark("job_end", t=t + 1.0)
    tr.close()
    orch.close()


def sqlite_store(request: pytest.FixtureRequest, dest: Path) -> str:
    """A tracking URI of a fresh, empty MLflow SQLite database in ``dest``."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        folder = Path(cache.mkdir(f"mlflow-{mlflow.__version__}-empty-db"))
    else:
        folder = request.getfixturevalue("tmp_path_factory").getbasetemp()
    template = folder / "mlflow.db"
    if not template.exists():
        tmp = folder / f"creating-{os.getpid()}.db"
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()  # runs migrations
        os.replace(tmp, template)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, dest / "mlflow.db")
    return f"sqlite:///{dest / 'mlflow.db'}"


@pytest.fixture(scope="module")
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return sqlite_store(request, tmp_path_factory.mktemp("mlflow"))


def _config(tmp_path: Path, store: str, job_id: str, monkeypatch: pytest.MonkeyPatch) -> JobConfig:
    monkeypatch.setenv("ETT_STORAGE__S3_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("ETT_STORAGE__S3_ACCESS_KEY_ID", KEY_ID)
    config = tiny_config(tmp_path, job_id=job_id, tracking={"mlflow_uri": store})
    assert config.storage.s3_secret_access_key.get_secret_value() == SECRET  # env took effect
    return config


def _git_head() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=run_metadata.REPO_ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr  # the test suite runs from a git checkout
    return out.stdout.strip()


def write_anchor(job_url: str, step: int, job_id: str) -> str:
    """A committed anchor checkpoint of the job: its manifest only (what the LoggedModel is
    made from); returns its URL."""
    url = storage.join(job_url, "checkpoints", step_dir_name(step))
    manifest = Manifest(step=step, world_size=2, config_hash="h", files={}, anchor=True)
    storage.write_text(storage.join(url, MANIFEST), replace(manifest, job_id=job_id).to_json())
    return url


def ui_sections(keys: list[str]) -> list[str]:
    """The Model metrics tab's sections in the order MLflow 3.17's UI shows them: the part of
    a name before its last ``/``, in code-point order, then the names without one ("Model
    metrics") -- ``getBaseChartAndSectionConfigs`` in MLflow's JS bundle."""
    named = sorted({k.rsplit("/", 1)[0] for k in keys if "/" in k})
    return named + (["Model metrics"] if any("/" not in k for k in keys) else [])


def test_job_run_holds_report_curves_attempts_and_artifacts(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, store, "job-report", monkeypatch)
    write_job(config.layout.url, fail_after=7, eval_every=5)
    anchor_url = write_anchor(config.layout.url, 20, "job-report")
    events = read_events(config.layout)
    report = report_for_job(config.layout)
    assert report.num_failures == 1 and report.observed_unsaved_s == 2.0

    run_id = mlflow_runs.start_job_run(config)
    attempts = mlflow_runs.attempts_from_ledger(report, events)
    children = [mlflow_runs.log_attempt(run_id, a, tracking_uri=store) for a in attempts]
    logged = mlflow_runs.log_job_report(
        run_id, JobSummary.read(config.layout), data_url=config.data.url
    )

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "job-report"
    tags = run.data.tags
    assert tags["ett.job_id"] == "job-report" and tags["ett.job_url"] == config.layout.url
    # Source and commit (the UI's Source column), a description naming the two holdout AUCs.
    assert tags["mlflow.source.name"] == "flows/train_flow.py"
    assert tags["mlflow.source.type"] == "JOB"
    assert tags["mlflow.source.git.commit"] == _git_head()
    assert "`eval/auc`" in tags["mlflow.note.content"]
    assert f"first {config.train.eval_rows} holdout rows" in tags["mlflow.note.content"]
    # The experiment opens as model training, not as a GenAI project.
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    # Metrics: the curves and the ETT headline only, in sections; the curves' sections come
    # first in the Model metrics tab. No timestamp, flag or bucket is a metric.
    m = run.data.metrics
    assert set(m) == {
        names.TRAIN_LOSS,
        names.EVAL_AUC,
        names.EVAL_LOGLOSS,
        names.ETT_PCT,
        names.IDLENESS_PCT,
        names.FAILURE_PCT,
        names.TIME_TO_START_S,
        names.TIME_TO_RECOVER_S,
        names.NUM_FAILURES,
    }
    assert ui_sections(list(m)) == ["eval", "train", "wall_time"]
    # Rounded as shown: percents to 2 decimals, seconds to milliseconds.
    assert m[names.ETT_PCT] == round(report.ett_pct, 2) != report.ett_pct
    assert m[names.FAILURE_PCT] == round(report.failure_pct, 2)
    assert m[names.NUM_FAILURES] == 1 and m[names.TIME_TO_START_S] == 10.0
    assert logged == {k: m[k] for k in logged} and names.TIME_TO_RECOVER_S not in logged
    ttr = client.get_metric_history(run_id, names.TIME_TO_RECOVER_S)
    assert [h.step for h in ttr] == [0]
    assert ttr[0].value == round(report.time_to_recover_total_s, 3)
    # Curves by step from the ledger: one point per step, a redone step from its last run,
    # five significant digits.
    loss = {h.step: h.value for h in client.get_metric_history(run_id, names.TRAIN_LOSS)}
    assert sorted(loss) == list(range(1, 21))
    assert loss[5] == loss_at(5, 0) and loss[20] == loss_at(20, 1)
    assert loss[6] == 0.66667 != loss_at(6, 1)  # 1/6 + 0.5, redone by attempt 1
    auc = {h.step: h.value for h in client.get_metric_history(run_id, names.EVAL_AUC)}
    assert auc == {5: auc_at(5, 0), 10: auc_at(10, 1), 15: auc_at(15, 1), 20: auc_at(20, 1)}
    assert len(client.get_metric_history(run_id, names.EVAL_LOGLOSS)) == 4
    # The trainer's eval data set, named by its size.
    inputs = run.inputs.dataset_inputs
    assert [d.dataset.name for d in inputs] == [f"holdout[:{EVAL_ROWS}]"]
    # The anchor checkpoint: a LoggedModel of this run at its step, with the run's eval
    # metrics at that step linked to it (and their data set).
    (output,) = run.outputs.model_outputs
    assert output.step == 20
    model = client.get_logged_model(output.model_id)
    assert model.name == "ranker-job-report-step-20" and model.source_run_id == run_id
    assert model.status == LoggedModelStatus.READY and model.model_type == "ranker"
    assert model.tags["mlflow.model.isExternal"] == "true"  # until publishing logs files
    assert "job `job-report`" in model.tags["mlflow.note.content"]
    assert model.params["anchor_uri"] == anchor_url and model.params["step"] == "20"
    assert model.params["job_id"] == "job-report" and model.params["training_run_id"] == run_id
    assert model.params["anchor_world_size"] == "2"
    sha = hashlib.sha256(storage.read_text(storage.join(anchor_url, MANIFEST)).encode())
    assert model.params["anchor_key"] == anchor_key(anchor_url, sha.hexdigest())
    on_model = {x.key: x for x in model.metrics}
    assert set(on_model) == {names.EVAL_AUC, names.EVAL_LOGLOSS}
    assert on_model[names.EVAL_AUC].value == auc_at(20, 1) and on_model[names.EVAL_AUC].step == 20
    assert on_model[names.EVAL_AUC].dataset_name == f"holdout[:{EVAL_ROWS}]"
    # Params: the flattened public config, and no credential anywhere.
    p = run.data.params
    assert p["job_id"] == "job-report" and p["train.steps"] == "20"
    assert p["data.cat_vocab_sizes"] == "[50, 20, 10]" and p["tracking.mlflow_uri"] == store
    assert p["checkpoint.mode"] == "async_staged" and p["storage.root"] == config.storage.root
    assert not any("secret" in k or "access_key" in k for k in p)
    for text in [*p.values(), *p.keys(), *run.data.tags.values()]:
        assert SECRET not in text and KEY_ID not in text
    # Attempts: nested runs; times are the run's own, outcome and exit code tags, duration
    # and last step metrics; nothing twice, no timestamps among the metrics.
    expected = [(0, "sigkill", "-9", 7, "FAILED"), (1, "success", "0", 20, "FINISHED")]
    for child_id, a, (number, outcome, code, last, status) in zip(
        children, attempts, expected, strict=True
    ):
        child = client.get_run(child_id)
        assert child.data.tags["mlflow.parentRunId"] == run_id
        assert child.data.tags["ett.attempt"] == str(number)
        assert child.data.tags["ett.outcome"] == outcome
        assert child.data.tags["ett.exit_code"] == code and child.info.status == status
        assert child.info.start_time == int(a.started * 1000)
        assert child.info.end_time == int(a.ended * 1000)
        assert child.data.params == {}
        assert child.data.tags["mlflow.source.git.commit"] == _git_head()
        assert child.data.metrics == {
            names.ATTEMPT_DURATION_S: round(a.ended - a.started, 3),
            names.ATTEMPT_LAST_STEP: last,
        }
    own = [e for e in events if e.attempt == 1 and e.name != "scheduling"]
    assert attempts[1].started == min(e.start for e in own)
    # Artifacts: the bucket table (listed as a table for the UI), report, PNG chart and every
    # ledger file, byte for byte.
    dst = Path(
        mlflow.artifacts.download_artifacts(
            run_id=run_id, tracking_uri=store, dst_path=str(tmp_path / "dl")
        )
    )
    table = json.loads((dst / "ett" / "buckets.json").read_text())
    assert table["columns"] == ["bucket", "seconds", "% of wall time"]
    rows = {row[0]: row[1:] for row in table["data"]}
    assert list(rows) == [*report.buckets, "total"]
    for bucket, secs in report.buckets.items():
        assert rows[bucket] == [round(secs, 3), round(report.bucket_pct()[bucket], 2)]
    assert rows["total"] == [round(report.wall_s, 3), 100.0]
    listed = json.loads(tags["mlflow.loggedArtifacts"])
    assert {"path": "ett/buckets.json", "type": "table"} in listed
    assert (dst / "ett" / "breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (dst / "ett" / "report.txt").read_text() == format_table(report)
    assert json.loads((dst / "ett" / "report.json").read_text())["ett_pct"] == report.ett_pct
    assert (dst / "ett" / "report.md").read_text().startswith("# ETT report")
    ledger_files = storage.glob(storage.join(config.layout.ledger, "*.jsonl"))
    assert len(ledger_files) == 4
    for url in ledger_files:
        assert (dst / "ledger" / url.rsplit("/", 1)[-1]).read_bytes() == storage.read_bytes(url)
    for f in dst.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes() and KEY_ID.encode() not in f.read_bytes()
    # Artifacts of a sqlite store live next to the database, not in the caller's cwd.
    assert Path(store[len("sqlite:///") :]).parent.joinpath("mlartifacts").is_dir()

    # Logged again (``ett report --log``): the same one model, output, table and points.
    mlflow_runs.log_job_report(run_id, JobSummary.read(config.layout), data_url=config.data.url)
    again = client.get_run(run_id)
    assert [o.model_id for o in again.outputs.model_outputs] == [model.model_id]
    by_name = "name = 'ranker-job-report-step-20'"
    found = client.search_logged_models([run.info.experiment_id], by_name)
    assert [x.model_id for x in found] == [model.model_id]
    assert len(client.get_logged_model(model.model_id).metrics) == 2
    assert json.loads(again.data.tags["mlflow.loggedArtifacts"]) == listed
    assert len(client.get_metric_history(run_id, names.TRAIN_LOSS)) == 20
    table_again = client.download_artifacts(run_id, "ett/buckets.json", str(tmp_path / "t2"))
    assert json.loads(Path(table_again).read_text()) == table

    # The anchor rewritten at the same URL (a retried anchor: another manifest) is another
    # checkpoint, as the registry's anchor_key says: a model of its own, not the old one.
    manifest = Manifest(step=20, world_size=1, config_hash="h", files={}, anchor=True)
    storage.write_text(
        storage.join(anchor_url, MANIFEST), replace(manifest, job_id="job-report").to_json()
    )
    mlflow_runs.log_job_report(run_id, JobSummary.read(config.layout), data_url=config.data.url)
    models = client.search_logged_models([run.info.experiment_id], by_name)
    assert len(models) == 2
    rewritten = next(x for x in models if x.model_id != model.model_id)
    assert rewritten.params["anchor_world_size"] == "1"
    assert rewritten.params["anchor_key"] != model.params["anchor_key"]
    outputs = client.get_run(run_id).outputs.model_outputs
    assert sorted(o.model_id for o in outputs) == sorted(x.model_id for x in models)


def test_a_job_run_again_keeps_its_one_run(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, store, "job-rerun", monkeypatch)
    client = MlflowClient(tracking_uri=store)
    first = mlflow_runs.start_job_run(config)
    mlflow_runs._run_uris.clear()  # as if the orchestrator restarted in a new process
    assert mlflow_runs.start_job_run(config) == first
    # An orchestrator that crashed may have left the run FAILED: the resumed job takes it back.
    client.set_terminated(first, status="FAILED")
    changed = tiny_config(
        tmp_path, job_id="job-rerun", tracking={"mlflow_uri": store}, train={"steps": 99}
    )
    assert mlflow_runs.start_job_run(changed) == first
    run = client.get_run(first)
    assert run.info.status == "RUNNING" and run.data.tags["ett.resumes"] == "2"
    assert run.data.params["train.steps"] == "20"  # params are immutable: the first ones stay
    assert run.data.tags["ett.params_changed_on_resume"] == "train.steps"
    # Logging one attempt twice updates it instead of adding a second nested run.
    a = mlflow_runs.LedgerAttempt(0, "sigkill", -9, T0, T0 + 5, None)
    b = mlflow_runs.LedgerAttempt(0, "sigkill", -9, T0, T0 + 6, None)
    assert mlflow_runs.log_attempt(first, a, tracking_uri=store) == mlflow_runs.log_attempt(
        first, b, tracking_uri=store
    )
    # A job that finished and is run again continues in its run: one run per job.
    write_job(config.layout.url)
    mlflow_runs.log_job(config, JobSummary.read(config.layout), first, succeeded=True)
    assert client.get_run(first).info.status == "FINISHED"
    again = mlflow_runs.start_job_run(config)
    assert again == first and client.get_run(first).info.status == "RUNNING"
    runs = client.search_runs([run.info.experiment_id], "tags.`ett.job_id` = 'job-rerun'")
    assert [r.info.run_id for r in runs] == [first]


def test_a_job_is_logged_whole_from_its_ledger_later(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `ett report --log` does for a job that ran while MLflow was down: the run, its
    attempts and curves from the ledger, in batches (1,500 steps: more than one log_batch
    request holds); logging it again adds nothing."""
    config = _config(tmp_path, store, "job-late", monkeypatch)
    write_job(config.layout.url, steps=1500, ckpt_every=100, fail_after=150, eval_every=500)
    run_id, scalars = mlflow_runs.log_job(config, JobSummary.read(config.layout))

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and scalars[names.NUM_FAILURES] == 1.0
    assert len(client.get_metric_history(run_id, names.TRAIN_LOSS)) == 1500
    children = client.search_runs(
        [run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'"
    )
    got = sorted((c.data.tags["ett.attempt"], c.data.tags["ett.outcome"]) for c in children)
    assert got == [("0", "sigkill"), ("1", "success")]

    assert mlflow_runs.log_job(config, JobSummary.read(config.layout))[0] == run_id
    assert len(client.get_metric_history(run_id, names.TRAIN_LOSS)) == 1500
    assert len(client.search_runs([run.info.experiment_id], "tags.`ett.job_id` = 'job-late'")) == 1
    assert (
        len(client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'"))
        == 2
    )


def test_experiment_kind_is_set_once_and_a_users_choice_kept(store: str) -> None:
    client = MlflowClient(tracking_uri=store)
    mine = client.create_experiment("kind-mine", tags={"mlflow.experimentKind": "finetuning"})
    bare = client.create_experiment("kind-bare")
    assert mlflow_client.ensure_experiment(client, "kind-mine", store) == mine
    assert mlflow_client.ensure_experiment(client, "kind-bare", store) == bare
    assert client.get_experiment(mine).tags["mlflow.experimentKind"] == "finetuning"
    assert client.get_experiment(bare).tags["mlflow.experimentKind"] == "custom_model_development"


class _Refuser:
    """A loopback port that accepts each connection and closes it at once: every HTTP call
    to it fails, and the accepts count how often MLflow tried."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=5)


def test_a_dead_tracking_server_is_given_up_on_after_two_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in mlflow_client.HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    server = _Refuser()
    try:
        config = tiny_config(tmp_path, job_id="dead", tracking={"mlflow_uri": server.url})
        with pytest.raises(MlflowException):
            mlflow_runs.start_job_run(config)
    finally:
        server.close()
    # MLflow's own default would try 8 times over ~4 minutes; bounded: 1 + 2 retries.
    assert server.accepted == 3
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "10"
    # An operator's own setting wins.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    mlflow_client.bound_http_calls()
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"


def test_fleet_files_go_to_one_fleet_run(tmp_path: Path, store: str) -> None:
    png = tmp_path / "ett_trend.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\nfake")
    md = tmp_path / "fleet.md"
    md.write_text("# fleet\n")
    files = {"ett_trend": str(png), "md": str(md)}
    first = mlflow_runs.log_fleet_report(store, "fleet-runs", files, {"fleet/ett_pct": 71.5})
    again = mlflow_runs.log_fleet_report(store, "fleet-runs", files, {"fleet/ett_pct": 72.0})
    assert first == again
    client = MlflowClient(tracking_uri=store)
    run = client.get_run(first)
    assert run.data.tags["ett.kind"] == "fleet" and run.info.status == "FINISHED"
    assert [h.value for h in client.get_metric_history(first, "fleet/ett_pct")] == [
        71.5,
        72.0,
    ]
    names = sorted(a.path for a in client.list_artifacts(first, "fleet"))
    assert names == ["fleet/ett_trend.png", "fleet/fleet.md"]


def test_flatten_params_and_redaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flat = run_metadata.flatten_params(
        {"a": {"b": 1, "c": [1, 2], "d": None, "e": {}}, "long": "x" * 7000, "f": True}
    )
    assert flat["a.b"] == "1" and flat["a.c"] == "[1, 2]" and flat["a.d"] == "None"
    assert flat["a.e"] == "{}" and flat["f"] == "True"
    assert len(flat["long"]) == run_metadata.MAX_PARAM_LEN and flat["long"].endswith("(truncated)")
    assert run_metadata.redact_url("http://user:pw@mlflow:5000/x") == "http://mlflow:5000/x"
    assert run_metadata.redact_url("s3://bucket/jobs/a") == "s3://bucket/jobs/a"
    config = tiny_config(tmp_path, tracking={"mlflow_uri": "http://user:pw@mlflow:5000"})
    assert run_metadata.job_params(config)["tracking.mlflow_uri"] == "http://mlflow:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ValueError, match="tracking_uri"):
        attempt = mlflow_runs.LedgerAttempt(0, "success", 0, T0, T0, None)
        mlflow_runs.log_attempt("unknown-run", attempt)
