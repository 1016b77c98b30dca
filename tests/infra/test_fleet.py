"""infra/whatif/fleet.py (and its rendering, infra/whatif/fleet_report.py) over jobs logged by
infra/tracking/mlflow_runs.py to a real SQLite MLflow store.

Six synthetic jobs an hour apart (10-minute train loops, some with a failure); job 4 takes twice
as long to start. Only that Time to Start regression may be flagged.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow import MlflowClient

from infra.accounting.summary import JobSummary
from infra.tracking import mlflow_runs
from infra.whatif.fleet import FleetJob, Thresholds, find_regressions, fleet_summary
from infra.whatif.fleet_report import PLOTS, format_fleet, write_files
from tests.factories import tiny_config
from tests.infra.test_tracking import T0, sqlite_store, write_job

PNG = b"\x89PNG\r\n\x1a\n"
STARTUP = [10.0, 10.4, 9.8, 10.2, 20.0, 10.1]  # job 4: the injected regression (~+96%)
FAIL_AFTER = [None, 41, None, 121, None, 81]
RESTART = [8.0, 8.0, 8.0, 8.5, 8.0, 7.8]


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fleet")
    store = sqlite_store(request, root)
    tracking_cfg = {"mlflow_uri": store, "experiment": "fleet"}
    reports = {}
    with pytest.MonkeyPatch.context() as mp:
        # A per-job chart costs seconds of matplotlib here; test_tracking checks the real one.
        mp.setattr(mlflow_runs, "plot_breakdown", lambda report, path: Path(path).write_bytes(PNG))
        for i, (startup, fail, restart) in enumerate(
            zip(STARTUP, FAIL_AFTER, RESTART, strict=True)
        ):
            config = tiny_config(root, job_id=f"retrain-{i}", tracking=tracking_cfg)
            write_job(
                config.layout.url,
                t0=T0 + 3600 * i,
                startup_s=startup,
                steps=300,
                step_s=2.0,
                ckpt_every=10,
                fail_after=fail,
                restart_s=restart,
            )
            run_id = mlflow_runs.start_job_run(config)
            if fail:  # nested attempt runs must not count as jobs
                attempt = mlflow_runs.LedgerAttempt(0, "sigkill", -9, T0, T0 + 100, fail)
                mlflow_runs.log_attempt(run_id, attempt)
            summary = JobSummary.read(config.layout)
            reports[config.job_id] = summary.report
            mlflow_runs.log_job_report(run_id, summary)
    # Started, not reported yet: listed as in progress, not as a job.
    mlflow_runs.start_job_run(tiny_config(root, job_id="retrain-6", tracking=tracking_cfg))
    summary = fleet_summary(store, "fleet")
    return {"store": store, "root": root, "reports": reports, "summary": summary}


def test_fleet_flags_the_time_to_start_regression_only(fleet: dict) -> None:
    s = fleet["summary"]
    assert [r.metric for r in s.regressions] == ["time_to_start_s"]
    (reg,) = s.regressions
    assert reg.job_id == "retrain-4" and reg.value == 20.0
    assert reg.baseline == pytest.approx(10.1)  # median of jobs 0-3
    assert "Time to Start 20.00 s is +98% over the trailing median 10.10 s" in reg.message
    text = format_fleet(s)
    assert reg.message in text and "retrain-5" in text


def test_fleet_jobs_match_their_reports(fleet: dict) -> None:
    s, reports = fleet["summary"], fleet["reports"]
    assert [j.job_id for j in s.jobs] == [f"retrain-{i}" for i in range(6)]  # oldest first
    assert s.in_progress == ("retrain-6",)
    for job in s.jobs:
        r = reports[job.job_id]
        assert job.ett_pct == r.ett_pct and job.time_to_start_s == r.time_to_start_s
        assert job.num_failures == r.num_failures and job.wall_s == r.wall_s
        assert job.time_to_recover_s == tuple(f.time_to_recover_s for f in r.failures)
        assert job.unsaved_s == r.observed_unsaved_s
        assert job.checkpoint_blocking_s == r.checkpoint_blocking_total_s
        assert job.start_time == r.start_time
    ttr = sorted(x for j in s.jobs for x in j.time_to_recover_s)
    assert ttr == pytest.approx([7.8, 8.0, 8.5])  # Unix-time float rounding
    totals = s.stats["totals"]
    assert totals["failures"] == 3 and totals["unsaved_s"] == pytest.approx(6.0)
    wall = sum(r.wall_s for r in reports.values())
    eff = sum(r.buckets["effective_training"] for r in reports.values())
    assert totals["fleet_ett_pct"] == pytest.approx(100 * eff / wall)
    assert s.stats["time_to_start_s"]["max"] == 20.0


def test_fleet_writes_plots_and_tables(fleet: dict) -> None:
    s, out = fleet["summary"], fleet["root"] / "out"
    files = write_files(s, out)
    for name in PLOTS:
        assert Path(files[name]).read_bytes()[:8] == PNG and Path(files[name]).parent == out
    md = (out / "fleet.md").read_text()
    assert "| retrain-4 |" in md and "time_to_start_s" in md
    assert (out / "fleet.txt").read_text() == format_fleet(s)
    assert json.loads((out / "fleet.json").read_text())["regressions"][0]["job_id"] == "retrain-4"


def test_missing_experiment_gives_empty_summary(fleet: dict, tmp_path: Path) -> None:
    s = fleet_summary(fleet["store"], "no-such-experiment")
    assert s.jobs == () and s.regressions == ()
    files = write_files(s, tmp_path)
    assert "(no reported jobs)" in (tmp_path / "fleet.txt").read_text()
    assert not set(PLOTS) & set(files)  # nothing to plot
    assert (
        MlflowClient(tracking_uri=fleet["store"]).get_experiment_by_name("no-such-experiment")
        is None
    )


def _job(i: int, **kw: object) -> FleetJob:
    base = FleetJob(
        run_id=f"r{i}",
        job_id=f"j{i}",
        status="FINISHED",
        start_time=T0 + i,
        wall_s=1000.0,
        ett_pct=90.0,
        failure_pct=2.0,
        idleness_pct=8.0,
        time_to_start_s=30.0,
        num_failures=1,
        time_to_recover_s=(20.0,),
        time_to_recover_total_s=20.0,
        unsaved_s=5.0,
        checkpoint_blocking_s=10.0,
        checkpoint_blocking_mean_s=1.0,
        effective_s=900.0,
    )
    return replace(base, **kw)


def test_regression_rules() -> None:
    jobs = [
        _job(0),
        _job(1, ett_pct=91.0),
        _job(2, ett_pct=89.0),
        _job(3, ett_pct=84.0),
        _job(4, time_to_recover_s=(35.0,)),
        _job(5, checkpoint_blocking_mean_s=1.6),
        _job(6, time_to_start_s=35.0),
    ]  # +17%: under the threshold
    found = {(r.job_id, r.metric) for r in find_regressions(jobs)}
    assert found == {
        ("j3", "ett_pct"),
        ("j4", "time_to_recover_s"),
        ("j5", "checkpoint_blocking_mean_s"),
    }
    assert find_regressions(jobs[:3] + [_job(3, ett_pct=1.0)], Thresholds(min_history=4)) == []
    # Tiny absolute changes of a tiny Time to Start are noise, not regressions.
    tiny = [_job(i, time_to_start_s=0.1) for i in range(5)] + [_job(5, time_to_start_s=0.5)]
    assert find_regressions(tiny) == []
