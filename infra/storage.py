"""One way to read and write any fsspec URL (file://, s3://, memory://, plain paths).

Everything that touches storage (data shards, checkpoints, ledgers, compile caches) goes
through here, so S3 endpoint and credentials are resolved in one place: from the job's
StorageConfig when given, otherwise from the standard AWS environment
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3).
Credentials are passed to s3fs only, never logged or written anywhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from fsspec import AbstractFileSystem

from infra.settings import StorageConfig

T = TypeVar("T")

_options: dict[str, Any] = {}
_retry: dict[str, Any] = {}  # with_retries' budget from StorageConfig (retries, backoff_s)


class StorageError(OSError):
    """A storage operation failed after all retries; the message names the URL."""


def configure(config: StorageConfig | None) -> None:
    """Set the S3 options used by every later call in this process (from the job config)."""
    _options.clear()
    _retry.clear()
    if config is None:
        return
    _retry.update(retries=config.retries, backoff_s=config.retry_backoff_s)
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


def _s3_options() -> dict[str, Any]:
    # No cached listings: checkpoints, markers and ledgers appear while a process watches
    # (a cached listing would hide them, and s3fs answers exists() from it).
    opts = {"use_listings_cache": False, **_options}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "client_kwargs" not in opts:
        opts["client_kwargs"] = {"endpoint_url": endpoint}
    return opts


def split(url: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem and the path within it for a URL (a plain path means local disk)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        fs = fsspec.filesystem("s3", **_s3_options())
        return fs, url.split("://", 1)[1]
    if protocol == "file":
        path = url.split("://", 1)[1] if "://" in url else url
        return fsspec.filesystem("file"), os.path.abspath(path)
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def join(url: str, *parts: str) -> str:
    """Join URL parts with '/' (works for every protocol, unlike os.path.join)."""
    out = url.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def local_path(url: str) -> str | None:
    """The local filesystem path of a file:// or plain URL, None for remote storage."""
    if "://" not in url:
        return os.path.abspath(url)
    if url.startswith("file://"):
        return os.path.abspath(url[len("file://") :])
    return None


def _transient_errors() -> tuple[type[BaseException], ...]:
    """OSError and botocore's network errors (s3fs passes those through untranslated, and
    they are no OSError: a refused or reset connection would escape every handler)."""
    errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # no S3 support installed
        return errors
    return (*errors, BotoConnectionError, HTTPClientError)


def with_retries(
    what: str, fn: Callable[[], T], retries: int | None = None, backoff_s: float | None = None
) -> T:
    """Run a storage call, retrying transient errors with exponential backoff.

    ``retries`` and ``backoff_s`` default to the job's StorageConfig (``configure``), else
    4 and 0.5 s. A missing file is not transient and is raised at once; anything still
    failing after ``retries`` retries becomes a StorageError naming ``what``.
    """
    retries = _retry.get("retries", 4) if retries is None else retries
    backoff_s = _retry.get("backoff_s", 0.5) if backoff_s is None else backoff_s
    transient = _transient_errors()
    for attempt in range(retries + 1):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except transient as exc:
            if attempt == retries:
                raise StorageError(f"{what}: failed after {retries + 1} tries: {exc}") from exc
            time.sleep(backoff_s * (2**attempt))
    raise AssertionError("unreachable")


def exists(url: str) -> bool:
    fs, path = split(url)
    return bool(with_retries(f"stat {url}", lambda: fs.exists(path)))


def read_bytes(url: str) -> bytes:
    fs, path = split(url)
    return with_retries(f"read {url}", lambda: fs.cat_file(path))


def write_bytes(url: str, data: bytes) -> None:
    """Write a whole object; on local disk via a temp file + rename so readers never see
    half a file (S3 PUTs are atomic already)."""
    fs, path = split(url)
    if local_path(url) is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return
    with_retries(f"write {url}", lambda: fs.pipe_file(path, data))


def read_text(url: str) -> str:
    return read_bytes(url).decode()


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode())


def listdir(url: str) -> list[str]:
    """Names (not paths) of the entries directly under a URL; empty when it does not exist."""
    fs, path = split(url)
    try:
        entries = with_retries(f"list {url}", lambda: fs.ls(path, detail=False, refresh=True))
    except FileNotFoundError:
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)


def glob(url_pattern: str) -> list[str]:
    """URLs matching a glob pattern, sorted, with the pattern's protocol kept."""
    fs, path = split(url_pattern)
    protocol = url_pattern.split("://", 1)[0] if "://" in url_pattern else ""
    found = sorted(with_retries(f"glob {url_pattern}", lambda: fs.glob(path)))
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
    return int(with_retries(f"stat {url}", lambda: fs.size(path)))


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
    with_retries(f"upload {url}", lambda: fs.put_file(local, path, max_concurrency=max_concurrency))


def get_file(url: str, local: str) -> None:
    """Download an object to a local file."""
    fs, path = split(url)
    with_retries(f"download {url}", lambda: fs.get_file(path, local))
