"""Checks of a job's config against the world, made by the orchestrator before torchrun starts.

A config can be valid (infra/settings.py) and still name places a job cannot use: a storage
root under a regular file, a data URL with no shards, a checkpoint URL with no committed
checkpoint, an MLflow URI that is no URI. Found by the trainer, each costs a launch, the
TorchRec planner and seconds of noise before a fatal exit code. Found here, each is one line
naming the config field and its URL (credentials masked), before anything starts: ``ett
train`` exits 2 (``ExitCode.USAGE``) and the ``train`` flow fails before its first attempt.

What the data or a checkpoint holds is not read here: a shard that turns out unreadable, or
a checkpoint made for another model, is still the trainer's to find (exit 88, 84).
Call ``preflight`` after ``infra.storage.configure`` (S3 endpoint and credentials).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from urllib.parse import urlsplit

from infra import data_layout, storage
from infra.checkpoint_manifest import CheckpointError, read_manifest
from infra.config_sources import redact_url
from infra.settings import HEALTH_AUTO, CheckpointMode, EvalMode, JobConfig, health_argv

# The tracking stores MLflow has built in (mlflow.tracking._tracking_service.utils); others
# come from plugins (the "mlflow.tracking_store" entry points). A database URI's scheme may
# name a driver too: postgresql+psycopg2://...
_MLFLOW_SCHEMES = frozenset({"", "file", "http", "https", "databricks", "databricks-uc", "uc"})
_MLFLOW_DATABASES = ("postgresql", "mysql", "sqlite", "mssql")
_USERINFO = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://(?P<userinfo>[^/@\s]+)@")


class PreflightError(Exception):
    """A config field names a place the job cannot use; the message is one line that names
    the field and its URL (credentials masked)."""

    def __init__(self, field: str, url: str, problem: str) -> None:
        self.field, self.url = field, redact_url(url)
        super().__init__(_scrub(f"{field} ({self.url}): {problem}", url))


def _scrub(text: str, url: str) -> str:
    """``text`` on one line, without the user:password part of ``url`` anywhere: library
    errors may quote the URL without its scheme, where redact_url cannot see it."""
    text = redact_url(" ".join(text.split()))
    match = _USERINFO.match(url)
    return text.replace(match["userinfo"], "***") if match else text


def _reason(exc: BaseException, limit: int = 240) -> str:
    """What went wrong, short: botocore quotes whole regular expressions."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def preflight(config: JobConfig) -> None:
    """Raise PreflightError for the first unusable place the config names: the health
    check's program (on this host), the storage root (writable), the data (shards), the
    checkpoints to resume or warm-start from (committed), the MLflow URI (parseable). Cheap:
    a PATH lookup, a write probe, a listing, a manifest read."""
    _health_check(config)
    _storage_root(config)
    _data(config)
    _checkpoints(config)
    _mlflow_uri(config.tracking.mlflow_uri)


def _health_check(config: JobConfig) -> None:
    """A ``recovery.health_check`` command this host runs (one host, no work pool): its
    program is here. Found at the first failure instead, it would mark every slot lost."""
    command, launch = config.recovery.health_check, config.launch
    if command in (None, HEALTH_AUTO) or launch.work_pool or launch.nnodes > 1:
        return
    program = health_argv(command, 0, "0")[0]
    if shutil.which(program) is None:
        raise PreflightError(
            "recovery.health_check", command, f"no program {program} here (PATH, executable)"
        )


def _storage_root(config: JobConfig) -> None:
    """Writable: on local disk, no regular file among its parents (named if there is one);
    then a small object written and deleted at the root."""
    root = config.storage.root
    field = "storage.root"
    local = storage.local_path(root)
    if local is not None:
        blocker = _non_folder_ancestor(local)
        if blocker == local:
            raise PreflightError(field, root, f"{blocker} is a regular file, not a folder")
        if blocker is not None:
            raise PreflightError(field, root, f"under {blocker}, a regular file, not a folder")
    probe = storage.join(root, f".ett-preflight-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        storage.makedirs(root)
        storage.write_bytes(probe, b"")
        storage.remove(probe)
    except Exception as exc:  # noqa: BLE001 - whatever stops a write is the root's problem
        raise PreflightError(field, root, f"cannot write there: {_reason(exc)}") from exc


def _non_folder_ancestor(path: str) -> str | None:
    """The nearest existing path at or above ``path`` when it is not a folder, else None."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
    return None if os.path.isdir(current) else current


def _data(config: JobConfig) -> None:
    """The training shards, and the holdout's when the job evaluates (in the loop, or by the
    side evaluator from its checkpoints)."""
    data, train = config.data, config.train
    splits = [data_layout.TRAIN]
    if train.eval == EvalMode.INLINE or (
        train.eval == EvalMode.ASYNC and config.checkpoint.mode != CheckpointMode.OFF
    ):
        splits.append(data_layout.HOLDOUT)
    for split in splits:
        pattern = data_layout.shard_pattern(data, split)
        try:
            found = data_layout.list_shards(data, split)
        except Exception as exc:  # noqa: BLE001 - an unreadable data URL is the field's problem
            raise PreflightError("data.url", data.url, f"cannot list it: {_reason(exc)}") from exc
        if not found:
            parquet = data.format == "parquet"
            hint = " (`ett generate` writes a synthetic data set)" if parquet else ""
            raise PreflightError(
                "data.url",
                data.url,
                f"no {data.format} shards match {redact_url(pattern)}{hint}",
            )


def _checkpoints(config: JobConfig) -> None:
    """``checkpoint.resume`` (when a URL) and ``checkpoint.warm_start``: committed."""
    ckpt = config.checkpoint
    named: list[tuple[str, str]] = []
    if ckpt.resume not in ("latest", "none") and ckpt.mode != CheckpointMode.OFF:
        named.append(("checkpoint.resume", ckpt.resume))
    if ckpt.warm_start:
        named.append(("checkpoint.warm_start", ckpt.warm_start))
    for field, url in named:
        try:
            read_manifest(url)
        except CheckpointError as exc:  # no manifest, or an unreadable one
            problem = str(exc).removeprefix(f"{url} is ")
            raise PreflightError(field, url, problem) from exc
        except Exception as exc:  # noqa: BLE001 - unreachable is the field's problem too
            raise PreflightError(field, url, f"cannot read it: {_reason(exc)}") from exc


def _mlflow_uri(uri: str) -> None:
    """Parseable as MLflow parses it, and a scheme it has a tracking store for; not
    contacted (a server that is down does not stop training: see infra/tracking/mlflow_runs.py)."""
    problem = _mlflow_problem(uri)
    if problem is not None:
        raise PreflightError("tracking.mlflow_uri", uri, problem)


def _mlflow_problem(uri: str) -> str | None:
    if not uri.strip():
        return "empty"
    if any(c.isspace() for c in uri):
        return "has white space in it"
    if uri in ("databricks", "databricks-uc", "uc"):
        return None
    try:
        parts = urlsplit(uri)
        _ = parts.port  # ValueError for a port that is no number in range
    except ValueError as exc:
        return f"not a URI: {exc}"
    scheme = parts.scheme.lower()
    if len(scheme) == 1 or scheme in ("", "file"):  # a path (C:\ too), or a file store
        return None
    usage = "use http(s)://HOST:PORT, sqlite:///PATH, a database URI, or a folder"
    if scheme in ("http", "https"):
        if not parts.hostname:
            return f"names no host ({usage})"
        return None
    if scheme.split("+", 1)[0] in _MLFLOW_DATABASES:
        if "://" not in uri:  # SQLAlchemy's URLs: postgresql:///db is a local socket
            return f"a database URI needs '{scheme}://' ({usage})"
        return None
    if scheme in _MLFLOW_SCHEMES or scheme in _plugin_schemes():
        return None
    return f"MLflow has no tracking store for the scheme {scheme!r} ({usage})"


def _plugin_schemes() -> set[str]:
    """Schemes that installed MLflow plugins add (read without importing MLflow)."""
    from importlib.metadata import entry_points

    return {ep.name.lower() for ep in entry_points(group="mlflow.tracking_store")}
