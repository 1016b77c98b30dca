"""infra/accounting/report.py and infra/tables.py: what a user sees of a job's report."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
from rich.console import Console

from infra import tables
from infra.accounting.ett import report_for_job
from infra.accounting.ledger import Ledger
from infra.accounting.records import BUCKETS
from infra.accounting.report import COLORS, dominant_buckets, plot_breakdown, sections
from infra.job_layout import JobLayout

T0 = 1_700_000_000.0
STEPS, STEP_S, GAP_S = 1200, 0.060, 0.002  # 2 ms between steps: "other" time


def _many_short_steps(job_url: str) -> None:
    """5 s of startup, 1200 steps of 60 ms with 2 ms gaps, 2 s of shutdown."""
    with Ledger(JobLayout.at(job_url), attempt=0, clock=lambda: T0) as tr:
        tr.record_span("pre_train", T0, T0 + 5)
        t = T0 + 5
        for step in range(1, STEPS + 1):
            tr.record_span("train_step", t, t + STEP_S, step=step)
            t += STEP_S + GAP_S
        tr.record_span("shutdown", t, t + 2)
        tr.mark("job_end", t=t + 2)


def _rgb(hex_color: str) -> np.ndarray:
    return np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]) / 255


def _share_of_timeline(png: Path, bucket: str) -> float:
    """The share of the timeline strip's pixels drawn in ``bucket``'s colour. The strip is
    the band of rows in the lower panel holding the startup colour (it starts the job)."""
    img = mpimg.imread(png)[:, :, :3]
    lower = img[img.shape[0] // 2 :]
    is_color = lambda c: np.all(np.abs(lower - _rgb(COLORS[c])) < 0.05, axis=2)
    band = is_color("startup").any(axis=1)
    assert band.sum() > 5, "no timeline strip found"
    strip = lower[band]
    drawn = np.zeros(strip.shape[:2], dtype=bool)
    for b in BUCKETS:
        drawn |= np.all(np.abs(strip - _rgb(COLORS[b])) < 0.05, axis=2)
    mine = np.all(np.abs(strip - _rgb(COLORS[bucket])) < 0.05, axis=2)
    return float(mine.sum() / drawn.sum())


def test_timeline_shows_training_between_millisecond_gaps(tmp_path: Path) -> None:
    """Thousands of 2 ms 'other' gaps must not paint over the training: the timeline is as
    green as the job was effective (up to the gaps, which are below a pixel)."""
    _many_short_steps(str(tmp_path / "job"))
    report = report_for_job(JobLayout.at(str(tmp_path / "job")))
    pct = report.bucket_pct()
    png = plot_breakdown(report, tmp_path / "ett.png")
    green = 100 * _share_of_timeline(png, "effective_training")
    assert pct["effective_training"] - 1 <= green <= pct["effective_training"] + pct["other"] + 1


def test_dominant_buckets_per_slice() -> None:
    segments = [(0.0, 1.0, "startup"), (1.0, 1.4, "effective_training"), (1.4, 1.5, "other")]
    segments += [(1.5, 4.0, "effective_training"), (4.0, 4.0 + 1e-3, "other")]
    segments += [(4.0 + 1e-3, 5.0, "effective_training")]
    got = [BUCKETS[i] for i in dominant_buckets(segments, 5.0, 5)]
    assert (
        got == ["startup", "effective_training", "effective_training"] + ["effective_training"] * 2
    )
    assert list(dominant_buckets([], 5.0, 3)) == [len(BUCKETS)] * 3  # nothing drawn


@pytest.fixture
def report(tmp_path: Path):
    _many_short_steps(str(tmp_path / "job"))
    return report_for_job(JobLayout.at(str(tmp_path / "job")))


def test_tables_are_plain_when_piped_and_rich_in_a_terminal(report) -> None:
    plain = tables.to_text(sections(report))
    assert "== Wall-time buckets ==" in plain
    assert not set("│╭─") & set(plain) and "\x1b[" not in plain  # no box, no colour
    row = next(line for line in plain.splitlines() if line.startswith("effective_training"))
    assert row.split()[2] == f"{report.bucket_pct()['effective_training']:.2f}"

    terminal = Console(force_terminal=True, width=120, record=True, markup=False)
    tables._render(sections(report), terminal, fancy=True)
    fancy = terminal.export_text()
    assert "╭" in fancy and "│ effective_training" in fancy


def test_markdown_escapes_cells(report) -> None:
    md = tables.to_markdown([("T", ["a", "b"], [["x|y", "[bold]z[/bold]"]])])
    assert "| x\\|y | [bold]z[/bold] |" in md
    assert tables.to_text([("T", ["a"], [["[bold]z[/bold]"]])]).count("[bold]") == 1
