"""Keep the latest k committed checkpoints; clear folders that can never commit.

Never deletes the checkpoint just committed (the newest one this process verified: it
wrote and checksummed every byte), the newest committed one, an anchor (a publisher may
still read it), or a folder newer than the newest commit (that may be the one in flight).
With ``train.eval: async`` the newest ``EVAL_BACKLOG`` checkpoints at eval steps are kept
too: the side evaluator reads them while training goes on, and at the advisor's short
interval the latest k would otherwise roll past an eval step before it is evaluated.
Checkpoints found corrupt are quarantined by restore (manifest.quarantine), so they are not
listed here and never take the place of a usable one among the k. Chains of incremental
checkpoints are kept whole: the base and links a kept delta needs are never deleted
(infra/checkpoint_chain.py), so with deltas more than k folders may remain.
"""

from __future__ import annotations

import logging

from infra import storage
from infra.checkpoint_chain import needed_steps
from infra.checkpoint_manifest import MANIFEST, committed_checkpoints
from infra.job_layout import JobLayout

log = logging.getLogger(__name__)

EVAL_BACKLOG = 3  # eval-step checkpoints kept for the side evaluator (newest first)


def purge_old(
    layout: JobLayout, keep_latest_k: int, keep: str | None = None, eval_every: int = 0
) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep_latest_k`` (anchors, ``keep``
    and, when ``eval_every`` > 0, the newest ``EVAL_BACKLOG`` eval-step ones kept) and
    uncommitted folders older than the newest commit. Returns the deleted URLs."""
    committed = committed_checkpoints(layout)
    if not committed:
        return []
    keep = keep.rstrip("/") if keep else None
    eval_steps = [c.step for c in committed if eval_every > 0 and c.step % eval_every == 0]
    for_eval = set(eval_steps[:EVAL_BACKLOG])
    beyond = [
        c
        for c in committed[max(keep_latest_k, 1) :]
        if not c.manifest.anchor and c.url.rstrip("/") != (keep or "") and c.step not in for_eval
    ]
    # A kept delta restores through its base and every link before it: keep those too.
    kept = [c for c in committed if c not in beyond]
    needed = needed_steps(kept, committed)
    doomed = [c.url for c in beyond if c.step not in needed]
    # Uncommitted folders below this step are debris; above it one may be in flight.
    newest = next((c.step for c in committed if c.url.rstrip("/") == (keep or "")), None)
    newest = committed[0].step if newest is None else newest
    root = layout.checkpoints
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


def purge_uncommitted(layout: JobLayout) -> list[str]:
    """At the start of an attempt nothing is in flight: every folder without a manifest is
    debris of a crashed attempt and would confuse a new save of the same step."""
    root = layout.checkpoints
    doomed = [
        storage.join(root, name)
        for name in storage.listdir(root)
        if name.startswith("step-") and not storage.exists(storage.join(root, name, MANIFEST))
    ]
    for url in doomed:
        storage.remove(url, recursive=True)
    return doomed
