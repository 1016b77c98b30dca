"""Every ``ett`` subcommand as a user runs it: the installed script, flags in the order the
README shows, a happy path where it is cheap and a user error for each. A user error is one
line on stderr that names the problem, a non-zero exit code, and never a traceback.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from infra import storage
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Mark
from infra.accounting.summary import JobSummary
from infra.devstack import servers, stack
from infra.exit_codes import ExitCode
from infra.settings import JobConfig, dump_config
from infra.tracking import mlflow_runs
from tests.factories import ROOT, tiny_config
from tests.infra.test_tracking import sqlite_store

ETT = Path(sys.executable).with_name("ett")  # the console script of the installed package
SUBCOMMANDS = ("generate", "train", "pool", "report", "advise", "demo", "fleet", "stack", "publish")


def ett(*args: str, cwd: Path, env: dict[str, str | None] | None = None, timeout: float = 600):
    """Run ``ett ARGS`` (``env``: None removes a variable); no output may hold a traceback."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    proc = subprocess.run(
        [str(ETT), *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def user_error(proc: subprocess.CompletedProcess[str], *words: str, code: int = ExitCode.USAGE):
    """One line on stderr naming the problem (each of ``words``), exit code ``code``."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def write(config: JobConfig, path: Path) -> str:
    dump_config(config, path)
    return str(path)


@dataclass(frozen=True)
class Trained:
    tmp: Path
    config: JobConfig
    path: str  # the job config file


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """``ett generate`` then ``ett train`` of a tiny job, as a user would start."""
    tmp = tmp_path_factory.mktemp("cli")
    config = tiny_config(tmp, job_id="tiny", train={"steps": 20, "dense_lr": 0.02})
    path = write(config, tmp / "job.yaml")
    generated = ett("generate", "--config", path, cwd=tmp)
    assert generated.returncode == 0, generated.stderr
    assert "Bayes-optimal holdout AUC" in generated.stdout
    assert (tmp / "data" / "_meta.json").is_file()
    proc = ett("train", "--config", path, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 20/20" in proc.stderr  # the trainer's log, passed on by the orchestrator
    assert "succeeded on attempt 0" in proc.stdout
    return Trained(tmp, config, path)


def test_help_names_every_subcommand(tmp_path: Path) -> None:
    top = ett("--help", cwd=tmp_path)
    assert top.returncode == 0 and all(name in top.stdout for name in SUBCOMMANDS)
    for name in SUBCOMMANDS:
        proc = ett(name, "--help", cwd=tmp_path)
        assert proc.returncode == 0 and f"usage: ett {name}" in proc.stdout, proc.stderr
    user_error(ett("frobnicate", cwd=tmp_path), "invalid choice: 'frobnicate'")


def test_generate_daily_windows_for_retrain(tmp_path: Path) -> None:
    from flows.retrain_flow import latest_window

    path = write(tiny_config(tmp_path), tmp_path / "job.yaml")
    root = f"file://{tmp_path}/daily"
    proc = ett("generate", "--config", path, "--daily", "3", "--url", root, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    days = sorted(p.name for p in (tmp_path / "daily").iterdir())
    assert len(days) == 3 and all((tmp_path / "daily" / d / "_meta.json").is_file() for d in days)
    metas = [json.loads((tmp_path / "daily" / d / "_meta.json").read_text()) for d in days]
    assert [m["window"] for m in metas] == [d.removeprefix("dt=") for d in days]
    assert len({m["bayes_auc"] for m in metas}) == 3  # other rows each day, one world
    assert latest_window.fn(root).date == days[-1].removeprefix("dt=")
    again = ett("generate", "--config", path, "--daily", "3", "--url", root, cwd=tmp_path)
    assert again.returncode == 0 and "(0 new)" in again.stdout
    user_error(ett("generate", "--daily", "0", cwd=tmp_path), "--daily", "greater than 0")
    user_error(ett("generate", "--config", "nope.yaml", cwd=tmp_path), "not found: nope.yaml")


def test_train_refuses_a_bad_config_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"train": {"steps": 0}}))
    user_error(ett("train", "--config", str(path), cwd=tmp_path), "train.steps", "bad.yaml")


def test_train_refuses_a_finished_job_in_one_line(trained: Trained) -> None:
    """`ett train` of the trained job's id again: exit 2, one line naming the job and how to
    start a new one; nothing under its storage is touched."""
    store = trained.tmp / "store"
    before = {p: p.stat().st_mtime_ns for p in sorted(store.rglob("*"))}
    proc = ett("train", "--config", trained.path, cwd=trained.tmp)
    user_error(proc, "job tiny is finished", "leave job_id out (or pass a new one)")
    assert {p: p.stat().st_mtime_ns for p in sorted(store.rglob("*"))} == before


def test_train_resume_continues_the_newest_unfinished_job(trained: Trained, tmp_path: Path) -> None:
    """`ett train --resume`: nothing to resume is one line; an unfinished job that `ett
    train` started (a killed attempt 0 in its ledger) is continued under its id."""
    config = tiny_config(
        tmp_path, job_id=None, data={"url": trained.config.data.url}, train={"steps": 10}
    )
    path = write(config, tmp_path / "job.yaml")
    nothing = ett("train", "--config", path, "--resume", cwd=tmp_path)
    user_error(nothing, "no unfinished train job under", "leave resume out")
    killed = config.model_copy(update={"job_id": "train-20261201-100000-aaaa"})
    storage.configure(killed.storage)
    with Ledger(killed.layout, attempt=0, rank=0, role="orchestrator") as ledger:
        ledger.mark(Mark.FAILURE, step=3, cause="sigkill", exit_code=-9)
    proc = ett("train", "--config", path, "--resume", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "job train-20261201-100000-aaaa has 1 earlier attempt(s)" in proc.stderr
    assert "succeeded on attempt 1" in proc.stdout
    assert [p.name for p in (tmp_path / "store" / "jobs").iterdir()] == [killed.job_id]


def test_report_plain_when_piped_with_plot(trained: Trained) -> None:
    png = trained.tmp / "ett.png"
    proc = ett("report", "tiny", "--config", trained.path, "--plot", str(png), cwd=trained.tmp)
    assert proc.returncode == 0, proc.stderr
    assert "== Wall-time buckets ==" in proc.stdout and "effective_training" in proc.stdout
    assert "│" not in proc.stdout  # plain text into a pipe
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = ett("report", "no-such-job", "--config", trained.path, cwd=trained.tmp)
    user_error(missing, "no-such-job", "jobs there: tiny")


def test_report_is_a_rich_table_in_a_terminal(trained: Trained) -> None:
    """stdout on a pseudo-terminal: rich draws the tables."""
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    proc = subprocess.Popen(
        [str(ETT), "report", "tiny", "--config", trained.path],
        cwd=trained.tmp,
        env=env,
        stdout=follower,
        stderr=subprocess.PIPE,
    )
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    text = out.decode(errors="replace")
    assert "╭" in text and "effective_training" in text and "Traceback" not in text


def test_advise(tmp_path: Path) -> None:
    proc = ett("advise", "--blocking-s", "15", "--failures-per-day", "3", cwd=tmp_path)
    assert proc.returncode == 0 and "929.5 s" in proc.stdout, proc.stdout + proc.stderr
    zero = ett("advise", "--blocking-s", "15", "--failures-per-day", "0", cwd=tmp_path)
    user_error(zero, "--failures-per-day", "greater than 0")
    user_error(ett("advise", "--blocking-s", "15", cwd=tmp_path), "--failures-per-day")


def test_stack_takes_flags_before_the_command(tmp_path: Path) -> None:
    state = str(tmp_path / "stack")
    up = ett("stack", "--state-dir", state, "--services", "s3", "up", cwd=tmp_path, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "S3 endpoint: http://127.0.0.1:" in up.stdout
        status = ett("stack", "--state-dir", state, "status", cwd=tmp_path)
        assert status.returncode == 0 and "healthy" in status.stdout, status.stdout
        env = ett("stack", "--state-dir", state, "env", cwd=tmp_path)
        assert "export AWS_ENDPOINT_URL_S3=http://127.0.0.1:" in env.stdout
        again = ett("stack", "--state-dir", state, "--services", "s3", "up", cwd=tmp_path)
        user_error(again, "already runs")
    finally:
        down = ett("stack", "--state-dir", state, "down", cwd=tmp_path)
    assert down.returncode == 0 and "stopped: s3" in down.stdout
    assert stack.running_services(state) == []
    empty = str(tmp_path / "empty")
    user_error(ett("stack", "--state-dir", empty, "env", cwd=tmp_path), "no stack recorded")
    user_error(ett("stack", "--state-dir", empty, "sideways", cwd=tmp_path), "invalid choice")


@pytest.mark.slow  # MLflow's SQLite schema, then export and validation: ~30 s
def test_publish_the_trained_anchor(trained: Trained, request: pytest.FixtureRequest) -> None:
    store = sqlite_store(request, trained.tmp / "mlflow-publish")
    anchor = sorted((trained.tmp / "store" / "jobs" / "tiny" / "checkpoints").glob("step-*"))[-1]
    proc = ett(
        "publish",
        "--uri",
        f"file://{anchor}",
        "--job-id",
        "tiny",
        "--tracking-uri",
        store,
        "--registered-model",
        "cli-ranker",
        cwd=trained.tmp,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["registered_model"] == "cli-ranker" and result["step"] == 20
    user_error(ett("publish", cwd=trained.tmp), "--uri")
    refused = ett("publish", "--uri", f"file://{trained.tmp}/nothing", cwd=trained.tmp)
    assert refused.returncode == ExitCode.REFUSED
    assert refused.stderr.strip().splitlines()[-1].startswith("publish refused:")


@pytest.mark.slow  # MLflow's SQLite schema
def test_fleet(trained: Trained, request: pytest.FixtureRequest) -> None:
    store = sqlite_store(request, trained.tmp / "mlflow-fleet")
    config = trained.config.model_copy(
        update={"tracking": trained.config.tracking.model_copy(update={"mlflow_uri": store})}
    )
    run_id = mlflow_runs.start_job_run(config)  # what the train flow logs for a job
    mlflow_runs.log_job_report(run_id, JobSummary.read(config.layout))
    out = trained.tmp / "fleet"
    proc = ett(
        "fleet",
        "--tracking-uri",
        store,
        "--experiment",
        "ett-pipeline",
        "--out",
        str(out),
        cwd=trained.tmp,
    )
    assert proc.returncode == 0, proc.stderr
    assert "1 job(s) reported" in proc.stdout and "tiny" in proc.stdout
    assert (out / "ett_trend.png").read_bytes()[:4] == b"\x89PNG"
    user_error(ett("fleet", "--config", "nope.yaml", cwd=trained.tmp), "nope.yaml")


def test_report_log_by_url_names_the_ledger_it_read(
    trained: Trained, request: pytest.FixtureRequest
) -> None:
    """``ett report URL --log`` with a config whose storage root is elsewhere: the MLflow run
    is the job's at that URL (its id, its URL), not one under the config's root."""
    store = sqlite_store(request, trained.tmp / "mlflow-log")
    elsewhere = trained.config.model_copy(
        update={
            "storage": trained.config.storage.model_copy(
                update={"root": f"file://{trained.tmp}/elsewhere"}
            ),
            "tracking": trained.config.tracking.model_copy(update={"mlflow_uri": store}),
        }
    )
    path = write(elsewhere, trained.tmp / "elsewhere.yaml")
    url = trained.config.layout.url
    proc = ett("report", url, "--config", path, "--log", cwd=trained.tmp)
    assert proc.returncode == 0, proc.stderr
    assert "logged tiny to MLflow run" in proc.stdout
    ml = mlflow_runs.client(store)
    experiment = ml.get_experiment_by_name(elsewhere.tracking.experiment)
    [run] = ml.search_runs([experiment.experiment_id], "attributes.run_name = 'tiny'")
    assert run.data.tags[mlflow_runs.JOB_URL_TAG] == url
    # A ledger outside a jobs/ folder is reported, but a run needs the job's id and root.
    flat = f"file://{trained.tmp}/flat"
    shutil.copytree(
        trained.tmp / "store" / "jobs" / "tiny" / "ledger", trained.tmp / "flat" / "ledger"
    )
    user_error(ett("report", flat, "--config", path, "--log", cwd=trained.tmp), "jobs/<job id>")


def test_demo_against_a_server_that_is_down(tmp_path: Path) -> None:
    api = f"http://127.0.0.1:{servers.free_port()}/api"
    proc = ett("demo", cwd=tmp_path, env={"PREFECT_API_URL": api})
    user_error(proc, f"PREFECT_API_URL={api} does not answer")


@pytest.mark.slow  # a temporary Prefect API, two attempts and a publish: ~2 min here
def test_demo_on_a_tiny_config(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store = sqlite_store(request, tmp_path / "mlflow")
    config = tiny_config(
        tmp_path,
        job_id="unused",  # the demo names its job demo-<time>
        train={"steps": 20, "dense_lr": 0.02},
        tracking={"mlflow_uri": store, "registered_model": "demo-ranker"},
    )
    path = write(config, tmp_path / "demo.yaml")
    env = {"PREFECT_API_URL": None, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    proc = ett("demo", "--config", path, "--steps", "20", cwd=tmp_path, env=env, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "== ETT report of job demo-" in proc.stdout
    assert "published: demo-ranker version 1 (aliases: candidate, champion)" in proc.stdout
    assert "this demo ran on a temporary API" in proc.stdout
    assert "ChildFailedError" not in out  # torchrun's own traceback is DEBUG
    assert "planner.stats" not in out and "[TBE=" not in out  # library dumps too
    # What users see (docs/logging.md): the report once, no library noise, no stray lines,
    # a failed attempt's reason, and closing commands that work as printed.
    assert out.count("== Wall-time buckets ==") == 1
    assert "NoneType: None" not in out
    for noise in ("topology was constructed", "is_fx_tracing", "deprecating ShardedTensor"):
        assert noise not in out, noise
    failed = r" ERROR prefect\.task_runs: Finished in state Failed\('attempt 0 failed: sigkill "
    assert re.search(failed, out), out[-6000:]
    [again] = [x for x in proc.stdout.splitlines() if x.startswith("ETT report again: ")]
    report = subprocess.run(
        shlex.split(again.removeprefix("ETT report again: ").split("   (")[0]),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert report.returncode == 0 and "== Wall-time buckets ==" in report.stdout, report.stderr
    [ui] = [x for x in proc.stdout.splitlines() if x.startswith("MLflow UI: ")]
    mlflow = Path(shlex.split(ui.removeprefix("MLflow UI: "), comments=True)[0])
    assert mlflow.resolve() == ETT.with_name("mlflow").resolve() and "--port 5001" in ui
