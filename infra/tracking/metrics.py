"""Every MLflow metric name the project logs, and the values as they are shown (rounded).

MLflow 3.17's Model metrics tab groups metrics into sections by the part of the name before
the last ``/`` and shows the sections in code-point order, then the names without a ``/``
("Model metrics") last (``getBaseChartAndSectionConfigs`` in MLflow's UI bundle). So the curves
are ``eval/*`` and ``train/*`` and the ETT headline comes after them in ``wall_time/*``
(``ett/`` would sort before ``eval/``):

    eval/auc, eval/logloss        the trainer's holdout evaluation, by training step (on the
                                  first ``train.eval_rows`` holdout rows)
    train/loss                    training loss, by step (rank 0)
    wall_time/ett_pct, wall_time/idleness_pct, wall_time/failure_pct, wall_time/time_to_start_s,
    wall_time/num_failures        the job's ETT headline, one point each
    wall_time/time_to_recover_s   one point per failure, its index as the step

Only the headline is a metric: the full breakdown (every bucket, seconds and % of wall time)
is one table artifact, ``ett/buckets.json`` (``bucket_table``), beside ``ett/report.*``.
Timestamps and flags are never metrics. The publish gate logs ``publish/*`` (publish/validate.py),
attempt runs ``attempt/*``, the fleet run ``fleet/*``. The curves carry their spans' end times,
so logging the same ledger again adds no point to them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from mlflow.entities import Metric

from infra.accounting.ledger_format import Event, Span
from infra.accounting.records import EttReport

TRAIN_LOSS = "train/loss"
EVAL_AUC = "eval/auc"
EVAL_LOGLOSS = "eval/logloss"
WALL_TIME = "wall_time/"
ETT_PCT = f"{WALL_TIME}ett_pct"
IDLENESS_PCT = f"{WALL_TIME}idleness_pct"
FAILURE_PCT = f"{WALL_TIME}failure_pct"
TIME_TO_START_S = f"{WALL_TIME}time_to_start_s"
TIME_TO_RECOVER_S = f"{WALL_TIME}time_to_recover_s"  # by failure index
NUM_FAILURES = f"{WALL_TIME}num_failures"
ATTEMPT_DURATION_S = "attempt/duration_s"
ATTEMPT_LAST_STEP = "attempt/last_step"
PUBLISH = "publish/"  # the publish gate's numbers (publish/validate.py names them)
FLEET = "fleet/"  # the fleet run's totals (tasks/fleet.py)

# The breakdown as one table artifact (MLflow renders a JSON "split" table listed in the run's
# mlflow.loggedArtifacts tag as a table).
BUCKET_TABLE = "ett/buckets.json"
BUCKET_COLUMNS = ("bucket", "seconds", "% of wall time")

# Ledger span attribute -> metric key, per span name: the training curves of a job's run.
CURVES: dict[str, dict[str, str]] = {
    Span.TRAIN_STEP: {"loss": TRAIN_LOSS},
    Span.EVAL: {"auc": EVAL_AUC, "logloss": EVAL_LOGLOSS},
    # The side evaluator (train.eval: async) scores the same rows from each eval checkpoint.
    Span.ASYNC_EVAL: {"auc": EVAL_AUC, "logloss": EVAL_LOGLOSS},
}
EVAL_CURVES = frozenset({EVAL_AUC, EVAL_LOGLOSS})


def seconds(value: float) -> float:
    """A duration as shown: milliseconds."""
    return round(float(value), 3)


def percent(value: float) -> float:
    """A share of wall time as shown: two decimals."""
    return round(float(value), 2)


def score(value: float) -> float:
    """A loss, AUC or log-loss as shown: five significant digits."""
    return float(f"{float(value):.5g}") if math.isfinite(value) else float(value)


def headline_metrics(report: EttReport) -> dict[str, float]:
    """The job's ETT headline, named as logged (Time to Recover is a history: see
    ``history_metrics``); a job that has not started training has no Time to Start."""
    m = {
        ETT_PCT: percent(report.ett_pct),
        IDLENESS_PCT: percent(report.idleness_pct),
        FAILURE_PCT: percent(report.failure_pct),
        NUM_FAILURES: float(report.num_failures),
    }
    if report.time_to_start_s is not None:
        m[TIME_TO_START_S] = seconds(report.time_to_start_s)
    return {k: v for k, v in m.items() if math.isfinite(v)}


def history_metrics(report: EttReport, at: int) -> list[Metric]:
    """Time to Recover of each failure, its index as the step."""
    return [
        Metric(TIME_TO_RECOVER_S, seconds(f.time_to_recover_s), at, i)
        for i, f in enumerate(report.failures)
    ]


def bucket_table(report: EttReport) -> dict[str, Any]:
    """Every bucket of the job's wall time (seconds, % of wall time) and the total, as the
    JSON "split" table MLflow's UI renders (``{"columns": [...], "data": [[...], ...]}``)."""
    pct = report.bucket_pct()
    rows: list[list[Any]] = [
        [bucket, seconds(secs), percent(pct[bucket])] for bucket, secs in report.buckets.items()
    ]
    rows.append(["total", seconds(report.wall_s), 100.0])
    return {"columns": list(BUCKET_COLUMNS), "data": rows}


def training_curves(events: Iterable[Event]) -> list[Metric]:
    """The job's curves by training step, from the ledger (see CURVES): rank 0's spans, one
    point per step. A step that was redone after a failure keeps its last execution (by
    attempt, then start), the one that counts, as in the ETT report. Timestamps are the spans'
    ends, so logging the same ledger again adds nothing."""
    latest: dict[tuple[str, int], Event] = {}
    spans = [e for e in events if e.rank == 0 and e.name in CURVES and e.step is not None]
    for e in sorted(spans, key=lambda e: (e.attempt, e.start)):
        latest[(e.name, int(e.step))] = e  # type: ignore[arg-type]
    out = []
    for (name, step), e in sorted(latest.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for attr, key in CURVES[name].items():
            value = e.attrs.get(attr)
            if isinstance(value, (int, float)) and math.isfinite(value):
                out.append(Metric(key, score(value), int(e.end * 1000), step))
    return out


def eval_rows(events: Iterable[Event]) -> int | None:
    evals = (Span.EVAL, Span.ASYNC_EVAL)
    rows = [e.attrs.get("rows") for e in events if e.rank == 0 and e.name in evals]
    found = [int(r) for r in rows if isinstance(r, (int, float))]
    return found[-1] if found else None
