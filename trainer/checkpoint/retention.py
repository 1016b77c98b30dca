"""Keep the latest k committed checkpoints; clear folders that can never commit.

Never deletes the newest committed checkpoint, an anchor (a publisher may still read it),
or a folder newer than the newest commit (that may be the one in flight).
"""

from __future__ import annotations

import logging

from infra import storage
from trainer.checkpoint.manifest import MANIFEST, checkpoints_url, committed_checkpoints

log = logging.getLogger(__name__)


def purge_old(job_url: str, keep_latest_k: int) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep_latest_k`` (anchors kept) and
    uncommitted folders older than the newest commit. Returns the deleted URLs."""
    committed = committed_checkpoints(job_url)
    if not committed:
        return []
    doomed = [c.url for c in committed[max(keep_latest_k, 1) :] if not c.manifest.anchor]
    newest = committed[0].step
    root = checkpoints_url(job_url)
    for name in storage.listdir(root):
        url = storage.join(root, name)
        if (
            name.startswith("step-")
            and int(name.split("-", 1)[1]) < newest
            and not storage.exists(storage.join(url, MANIFEST))
        ):
            doomed.append(url)
    for url in doomed:
        try:
            # The manifest goes first, so a half-deleted checkpoint is never seen as committed.
            storage.remove(storage.join(url, MANIFEST))
            storage.remove(url, recursive=True)
        except OSError as exc:
            log.warning("could not delete old checkpoint %s: %s", url, exc)
    return doomed


def purge_uncommitted(job_url: str) -> list[str]:
    """At the start of an attempt nothing is in flight: every folder without a manifest is
    debris of a crashed attempt and would confuse a new save of the same step."""
    root = checkpoints_url(job_url)
    doomed = [
        storage.join(root, name)
        for name in storage.listdir(root)
        if name.startswith("step-") and not storage.exists(storage.join(root, name, MANIFEST))
    ]
    for url in doomed:
        storage.remove(url, recursive=True)
    return doomed
