"""Joining the parts of a URL (any protocol), with no I/O and no filesystem library.

Apart from infra/storage.py (which does the I/O and exposes ``join`` to its callers) so that
what only names places (the job's layout, the settings) needs no fsspec: the serving model
that publishing bundles carries these files and no fsspec.
"""

from __future__ import annotations


def join(url: str, *parts: str) -> str:
    """Join URL parts with '/' (works for every protocol, unlike os.path.join)."""
    out = url.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out
