"""What a job's checkpoints cost and how often they came: the blocking per checkpoint, the
interval between them, and how long a commit trailed the step that saved it.

Derived from rank 0's ledger spans beside the partition (infra/accounting/ett.py), never part
of it: the partition already gives checkpoint blocking its bucket.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from infra.accounting.ledger_format import CheckpointTier, Event, Mark, Span


def median_or_none(xs: list[float]) -> float | None:
    """The median, None for no values (a report field the ledger could not give)."""
    return statistics.median(xs) if xs else None


@dataclass(frozen=True)
class CheckpointStats:
    """The checkpoint fields of the ETT report (``EttReport.checkpoint_*``)."""

    blocking_total_s: float
    blocking_mean_s: float | None  # per checkpoint: the save call and its staging wait
    committed: int
    interval_s: float | None
    interval_steps: float | None
    commit_latency_s: float | None
    interval_reason: str | None  # why the checkpointer chose its interval
    memory_copies: int = 0  # in-memory copies written
    memory_blocking_s: float = 0.0  # the loop's blocking for them (``memory_copy_blocking``)
    memory_interval_s: float | None = None  # the in-memory tier's last interval chosen
    # Bytes written per durable commit, by kind (full, delta): (commits, median bytes).
    commit_bytes: dict[str, tuple[int, float]] = field(default_factory=dict)


def commit_bytes(commits: list[Event]) -> dict[str, tuple[int, float]]:
    """(commits, median bytes written) of each kind of commit: full against delta. A commit
    marked without a kind is full (incremental checkpoints off, or an older trainer)."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    for e in commits:
        if "bytes" in e.attrs:
            by_kind[str(e.attrs.get("kind", "full"))].append(float(e.attrs["bytes"]))
    return {kind: (len(xs), statistics.median(xs)) for kind, xs in sorted(by_kind.items())}


def checkpoint_stats(job: list[Event], loop_s: float, interval_s: float | None) -> CheckpointStats:
    """The checkpoint statistics of rank 0's job events; ``interval_s`` overrides the observed
    interval, which falls back to the training loop's time per checkpoint (``loop_s``)."""
    # One checkpoint may block twice (the save call, then the wait for its staging copy
    # before the next step): its spans share attempt and step.
    spans = [e for e in job if e.name == Span.CHECKPOINT_BLOCKING]
    per_ckpt: dict[tuple[int, int | None], list[Event]] = defaultdict(list)
    for e in spans:
        per_ckpt[(e.attempt, e.step)].append(e)
    ckpts = sorted(
        (min(es, key=lambda e: e.start) for es in per_ckpt.values()),
        key=lambda e: (e.attempt, e.start),
    )
    pairs = [(a, b) for a, b in zip(ckpts, ckpts[1:], strict=False) if a.attempt == b.attempt]
    gaps_steps = [float(b.step - a.step) for a, b in pairs if None not in (a.step, b.step)]
    blocking_total = math.fsum(e.duration for e in spans)
    interval = (
        interval_s
        if interval_s is not None
        else median_or_none([b.start - a.start for a, b in pairs])
    )
    if interval is None and ckpts and loop_s > 0:
        interval = loop_s / len(ckpts)
    blocks = {key: max(e.end for e in es) for key, es in per_ckpt.items()}
    commits = [e for e in job if e.name == Mark.CHECKPOINT_COMMITTED]
    latency = [
        e.start - blocks[(e.attempt, e.step)] for e in commits if (e.attempt, e.step) in blocks
    ]
    marks = [e for e in job if e.name == Mark.CHECKPOINT_INTERVAL]
    reasons = [
        e for e in marks if e.attrs.get("tier", CheckpointTier.DURABLE) == CheckpointTier.DURABLE
    ]
    memory = [e for e in marks if e.attrs.get("tier") == CheckpointTier.MEMORY]
    memory_interval = memory[-1].attrs.get("interval_s") if memory else None
    return CheckpointStats(
        blocking_total_s=blocking_total,
        blocking_mean_s=blocking_total / len(ckpts) if ckpts else None,
        committed=len(commits),
        interval_s=interval,
        interval_steps=median_or_none(gaps_steps),
        commit_latency_s=median_or_none(latency),
        interval_reason=str(reasons[-1].attrs.get("reason")) if reasons else None,
        memory_copies=sum(1 for e in job if e.name == Mark.MEMORY_COPY and "seq" in e.attrs),
        memory_blocking_s=math.fsum(e.duration for e in job if e.name == Span.MEMORY_COPY_BLOCKING),
        memory_interval_s=None if memory_interval is None else float(memory_interval),
        commit_bytes=commit_bytes(commits),
    )
