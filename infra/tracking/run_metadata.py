"""What may be logged to MLflow: params without credentials, the code's source, the holdout.

Credentials are never logged: params come from ``config.public_dict()``, secret-looking keys
and the config's secret values are dropped, and user:password parts of URLs are stripped.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import hashlib
import json
import logging
import re
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.utils import mlflow_tags
from pydantic import BaseModel, SecretStr

from infra import storage
from infra.settings import JobConfig

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
SECRET_WORDS = ("secret", "password", "passwd", "token", "access_key", "credential", "api_key")
# MLflow's own limits (mlflow.utils.validation): longer params are cut, longer keys dropped.
MAX_PARAM_LEN = 6000
MAX_KEY_LEN = 250

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def redact_url(url: str) -> str:
    """The URL without a user:password@ part (the rest is kept)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


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


@functools.cache
def _git_tags() -> dict[str, str]:
    """The commit (and branch) of the code that runs, when it is a git checkout."""
    from mlflow.utils.git_utils import get_git_branch, get_git_commit

    tags = {}
    if commit := get_git_commit(str(REPO_ROOT)):
        tags[mlflow_tags.MLFLOW_GIT_COMMIT] = commit
        if branch := get_git_branch(str(REPO_ROOT)):
            tags[mlflow_tags.MLFLOW_GIT_BRANCH] = branch
    return tags


def source_tags(source: str) -> dict[str, str]:
    """MLflow's source tags (the UI's Source column and its commit link) for code in
    ``source`` (a path in this repository), and the user who ran it."""
    tags = {
        mlflow_tags.MLFLOW_SOURCE_TYPE: "JOB",
        mlflow_tags.MLFLOW_SOURCE_NAME: source,
        **_git_tags(),
    }
    with contextlib.suppress(KeyError, OSError):  # no user name in a bare container
        tags[mlflow_tags.MLFLOW_USER] = getpass.getuser()
    return tags


def holdout_dataset(data_url: str, rows: int) -> MetaDataset:
    """The first ``rows`` rows of a data set's holdout split as an MLflow dataset: the trainer's
    eval and the publish gate score such prefixes of one split, named apart by their size."""
    holdout = storage.join(data_url, "holdout")
    digest = hashlib.sha256(f"{redact_url(holdout)}\n{rows}".encode()).hexdigest()[:16]
    with warnings.catch_warnings():  # file:// matches two equal local sources: either will do
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source(redact_url(holdout))
    return MetaDataset(source=source, name=f"holdout[:{rows}]", digest=digest)
