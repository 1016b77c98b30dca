"""A warm standby killed from outside, the way a fleet loses one (the OOM killer, a node
agent), while it waits and while it is being promoted: ``ett train`` as a user runs it, the
processes found and SIGKILLed by their environment, the ledger watched as ``tail -f`` would.

The finding these pin: a parked standby SIGKILLed, then the primary's rank killed, made the
orchestrator relaunch cold under the dead standby's attempt number; the report dropped that
attempt whole and said "Finished: no" for a job that finished.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from infra.accounting.ett import report_for_job
from infra.accounting.ledger_format import Mark
from infra.accounting.ledger_read import read_events
from infra.accounting.report import format_table
from tests.reliability.ett_job import EttTrain
from tests.reliability.jobs import job_config

pytestmark = pytest.mark.slow

STEPS = 1500


def _config(tmp_path: Path, data_url: str, job_id: str):
    return job_config(
        tmp_path,
        data_url,
        STEPS,
        job_id=job_id,
        checkpoint={"every_steps": 20},
    )


def _file(kind: str, attempt: int) -> str:
    return f"{kind}-attempt{attempt:03d}-rank000.jsonl"


def test_a_standby_killed_while_parked_is_replaced_and_the_job_reports_whole(
    tmp_path: Path, data_url: str
) -> None:
    """The finding's scenario: standby 1 SIGKILLed once parked, the primary's rank SIGKILLed
    three seconds later. The job finishes and its report shows every attempt and step."""
    job = EttTrain(_config(tmp_path, data_url, "lost-standby"), tmp_path, "--backoff-s", "0")
    try:
        job.wait_until(
            "standby 1 parked", lambda: job.ledger_says(_file("trainer", 1), "standby_ready")
        )
        job.kill(1)  # the parked standby: its agent and its rank
        time.sleep(3.0)  # the finding's three seconds: the job trains on meanwhile
        job.kill(0, ranks_only=True)  # then the primary's rank
        assert job.wait() == 0, job.tail()
        job.assert_left_nothing()
    finally:
        job.end()
    report = report_for_job(job.config.layout)
    assert report.finished and report.num_steps == STEPS, format_table(report)
    assert [(a.attempt, a.outcome) for a in report.attempts] == [(0, "sigkill"), (2, "success")]
    [lost] = report.lost_standbys
    assert (lost.attempt, lost.parked, lost.cause) == (1, True, "sigkill")
    assert [f.cause for f in report.failures] == ["sigkill"]  # the lost standby is no failure
    assert [s.attempt for s in report.standbys] == [2]  # the replacement, promoted
    out = job.output()
    assert "standby attempt 1 lost while parked (killed by SIGKILL" in out
    assert "promoting standby attempt 2" in out
    # Every attempt number is its own: no trainer file mixes a dead standby with a launch.
    events = read_events(job.config.layout)
    starts = [(e.attempt, e.attrs.get("standby")) for e in events if e.name == Mark.ATTEMPT_START]
    assert len(starts) == len({a for a, _ in starts}), starts
    text = format_table(report)
    assert "standby attempt 1 lost while parked (sigkill)" in text
    assert "attempt 2 (promoted standby) resumed from step" in text


def test_a_standby_killed_as_it_is_promoted_is_a_failure_and_a_cold_attempt_finishes(
    tmp_path: Path, data_url: str
) -> None:
    """The primary's rank killed; 0.1 s after the standby marks its promotion it is killed
    too. That is the promoted attempt failing: the next is launched cold under a new number,
    and a new standby parks behind it."""
    job = EttTrain(_config(tmp_path, data_url, "promoted-killed"), tmp_path, "--backoff-s", "0")
    try:
        job.wait_until(
            "standby 1 parked", lambda: job.ledger_says(_file("trainer", 1), "standby_ready")
        )
        job.kill(0, ranks_only=True)
        job.wait_until(
            "standby 1 promoted", lambda: job.ledger_says(_file("trainer", 1), Mark.PROMOTED)
        )
        time.sleep(0.1)
        job.kill(1)
        assert job.wait() == 0, job.tail()
        job.assert_left_nothing()
    finally:
        job.end()
    report = report_for_job(job.config.layout)
    assert report.finished and report.num_steps == STEPS, format_table(report)
    outcomes = [(a.attempt, a.outcome) for a in report.attempts]
    assert outcomes == [(0, "sigkill"), (1, "sigkill"), (2, "success")], outcomes
    assert [f.cause for f in report.failures] == ["sigkill", "sigkill"]
    assert report.lost_standbys == ()
    events = read_events(job.config.layout)
    # The replacement: attempt 2's own standby (attempt 3) started once attempt 2 trained.
    standbys = {
        e.attempt for e in events if e.name == Mark.ATTEMPT_START and e.attrs.get("standby")
    }
    assert {1, 3} <= standbys
