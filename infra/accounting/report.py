"""Rendering an EttReport: tables (terminal, plain text, markdown artifact), a PNG breakdown.

Rendering is kept apart from the calculator so the numbers can be tested without it and so the
calculator does not import matplotlib.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from infra import tables
from infra.accounting.mfu import MfuReport
from infra.accounting.records import BUCKETS, AttemptSummary, Bucket, EttReport
from infra.figures import pyplot, save_png

TIMELINE_BINS = 2000  # slices of the timeline: more than the figure's pixels across
COLORS = {
    Bucket.EFFECTIVE_TRAINING: "#2ca02c",
    Bucket.WASTED_TRAINING: "#d62728",
    Bucket.CHECKPOINT_BLOCKING: "#ff7f0e",
    Bucket.STARTUP: "#1f77b4",
    Bucket.RECOVERY: "#9467bd",
    Bucket.EVAL: "#17becf",
    Bucket.SHUTDOWN: "#8c564b",
    Bucket.UNKNOWN: "#e7e7e7",
    Bucket.OTHER: "#c7c7c7",
}


def _s(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.3f} {unit}".rstrip()


def _efficiency(m: MfuReport) -> list[list[str]]:
    """MFU beside ETT (infra/accounting/mfu.py)."""
    return [
        ["MFU%", f"{m.mfu_pct:.2f}"],
        ["ETT% x MFU (end-to-end)", f"{m.ett_x_mfu_pct:.3f}"],
        [
            "Achieved / peak per device",
            f"{m.achieved_flops / 1e12:.4g} / {m.peak_flops / 1e12:.4g} TFLOP/s",
        ],
        ["Peak from", m.peak_source],
        ["Model FLOPs (effective steps)", f"{m.model_flops:.4g} on {m.world_size} device(s)"],
    ]


def _commit_bytes(by_kind: dict[str, tuple[int, float]]) -> str:
    """ "full 2.1 MB x 2, delta 180 kB x 6": what a durable commit wrote, full against delta."""
    if not by_kind:
        return "n/a"
    return ", ".join(f"{kind} {_bytes(b)} x {n}" for kind, (n, b) in by_kind.items())


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def sections(r: EttReport, mfu: MfuReport | None = None) -> list[tables.Section]:
    """(title, header, rows) for every section, shared by every renderer."""
    pct = r.bucket_pct()
    buckets = [[b, f"{r.buckets[b]:.3f}", f"{pct[b]:.2f}"] for b in BUCKETS]
    buckets.append(["total (W)", f"{r.wall_s:.3f}", "100.00"])
    headline = [
        ["ETT%", f"{r.ett_pct:.2f}"],
        ["Idleness%", f"{r.idleness_pct:.2f}"],
        ["Failure%", f"{r.failure_pct:.2f}"],
        ["Time to Start", _s(r.time_to_start_s)],
        ["Number of Failures", str(r.num_failures)],
        ["Time to Recover (total)", _s(r.time_to_recover_total_s)],
        ["Observed unsaved training", _s(r.observed_unsaved_s)],
        ["  of which redone after a checkpoint fallback", _s(r.fallback_redone_s)],
        *[
            [f"  of which redone after a restore from {tier}", _s(secs)]
            for tier, secs in sorted(r.redone_by_tier.items())
        ],
        ["Predicted unsaved (failures x interval/2)", _s(r.predicted_unsaved_s)],
        ["Checkpoint blocking (total)", _s(r.checkpoint_blocking_total_s)],
        ["Checkpoint blocking (mean)", _s(r.checkpoint_blocking_mean_s)],
        ["Predicted blocking (loop/interval x mean)", _s(r.predicted_blocking_s)],
        ["Checkpoints committed", str(r.num_checkpoints_committed)],
        ["Checkpoint interval", _s(r.checkpoint_interval_s)],
        ["Commit latency (upload)", _s(r.commit_latency_s)],
        ["Bytes per commit (median)", _commit_bytes(r.commit_bytes)],
        ["In-memory copies / blocking", f"{r.memory_copies} / {_s(r.memory_blocking_total_s)}"],
        ["In-memory copy interval", _s(r.memory_interval_s)],
        ["Steps (executions)", f"{r.num_steps} ({r.num_step_executions})"],
        ["Step time median / MAD", f"{_s(r.step_time_median_s)} / {_s(r.step_time_mad_s)}"],
        ["Finished (job_end seen)", "yes" if r.finished else "no"],
    ]
    failures = [
        [
            str(f.attempt),
            f.cause,
            str(f.last_step),
            _s(f.died_at),
            _s(f.detected_at),
            _s(f.resumed_at),
            _s(f.time_to_recover_s),
        ]
        for f in r.failures
    ]
    init: list[list[str]] = []
    for ib in r.init:
        init += [
            [str(ib.attempt), name, _s(secs), "*" if name in ib.critical_path else ""]
            for name, secs in ib.stages.items()
        ]
        init.append(
            [
                str(ib.attempt),
                "(sum / union / wall)",
                f"{_s(ib.sum_s)} / {_s(ib.union_s)} / {_s(ib.wall_s)}",
                "",
            ]
        )
        init.append(
            [
                str(ib.attempt),
                "(critical path)",
                _s(ib.critical_path_s),
                " > ".join(ib.critical_path),
            ]
        )
    sections = [
        ("Wall-time buckets", ["bucket", "seconds", "% of W"], buckets),
        ("L1 metrics", ["metric", "value"], headline),
        (
            "Failures",
            [
                "attempt",
                "cause",
                "last step",
                "died at",
                "detected at",
                "resumed at",
                "time to recover",
            ],
            failures,
        ),
        ("Startup sub-stages", ["attempt", "stage", "seconds", "critical path"], init),
    ]
    if mfu is not None:
        sections.insert(2, ("Model efficiency", ["metric", "value"], _efficiency(mfu)))
    if r.resizes:  # a job that ran on several world sizes: each attempt's
        sizes = [
            [str(a.attempt), "?" if a.ranks is None else str(a.ranks), _steps(a), str(a.outcome)]
            for a in r.attempts
        ]
        sections.append(("World size per attempt", ["attempt", "ranks", "steps", "outcome"], sizes))
    # Said only when there is something to say: what recovery did, and times not believed.
    if recovered := recovery_lines(r):
        sections.insert(1, ("What recovery did", ["what"], [[line] for line in recovered]))
    if notes := r.clock.notes():
        sections.insert(1, ("Ledger checks", ["finding"], [[line] for line in notes]))
    return sections


def _steps(a: AttemptSummary) -> str:
    return "-" if a.first_step is None else f"{a.first_step}-{a.last_step}"


def recovery_lines(r: EttReport) -> list[str]:
    """Every restore of training state and every standby lost, in the order they happened
    (``attempt 2 (promoted standby) resumed from step 125, step 150 quarantined: ...``)."""
    timed = [(res.at, res.describe()) for res in r.resumes]
    timed += [(size.at, size.describe()) for size in r.resizes]
    timed += [
        (
            lost.lost_at,
            f"standby attempt {lost.attempt} lost while "
            f"{'parked' if lost.parked else 'starting'} ({lost.cause}) at {lost.lost_at:.1f} s; "
            "another was started",
        )
        for lost in r.lost_standbys
    ]
    return [text for _, text in sorted(timed)]


def format_table(report: EttReport, mfu: MfuReport | None = None) -> str:
    """Plain-text tables for logs and pipes (times in seconds, from W's start)."""
    return tables.to_text(sections(report, mfu))


def to_markdown(report: EttReport, mfu: MfuReport | None = None) -> str:
    """Markdown for a Prefect artifact: a headline line, then one table per section."""
    head = [
        f"# ETT report: **{report.ett_pct:.1f}%** effective",
        "",
        f"Wall time {report.wall_s:.1f} s; idleness {report.idleness_pct:.1f}%, "
        f"failure {report.failure_pct:.1f}%, {report.num_failures} failure(s).",
    ]
    if not report.clock.clean:
        head += ["", f"**Ledger checks:** {report.clock.notes()[0]}"]
    return "\n".join(head) + "\n" + tables.to_markdown(sections(report, mfu))


def dominant_buckets(
    segments: tuple[tuple[float, float, str], ...] | list[tuple[float, float, str]],
    wall_s: float,
    bins: int,
) -> np.ndarray:
    """For each of ``bins`` equal slices of [0, wall_s], the index (in BUCKETS) of the bucket
    that covers most of it; len(BUCKETS) where nothing does.

    A timeline of thousands of segments cannot be drawn segment by segment: a 2 ms gap
    between two steps is a fraction of a pixel, yet every drawn rectangle takes at least one,
    so the gaps paint over the training around them. One colour per pixel-wide slice, the
    majority's, is what the resolution can show (the bar above gives the exact shares)."""
    if not segments or wall_s <= 0:
        return np.full(bins, len(BUCKETS))
    starts = np.array([a for a, _, _ in segments])
    ends = np.array([b for _, b, _ in segments])
    kinds = [k for _, _, k in segments]
    edges = np.linspace(0.0, wall_s, bins + 1)
    cover = np.zeros((len(BUCKETS), bins))
    for i, bucket in enumerate(BUCKETS):
        mine = np.array([k == bucket for k in kinds])
        if not mine.any():
            continue
        # Time spent in ``bucket`` up to t, piecewise linear between segment boundaries.
        knots = np.concatenate([starts[mine], ends[mine]])
        order = np.argsort(knots, kind="stable")
        gained = np.concatenate([np.zeros(mine.sum()), ends[mine] - starts[mine]])[order]
        cover[i] = np.diff(np.interp(edges, knots[order], np.cumsum(gained)))
    best = cover.argmax(axis=0)
    best[cover.max(axis=0) <= 0] = len(BUCKETS)
    return best


def plot_breakdown(report: EttReport, path: str | Path) -> Path:
    """PNG: a stacked bar of the buckets (% of W) over a timeline of the partition."""
    from matplotlib.colors import to_rgb

    plt = pyplot()

    fig, (bar, line) = plt.subplots(
        2, 1, figsize=(10, 4.2), gridspec_kw={"height_ratios": [1, 1.6]}
    )
    left = 0.0
    for bucket, pct in report.bucket_pct().items():
        if pct > 0:
            bar.barh(0, pct, left=left, color=COLORS[bucket], label=f"{bucket} {pct:.1f}%")
            left += pct
    bar.set_xlim(0, 100)
    bar.set_yticks([])
    bar.set_xlabel("% of wall time")
    bar.set_title(
        f"ETT {report.ett_pct:.1f}%  |  idle {report.idleness_pct:.1f}%  |  "
        f"failure {report.failure_pct:.1f}%"
    )
    bar.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=7)
    if report.segments:
        colors = np.array([to_rgb(COLORS[b]) for b in BUCKETS] + [to_rgb("white")])
        strip = colors[dominant_buckets(report.segments, report.wall_s, TIMELINE_BINS)]
        line.imshow(
            strip[np.newaxis],
            extent=(0, max(report.wall_s, 1e-9), 0.6, 1.4),
            aspect="auto",
            interpolation="nearest",
        )
    for i, att in enumerate(report.attempts):
        color = "#d62728" if att.outcome.failed else "#555555"
        line.broken_barh(
            [(att.start, att.end - att.start)], (1.8 + i * 0.5, 0.35), facecolor=color, linewidth=0
        )
        line.text(att.start, 2.25 + i * 0.5, f"attempt {att.attempt}: {att.outcome}", fontsize=7)
    for f in report.failures:
        line.axvline(f.died_at, color="#d62728", linestyle=":", linewidth=1)
    line.set_xlim(0, max(report.wall_s, 1e-9))
    line.set_ylim(0.4, 2.6 + 0.5 * len(report.attempts))
    line.set_yticks([1.0], ["buckets"])
    line.set_xlabel("seconds since job start")
    return save_png(fig, path)
