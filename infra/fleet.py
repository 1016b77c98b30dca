"""The fleet view: ETT of every job run of an MLflow experiment, trends and regressions.

The dashboard of Meta's blog, for one experiment: the ETT% of successive jobs over time, the
distributions of Time to Start and Time to Recover, failures, unsaved (wasted) training and
checkpoint blocking per job, and regressions flagged against the trailing median of the previous
``window`` jobs (e.g. Time to Start up by more than 20%, ETT% down by more than 5 points).

    summary = fleet_summary("sqlite:///mlflow.db", "ett-pipeline", "reports/fleet")
    print(format_fleet(summary))

Reads only what infra/tracking.py logs (tag ``ett.kind = job``, ``ett.*`` metrics); writes
``ett_trend.png``, ``time_to_start.png``, ``time_to_recover.png``, ``waste.png``, ``fleet.md``,
``fleet.txt`` and ``fleet.json`` into ``out_dir``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mlflow import MlflowClient

from infra.tracking import JOB_ID_TAG, KIND_TAG, METRIC_PREFIX, redact_url


@dataclass(frozen=True)
class Thresholds:
    """When a job counts as a regression against the trailing median of earlier jobs."""

    window: int = 5  # previous jobs in the trailing median
    min_history: int = 3  # fewer earlier jobs: no verdict
    time_to_start_increase: float = 0.20  # fraction over the median
    ett_drop_points: float = 5.0  # ETT% points under the median
    time_to_recover_increase: float = 0.50  # mean per failure, fraction over the median
    blocking_increase: float = 0.50  # checkpoint blocking per checkpoint
    min_delta_s: float = 1.0  # ignore smaller absolute changes of Time to Start / Recover


@dataclass(frozen=True)
class FleetJob:
    run_id: str
    job_id: str
    status: str
    start_time: float  # Unix seconds of the job's first event
    wall_s: float
    ett_pct: float
    failure_pct: float
    idleness_pct: float
    time_to_start_s: float | None
    num_failures: int
    time_to_recover_s: tuple[float, ...]  # one per failure
    time_to_recover_total_s: float
    unsaved_s: float  # observed wasted training
    checkpoint_blocking_s: float
    checkpoint_blocking_mean_s: float | None
    effective_s: float


@dataclass(frozen=True)
class Regression:
    job_id: str
    run_id: str
    metric: str
    value: float
    baseline: float  # trailing median
    message: str


@dataclass(frozen=True)
class FleetSummary:
    experiment: str
    tracking_uri: str  # without credentials
    jobs: tuple[FleetJob, ...]  # oldest first
    regressions: tuple[Regression, ...]
    in_progress: tuple[str, ...]  # job ids of runs without an ETT report yet
    stats: dict[str, dict[str, float]]
    files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- reading ----------------------------------------------------------------------------------
def _job_runs(client: MlflowClient, experiment_id: str) -> list[Any]:
    runs, token = [], None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{KIND_TAG}` = 'job'",
            max_results=1000,
            page_token=token,
        )
        runs += list(page)
        token = page.token
        if not token:
            return runs


def _job(client: MlflowClient, run: Any) -> FleetJob:
    m = {
        k[len(METRIC_PREFIX) :]: v
        for k, v in run.data.metrics.items()
        if k.startswith(METRIC_PREFIX)
    }
    failures = int(m.get("num_failures", 0))
    ttr: tuple[float, ...] = ()
    if failures:
        hist = client.get_metric_history(run.info.run_id, f"{METRIC_PREFIX}time_to_recover_s")
        latest = {h.step: h for h in sorted(hist, key=lambda h: h.timestamp)}
        ttr = tuple(latest[s].value for s in sorted(latest))
    return FleetJob(
        run_id=run.info.run_id,
        job_id=run.data.tags.get(JOB_ID_TAG, run.info.run_name),
        status=run.info.status,
        start_time=m.get("start_time", run.info.start_time / 1000.0),
        wall_s=m.get("wall_s", 0.0),
        ett_pct=m["ett_pct"],
        failure_pct=m.get("failure_pct", 0.0),
        idleness_pct=m.get("idleness_pct", 0.0),
        time_to_start_s=m.get("time_to_start_s"),
        num_failures=failures,
        time_to_recover_s=ttr,
        time_to_recover_total_s=m.get("time_to_recover_total_s", 0.0),
        unsaved_s=m.get("observed_unsaved_s", 0.0),
        checkpoint_blocking_s=m.get("checkpoint_blocking_total_s", 0.0),
        checkpoint_blocking_mean_s=m.get("checkpoint_blocking_mean_s"),
        effective_s=m.get("bucket_effective_training_s", 0.0),
    )


# -- analysis ---------------------------------------------------------------------------------
def _mean_ttr(job: FleetJob) -> float | None:
    return statistics.fmean(job.time_to_recover_s) if job.time_to_recover_s else None


def find_regressions(jobs: list[FleetJob], t: Thresholds | None = None) -> list[Regression]:
    """Each job against the median of the previous ``t.window`` jobs that have the metric."""
    t = t or Thresholds()
    rules = [  # (metric, label, value of a job, is it worse than the baseline?)
        (
            "time_to_start_s",
            "Time to Start",
            lambda j: j.time_to_start_s,
            lambda v, b: v > b * (1 + t.time_to_start_increase) and v - b >= t.min_delta_s,
            f"threshold +{t.time_to_start_increase:.0%}",
        ),
        (
            "ett_pct",
            "ETT%",
            lambda j: j.ett_pct,
            lambda v, b: b - v > t.ett_drop_points,
            f"threshold -{t.ett_drop_points:g} points",
        ),
        (
            "time_to_recover_s",
            "Time to Recover (mean per failure)",
            _mean_ttr,
            lambda v, b: v > b * (1 + t.time_to_recover_increase) and v - b >= t.min_delta_s,
            f"threshold +{t.time_to_recover_increase:.0%}",
        ),
        (
            "checkpoint_blocking_mean_s",
            "Checkpoint blocking per checkpoint",
            lambda j: j.checkpoint_blocking_mean_s,
            lambda v, b: v > b * (1 + t.blocking_increase),
            f"threshold +{t.blocking_increase:.0%}",
        ),
    ]
    out: list[Regression] = []
    for metric, label, get, worse, rule in rules:
        seen: list[float] = []
        for job in jobs:
            value = get(job)
            if value is None:
                continue
            history = seen[-t.window :]
            if len(history) >= t.min_history:
                base = statistics.median(history)
                if worse(value, base):
                    if metric == "ett_pct":
                        change = f"{base - value:.1f} points below"
                        unit = ""
                    else:
                        change = f"{(value / base - 1) if base else float('inf'):+.0%} over"
                        unit = " s"
                    out.append(
                        Regression(
                            job.job_id,
                            job.run_id,
                            metric,
                            value,
                            base,
                            f"{job.job_id}: {label} {value:.2f}{unit} is {change} the trailing "
                            f"median {base:.2f}{unit} of the previous {len(history)} jobs ({rule})",
                        )
                    )
            seen.append(value)
    order = {j.run_id: i for i, j in enumerate(jobs)}
    return sorted(out, key=lambda r: order[r.run_id])


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0.0}
    s = sorted(xs)
    pick = lambda q: s[max(0, math.ceil(q * len(s)) - 1)]  # nearest rank
    return {
        "n": float(len(s)),
        "min": s[0],
        "p50": statistics.median(s),
        "p90": pick(0.9),
        "max": s[-1],
        "mean": statistics.fmean(s),
    }


def _stats(jobs: list[FleetJob]) -> dict[str, dict[str, float]]:
    wall = sum(j.wall_s for j in jobs)
    return {
        "ett_pct": _quantiles([j.ett_pct for j in jobs]),
        "time_to_start_s": _quantiles(
            [j.time_to_start_s for j in jobs if j.time_to_start_s is not None]
        ),
        "time_to_recover_s": _quantiles([x for j in jobs for x in j.time_to_recover_s]),
        "totals": {
            "jobs": float(len(jobs)),
            "fleet_ett_pct": 100.0 * sum(j.effective_s for j in jobs) / wall if wall else 0.0,
            "wall_s": wall,
            "failures": float(sum(j.num_failures for j in jobs)),
            "unsaved_s": sum(j.unsaved_s for j in jobs),
            "checkpoint_blocking_s": sum(j.checkpoint_blocking_s for j in jobs),
            "time_to_recover_s": sum(j.time_to_recover_total_s for j in jobs),
        },
    }


# -- rendering --------------------------------------------------------------------------------
def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M")


def _rows(s: FleetSummary) -> tuple[list[str], list[list[str]]]:
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
    return header, rows


def _headline(s: FleetSummary) -> list[str]:
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


def format_fleet(summary: FleetSummary) -> str:
    """Plain text: headline, regressions, one row per job (oldest first)."""
    out = _headline(summary) + [""]
    out.append(f"Regressions ({len(summary.regressions)}):")
    out += [f"  ! {r.message}" for r in summary.regressions] or ["  none"]
    out.append("")
    if not summary.jobs:
        return "\n".join(out + ["(no reported jobs)"]) + "\n"
    header, rows = _rows(summary)
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, ["-" * w for w in widths], *rows]:
        out.append("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(out) + "\n"


def to_markdown(summary: FleetSummary) -> str:
    out = ["# " + _headline(summary)[0], "", *_headline(summary)[1:], "", "## Regressions", ""]
    out += [f"- `{r.metric}` {r.message}" for r in summary.regressions]
    if not summary.regressions:
        out.append("_none_")
    out += ["", "## Jobs", ""]
    header, rows = _rows(summary)
    out += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def _plots(s: FleetSummary, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs, files = list(s.jobs), {}
    x = [datetime.fromtimestamp(j.start_time, UTC) for j in jobs]
    flagged = {(r.run_id, r.metric) for r in s.regressions}

    def save(fig: Any, name: str, dates: bool = True) -> None:
        if dates:
            fig.autofmt_xdate()
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        files[name] = str(out / f"{name}.png")

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(x, [j.ett_pct for j in jobs], "o-", color="#2ca02c", label="ETT%")
    ax.plot(x, [j.failure_pct for j in jobs], "s--", color="#d62728", label="Failure%")
    ax.plot(x, [j.idleness_pct for j in jobs], "^--", color="#7f7f7f", label="Idleness%")
    for xi, j in zip(x, jobs, strict=True):
        if (j.run_id, "ett_pct") in flagged:
            ax.annotate(f"regression\n{j.job_id}", (xi, j.ett_pct), color="#d62728", fontsize=7)
    ax.set_ylim(0, 100)
    ax.set_ylabel("% of wall time")
    ax.set_title(f"ETT% per job - {s.experiment}")
    ax.legend(fontsize=8)
    save(fig, "ett_trend")

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
    save(fig, "time_to_start")

    fig, ax = plt.subplots(figsize=(6, 3.8))
    ttr = [v for j in jobs for v in j.time_to_recover_s]
    ax.hist(ttr or [0], bins=min(20, max(1, len(ttr))), color="#9467bd")
    ax.set_xlabel("seconds per failure")
    ax.set_title(f"Time to Recover distribution ({len(ttr)} failures)")
    save(fig, "time_to_recover", dates=False)

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
        ax.annotate(
            f"{j.num_failures}F",
            (i, unsaved[i] + blocking[i] + recover[i]),
            ha="center",
            fontsize=7,
        )
    ax.set_xticks(list(idx), [j.job_id for j in jobs], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title("Lost time per job (F = failures)")
    ax.legend(fontsize=8)
    save(fig, "waste", dates=False)
    return files


# -- entry point ------------------------------------------------------------------------------
def fleet_summary(
    tracking_uri: str, experiment: str, out_dir: str | Path, thresholds: Thresholds | None = None
) -> FleetSummary:
    """Summarise every job run of ``experiment``; write plots and tables into ``out_dir``.

    An experiment that does not exist (yet) gives an empty summary, not an error."""
    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    runs = _job_runs(client, exp.experiment_id) if exp is not None else []
    reported = [r for r in runs if f"{METRIC_PREFIX}ett_pct" in r.data.metrics]
    jobs = sorted((_job(client, r) for r in reported), key=lambda j: (j.start_time, j.job_id))
    in_progress = tuple(
        r.data.tags.get(JOB_ID_TAG, r.info.run_name)
        for r in runs
        if f"{METRIC_PREFIX}ett_pct" not in r.data.metrics
    )
    summary = FleetSummary(
        experiment=experiment,
        tracking_uri=redact_url(tracking_uri),
        jobs=tuple(jobs),
        regressions=tuple(find_regressions(jobs, thresholds)),
        in_progress=in_progress,
        stats=_stats(jobs),
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = _plots(summary, out) if jobs else {}
    for name, text in (("fleet.md", to_markdown(summary)), ("fleet.txt", format_fleet(summary))):
        (out / name).write_text(text)
        files[name.split(".")[1]] = str(out / name)
    files["json"] = str(out / "fleet.json")
    summary = replace(summary, files=files)
    (out / "fleet.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary
