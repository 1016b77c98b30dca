"""Which events of a job with a warm standby are the job's: a standby's time before its
promotion is not, a standby that never took over is none of it (the calculator's spec,
infra/accounting/ett.py, says why), and an attempt that trained always is.
"""

from __future__ import annotations

from infra.accounting.ledger_format import Event, Mark, Span
from infra.accounting.records import StandbyRecord


def split_standby_prewarm(
    events: list[Event],
) -> tuple[list[Event], list[StandbyRecord], list[tuple[Event, bool]]]:
    """A standby's events before its promotion are not the job's; a never-promoted standby's
    are none of the job's (infra/accounting/ett.py's spec), unless it trained. Returns the job's
    events, the promoted standbys (promotion times absolute) and the lost ones (their
    ``standby_lost`` mark, and whether they had parked)."""
    ready = {e.attempt: e.start for e in events if e.name == Mark.STANDBY_READY and e.rank == 0}
    lost = {e.attempt: e for e in events if e.name == Mark.STANDBY_LOST}
    standby = set(ready) | set(lost)
    standby |= {
        e.attempt for e in events if e.name == Mark.ATTEMPT_START and e.attrs.get("standby")
    }
    if not standby:
        return events, [], []
    promoted = {e.attempt: e.start for e in events if e.name == Mark.PROMOTED and e.rank == 0}
    cuts: dict[int, float] = dict(promoted)
    for e in events:  # a number reused by a cold relaunch: the job's part starts there
        cold = e.name == Mark.ATTEMPT_START and not e.attrs.get("standby") and e.rank == 0
        if cold and e.attempt in standby and e.attempt not in promoted:
            cuts[e.attempt] = max(cuts.get(e.attempt, e.start), e.start)
    for e in events:  # it trained: never dropped, whatever its marks say
        if e.name == Span.TRAIN_STEP and e.attempt in standby and e.attempt not in cuts:
            cuts[e.attempt] = e.start - 1e-9
    firsts: dict[int, float] = {}
    for e in events:
        if e.attempt in ready:
            firsts[e.attempt] = min(firsts.get(e.attempt, e.start), e.start)
    kept = [
        e
        for e in events
        if e.attempt not in standby or (e.attempt in cuts and e.end > cuts[e.attempt])
    ]
    records = [
        StandbyRecord(a, ready[a] - firsts[a], promoted[a] - ready[a], promoted[a])
        for a in sorted(promoted)
        if a in ready
    ]
    gone = [(lost[a], a in ready) for a in sorted(lost) if a not in cuts]
    return kept, records, gone
