"""MLflow tracking of a job: one run per job (ETT headline and training curves), one nested
run per attempt, its anchor checkpoints as LoggedModels, a fleet run per experiment for the fleet
report.

    run_id = start_job_run(config)              # at job start; a re-run job gets its run back
    log_attempt(run_id, attempt_report, tracking_uri=config.tracking.mlflow_uri)
    log_job(config, run_id, succeeded=True)     # report, curves, artifacts; fills in attempts

Everything a job's run holds is derived from the job's ledger, so ``log_job`` can log a job
whole, later: a job that ran while MLflow was down is logged at the end of its flow or with
``ett report --log JOB``. The client and its bounds are infra/tracking/client.py's, what may be
logged (params without credentials, source tags) infra/tracking/run_metadata.py's, the metric names
infra/tracking/metrics.py's, the checkpoint models infra/tracking/logged_models.py's. Tags are
``ett.*`` plus MLflow's own (source, git commit, description).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mlflow import MlflowClient
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.utils import mlflow_tags

from infra.accounting.ledger_format import Event, Mark, Span
from infra.accounting.records import EttReport
from infra.accounting.report import format_table, plot_breakdown, recovery_lines, to_markdown
from infra.accounting.summary import JobSummary
from infra.exit_codes import Outcome
from infra.naming import attempt_run_name
from infra.settings import JobConfig
from infra.tracking import logged_models
from infra.tracking import metrics as names
from infra.tracking.client import client, ensure_experiment
from infra.tracking.metrics import (
    bucket_table,
    eval_rows,
    headline_metrics,
    history_metrics,
    training_curves,
)
from infra.tracking.run_metadata import holdout_dataset, job_params, redact_url, source_tags

log = logging.getLogger(__name__)

JOB_ID_TAG = "ett.job_id"
JOB_URL_TAG = "ett.job_url"
KIND_TAG = "ett.kind"  # "job" | "attempt" | "publish" | "fleet"
PARENT_JOB_TAG = "ett.parent_job_id"  # on attempt and publish runs (a job id search finds jobs)
ATTEMPT_TAG = "ett.attempt"
OUTCOME_TAG = "ett.outcome"
EXIT_CODE_TAG = "ett.exit_code"
PARENT_TAG = mlflow_tags.MLFLOW_PARENT_RUN_ID
FLEET_RUN_NAME = "fleet-report"
TAG_LIMIT = 5000  # characters MLflow keeps of a tag value

_run_uris: dict[str, str] = {}  # run id -> tracking URI, for runs started by this process


class AttemptLike(Protocol):
    """What ``log_attempt`` needs of an attempt (the orchestrator's AttemptReport has it)."""

    attempt: int
    outcome: str  # an infra.exit_codes.Outcome value
    exit_code: int | None
    started: float  # Unix seconds
    ended: float
    last_step: int | None


@dataclass(frozen=True)
class LedgerAttempt:
    """An attempt as the job's ledger tells it, for logging a job after the fact (the
    orchestrator's own reports are gone by then); see ``attempts_from_ledger``."""

    attempt: int
    outcome: str
    exit_code: int | None
    started: float
    ended: float
    last_step: int | None


def _resolve_uri(run_id: str, tracking_uri: str | None) -> str:
    uri = tracking_uri or _run_uris.get(run_id) or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ValueError(
            f"no tracking URI for run {run_id}: pass tracking_uri=config.tracking.mlflow_uri "
            "(or set MLFLOW_TRACKING_URI)"
        )
    return uri


def find_job_run(ml: MlflowClient, experiment_id: str, job_id: str) -> Any | None:
    """The job's run (whatever its status), or None. One run per job: a job that is run again,
    after a failure or after it finished, continues in its run."""
    runs = ml.search_runs(
        [experiment_id],
        filter_string=f"tags.`{JOB_ID_TAG}` = '{job_id}' and tags.`{KIND_TAG}` = 'job'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0] if runs else None


def _job_description(config: JobConfig) -> str:
    return (
        f"Training job `{config.job_id}` ({redact_url(config.layout.url)}).\n\n"
        f"- `{names.TRAIN_LOSS}`: training loss per step (rank 0; a step redone after a "
        "failure shows its last run).\n"
        f"- `{names.EVAL_AUC}`, `{names.EVAL_LOGLOSS}`: the trainer's own evaluation every "
        f"{config.train.eval_every} steps on the first {config.train.eval_rows} holdout rows "
        f"(dataset `holdout[:{config.train.eval_rows}]`). The publish gate's "
        "`publish/holdout_*` on the model are on fewer rows of the same split, so they "
        "differ by sampling noise.\n"
        f"- `{names.WALL_TIME}*`: the Effective Training Time headline; every bucket is the table "
        f"`{names.BUCKET_TABLE}` (Artifacts), with the full report beside it.\n"
        "- Logged models: the anchor checkpoints, at their step; attempts and publish runs are "
        "nested runs."
    )


def start_job_run(config: JobConfig, source: str = "flows/train_flow.py") -> str:
    """The job's MLflow run id, its run found (a re-run or resumed job keeps its run and is
    RUNNING again) or created, with the config as params."""
    uri = config.tracking.mlflow_uri
    ml = client(uri)
    exp_id = ensure_experiment(ml, config.tracking.experiment, uri)
    params = job_params(config)
    tags = {
        JOB_ID_TAG: config.job_id,
        JOB_URL_TAG: redact_url(config.layout.url),
        KIND_TAG: "job",
        **source_tags(source),
    }
    run = find_job_run(ml, exp_id, config.job_id)
    if run is None:
        tags[mlflow_tags.MLFLOW_RUN_NOTE] = _job_description(config)
        run_id = ml.create_run(exp_id, tags=tags, run_name=config.job_id).info.run_id
        new_params = params
    else:
        run_id = run.info.run_id
        if run.info.status != "RUNNING":
            ml.update_run(run_id, status="RUNNING")
        old = run.data.params
        new_params = {k: v for k, v in params.items() if k not in old}
        changed = sorted(k for k, v in params.items() if k in old and old[k] != v)
        tags["ett.resumes"] = str(int(run.data.tags.get("ett.resumes", "0")) + 1)
        if changed:  # MLflow params are immutable: keep the first values, say what moved
            log.warning(
                "job %s run again with changed params (kept the first): %s",
                config.job_id,
                ", ".join(changed),
            )
            tags["ett.params_changed_on_resume"] = ",".join(changed)
        log.info("continuing MLflow run %s of job %s", run_id, config.job_id)
    ml.log_batch(
        run_id,
        params=[Param(k, v) for k, v in new_params.items()],
        tags=[RunTag(k, v) for k, v in tags.items()],
    )
    _run_uris[run_id] = uri
    return run_id


# -- attempts ---------------------------------------------------------------------------------
def _attempt_status(outcome: str) -> str:
    """The attempt run's MLflow status for its outcome (an ``Outcome`` value)."""
    if outcome == Outcome.SUCCESS:
        return "FINISHED"
    return "KILLED" if outcome in (Outcome.PREEMPTED, Outcome.CANCELLED) else "FAILED"


def log_attempt(run_id: str, attempt: AttemptLike, *, tracking_uri: str | None = None) -> str:
    """Record one attempt as a nested run of the job's run; returns its id. The attempt's
    start and end are the run's own times; its outcome and exit code are tags (searchable:
    ``tags.`ett.outcome` = 'sigkill'``); duration and last step are metrics. Logging an
    attempt again updates its run instead of adding another."""
    uri = _resolve_uri(run_id, tracking_uri)
    ml = client(uri)
    parent = ml.get_run(run_id)
    found = ml.search_runs(
        [parent.info.experiment_id],
        filter_string=(
            f"tags.`{PARENT_TAG}` = '{run_id}' and tags.`{ATTEMPT_TAG}` = '{attempt.attempt}'"
        ),
        max_results=1,
    )
    tags = {
        OUTCOME_TAG: str(attempt.outcome),
        EXIT_CODE_TAG: "none" if attempt.exit_code is None else str(attempt.exit_code),
    }
    if found:
        child_id = found[0].info.run_id
    else:
        job_id = parent.data.tags.get(JOB_ID_TAG, parent.info.run_name)
        tags |= {
            PARENT_TAG: run_id,
            ATTEMPT_TAG: str(attempt.attempt),
            KIND_TAG: "attempt",
            PARENT_JOB_TAG: job_id,
            **source_tags("flows/train_flow.py"),
        }
        child_id = ml.create_run(
            parent.info.experiment_id,
            start_time=int(attempt.started * 1000),
            tags=tags,
            run_name=attempt_run_name(job_id, attempt.attempt),
        ).info.run_id
    at = int(attempt.ended * 1000)
    duration = names.seconds(attempt.ended - attempt.started)
    metrics = [Metric(names.ATTEMPT_DURATION_S, duration, at, 0)]
    if attempt.last_step is not None:
        metrics.append(Metric(names.ATTEMPT_LAST_STEP, float(attempt.last_step), at, 0))
    ml.log_batch(child_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])
    ml.set_terminated(child_id, status=_attempt_status(attempt.outcome), end_time=at)
    _run_uris[child_id] = uri
    return child_id


def attempts_from_ledger(report: EttReport, events: Sequence[Event]) -> list[LedgerAttempt]:
    """Every attempt of a job as its ledger tells it: start and end (the attempt's own
    events, without the flow's scheduling wait), outcome (the failure mark's cause, else
    ``success`` for an attempt that reached job_end, else the report's view), exit code (from
    the failure mark; 0 for a success) and last step."""
    mine = [e for e in events if e.rank == 0 and e.name != Span.SCHEDULING]
    out = []
    for summary in report.attempts:
        own = [e for e in mine if e.attempt == summary.attempt]
        if not own:
            continue
        marks = [e for e in own if e.name == Mark.FAILURE]
        outcome = summary.outcome
        code = 0 if outcome == Outcome.SUCCESS else None
        if marks:
            code = marks[0].attrs.get("exit_code")
        out.append(
            LedgerAttempt(
                attempt=summary.attempt,
                outcome=str(outcome),
                exit_code=int(code) if isinstance(code, (int, float)) else None,
                started=min(e.start for e in own),
                ended=max(e.end for e in own),
                last_step=summary.last_step,
            )
        )
    return out


def _logged_attempts(ml: MlflowClient, run_id: str) -> set[int]:
    run = ml.get_run(run_id)
    children = ml.search_runs(
        [run.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{run_id}'"
    )
    return {int(c.data.tags[ATTEMPT_TAG]) for c in children if ATTEMPT_TAG in c.data.tags}


def log_job_report(
    run_id: str,
    summary: JobSummary,
    extra_metrics: Mapping[str, float] | None = None,
    *,
    tracking_uri: str | None = None,
    data_url: str | None = None,
    status: str | None = "FINISHED",
) -> dict[str, float]:
    """Log the job's ETT headline, its training curves, its anchor checkpoints (LoggedModels)
    and artifacts to its run, then end it with ``status`` (None: leave it running). Returns
    the headline metrics.

    Artifacts: ``ett/buckets.json`` (every bucket, one table), ``ett/report.json``,
    ``ett/report.txt`` (table), ``ett/report.md``, ``ett/breakdown.png`` and every ledger file
    of the job under ``ledger/``. ``data_url`` names the holdout the trainer evaluated on
    (logged as the run's eval dataset, and the dataset of the models' ``eval/*``).
    """
    ml = client(_resolve_uri(run_id, tracking_uri))
    report, events = summary.report, summary.events
    at = int(time.time() * 1000)
    scalars = headline_metrics(report)
    scalars.update({k: float(v) for k, v in (extra_metrics or {}).items()})
    curves = training_curves(events)
    metrics = [Metric(k, v, at, 0) for k, v in scalars.items()]
    metrics += history_metrics(report, at) + curves
    tags = {
        JOB_URL_TAG: redact_url(summary.layout.url),
        "ett.finished": str(report.finished).lower(),
    }
    # What recovery did and what the ledger checks found: one line each, in the run's tags.
    if recovered := recovery_lines(report):
        tags["ett.recovery"] = "\n".join(recovered)[:TAG_LIMIT]
    # Each resize on a tag of its own, so a search finds the jobs that ran smaller.
    if report.resizes:
        tags["ett.resizes"] = "\n".join(r.describe() for r in report.resizes)[:TAG_LIMIT]
    if notes := report.clock.notes():
        tags["ett.ledger_checks"] = "\n".join(notes)[:TAG_LIMIT]
    ml.log_batch(run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])
    rows = eval_rows(events)
    dataset = holdout_dataset(data_url, rows) if data_url and rows else None
    if dataset is not None:
        context = InputTag(key=mlflow_tags.MLFLOW_DATASET_CONTEXT, value="eval")
        entity = dataset._to_mlflow_entity()
        ml.log_inputs(run_id, datasets=[DatasetInput(entity, tags=[context])])
    evals = [m for m in curves if m.key in names.EVAL_CURVES]
    named = (dataset.name, dataset.digest) if dataset is not None else None
    for ckpt in logged_models.anchors(summary.layout):
        model = logged_models.ensure_model(ml, _experiment_of(ml, run_id), ckpt, run_id)
        logged_models.link_metrics(ml, run_id, model, ckpt.step, evals, named)
    with tempfile.TemporaryDirectory(prefix="ett-mlflow-") as tmp:
        ett_dir, ledger_dir = Path(tmp, "ett"), Path(tmp, "ledger")
        ett_dir.mkdir()
        ledger_dir.mkdir()
        table = Path(tmp, names.BUCKET_TABLE)
        table.write_text(json.dumps(bucket_table(report)))
        (ett_dir / "report.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
        (ett_dir / "report.txt").write_text(format_table(report, summary.mfu))
        (ett_dir / "report.md").write_text(to_markdown(report, summary.mfu))
        plot_breakdown(report, ett_dir / "breakdown.png")
        ml.log_artifacts(run_id, str(ett_dir), artifact_path="ett")
        _list_table(ml, run_id, names.BUCKET_TABLE)
        for file in summary.files:  # segmented ones reassembled
            (ledger_dir / file.name).write_bytes(file.data)
        if summary.files:
            ml.log_artifacts(run_id, str(ledger_dir), artifact_path="ledger")
        else:
            log.warning("no ledger files under %s", redact_url(summary.layout.ledger))
    if status is not None:
        ml.set_terminated(run_id, status=status)
    return scalars


def _experiment_of(ml: MlflowClient, run_id: str) -> str:
    return str(ml.get_run(run_id).info.experiment_id)


def _list_table(ml: MlflowClient, run_id: str, path: str) -> None:
    """List ``path`` (a JSON "split" table artifact) in the run's ``mlflow.loggedArtifacts``,
    as ``MlflowClient.log_table`` does, so the UI renders it as a table. (log_table itself
    appends to a table logged before: logging a job again would double its rows.)"""
    tag = mlflow_tags.MLFLOW_LOGGED_ARTIFACTS
    listed = json.loads(ml.get_run(run_id).data.tags.get(tag, "[]"))
    entry = {"path": path, "type": "table"}
    if entry not in listed:
        ml.set_tag(run_id, tag, json.dumps([*listed, entry]))


def _final_status(report: EttReport, succeeded: bool | None) -> str | None:
    """The job run's status: the flow's verdict when it has one; otherwise (``ett report
    --log``) FINISHED when the job finished, FAILED when its last attempt failed, and still
    RUNNING (None) while its last attempt may still be running."""
    if succeeded is not None:
        return "FINISHED" if succeeded else "FAILED"
    if report.finished:
        return "FINISHED"
    last = max(report.attempts, key=lambda a: a.attempt, default=None)
    return "FAILED" if last is not None and last.outcome.failed else None


def log_job(
    config: JobConfig,
    summary: JobSummary,
    run_id: str | None = None,
    *,
    succeeded: bool | None = None,
    extra_metrics: Mapping[str, float] | None = None,
) -> tuple[str, dict[str, float]]:
    """Log a job whole from its summary: its run (``run_id``, else found or created), every
    attempt not logged yet, the ETT report, the curves and the artifacts. Returns the run id
    and the scalar metrics. This is how a job that ran while MLflow was down gets logged."""
    uri = config.tracking.mlflow_uri
    report = summary.report
    run_id = run_id or start_job_run(config)
    ml = client(uri)
    logged = _logged_attempts(ml, run_id)
    for attempt in attempts_from_ledger(report, summary.events):
        if attempt.attempt not in logged:
            log_attempt(run_id, attempt, tracking_uri=uri)
    scalars = log_job_report(
        run_id,
        summary,
        extra_metrics,
        tracking_uri=uri,
        data_url=config.data.url,
        status=_final_status(report, succeeded),
    )
    return run_id, scalars


# -- the fleet view -------------------------------------------------------------------------------
def log_fleet_report(
    tracking_uri: str,
    experiment: str,
    files: Mapping[str, str | os.PathLike[str]],
    metrics: Mapping[str, float] | None = None,
) -> str:
    """Log the fleet report's files (plots, tables) to the experiment's fleet run (one per
    experiment, reused: each report adds a new metric point and replaces the files), so the
    plots live in MLflow, not on a worker's disk. Returns the run id."""
    ml = client(tracking_uri)
    exp_id = ensure_experiment(ml, experiment, tracking_uri)
    runs = ml.search_runs([exp_id], filter_string=f"tags.`{KIND_TAG}` = 'fleet'", max_results=1)
    if runs:
        run_id = runs[0].info.run_id
        ml.update_run(run_id, status="RUNNING")
    else:
        tags = {KIND_TAG: "fleet", **source_tags("flows/report_flow.py")}
        tags[mlflow_tags.MLFLOW_RUN_NOTE] = (
            f"ETT across the jobs of experiment `{experiment}`: trend, Time to Start and Time to "
            "Recover distributions, lost time per job (Artifacts, `fleet/`)."
        )
        run_id = ml.create_run(exp_id, tags=tags, run_name=FLEET_RUN_NAME).info.run_id
    at = int(time.time() * 1000)
    values = [Metric(k, float(v), at, 0) for k, v in (metrics or {}).items() if math.isfinite(v)]
    ml.log_batch(run_id, metrics=values)
    for path in files.values():
        ml.log_artifact(run_id, str(path), artifact_path="fleet")
    ml.set_terminated(run_id, status="FINISHED")
    return run_id
