"""MLflow tracking of ETT: one run per job, one nested run per attempt, the report at the end.

    run_id = start_job_run(config)                 # at job start; a resumed job gets its run back
    log_attempt(run_id, 0, exit_code=-9, cause="sigkill", started=t0, ended=t1, last_step=40,
                tracking_uri=config.tracking.mlflow_uri)
    log_job_report(run_id, report_for_job(config.job_url), config.job_url,
                   tracking_uri=config.tracking.mlflow_uri)   # metrics + artifacts, ends the run

Every call builds its own ``MlflowClient(tracking_uri=...)``, so nothing global is set and the
same code logs to ``sqlite:///...`` and to an ``http://`` MLflow server. ``log_attempt`` and
``log_job_report`` take the URI from their ``tracking_uri`` argument, else from the run started
by ``start_job_run`` in this process, else from ``MLFLOW_TRACKING_URI``; pass it explicitly
from another process. Credentials are never logged: params come from ``config.public_dict()``
(which leaves them out), secret-looking keys and the config's secret values are dropped as well,
and user:password parts of URLs are stripped.

Metric names (all prefixed ``ett.``): the report's ``to_metrics()`` (``ett.ett_pct``,
``ett.failure_pct``, ``ett.idleness_pct``, ``ett.wall_s``, ``ett.bucket_<bucket>_s``,
``ett.time_to_start_s``, ``ett.time_to_recover_total_s``, ``ett.num_failures``, ...), the L2
shares ``ett.bucket_<bucket>_pct``, ``ett.start_time`` (Unix s of W's start),
``ett.num_attempts``, ``ett.num_steps``, ``ett.train_loop_s``, ``ett.finished`` (0/1) and, as
metric histories, ``ett.time_to_recover_s`` (step = failure index) and ``ett.init.<stage>_s``,
``ett.init.wall_s``, ``ett.init.critical_path_s`` (step = attempt).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from pydantic import BaseModel, SecretStr

from infra.ett import EttReport
from infra.ett_report import format_table, plot_breakdown, to_markdown
from infra.ledger import ledger_url, read_files
from infra.settings import JobConfig

log = logging.getLogger(__name__)

JOB_ID_TAG = "ett.job_id"
JOB_URL_TAG = "ett.job_url"
KIND_TAG = "ett.kind"  # "job" | "attempt"
ATTEMPT_TAG = "attempt"
PARENT_TAG = "mlflow.parentRunId"
METRIC_PREFIX = "ett."
# MLflow's limits (mlflow.utils.validation, 3.x); a server may be stricter on old versions.
MAX_PARAM_LEN = 6000
MAX_TAG_LEN = 8000
MAX_KEY_LEN = 250
BATCH = 100  # params, and tags, per log_batch call
MAX_BATCH = 1000  # metrics + params + tags per log_batch call
SECRET_WORDS = ("secret", "password", "passwd", "token", "access_key", "credential", "api_key")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_run_uris: dict[str, str] = {}  # run id -> tracking URI, for runs started by this process


# -- helpers --------------------------------------------------------------------------------
def redact_url(url: str) -> str:
    """The URL without a user:password@ part (the rest is kept)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def _client(tracking_uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=tracking_uri)


def _resolve_uri(run_id: str, tracking_uri: str | None) -> str:
    uri = tracking_uri or _run_uris.get(run_id) or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ValueError(
            f"no tracking URI for run {run_id}: pass tracking_uri=config.tracking.mlflow_uri "
            "(or set MLFLOW_TRACKING_URI)"
        )
    return uri


def _secret_values(obj: Any) -> set[str]:
    """Every SecretStr value inside a (nested) pydantic model."""
    found: set[str] = set()
    if isinstance(obj, SecretStr):
        if obj.get_secret_value():
            found.add(obj.get_secret_value())
    elif isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            found |= _secret_values(getattr(obj, name))
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            found |= _secret_values(item)
    return found


def flatten_params(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts -> dotted keys; lists as JSON; values cut to MLflow's param length."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_params(value, prefix=f"{name}."))
            continue
        text = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
        if len(text) > MAX_PARAM_LEN:
            text = text[: MAX_PARAM_LEN - 14] + "...(truncated)"
        if len(name) > MAX_KEY_LEN:
            log.warning("param key longer than %d characters not logged: %s", MAX_KEY_LEN, name)
            continue
        out[name] = text
    return out


def job_params(config: JobConfig) -> dict[str, str]:
    """The config as MLflow params, without credentials."""
    secrets = _secret_values(config)
    params = flatten_params(config.public_dict())
    safe = {}
    for key, value in params.items():
        leaf = key.rsplit(".", 1)[-1].lower()
        if any(w in leaf for w in SECRET_WORDS) or any(s in value for s in secrets):
            continue
        safe[key] = redact_url(value) if _URL.match(value) else value
    return safe


def _log_batches(
    client: MlflowClient,
    run_id: str,
    metrics: Sequence[Metric] = (),
    params: dict[str, str] | None = None,
    tags: dict[str, str] | None = None,
) -> None:
    """As few log_batch calls as MLflow's limits allow (100 params, 100 tags, 1000 in all):
    each call is one transaction (SQLite) or one request (HTTP)."""
    p = [Param(k, v) for k, v in (params or {}).items()]
    t = [RunTag(k, v[:MAX_TAG_LEN]) for k, v in (tags or {}).items()]
    m = list(metrics)
    while p or t or m:
        bp, bt = p[:BATCH], t[:BATCH]
        bm = m[: MAX_BATCH - len(bp) - len(bt)]
        client.log_batch(run_id, metrics=bm, params=bp, tags=bt)
        p, t, m = p[len(bp) :], t[len(bt) :], m[len(bm) :]


def _experiment_id(client: MlflowClient, name: str, tracking_uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    location = None
    if tracking_uri.startswith("sqlite:///"):
        # MLflow would put artifacts in ./mlruns of whatever directory the caller runs in
        # (Prefect workers run flows in temp dirs): keep them next to the database instead.
        db = Path(tracking_uri[len("sqlite:///") :]).resolve()
        location = (db.parent / "mlartifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:  # created meanwhile by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def find_open_job_run(client: MlflowClient, experiment_id: str, job_id: str) -> Any | None:
    """The newest unfinished (not FINISHED) top-level run of a job, or None."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{JOB_ID_TAG}` = '{job_id}'",
        order_by=["attributes.start_time DESC"],
        max_results=50,
    )
    for run in runs:
        if run.info.status != "FINISHED" and PARENT_TAG not in run.data.tags:
            return run
    return None


# -- the API --------------------------------------------------------------------------------
def start_job_run(config: JobConfig) -> str:
    """The job's MLflow run id: the unfinished run of ``config.job_id`` if there is one
    (a resumed job keeps its run), otherwise a new run named after the job."""
    uri = config.tracking.mlflow_uri
    client = _client(uri)
    exp_id = _experiment_id(client, config.tracking.experiment, uri)
    params = job_params(config)
    tags = {JOB_ID_TAG: config.job_id, JOB_URL_TAG: redact_url(config.job_url), KIND_TAG: "job"}
    run = find_open_job_run(client, exp_id, config.job_id)
    if run is None:
        run_id = client.create_run(exp_id, tags=tags, run_name=config.job_id).info.run_id
        new_params = params
    else:
        run_id = run.info.run_id
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        old = run.data.params
        new_params = {k: v for k, v in params.items() if k not in old}
        changed = sorted(k for k, v in params.items() if k in old and old[k] != v)
        resumes = int(run.data.tags.get("ett.resumes", "0")) + 1
        tags["ett.resumes"] = str(resumes)
        if changed:  # MLflow params are immutable: keep the first values, say what moved
            log.warning(
                "job %s resumed with changed params (kept the first): %s",
                config.job_id,
                ", ".join(changed),
            )
            tags["ett.params_changed_on_resume"] = ",".join(changed)
        log.info("reusing MLflow run %s of job %s (resume %d)", run_id, config.job_id, resumes)
    _log_batches(client, run_id, params=new_params, tags=tags)
    _run_uris[run_id] = uri
    return run_id


def log_attempt(
    run_id: str,
    attempt: int,
    exit_code: int,
    cause: str,
    started: float,
    ended: float,
    last_step: int | None,
    *,
    tracking_uri: str | None = None,
) -> str:
    """Record one attempt as a nested run of the job's run (tag ``attempt``); returns its id.

    Logging the same attempt again updates its metrics instead of adding a second run."""
    uri = _resolve_uri(run_id, tracking_uri)
    client = _client(uri)
    parent = client.get_run(run_id)
    found = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{run_id}' and tags.{ATTEMPT_TAG} = '{attempt}'",
        max_results=1,
    )
    params = {
        "attempt": str(attempt),
        "exit_code": str(exit_code),
        "cause": cause,
        "last_step": str(last_step),
    }
    if found:
        child_id = found[0].info.run_id
        params = {k: v for k, v in params.items() if k not in found[0].data.params}
    else:
        job_id = parent.data.tags.get(JOB_ID_TAG, parent.info.run_name)
        tags = {
            PARENT_TAG: run_id,
            ATTEMPT_TAG: str(attempt),
            KIND_TAG: "attempt",
            "ett.parent_job_id": job_id,
        }
        child_id = client.create_run(
            parent.info.experiment_id,
            start_time=int(started * 1000),
            tags=tags,
            run_name=f"{job_id}-attempt{attempt}",
        ).info.run_id
    now = int(time.time() * 1000)
    values = {
        "exit_code": float(exit_code),
        "duration_s": ended - started,
        "started": started,
        "ended": ended,
    }
    if last_step is not None:
        values["last_step"] = float(last_step)
    metrics = [Metric(k, v, now, 0) for k, v in values.items()]
    _log_batches(client, child_id, metrics, params=params, tags={"cause": cause})
    status = "FINISHED" if exit_code == 0 else "FAILED"
    client.set_terminated(child_id, status=status, end_time=int(ended * 1000))
    _run_uris[child_id] = uri
    return child_id


def report_metrics(report: EttReport) -> dict[str, float]:
    """Scalar ETT metrics of a report, named as logged (``ett.`` prefix)."""
    m = dict(report.to_metrics())
    m.update({f"bucket_{k}_pct": v for k, v in report.bucket_pct().items()})
    m.update(
        start_time=report.start_time,
        num_attempts=float(len(report.attempts)),
        num_steps=float(report.num_steps),
        train_loop_s=report.train_loop_s,
        finished=1.0 if report.finished else 0.0,
    )
    for name in ("checkpoint_interval_s", "commit_latency_s"):
        if getattr(report, name) is not None:
            m[name] = float(getattr(report, name))
    return {f"{METRIC_PREFIX}{k}": float(v) for k, v in m.items() if math.isfinite(v)}


def _history(report: EttReport, now: int) -> list[Metric]:
    out = [
        Metric(f"{METRIC_PREFIX}time_to_recover_s", f.time_to_recover_s, now, i)
        for i, f in enumerate(report.failures)
    ]
    for ib in report.init:
        values = {f"init.{k}_s": v for k, v in ib.stages.items()}
        values["init.critical_path_s"] = ib.critical_path_s
        if ib.wall_s is not None:
            values["init.wall_s"] = ib.wall_s
        out += [Metric(f"{METRIC_PREFIX}{k}", float(v), now, ib.attempt) for k, v in values.items()]
    return out


def log_job_report(
    run_id: str,
    report: EttReport,
    job_url: str,
    extra_metrics: dict[str, float] | None = None,
    *,
    tracking_uri: str | None = None,
    end_run: bool = True,
    status: str = "FINISHED",
) -> dict[str, float]:
    """Log the job's ETT metrics and artifacts to its run, then end it (unless ``end_run`` is
    False). ``extra_metrics`` are logged under the names given. Returns the scalar metrics.

    Artifacts: ``ett/report.json``, ``ett/report.txt`` (table), ``ett/report.md``,
    ``ett/breakdown.png`` and every ledger file of the job under ``ledger/``.
    """
    client = _client(_resolve_uri(run_id, tracking_uri))
    now = int(time.time() * 1000)
    scalars = report_metrics(report)
    scalars.update({k: float(v) for k, v in (extra_metrics or {}).items()})
    metrics = [Metric(k, v, now, 0) for k, v in scalars.items()] + _history(report, now)
    tags = {JOB_URL_TAG: redact_url(job_url), "ett.finished": str(report.finished).lower()}
    _log_batches(client, run_id, metrics, tags=tags)
    with tempfile.TemporaryDirectory(prefix="ett-mlflow-") as tmp:
        ett_dir, ledger_dir = Path(tmp, "ett"), Path(tmp, "ledger")
        ett_dir.mkdir()
        ledger_dir.mkdir()
        (ett_dir / "report.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
        (ett_dir / "report.txt").write_text(format_table(report))
        (ett_dir / "report.md").write_text(to_markdown(report))
        plot_breakdown(report, ett_dir / "breakdown.png")
        client.log_artifacts(run_id, str(ett_dir), artifact_path="ett")
        files = read_files(job_url)  # segmented ones reassembled
        for file in files:
            (ledger_dir / file.name).write_bytes(file.data)
        if files:
            client.log_artifacts(run_id, str(ledger_dir), artifact_path="ledger")
        else:
            log.warning("no ledger files under %s", redact_url(ledger_url(job_url)))
    if end_run:
        client.set_terminated(run_id, status=status)
    return scalars
