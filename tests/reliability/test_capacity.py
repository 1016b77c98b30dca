"""Capacity lost (issue 29, Must show 2): a 2-rank job whose rank 1 is SIGKILLed from outside
while its device fails goes on with 1 rank after ``recovery.wait_for_capacity_s``, resharded
from the newest commit, consuming every global batch's rows exactly once; the report, the
ledger and the MLflow run show the resize. The slot is lost the way a user's job loses it:
the job's ``recovery.health_check`` (tests/health_probe.py, failing while a file says the
device is gone) fails for it when the orchestrator probes the slots before the relaunch, and
passes again once the file is removed, and the job grows back. Attempt 0 is held in step 12
(after its commit of step 10) until the kill, so the kill lands at a known place."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from infra.accounting.ett import report_for_job
from infra.accounting.ledger_format import Mark
from infra.accounting.ledger_read import read_events
from infra.accounting.report import format_table, recovery_lines
from infra.accounting.summary import JobSummary
from infra.config_sources import ConfigError
from infra.exit_codes import ExitCode, Outcome
from infra.settings import JobConfig, load_config
from infra.tracking import mlflow_runs
from tasks.attempt import AttemptProcess
from tasks.capacity import Capacity
from tasks.health import HealthCheck, HealthMonitor
from tasks.orchestrator import Orchestrator
from tests import health_probe
from tests.factories import assert_same_rows, tiny_config
from tests.infra.test_tracking import sqlite_store
from tests.reliability.jobs import job_config, run_to_end

STEPS = 40  # enough steps after the kill for the grow-back to land before the end
HELD_S = 120  # the longest attempt 0 is held before the kill
WAIT_S = 1.0  # recovery.wait_for_capacity_s


def _lose_rank_one(config: JobConfig, devices: Path, attempt: AttemptProcess) -> None:
    """Once attempt 0 has committed step 10: slot 1's device fails (its health check will
    say so), then its rank is SIGKILLed."""
    deadline = time.monotonic() + HELD_S
    while time.monotonic() < deadline and attempt.poll() is None:
        committed = any(
            e.name == Mark.CHECKPOINT_COMMITTED and e.attempt == 0 and e.step == 10
            for e in read_events(config.layout)
        )
        ranks = dict(enumerate(attempt.nodes[0].rank_exits()))
        if committed and 1 in ranks:
            (devices / "lost-1").touch()
            os.kill(ranks[1][0], signal.SIGKILL)
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, data_url: str) -> JobConfig:
    """The same job on 2 ranks throughout, uninterrupted: the rows every run must match."""
    tmp_path = tmp_path_factory.mktemp("clean")
    config = job_config(tmp_path, data_url, STEPS, job_id="clean")
    code, out = run_to_end(config, tmp_path, nproc=2)
    assert code == ExitCode.SUCCESS, out[-3000:]
    return config


def _run(config: JobConfig, devices: Path, grow_back: bool) -> Orchestrator:
    """The job to its end; ``grow_back``: slot 1's device returns as soon as attempt 1 (1
    rank) has been launched; the health check's recheck regains it, the job grows back."""
    with Orchestrator(config, env={"OMP_NUM_THREADS": "1"}) as job:
        for attempt in job:
            if attempt.number == 0:
                args = (config, devices, attempt)
                threading.Thread(target=_lose_rank_one, args=args, daemon=True).start()
            elif attempt.number == 1 and grow_back:
                (devices / "lost-1").unlink()
            job.watch(attempt)
    return job


def _shrinking_job(tmp_path: Path, data_url: str, job_id: str, **sections: Any) -> JobConfig:
    """Slots checked by tests/health_probe.py on ``tmp_path / "devices"``."""
    (tmp_path / "devices").mkdir()
    recovery = {
        "max_failures": 1,
        "backoff_s": 0,
        "standby": False,
        "hang_timeout_s": HELD_S,
        "health_check": health_probe.command(tmp_path / "devices"),
    }
    return job_config(
        tmp_path,
        data_url,
        STEPS,
        job_id=job_id,
        launch={"nproc": 2},
        faults=[{"kind": "hang", "step": 12, "attempt": 0}],  # held there until the kill
        recovery={**recovery, "min_ranks": 1, "wait_for_capacity_s": WAIT_S},
        **sections,
    )


@pytest.mark.timeout(HELD_S + 240)
def test_a_rank_lost_for_good_goes_on_with_one_rank_every_row_once(
    tmp_path: Path,
    data_url: str,
    clean: JobConfig,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 1 SIGKILLed, its device failing its health check, min_ranks 1: attempt 1 runs
    on 1 rank from step 10."""
    mlflow_store = sqlite_store(request, tmp_path / "mlflow")
    tracking = {"mlflow_uri": mlflow_store}
    config = _shrinking_job(tmp_path, data_url, "shrunk", tracking=tracking)
    with caplog.at_level(logging.WARNING, logger="ett.orchestrator"):
        job = _run(config, tmp_path / "devices", grow_back=False)
    assert job.result is not None
    said = [r.getMessage() for r in caplog.records if r.name == "ett.orchestrator"]
    lost = "rank slot 1 lost (health check): exit 3: slot 1: device gone (lost-1 present)"
    assert said.count(lost) == 1, said
    assert any("relaunching on 1 of 2 ranks (slots 0)" in line for line in said), said
    outcome = job.result.outcome
    assert [a.outcome.failed for a in outcome.attempts] == [True, False], outcome.message
    assert outcome.succeeded, outcome.message
    assert_same_rows(clean, config, STEPS)

    # The resize: in the ledger, in the report's recovery lines and world sizes.
    report = report_for_job(config.layout)
    [resize] = report.resizes
    assert (resize.attempt, resize.step, resize.from_ranks, resize.to_ranks) == (1, 10, 2, 1)
    assert "attempt 1 resized at step 10: 2 -> 1 ranks" in "\n".join(recovery_lines(report))
    assert [(a.attempt, a.ranks) for a in report.attempts] == [(0, 2), (1, 1)]
    assert "World size per attempt" in format_table(report)

    # ...and on the job's MLflow run, a tag of its own.
    run_id = mlflow_runs.start_job_run(config)
    mlflow_runs.log_job_report(run_id, JobSummary.read(config.layout))
    tags = MlflowClient(tracking_uri=mlflow_store).get_run(run_id).data.tags
    assert tags["ett.resizes"] == resize.describe()


@pytest.mark.timeout(HELD_S + 240)
def test_the_job_grows_back_at_its_next_commit_once_the_slot_returns(
    tmp_path: Path, data_url: str, clean: JobConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """Slot 1's device back while attempt 1 trains on 1 rank: the recheck regains it,
    attempt 1 is preempted (it commits at its step boundary) and attempt 2 resumes on 2
    ranks from that commit."""
    config = _shrinking_job(tmp_path, data_url, "regrown")
    with caplog.at_level(logging.WARNING, logger="ett.orchestrator"):
        job = _run(config, tmp_path / "devices", grow_back=True)
    assert job.result is not None
    said = [r.getMessage() for r in caplog.records if r.name == "ett.orchestrator"]
    assert "rank slot 1 usable again: slot 1: ok" in said, said
    outcome = job.result.outcome
    got = [a.outcome for a in outcome.attempts]
    assert got[1:] == [Outcome.PREEMPTED, Outcome.SUCCESS], outcome.message
    assert got[0].failed and outcome.succeeded, outcome.message
    assert_same_rows(clean, config, STEPS)

    report = report_for_job(config.layout)
    shrink, grow = report.resizes
    assert (shrink.attempt, shrink.from_ranks, shrink.to_ranks) == (1, 2, 1)
    assert (grow.attempt, grow.from_ranks, grow.to_ranks) == (2, 1, 2)
    assert grow.step > shrink.step  # the commit attempt 1 made when it was preempted
    assert [(a.attempt, a.ranks) for a in report.attempts] == [(0, 2), (1, 1), (2, 2)]


def test_min_ranks_above_the_launch_is_refused_in_one_line() -> None:
    """A minimum the launch cannot reach is a config error naming both values."""
    with pytest.raises(ConfigError) as info:
        load_config(None, launch={"nproc": 2}, recovery={"min_ranks": 3})
    # The config error's header, then the problem on one line of its own.
    [problem] = [line for line in str(info.value).splitlines() if "min_ranks" in line]
    assert "recovery.min_ranks 3 is more than launch.nproc 2" in problem


def test_a_lost_slot_counts_until_it_is_regained() -> None:
    """Losing a slot twice loses it once; a slot the host never had is refused."""
    capacity = Capacity(2)
    capacity.lose(1)
    capacity.lose(1)
    assert capacity.ranks == 1
    capacity.regain(1)
    assert capacity.ranks == 2
    with pytest.raises(ValueError, match="rank slot 2 is not one of 0..1"):
        capacity.lose(2)


def _decider(tmp_path: Path, min_ranks: int | None) -> tuple[Orchestrator, list[float]]:
    """An orchestrator never entered (nothing launched): its decision of the next size, with
    a sleep that records its waits instead of waiting."""
    recovery = {"min_ranks": min_ranks, "wait_for_capacity_s": 3.0}
    config = tiny_config(tmp_path, launch={"nproc": 2}, recovery=recovery)
    waits: list[float] = []
    return Orchestrator(config, sleep=waits.append), waits


def test_too_few_slots_left_fail_the_job_in_one_line_after_the_wait(tmp_path: Path) -> None:
    """The default minimum is the launched size: a lost slot never shrinks the job."""
    job, waits = _decider(tmp_path, None)
    job.capacity.lose(0)
    assert job._ranks_for_next() is None
    assert sum(waits) == pytest.approx(3.0)
    assert job._outcome is not None and not job._outcome.succeeded
    assert job._outcome.message == (
        "capacity lost: 1 of 2 rank slots left after 3 s, recovery.min_ranks is 2"
    )


def test_a_slot_back_within_the_wait_relaunches_at_full_size(tmp_path: Path) -> None:
    """The wait ends as soon as the lost slot is regained: no resize."""
    job, waits = _decider(tmp_path, 1)
    job.capacity.lose(1)
    job.sleep = lambda s: (waits.append(s), job.capacity.regain(1))
    assert job._ranks_for_next() == (0, 1)
    assert len(waits) == 1 and job._outcome is None


def test_the_health_check_before_a_relaunch_leaves_the_usable_slots(tmp_path: Path) -> None:
    """Slot 0's device fails its check: after the wait, the next attempt runs on slot 1
    alone (min_ranks 1: exactly the minimum is enough)."""
    job, waits = _decider(tmp_path, 1)
    (tmp_path / "lost-0").touch()
    check = HealthCheck(health_probe.command(tmp_path), 10.0, None)
    job.health = HealthMonitor(check, job.capacity, job.log)  # no thread: nothing regains
    assert job._ranks_for_next() == (1,)
    assert sum(waits) == pytest.approx(3.0) and job._outcome is None
