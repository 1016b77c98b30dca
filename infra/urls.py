"""URLs as strings, no I/O: joining their parts and telling a local path from a remote one.

Apart from infra/storage.py (which does the I/O and exposes both) so that what only names
places (the job's layout, the settings) needs no filesystem library: the serving model that
publishing bundles carries these files and no fsspec.
"""

from __future__ import annotations

import os


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
