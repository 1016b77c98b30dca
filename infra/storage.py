"""One way to read and write any fsspec URL (file://, s3://, memory://, plain paths).

Everything that touches storage (data shards, checkpoints, ledgers, compile caches) goes
through here, so S3 endpoint, credentials and retries are set in one place: from the job's
StorageConfig when given; anything it leaves out botocore resolves itself from the standard
AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL_S3 /
AWS_ENDPOINT_URL, AWS_MAX_ATTEMPTS). Credentials are passed to s3fs only, never logged or
written anywhere.

Retries are botocore's, and only botocore's: its ``standard`` retry mode (exponential backoff
with jitter, connection errors, throttling and 5xx responses) with ``StorageConfig.retries``
retries. s3fs's own retry loop around each call is set to a single try so the two do not
multiply. What still fails becomes a StorageError (an OSError) that names the URL: callers
such as the ledger and the checkpointer treat OSError as "storage is unavailable", and
botocore's network errors are no OSError.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
from fsspec import AbstractFileSystem

from infra.urls import join  # noqa: F401 - storage API: callers name places with it

if TYPE_CHECKING:  # the settings name their storage's paths (infra/job_layout.py)
    from infra.settings import StorageConfig


T = TypeVar("T")

_options: dict[str, Any] = {}
S3FS_TRIES = 1  # s3fs's own loop: one try, botocore retries (see the module docstring)


def local_path(url: str) -> str | None:
    """The local filesystem path of a file:// or plain URL, None for remote storage."""
    if "://" not in url:
        return os.path.abspath(url)
    if url.startswith("file://"):
        return os.path.abspath(url[len("file://") :])
    return None


class StorageError(OSError):
    """A storage operation failed after botocore's retries; the message names the URL."""


def configure(config: StorageConfig | None) -> None:
    """Set the S3 options used by every later call in this process (from the job config)."""
    _options.clear()
    if config is None:
        return
    # total_max_attempts counts the first try too.
    retries = {"mode": "standard", "total_max_attempts": config.retries + 1}
    _options["config_kwargs"] = {"retries": retries}
    client_kwargs: dict[str, Any] = {}
    if config.s3_endpoint_url:
        client_kwargs["endpoint_url"] = config.s3_endpoint_url
    if config.s3_region:
        client_kwargs["region_name"] = config.s3_region
    if client_kwargs:
        _options["client_kwargs"] = client_kwargs
    if config.s3_access_key_id and config.s3_secret_access_key:
        _options["key"] = config.s3_access_key_id.get_secret_value()
        _options["secret"] = config.s3_secret_access_key.get_secret_value()


def split(url: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem and the path within it for a URL (a plain path means local disk)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        # No cached listings: checkpoints, markers and ledgers appear while a process watches
        # (a cached listing would hide them, and s3fs answers exists() from it).
        fs = fsspec.filesystem("s3", use_listings_cache=False, **_options)
        fs.retries = S3FS_TRIES
        return fs, url.split("://", 1)[1]
    if protocol == "file":
        path = url.split("://", 1)[1] if "://" in url else url
        return fsspec.filesystem("file"), os.path.abspath(path)
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def _unavailable() -> tuple[type[BaseException], ...]:
    """botocore's network errors: s3fs passes them through untranslated, and they are no
    OSError (a refused or reset connection would escape every handler)."""
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # no S3 support installed
        return ()
    return (BotoConnectionError, HTTPClientError)


def call(what: str, fn: Callable[[], T]) -> T:
    """Run one storage call; a network error that outlived botocore's retries becomes a
    StorageError naming ``what`` (OSErrors, FileNotFoundError included, pass unchanged)."""
    try:
        return fn()
    except _unavailable() as exc:
        tries = _options.get("config_kwargs", {}).get("retries", {}).get("total_max_attempts")
        budget = f"at most {tries} tries" if tries else "botocore's default retries"
        raise StorageError(f"{what}: failed after botocore's retries ({budget}): {exc}") from exc


def exists(url: str) -> bool:
    fs, path = split(url)
    return bool(call(f"stat {url}", lambda: fs.exists(path)))


def read_bytes(url: str) -> bytes:
    fs, path = split(url)
    return call(f"read {url}", lambda: fs.cat_file(path))


def write_synced(path: str, data: bytes, suffix: str) -> str:
    """``data`` in the local file ``{path}.{suffix}`` (its folder made), flushed to disk: a
    file to rename or link into place, so that readers never see half of it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{suffix}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return tmp


def write_bytes(url: str, data: bytes) -> None:
    """Write a whole object; on local disk via a temp file + rename so readers never see
    half a file (S3 PUTs are atomic already)."""
    fs, path = split(url)
    if local_path(url) is not None:
        os.replace(write_synced(path, data, f"tmp-{os.getpid()}"), path)
        return
    call(f"write {url}", lambda: fs.pipe_file(path, data))


def read_text(url: str) -> str:
    return read_bytes(url).decode()


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode())


def listdir(url: str) -> list[str]:
    """Names (not paths) of the entries directly under a URL; empty when it does not exist
    (nor can: a local path under a regular file)."""
    fs, path = split(url)
    try:
        entries = call(f"list {url}", lambda: fs.ls(path, detail=False, refresh=True))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)


def glob(url_pattern: str) -> list[str]:
    """URLs matching a glob pattern, sorted, with the pattern's protocol kept."""
    fs, path = split(url_pattern)
    protocol = url_pattern.split("://", 1)[0] if "://" in url_pattern else ""
    found = sorted(call(f"glob {url_pattern}", lambda: fs.glob(path)))
    if protocol == "":
        return found
    if protocol == "file":
        return [f"file://{p}" for p in found]
    return [f"{protocol}://{p.lstrip('/')}" for p in found]  # memory:// paths start with /


def remove(url: str, recursive: bool = False) -> None:
    fs, path = split(url)
    if fs.exists(path):
        fs.rm(path, recursive=recursive)


def makedirs(url: str) -> None:
    """Create a folder on local disk (object stores have no folders: a no-op there)."""
    path = local_path(url)
    if path is not None:
        os.makedirs(path, exist_ok=True)


def size(url: str) -> int:
    fs, path = split(url)
    return int(call(f"stat {url}", lambda: fs.size(path)))


def open_file(url: str, mode: str = "rb", **kwargs: Any) -> Any:
    """A file object for streaming reads or writes (local dirs are created for writes)."""
    fs, path = split(url)
    if "w" in mode or "a" in mode:
        makedirs(url.rsplit("/", 1)[0])
    return fs.open(path, mode, **kwargs)


def put_file(local: str, url: str, max_concurrency: int = 8) -> None:
    """Upload a local file; to S3 as a parallel multipart upload for large files."""
    fs, path = split(url)
    if local_path(url) is not None:
        makedirs(url.rsplit("/", 1)[0])
        fs.put_file(local, path)
        return
    call(f"upload {url}", lambda: fs.put_file(local, path, max_concurrency=max_concurrency))


def get_file(url: str, local: str) -> None:
    """Download an object to a local file."""
    fs, path = split(url)
    call(f"download {url}", lambda: fs.get_file(path, local))
