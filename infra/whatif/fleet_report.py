"""Rendering a FleetSummary: text and rich tables, markdown for a Prefect artifact, plots.

Kept apart from infra/whatif/fleet.py (which computes the summary) as infra/accounting/report.py is
kept apart from infra/accounting/ett.py. ``figures`` returns matplotlib figures and writes nothing,
so the caller decides where they go: files for ``ett fleet --out``, an MLflow run for the flow.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from infra import tables
from infra.figures import pyplot
from infra.whatif.fleet import FleetSummary

PLOTS = ("ett_trend", "time_to_start", "time_to_recover", "waste")


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M")


def _jobs_section(s: FleetSummary) -> tables.Section:
    header = [
        "job",
        "started (UTC)",
        "ETT%",
        "start s",
        "failures",
        "recover s",
        "unsaved s",
        "ckpt block s",
        "wall s",
        "flags",
    ]
    flags: dict[str, list[str]] = {}
    for r in s.regressions:
        flags.setdefault(r.run_id, []).append(r.metric)
    f = lambda x: "-" if x is None else f"{x:.1f}"
    rows = [
        [
            j.job_id,
            _when(j.start_time),
            f"{j.ett_pct:.2f}",
            f(j.time_to_start_s),
            str(j.num_failures),
            f(j.time_to_recover_total_s),
            f(j.unsaved_s),
            f(j.checkpoint_blocking_s),
            f(j.wall_s),
            ",".join(flags.get(j.run_id, [])),
        ]
        for j in s.jobs
    ]
    return ("Jobs (oldest first)", header, rows)


def headline(s: FleetSummary) -> list[str]:
    tot, st = s.stats["totals"], s.stats
    q = lambda k, p: "-" if p not in st[k] else f"{st[k][p]:.1f}"
    return [
        f"Fleet ETT: experiment {s.experiment!r} at {s.tracking_uri}",
        f"{len(s.jobs)} job(s) reported, {len(s.in_progress)} in progress; "
        f"fleet ETT {tot['fleet_ett_pct']:.2f}% (time-weighted), median ETT {q('ett_pct', 'p50')}%",
        f"Time to Start p50/p90 {q('time_to_start_s', 'p50')}/{q('time_to_start_s', 'p90')} s; "
        f"Time to Recover p50/p90 {q('time_to_recover_s', 'p50')}/{q('time_to_recover_s', 'p90')}"
        f" s; {int(tot['failures'])} failure(s); unsaved {tot['unsaved_s']:.1f} s; "
        f"checkpoint blocking {tot['checkpoint_blocking_s']:.1f} s",
    ]


def _preamble(s: FleetSummary) -> list[str]:
    out = [*headline(s), "", f"Regressions ({len(s.regressions)}):"]
    out += [f"  ! {r.message}" for r in s.regressions] or ["  none"]
    return [*out, ""]


def format_fleet(summary: FleetSummary) -> str:
    """Plain text: headline, regressions, one row per job (oldest first)."""
    if not summary.jobs:
        return "\n".join([*_preamble(summary), "(no reported jobs)"]) + "\n"
    return "\n".join(_preamble(summary)) + "\n" + tables.to_text([_jobs_section(summary)])


def show_fleet(summary: FleetSummary, stream: IO[str]) -> None:
    """Print the fleet view: a rich table in a terminal, :func:`format_fleet` elsewhere."""
    if not tables.is_terminal(stream) or not summary.jobs:
        stream.write(format_fleet(summary))
        return
    stream.write("\n".join(_preamble(summary)) + "\n")
    tables.show([_jobs_section(summary)], stream)


def to_markdown(summary: FleetSummary) -> str:
    lines = headline(summary)
    out = ["# " + lines[0], "", *lines[1:], "", "## Regressions", ""]
    out += [f"- `{r.metric}` {r.message}" for r in summary.regressions]
    if not summary.regressions:
        out.append("_none_")
    return "\n".join(out) + "\n" + tables.to_markdown([_jobs_section(summary)])


def figures(summary: FleetSummary) -> dict[str, Any]:
    """The four plots of the fleet view as matplotlib figures (named as PLOTS); empty when
    no job has reported yet. The caller saves or logs them, then closes them."""
    if not summary.jobs:
        return {}
    plt = pyplot()
    jobs = list(summary.jobs)
    x = [datetime.fromtimestamp(j.start_time, UTC) for j in jobs]
    flagged = {(r.run_id, r.metric) for r in summary.regressions}
    out: dict[str, Any] = {}

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(x, [j.ett_pct for j in jobs], "o-", color="#2ca02c", label="ETT%")
    ax.plot(x, [j.failure_pct for j in jobs], "s--", color="#d62728", label="Failure%")
    ax.plot(x, [j.idleness_pct for j in jobs], "^--", color="#7f7f7f", label="Idleness%")
    for xi, j in zip(x, jobs, strict=True):
        if (j.run_id, "ett_pct") in flagged:
            ax.annotate(f"regression\n{j.job_id}", (xi, j.ett_pct), color="#d62728", fontsize=7)
    ax.set_ylim(0, 100)
    ax.set_ylabel("% of wall time")
    ax.set_title(f"ETT% per job - {summary.experiment}")
    ax.legend(fontsize=8)
    fig.autofmt_xdate()
    out["ett_trend"] = fig

    fig, (trend, hist) = plt.subplots(1, 2, figsize=(10, 3.8))
    pts = [(xi, j) for xi, j in zip(x, jobs, strict=True) if j.time_to_start_s is not None]
    trend.plot([p[0] for p in pts], [p[1].time_to_start_s for p in pts], "o-")
    for xi, j in pts:
        if (j.run_id, "time_to_start_s") in flagged:
            trend.plot([xi], [j.time_to_start_s], "x", color="#d62728", markersize=12)
            trend.annotate(j.job_id, (xi, j.time_to_start_s), color="#d62728", fontsize=7)
    trend.set_ylabel("seconds")
    trend.set_title("Time to Start per job")
    hist.hist([p[1].time_to_start_s for p in pts] or [0], bins=min(20, max(1, len(pts))))
    hist.set_xlabel("seconds")
    hist.set_title("Time to Start distribution")
    fig.autofmt_xdate()
    out["time_to_start"] = fig

    fig, ax = plt.subplots(figsize=(6, 3.8))
    ttr = [v for j in jobs for v in j.time_to_recover_s]
    ax.hist(ttr or [0], bins=min(20, max(1, len(ttr))), color="#9467bd")
    ax.set_xlabel("seconds per failure")
    ax.set_title(f"Time to Recover distribution ({len(ttr)} failures)")
    out["time_to_recover"] = fig

    fig, ax = plt.subplots(figsize=(9, 4))
    idx = range(len(jobs))
    unsaved = [j.unsaved_s for j in jobs]
    blocking = [j.checkpoint_blocking_s for j in jobs]
    recover = [j.time_to_recover_total_s for j in jobs]
    ax.bar(idx, unsaved, color="#d62728", label="unsaved (wasted) training")
    ax.bar(idx, blocking, bottom=unsaved, color="#ff7f0e", label="checkpoint blocking")
    ax.bar(
        idx,
        recover,
        bottom=[a + b for a, b in zip(unsaved, blocking, strict=True)],
        color="#9467bd",
        label="time to recover",
    )
    for i, j in enumerate(jobs):
        top = unsaved[i] + blocking[i] + recover[i]
        ax.annotate(f"{j.num_failures}F", (i, top), ha="center", fontsize=7)
    ax.set_xticks(list(idx), [j.job_id for j in jobs], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title("Lost time per job (F = failures)")
    ax.legend(fontsize=8)
    out["waste"] = fig
    for fig in out.values():
        fig.tight_layout()
    return out


def close(figs: dict[str, Any]) -> None:
    for fig in figs.values():
        pyplot().close(fig)


def write_files(summary: FleetSummary, out_dir: str | Path) -> dict[str, str]:
    """The plots (PNG), ``fleet.md``, ``fleet.txt`` and ``fleet.json`` in ``out_dir`` (for
    ``ett fleet --out``); returns name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    figs = figures(summary)
    try:
        for name, fig in figs.items():
            fig.savefig(out / f"{name}.png", dpi=100)
            files[name] = str(out / f"{name}.png")
    finally:
        close(figs)
    for name, text in (
        ("md", to_markdown(summary)),
        ("txt", format_fleet(summary)),
        ("json", json.dumps(summary.to_dict(), indent=2)),
    ):
        path = out / f"fleet.{name}"
        path.write_text(text)
        files[name] = str(path)
    return files
