"""An exception inside a step: recovered in place when ``recovery.in_process_restart`` is
on, a process failure when it is off; the ledger says which, and only what happened."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.ett import report_for_job
from infra.exit_codes import ExitCode
from infra.ledger import Mark, read_events
from tests.reliability.jobs import job_config, run_to_end

CRASH = [{"kind": "crash", "step": 7, "attempt": 0}]


@pytest.mark.parametrize("in_process", [True, False], ids=["restarted", "escalated"])
def test_a_crash_is_marked_in_process_only_when_recovered_in_place(
    tmp_path: Path, data_url: str, in_process: bool
) -> None:
    config = job_config(
        tmp_path,
        data_url,
        steps=10,
        faults=CRASH,
        recovery={"standby": False, "in_process_restart": in_process},
    )
    code, out = run_to_end(config, tmp_path)
    events = read_events(config.job_url)
    marks = [(e.step, e.attempt) for e in events if e.name == Mark.IN_PROCESS_RESTART]
    if in_process:
        assert code == ExitCode.SUCCESS, out[-3000:]
        assert marks == [(7, 0)]
        # Restored from step 5 in the same attempt: steps 6 and 7 run twice, 10 once.
        steps = [e.step for e in events if e.name == "train_step"]
        assert steps.count(6) == 2 and steps.count(10) == 1
        [failure] = report_for_job(config.job_url).failures
        assert failure.in_process and failure.last_step == 7
    else:
        assert code == ExitCode.CRASH, out[-3000:]
        # An escalated exception is no in-process restart: the orchestrator, which sees the
        # exit code, records the failure (here there is none: one attempt by hand).
        assert marks == []
        assert report_for_job(config.job_url).failures == ()
