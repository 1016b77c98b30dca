"""The calculator's geometry: the wall time a set of spans covers, the chain of stages that set
an end time, and the sweep that gives each instant to the highest-priority span over it.
"""

from __future__ import annotations

import math

from infra.accounting.ledger_format import Event
from infra.accounting.records import BUCKETS, PRIORITY, Bucket


def union_length(spans: list[tuple[float, float]]) -> float:
    """Wall time covered by at least one of the (start, end) spans."""
    total, reach = 0.0, -math.inf
    for s, e in sorted(spans):
        if e > reach:
            total, reach = total + e - max(s, reach), e
    return total


def critical_path(spans: list[Event]) -> list[Event]:
    """The chain of stages that set the end time, walking back from the stage that ends last.

    A stage's predecessor is, among the stages that began before it, the one still running
    latest before it began (max of min(end, its start)): the one it waited for, or that was
    still busy when it took over. Ties go to the later-starting stage. Stops at the earliest.
    """
    if not spans:
        return []
    cur = max(spans, key=lambda e: (e.end, -e.start))
    path = [cur]
    while earlier := [e for e in spans if e.start < cur.start]:
        cur = max(earlier, key=lambda e, s=cur.start: (min(e.end, s), e.start))
        path.append(cur)
    return path[::-1]


def partition(
    intervals: list[tuple[float, float, str]], t0: float, t1: float
) -> tuple[dict[str, float], list[tuple[float, float, str]]]:
    """Sweep the elementary intervals of [t0, t1]; each goes to its highest-priority cover.

    Returns the per-bucket totals (math.fsum of exact differences, so they sum to t1 - t0)
    and the merged segments (start, end, bucket) relative to t0.
    """
    rank = {b: i for i, b in enumerate(PRIORITY)}
    points: list[tuple[float, int, int]] = []
    for s, e, bucket in intervals:
        s, e = max(s, t0), min(e, t1)
        if e > s:
            points += [(s, 1, rank[bucket]), (e, -1, rank[bucket])]
    points.sort(key=lambda p: p[0])
    counts = [0] * len(PRIORITY)
    parts: dict[str, list[float]] = {b: [] for b in BUCKETS}
    segments: list[tuple[float, float, str]] = []
    prev, i = t0, 0
    while prev < t1:
        t = points[i][0] if i < len(points) else t1
        if t > prev:
            bucket = next((PRIORITY[k] for k, c in enumerate(counts) if c > 0), Bucket.OTHER)
            parts[bucket].append(t - prev)
            a, b = prev - t0, t - t0
            if segments and segments[-1][2] == bucket and segments[-1][1] == a:
                segments[-1] = (segments[-1][0], b, bucket)
            else:
                segments.append((a, b, bucket))
            prev = t
        while i < len(points) and points[i][0] <= prev:
            counts[points[i][2]] += points[i][1]
            i += 1
    return {b: math.fsum(v) for b, v in parts.items()}, segments
