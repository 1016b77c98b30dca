"""infra/accounting/cold_start.py: a first job that compiled cold says so in one line, with
what the next job takes; a warm one says nothing. Read from ledgers written as a trainer
writes them, through ``JobSummary`` and through ``ett report``."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra import storage
from infra.accounting.cold_start import WARM_SHARE
from infra.accounting.ledger import Ledger
from infra.accounting.summary import JobSummary
from infra.job_layout import JobLayout
from tests.flows.test_cli import ett

T0 = 1_800_000_000.0


def _attempt(url: str, attempt: int, at: float, status: str, compile_s: float) -> float:
    """One attempt's trainer: its cache load (``status``), its compile, three steps; returns
    the end of its last step."""
    clock = lambda: T0  # noqa: E731 - every time is given explicitly
    tr = Ledger(JobLayout.at(url), attempt=attempt, clock=clock)
    tr.mark("attempt_start", t=at)
    tr.record_span("pre_train", at, at + 0.2, stage="compile_cache_load", cache_status=status)
    tr.record_span("compile", at + 0.2, at + 0.2 + compile_s, what="warmup")
    t = at + 0.5 + compile_s
    for step in range(1, 4):
        tr.record_span("train_step", t, t + 0.1, step=step)
        t += 0.1
    tr.mark("job_end", step=3, t=t)
    tr.close()
    return t


def _job(tmp: Path, job_id: str, status: str, compile_s: float, standby_s: float | None) -> str:
    """A job: launcher 2 s, attempt 0 (``status``, ``compile_s``), and when ``standby_s`` is
    given a standby (attempt 1) that loaded the cache and compiled warm in that time."""
    url = f"file://{tmp}/store/jobs/{job_id}"
    storage.configure(None)
    orch = Ledger(JobLayout.at(url), attempt=0, role="orchestrator", clock=lambda: T0)
    orch.record_span("launcher_init", T0, T0 + 2.0)
    orch.close()
    if standby_s is not None:
        _attempt(url, 1, T0 + 30.0, "hit", standby_s)
    _attempt(url, 0, T0 + 2.0, status, compile_s)
    return url


def _summary(url: str) -> JobSummary:
    return JobSummary.read(JobLayout.at(url))


def test_a_cold_compile_that_dominates_time_to_start_is_explained(tmp_path: Path) -> None:
    summary = _summary(_job(tmp_path, "cold", "miss", 16.0, standby_s=1.8))
    assert summary.report.time_to_start_s == pytest.approx(18.5)
    cold = summary.cold_start()
    assert cold is not None
    # next = 18.5 - (16.0 + 0.2) + (1.8 + 0.2): the standby's warm compile, measured
    assert cold.next_start_s == pytest.approx(4.3)
    assert cold.describe() == (
        "cold compile 16.2 s of Time to Start 18.5 s; the compile cache under "
        f"{tmp_path}/store/compile-cache is now warm: the next job starts in ~4 s "
        "(its warm compile took 2.0 s in attempt 1)"
    )


def test_without_a_warm_start_to_measure_the_warm_compile_is_estimated(tmp_path: Path) -> None:
    cold = _summary(_job(tmp_path, "alone", "miss", 16.0, standby_s=None)).cold_start()
    assert cold is not None and cold.warm_measured_on is None
    assert cold.warm_compile_s == pytest.approx(WARM_SHARE * 16.2)
    assert "a warm compile is ~9% of a cold one" in cold.describe()


@pytest.mark.parametrize(
    ("status", "compile_s"),
    [("hit", 16.0), ("off", 16.0), ("miss", 1.0)],  # warm, no cache, a cold compile that is short
)
def test_nothing_to_explain(tmp_path: Path, status: str, compile_s: float) -> None:
    assert _summary(_job(tmp_path, "j", status, compile_s, standby_s=1.8)).cold_start() is None


def test_ett_report_says_it_for_a_cold_job_only(tmp_path: Path) -> None:
    cold = ett("report", _job(tmp_path, "cold", "miss", 16.0, 1.8), cwd=tmp_path)
    warm = ett("report", _job(tmp_path, "warm", "hit", 2.0, 1.8), cwd=tmp_path)
    assert cold.returncode == 0 and warm.returncode == 0, cold.stderr + warm.stderr
    said = [line for line in cold.stdout.splitlines() if line.startswith("cold compile ")]
    assert len(said) == 1 and "the next job starts in ~4 s" in said[0], cold.stdout
    assert "== Wall-time buckets ==" in warm.stdout and "cold compile" not in warm.stdout
