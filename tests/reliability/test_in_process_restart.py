"""An exception inside a step with ``recovery.in_process_restart`` off: a process failure,
and nothing in the ledger says it was restarted in place (the in-process path, and an
exception escalated within the window, are in tests/trainer/test_run_options.py)."""

from __future__ import annotations

from pathlib import Path

from infra.accounting.ett import report_for_job
from infra.accounting.ledger_format import Mark
from infra.accounting.ledger_read import read_events
from infra.exit_codes import ExitCode
from tests.reliability.jobs import job_config, run_to_end


def test_a_crash_with_in_process_restart_off_is_no_in_process_restart(
    tmp_path: Path, data_url: str
) -> None:
    config = job_config(
        tmp_path,
        data_url,
        steps=10,
        faults=[{"kind": "crash", "step": 7, "attempt": 0}],
        recovery={"standby": False, "in_process_restart": False},
    )
    code, out = run_to_end(config, tmp_path)
    assert code == ExitCode.CRASH, out[-3000:]
    assert [e for e in read_events(config.layout) if e.name == Mark.IN_PROCESS_RESTART] == []
    # The orchestrator, which sees the exit code, records the failure (here there is none:
    # one attempt run by hand), so the report has no failure at all.
    assert report_for_job(config.layout).failures == ()
