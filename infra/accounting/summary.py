"""What a job's end shows, from one read of its ledger: the events, the ETT report and MFU.

The ledger is read once (``JobSummary.read``); the terminal report (``ett report``), the
Prefect artifacts, the MLflow run and the final log line each render this one summary
instead of reading and computing again.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.accounting.cold_start import ColdStart, cold_start
from infra.accounting.ett import compute_report
from infra.accounting.ledger_format import Event
from infra.accounting.ledger_read import LedgerFile, ledger_of, read_files
from infra.accounting.mfu import MfuReport, mfu_report
from infra.accounting.records import EttReport
from infra.job_layout import JobLayout


@dataclass(frozen=True)
class JobSummary:
    """One job's ledger, read once: its files as stored (for the MLflow run's archive), its
    events checked and on one clock, and what is computed from them."""

    layout: JobLayout
    files: tuple[LedgerFile, ...]
    events: tuple[Event, ...]
    report: EttReport
    mfu: MfuReport | None

    @classmethod
    def read(cls, layout: JobLayout) -> JobSummary:
        """Read the job's ledger and compute its report. Raises ValueError for a job whose
        ledger holds nothing to account for (no rank-0 event)."""
        files = read_files(layout)
        read = ledger_of(files)
        report = compute_report(read.events, clock=read.clock)
        return cls(
            layout, tuple(files), tuple(read.events), report, mfu_report(read.events, report)
        )

    def cold_start(self) -> ColdStart | None:
        """A first attempt whose cold compile was most of Time to Start (cold_start.py)."""
        return cold_start(self.events, self.report.time_to_start_s, self.layout.compile_cache)
