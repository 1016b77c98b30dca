"""infra/tracking.py against a real SQLite MLflow store, with ETT reports from hand-made ledgers.

One store per module; each test uses its own job ids. Creating MLflow's tables runs all of its
schema migrations (5-20 s here), so ``sqlite_store`` copies an empty, migrated database made once
per MLflow version and kept in pytest's cache (or the session's tmp dir without a cache).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from infra import storage, tracking
from infra.ett import report_for_job
from infra.ett_report import format_table
from infra.ledger import Ledger, ledger_url
from infra.settings import JobConfig
from tests.factories import tiny_config

SECRET = "FAKE-SECRET-do-not-log-7f3a9c"
KEY_ID = "FAKEKEYID-4e1b"
T0 = 1_700_000_000.0


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
) -> None:
    """A job's ledger (orchestrator + trainer, rank 0): startup, steps with checkpoints, and
    optionally a SIGKILL right after step ``fail_after``; the next attempt needs ``restart_s``
    from the death to its first step and resumes from the last checkpoint."""
    clock = lambda: t0  # noqa: E731 - all times are explicit
    attempt, t = 0, t0
    orch = Ledger(job_url, attempt=0, role="orchestrator", clock=clock)
    tr = Ledger(job_url, attempt=0, clock=clock)
    orch.record_span("scheduling", t, t + 0.2 * startup_s)
    tr.record_span("device_init", t + 0.2 * startup_s, t + 0.5 * startup_s)
    tr.record_span("pre_train", t + 0.5 * startup_s, t + startup_s)
    t += startup_s
    step, last_ckpt = 1, 0
    while step <= steps:
        tr.record_span("train_step", t, t + step_s, step=step)
        t += step_s
        if step % ckpt_every == 0:
            tr.record_span("checkpoint_blocking", t, t + blocking_s, step=step)
            t += blocking_s
            tr.mark("checkpoint_committed", step=step, t=t)
            last_ckpt = step
        if attempt == 0 and step == fail_after:
            tr.close()
            orch.mark("failure", step=step, t=t + 0.5, cause="sigkill")
            orch.close()
            attempt = 1
            orch = Ledger(job_url, attempt=1, role="orchestrator", clock=clock)
            tr = Ledger(job_url, attempt=1, clock=clock)
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


def test_job_run_holds_report_params_attempts_and_artifacts(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, store, "job-report", monkeypatch)
    write_job(config.job_url, fail_after=7)
    report = report_for_job(config.job_url)
    assert report.num_failures == 1 and report.observed_unsaved_s == 2.0

    run_id = tracking.start_job_run(config)
    a0 = tracking.log_attempt(
        run_id,
        0,
        exit_code=-9,
        cause="sigkill",
        started=T0,
        ended=T0 + 17.75,
        last_step=7,
        tracking_uri=store,
    )
    a1 = tracking.log_attempt(run_id, 1, 0, "completed", T0 + 17.75, T0 + 40.0, 20)
    logged = tracking.log_job_report(
        run_id, report, config.job_url, extra_metrics={"advisor.interval_s": 12.5}
    )

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "job-report"
    assert run.data.tags["ett.job_id"] == "job-report"
    assert run.data.tags["ett.job_url"] == config.job_url
    # Metrics: exactly the report's numbers, under ett.*; plus the L2 shares and extras.
    m = run.data.metrics
    for name, value in report.to_metrics().items():
        assert m[f"ett.{name}"] == pytest.approx(value, rel=1e-12), name
    assert m["ett.ett_pct"] == report.ett_pct and m["ett.num_failures"] == 1
    assert m["ett.time_to_start_s"] == 10.0 and m["ett.time_to_recover_total_s"] == 8.0
    for bucket, pct in report.bucket_pct().items():
        assert m[f"ett.bucket_{bucket}_pct"] == pytest.approx(pct)
    assert m["ett.start_time"] == T0 and m["advisor.interval_s"] == 12.5
    assert logged["ett.ett_pct"] == report.ett_pct
    ttr = client.get_metric_history(run_id, "ett.time_to_recover_s")
    assert [(h.step, h.value) for h in ttr] == [(0, 8.0)]
    init = {h.step: h.value for h in client.get_metric_history(run_id, "ett.init.pre_train_s")}
    assert init == {0: 5.0, 1: 6.0}
    # Params: the flattened public config, and no credential anywhere.
    p = run.data.params
    assert p["job_id"] == "job-report" and p["train.steps"] == "20"
    assert p["data.cat_vocab_sizes"] == "[50, 20, 10]" and p["tracking.mlflow_uri"] == store
    assert p["checkpoint.mode"] == "async_staged" and p["storage.root"] == config.storage.root
    assert not any("secret" in k or "access_key" in k for k in p)
    for text in [*p.values(), *p.keys(), *run.data.tags.values()]:
        assert SECRET not in text and KEY_ID not in text
    # Attempts: nested runs tagged with their number, status from the exit code.
    for child_id, attempt, status, code in [(a0, 0, "FAILED", "-9"), (a1, 1, "FINISHED", "0")]:
        child = client.get_run(child_id)
        assert child.data.tags["mlflow.parentRunId"] == run_id
        assert child.data.tags["attempt"] == str(attempt) and child.info.status == status
        assert child.data.params["exit_code"] == code
    assert client.get_run(a0).data.metrics["duration_s"] == 17.75
    assert client.get_run(a0).data.params["last_step"] == "7"
    # Artifacts: report, table, PNG chart and every ledger file, byte for byte.
    dst = Path(
        mlflow.artifacts.download_artifacts(
            run_id=run_id, tracking_uri=store, dst_path=str(tmp_path / "dl")
        )
    )
    assert (dst / "ett" / "breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (dst / "ett" / "report.txt").read_text() == format_table(report)
    assert json.loads((dst / "ett" / "report.json").read_text())["ett_pct"] == report.ett_pct
    assert (dst / "ett" / "report.md").read_text().startswith("# ETT report")
    ledger_files = storage.glob(storage.join(ledger_url(config.job_url), "*.jsonl"))
    assert len(ledger_files) == 4
    for url in ledger_files:
        assert (dst / "ledger" / url.rsplit("/", 1)[-1]).read_bytes() == storage.read_bytes(url)
    for f in dst.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes() and KEY_ID.encode() not in f.read_bytes()
    # Artifacts of a sqlite store live next to the database, not in the caller's cwd.
    assert Path(store[len("sqlite:///") :]).parent.joinpath("mlartifacts").is_dir()


def test_resumed_job_reuses_its_run(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, store, "job-resume", monkeypatch)
    client = MlflowClient(tracking_uri=store)
    first = tracking.start_job_run(config)
    tracking._run_uris.clear()  # as if the orchestrator restarted in a new process
    assert tracking.start_job_run(config) == first
    # An orchestrator that crashed may have left the run FAILED: the resumed job takes it back.
    client.set_terminated(first, status="FAILED")
    changed = tiny_config(
        tmp_path, job_id="job-resume", tracking={"mlflow_uri": store}, train={"steps": 99}
    )
    assert tracking.start_job_run(changed) == first
    run = client.get_run(first)
    assert run.info.status == "RUNNING" and run.data.tags["ett.resumes"] == "2"
    assert run.data.params["train.steps"] == "20"  # params are immutable: the first ones stay
    assert run.data.tags["ett.params_changed_on_resume"] == "train.steps"
    # Logging one attempt twice updates it instead of adding a second nested run.
    a = tracking.log_attempt(first, 0, -9, "sigkill", T0, T0 + 5, None, tracking_uri=store)
    b = tracking.log_attempt(first, 0, -9, "sigkill", T0, T0 + 6, None, tracking_uri=store)
    assert a == b and client.get_run(a).data.metrics["duration_s"] == 6.0
    # Once the job's run is finished, the same job id starts a new run.
    write_job(config.job_url)
    tracking.log_job_report(
        first, report_for_job(config.job_url), config.job_url, tracking_uri=store
    )
    second = tracking.start_job_run(config)
    assert second != first and client.get_run(second).info.status == "RUNNING"
    runs = client.search_runs([run.info.experiment_id], "tags.`ett.job_id` = 'job-resume'")
    assert {r.info.run_id for r in runs} == {first, second}


def test_flatten_params_and_redaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flat = tracking.flatten_params(
        {"a": {"b": 1, "c": [1, 2], "d": None, "e": {}}, "long": "x" * 7000, "f": True}
    )
    assert flat["a.b"] == "1" and flat["a.c"] == "[1, 2]" and flat["a.d"] == "None"
    assert flat["a.e"] == "{}" and flat["f"] == "True"
    assert len(flat["long"]) == tracking.MAX_PARAM_LEN and flat["long"].endswith("(truncated)")
    assert tracking.redact_url("http://user:pw@mlflow:5000/x") == "http://mlflow:5000/x"
    assert tracking.redact_url("s3://bucket/jobs/a") == "s3://bucket/jobs/a"
    config = tiny_config(tmp_path, tracking={"mlflow_uri": "http://user:pw@mlflow:5000"})
    assert tracking.job_params(config)["tracking.mlflow_uri"] == "http://mlflow:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ValueError, match="tracking_uri"):
        tracking.log_attempt("unknown-run", 0, 0, "ok", T0, T0 + 1, None)
