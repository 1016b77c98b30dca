"""Rendering an EttReport: a terminal table, a markdown artifact, a PNG breakdown.

Rendering is kept apart from the calculator so the numbers can be tested without it and so the
calculator does not import matplotlib.
"""

from __future__ import annotations

from pathlib import Path

from infra.ett import BUCKETS, EttReport
from infra.mfu import MfuReport

COLORS = {
    "effective_training": "#2ca02c",
    "wasted_training": "#d62728",
    "checkpoint_blocking": "#ff7f0e",
    "startup": "#1f77b4",
    "recovery": "#9467bd",
    "eval": "#17becf",
    "shutdown": "#8c564b",
    "unknown": "#e7e7e7",
    "other": "#c7c7c7",
}


def _s(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.3f} {unit}".rstrip()


def _efficiency(m: MfuReport) -> list[list[str]]:
    """MFU beside ETT (infra/mfu.py)."""
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


def _sections(
    r: EttReport, mfu: MfuReport | None = None
) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for every section, shared by the text and markdown renderers."""
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
        ["Predicted unsaved (failures x interval/2)", _s(r.predicted_unsaved_s)],
        ["Checkpoint blocking (total)", _s(r.checkpoint_blocking_total_s)],
        ["Checkpoint blocking (mean)", _s(r.checkpoint_blocking_mean_s)],
        ["Predicted blocking (loop/interval x mean)", _s(r.predicted_blocking_s)],
        ["Checkpoints committed", str(r.num_checkpoints_committed)],
        ["Checkpoint interval", _s(r.checkpoint_interval_s)],
        ["Commit latency (upload)", _s(r.commit_latency_s)],
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
    return sections


def format_table(report: EttReport, mfu: MfuReport | None = None) -> str:
    """Plain-text tables for the terminal (times in seconds, from W's start)."""
    out: list[str] = []
    for title, header, rows in _sections(report, mfu):
        out.append(f"== {title} ==")
        if not rows:
            out.append("(none)")
            out.append("")
            continue
        widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
        for row in [header, ["-" * w for w in widths], *rows]:
            out.append("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def to_markdown(report: EttReport, mfu: MfuReport | None = None) -> str:
    """Markdown for a Prefect artifact: a headline line, then one table per section."""
    out = [
        f"# ETT report: **{report.ett_pct:.1f}%** effective",
        "",
        f"Wall time {report.wall_s:.1f} s; idleness {report.idleness_pct:.1f}%, "
        f"failure {report.failure_pct:.1f}%, {report.num_failures} failure(s).",
    ]
    for title, header, rows in _sections(report, mfu):
        out += ["", f"## {title}", ""]
        if not rows:
            out.append("_none_")
            continue
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join("---" for _ in header) + "|")
        out += ["| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def plot_breakdown(report: EttReport, path: str | Path) -> Path:
    """PNG: a stacked bar of the buckets (% of W) over a timeline of the partition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    for bucket in BUCKETS:
        spans = [(a, b - a) for a, b, k in report.segments if k == bucket]
        if spans:
            line.broken_barh(spans, (0.6, 0.8), color=COLORS[bucket])
    for i, att in enumerate(report.attempts):
        color = "#d62728" if att.outcome == "failed" else "#555555"
        line.broken_barh([(att.start, att.end - att.start)], (1.8 + i * 0.5, 0.35), color=color)
        line.text(att.start, 2.25 + i * 0.5, f"attempt {att.attempt}: {att.outcome}", fontsize=7)
    for f in report.failures:
        line.axvline(f.died_at, color="#d62728", linestyle=":", linewidth=1)
    line.set_xlim(0, max(report.wall_s, 1e-9))
    line.set_ylim(0.4, 2.6 + 0.5 * len(report.attempts))
    line.set_yticks([1.0], ["buckets"])
    line.set_xlabel("seconds since job start")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
