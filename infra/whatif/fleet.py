"""The fleet view: ETT of every job run of an MLflow experiment, trends and regressions.

An ETT dashboard for one experiment: the ETT% of successive jobs over time, the
distributions of Time to Start and Time to Recover, failures, unsaved (wasted) training and
checkpoint blocking per job, and regressions flagged against the trailing median of the previous
``window`` jobs (e.g. Time to Start up by more than 20%, ETT% down by more than 5 points).

    summary = fleet_summary("sqlite:///mlflow.db", "ett-pipeline")

This module computes; infra/whatif/fleet_report.py renders (tables, markdown, plots), the way
infra/accounting/ett.py and infra/accounting/report.py split a single job's report. It reads only
what infra/tracking/mlflow_runs.py logs (tag ``ett.kind = job``): the headline metrics
(``wall_time/*``, infra/tracking/metrics.py) and, for the rest, the run's ``ett/report.json``.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

from mlflow import MlflowClient

from infra.tracking import metrics as names
from infra.tracking.client import client as mlflow_client
from infra.tracking.mlflow_runs import JOB_ID_TAG, KIND_TAG
from infra.tracking.run_metadata import redact_url


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


REPORT_JSON = "ett/report.json"


def _report(client: MlflowClient, run_id: str) -> dict[str, Any]:
    """The job's full ETT report as logged (``ett/report.json``); {} when it is missing."""
    with tempfile.TemporaryDirectory(prefix="ett-fleet-") as tmp:
        try:
            path = client.download_artifacts(run_id, REPORT_JSON, tmp)
        except Exception:  # noqa: BLE001 - an older or half-logged run: headline only
            return {}
        with open(path) as fh:
            data: dict[str, Any] = json.load(fh)
    return data


def _job(client: MlflowClient, run: Any) -> FleetJob:
    m = run.data.metrics
    r = _report(client, run.info.run_id)
    failures = int(m.get(names.NUM_FAILURES, 0))
    ttr: tuple[float, ...] = ()
    if r.get("failures") is not None:
        ttr = tuple(float(f["time_to_recover_s"]) for f in r["failures"])
    elif failures:
        hist = client.get_metric_history(run.info.run_id, names.TIME_TO_RECOVER_S)
        latest = {h.step: h for h in sorted(hist, key=lambda h: h.timestamp)}
        ttr = tuple(latest[s].value for s in sorted(latest))
    return FleetJob(
        run_id=run.info.run_id,
        job_id=run.data.tags.get(JOB_ID_TAG, run.info.run_name),
        status=run.info.status,
        start_time=r.get("start_time", run.info.start_time / 1000.0),
        wall_s=r.get("wall_s", 0.0),
        ett_pct=r.get("ett_pct", m[names.ETT_PCT]),
        failure_pct=r.get("failure_pct", m.get(names.FAILURE_PCT, 0.0)),
        idleness_pct=r.get("idleness_pct", m.get(names.IDLENESS_PCT, 0.0)),
        time_to_start_s=r.get("time_to_start_s", m.get(names.TIME_TO_START_S)),
        num_failures=int(r.get("num_failures", failures)),
        time_to_recover_s=ttr,
        time_to_recover_total_s=r.get("time_to_recover_total_s", sum(ttr)),
        unsaved_s=r.get("observed_unsaved_s", 0.0),
        checkpoint_blocking_s=r.get("checkpoint_blocking_total_s", 0.0),
        checkpoint_blocking_mean_s=r.get("checkpoint_blocking_mean_s"),
        effective_s=r.get("buckets", {}).get("effective_training", 0.0),
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


# -- entry point ------------------------------------------------------------------------------
def fleet_summary(
    tracking_uri: str, experiment: str, thresholds: Thresholds | None = None
) -> FleetSummary:
    """Summarise every job run of ``experiment``. An experiment that does not exist (yet)
    gives an empty summary, not an error."""
    client = mlflow_client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    runs = _job_runs(client, exp.experiment_id) if exp is not None else []
    reported = [r for r in runs if names.ETT_PCT in r.data.metrics]
    jobs = sorted((_job(client, r) for r in reported), key=lambda j: (j.start_time, j.job_id))
    in_progress = tuple(
        r.data.tags.get(JOB_ID_TAG, r.info.run_name)
        for r in runs
        if names.ETT_PCT not in r.data.metrics
    )
    return FleetSummary(
        experiment=experiment,
        tracking_uri=redact_url(tracking_uri),
        jobs=tuple(jobs),
        regressions=tuple(find_regressions(jobs, thresholds)),
        in_progress=in_progress,
        stats=_stats(jobs),
    )
