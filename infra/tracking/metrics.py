"""A job's ETT report and training curves as MLflow metrics.

ETT metrics are ``ett.*`` (``ett.ett_pct``, ``ett.bucket_<bucket>_s``, the L2 shares
``ett.bucket_<bucket>_pct``, ``ett.time_to_recover_s`` by failure index, ``ett.init.<stage>_s``
by attempt, ...). Curves by training step: ``trainer.loss`` and the trainer's own holdout
evaluation ``trainer.holdout_auc`` / ``trainer.holdout_logloss`` (on the first
``train.eval_rows`` holdout rows; the publish gate's ``publish.holdout_*`` are on fewer rows, see
docs/publishing.md). The curves carry their spans' end times, so logging the same ledger again
adds no point to them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from mlflow.entities import Metric

from infra.accounting.ledger_format import Event, Span
from infra.accounting.records import EttReport

METRIC_PREFIX = "ett."
# Ledger span attribute -> metric key, per span name: the training curves of a job's run.
CURVES: dict[str, dict[str, str]] = {
    Span.TRAIN_STEP: {"loss": "trainer.loss"},
    Span.EVAL: {"auc": "trainer.holdout_auc", "logloss": "trainer.holdout_logloss"},
    # The side evaluator (train.eval: async) scores the same rows from each eval checkpoint.
    Span.ASYNC_EVAL: {"auc": "trainer.holdout_auc", "logloss": "trainer.holdout_logloss"},
}


def report_metrics(report: EttReport) -> dict[str, float]:
    """Scalar ETT metrics of a report, named as logged (``ett.`` prefix)."""
    m = dict(report.to_metrics())
    m.update({f"bucket_{k}_pct": v for k, v in report.bucket_pct().items()})
    m.update(
        num_attempts=float(len(report.attempts)),
        num_steps=float(report.num_steps),
        train_loop_s=report.train_loop_s,
        finished=1.0 if report.finished else 0.0,
    )
    for name in ("checkpoint_interval_s", "commit_latency_s"):
        if getattr(report, name) is not None:
            m[name] = float(getattr(report, name))
    return {f"{METRIC_PREFIX}{k}": float(v) for k, v in m.items() if math.isfinite(v)}


def history_metrics(report: EttReport, at: int) -> list[Metric]:
    out = [
        Metric(f"{METRIC_PREFIX}time_to_recover_s", f.time_to_recover_s, at, i)
        for i, f in enumerate(report.failures)
    ]
    for ib in report.init:
        values = {f"init.{k}_s": v for k, v in ib.stages.items()}
        values["init.critical_path_s"] = ib.critical_path_s
        if ib.wall_s is not None:
            values["init.wall_s"] = ib.wall_s
        out += [Metric(f"{METRIC_PREFIX}{k}", float(v), at, ib.attempt) for k, v in values.items()]
    return out


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
                out.append(Metric(key, float(value), int(e.end * 1000), step))
    return out


def eval_rows(events: Iterable[Event]) -> int | None:
    evals = (Span.EVAL, Span.ASYNC_EVAL)
    rows = [e.attrs.get("rows") for e in events if e.rank == 0 and e.name in evals]
    found = [int(r) for r in rows if isinstance(r, (int, float))]
    return found[-1] if found else None
