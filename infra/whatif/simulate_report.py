"""``ett simulate``: measured jobs in, validation and scale-out projection out.

Reads each job's ledger, replays it on its own failures beside what was measured (the
validation), then projects it to 1..16,384 GPUs under ``ScalingLaws``: tables for the
terminal and a markdown file (validation, measured inputs, assumptions, projection), JSON, and
a PNG of ETT% against N. Kept apart from the models so they do not import matplotlib.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.accounting.ett import report_for_job
from infra.accounting.records import EttReport
from infra.figures import pyplot, save_png
from infra.job_layout import JobLayout
from infra.tables import to_text
from infra.whatif.advisor import DAY_S
from infra.whatif.projection import Projection, gpu_grid, project
from infra.whatif.scaling import TABLE_GPUS, ScalingLaws
from infra.whatif.simulate import Validation, validate
from infra.whatif.simulated_job import JobModel

Table = tuple[str, list[str], list[list[str]]]  # (title, header, rows)
COLORS = ("#d62728", "#2ca02c", "#1f77b4", "#9467bd", "#ff7f0e")


@dataclass(frozen=True)
class SimulateOutput:
    validations: tuple[Validation, ...]
    projection: Projection | None
    tolerance_pts: float

    @property
    def validated(self) -> bool:
        return all(v.within(self.tolerance_pts) for v in self.validations)


def run_simulate(
    jobs: Mapping[str, JobLayout],
    laws: ScalingLaws,
    days: float,
    tolerance_pts: float = 3.0,
    runs: int = 300,
    seed: int = 0,
    validate_only: bool = False,
) -> SimulateOutput:
    """Validate every job (label -> its layout), then project them unless ``validate_only``."""
    reports: dict[str, EttReport] = {}
    for label, layout in jobs.items():
        try:
            reports[label] = report_for_job(layout)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{label} ({layout.url}): {exc}") from None
    validations = tuple(validate(r, label) for label, r in reports.items())
    if validate_only:
        return SimulateOutput(validations, None, tolerance_pts)
    models = {v.label: v.model for v in validations}
    projection = project(models, laws, days * DAY_S, gpu_grid(), runs=runs, seed=seed)
    return SimulateOutput(validations, projection, tolerance_pts)


# -- tables --------------------------------------------------------------------------------
def _hours(seconds: float) -> str:
    if seconds >= DAY_S * 2:
        return f"{seconds / DAY_S:,.0f} d"
    return f"{seconds / 3600:.1f} h"


def validation_tables(out: SimulateOutput) -> list[Table]:
    tol = out.tolerance_pts
    summary = [
        [
            v.label,
            f"{v.measured.ett_pct:.2f}",
            f"{v.predicted.ett_pct:.2f}",
            f"{v.error_pts:+.2f}",
            "yes" if v.within(tol) else "NO",
            f"{v.predicted_at_times.ett_pct:.2f}",
        ]
        for v in out.validations
    ]
    detail = [
        [v.label, name, f"{m:.3f}", f"{p:.3f}", f"{p - m:+.3f}"]
        for v in out.validations
        for name, m, p in v.rows()
    ]
    return [
        (
            "Validation: each job replayed on its own failures (where in the job, and kind)",
            [
                "job",
                "measured ETT%",
                "predicted ETT%",
                "error (pts)",
                f"within {tol:g} pts",
                "predicted, failures at their wall times",
            ],
            summary,
        ),
        ("Validation detail", ["job", "quantity", "measured", "predicted", "difference"], detail),
    ]


def _inputs(label: str, m: JobModel) -> list[list[str]]:
    rows = [
        ["step time s (mean kept step)", f"{m.step_time_s or 0:.4f}"],
        ["checkpoint interval s (progress)", f"{m.interval_s:.3f}"],
        ["blocking per checkpoint s", f"{m.blocking_s:.4f}"],
        ["upload (commit latency) s", f"{m.upload_s:.4f}"],
        ["startup s", f"{m.startup_s:.3f}"],
        ["restart s (unplanned failures, mean)", f"{m.restart_s:.3f}"],
        *[[f"restart s after {c}", f"{t:.3f}"] for c, t in m.restart_by_cause.items()],
        ["shutdown s (anchor save included)", f"{m.shutdown_s:.3f}"],
        ["eval + other per training second", f"{m.loop_overhead:.4f}"],
    ]
    return [[label, *r] for r in rows]


def projection_tables(p: Projection, only: tuple[int, ...] = TABLE_GPUS) -> list[Table]:
    labels = p.labels
    header = ["GPUs", "nodes", "failures/day", "MTBF"]
    for label in labels:
        header += [f"{label} interval s", f"{label} restart s", f"{label} ETT% (p5-p95)"]
    rows = []
    for r in p.rows:
        if r.gpus not in only:
            continue
        row = [f"{r.gpus:,}", f"{r.nodes:,}", f"{r.failures_per_day:.3g}", _hours(r.mtbf_s)]
        for label in labels:
            j = r.jobs[label]
            row += [
                f"{j.interval_s:.1f}",
                f"{j.restart_s:.1f}",
                f"{j.ett.ett_pct_mean:.2f} ({j.ett.ett_pct_p5:.2f}-{j.ett.ett_pct_p95:.2f})",
            ]
        rows.append(row)
    days = p.work_s / DAY_S
    return [
        ("Assumptions (ScalingLaws, infra/whatif/scaling.py)", ["#", "assumption"], _numbered(p)),
        (
            f"Projection: ETT% at the advisor's interval, a {days:g}-day job, "
            f"mean of {p.runs} seeded runs per point",
            header,
            rows,
        ),
    ]


def _numbered(p: Projection) -> list[list[str]]:
    return [[str(i), line] for i, line in enumerate(p.laws.describe(), 1)]


def tables(out: SimulateOutput) -> list[Table]:
    result = validation_tables(out)
    result.append(
        (
            "Measured inputs (per event, from each ledger)",
            ["job", "input", "value"],
            [row for v in out.validations for row in _inputs(v.label, v.model)],
        )
    )
    if out.projection is not None:
        result += projection_tables(out.projection)
    return result


def format_text(out: SimulateOutput) -> str:
    """Plain aligned tables (infra/tables.py), for pipes and logs."""
    return to_text(tables(out))


def to_markdown(out: SimulateOutput) -> str:
    lines = ["# ett simulate", ""]
    for title, header, rows in tables(out):
        lines += [f"## {title}", ""]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines += ["| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def to_dict(out: SimulateOutput) -> dict[str, Any]:
    return {
        "tolerance_pts": out.tolerance_pts,
        "validated": out.validated,
        "validation": [
            {
                "job": v.label,
                "measured_ett_pct": v.measured.ett_pct,
                "predicted_ett_pct": v.predicted.ett_pct,
                "error_pts": v.error_pts,
                "predicted_at_wall_times_ett_pct": v.predicted_at_times.ett_pct,
                "rows": [{"quantity": n, "measured": m, "predicted": p} for n, m, p in v.rows()],
                "model": {**vars(v.model), "restart_by_cause": dict(v.model.restart_by_cause)},
            }
            for v in out.validations
        ],
        "projection": None if out.projection is None else out.projection.to_dict(),
    }


# -- plot ----------------------------------------------------------------------------------
def plot_projection(p: Projection, path: str | Path) -> Path:
    """PNG: ETT% against N (log scale), one line per job with its p5-p95 band."""
    fig, ax = pyplot().subplots(figsize=(8, 4.6))
    gpus = [r.gpus for r in p.rows]
    for i, label in enumerate(p.labels):
        color = COLORS[i % len(COLORS)]
        mean = [r.jobs[label].ett.ett_pct_mean for r in p.rows]
        lo = [r.jobs[label].ett.ett_pct_p5 for r in p.rows]
        hi = [r.jobs[label].ett.ett_pct_p95 for r in p.rows]
        ax.plot(gpus, mean, marker="o", markersize=3, color=color, label=label)
        ax.fill_between(gpus, lo, hi, color=color, alpha=0.15, linewidth=0)
        for r in p.rows:
            if r.gpus in TABLE_GPUS:
                ax.annotate(
                    f"{r.jobs[label].ett.ett_pct_mean:.1f}",
                    (r.gpus, r.jobs[label].ett.ett_pct_mean),
                    textcoords="offset points",
                    xytext=(0, 6 if i % 2 == 0 else -12),
                    ha="center",
                    fontsize=7,
                    color=color,
                )
    ax.set_xscale("log", base=2)
    ticks = [1, *TABLE_GPUS]
    ax.set_xticks(ticks, [f"{g:,}" for g in ticks])
    ax.set_xlabel("GPUs (N)")
    ax.set_ylabel("ETT % (mean, band p5-p95)")
    per_day = p.laws.failures_per_gpu_day
    ax.set_title(
        f"Projected ETT% vs N: {p.work_s / DAY_S:g}-day job, {per_day:.3g} failures/GPU-day, "
        f"restart +{p.laws.rendezvous_s_per_node:.3g} s/node"
        f"{' (fitted)' if p.laws.restart_fit else ''}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_png(fig, path)


def write_outputs(out: SimulateOutput, folder: str | Path) -> list[Path]:
    """simulate.json, simulate.md and (with a projection) simulate.png under ``folder``."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / "simulate.json", root / "simulate.md"]
    paths[0].write_text(json.dumps(to_dict(out), indent=2, default=str))
    paths[1].write_text(to_markdown(out))
    if out.projection is not None:
        paths.append(plot_projection(out.projection, root / "simulate.png"))
    return paths
