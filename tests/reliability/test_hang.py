"""A hang under torchrun with two ranks: rank 0 stops stepping but keeps printing (output is
not progress), rank 1 blocks in the next collective. The orchestrator kills the attempt for
lack of progress, every rank of it is gone afterwards, and the job finishes on the next one."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from infra.accounting.ledger_format import Mark
from infra.accounting.ledger_read import read_events
from infra.exit_codes import Outcome
from tasks.orchestrator import run
from tests import procs
from tests.factories import tiny_config, write_dataset
from tests.procs import MARKER


class _Collect(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.slow
def test_a_chatty_hang_of_two_ranks_is_killed_whole(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        job_id="hang",
        train={"steps": 20, "log_every": 1, "eval": "off"},
        faults=[{"kind": "hang", "step": 8, "attempt": 0}],
        checkpoint={"preemption_budget_s": 1},
        launch={"nproc": 2},
        recovery={
            "backoff_s": 0,
            "standby": False,
            "hang_timeout_s": 6.0,
            "startup_timeout_s": 300.0,
        },
    )
    write_dataset(config)
    lines: list[str] = []
    log = logging.getLogger("test-hang")
    log.addHandler(_Collect(lines))
    log.setLevel(logging.INFO)
    marker = {MARKER: str(tmp_path)}
    outcome = run(config, log=log, env={"OMP_NUM_THREADS": "1", **marker}).outcome

    assert [a.outcome for a in outcome.attempts] == [Outcome.HANG, Outcome.SUCCESS]
    assert outcome.attempts[0].last_step == 7
    events = read_events(config.layout)
    failure = next(e for e in events if e.name == Mark.FAILURE)
    assert failure.attrs["cause"] == "hang" and failure.step == 7
    # Rank 0 kept printing while it hung: the hang was detected despite the output.
    assert sum("injected hang at step 8: still here" in line for line in lines) >= 5
    deadline = time.monotonic() + 10
    while procs.carrying(**marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert procs.carrying(**marker) == [], "a rank outlived its attempt"
