"""The ETT calculator: partitions a job's wall time W into disjoint buckets from its ledger.

W runs from the first rank-0 event to the end of the last one (normally the last attempt's
shutdown); every instant of W goes to exactly one bucket, so the buckets sum to W. Spans
overlap (launcher_init over trainer init, a checkpoint nested in a step), so an instant that
several cover goes to the first in ``PRIORITY`` (a sweep over elementary intervals):

    checkpoint_blocking > eval > effective_training > wasted_training > shutdown
        > unknown > recovery (window) > startup (window) > other

``startup`` is W's start up to the first attempt's first train_step (or its death, if it never
stepped), plus a planned restart (an attempt ended by shutdown without job_end) up to the next
step; ``recovery`` is, per failure, the failed attempt's last event up to the first train_step
of a later attempt; ``other`` is the rest (gaps between steps, ...). A train_step execution is
effective if it is the last execution of its step number (by attempt, then start), else it was
redone later: wasted. Only rank 0 is partitioned: the ranks step together, so rank 0's
spans stand for the job; other ranks feed straggler stats.
ETT% = effective/W, Failure% = (wasted + recovery)/W, Idleness% = 100 - ETT% - Failure%.

Warm standby: a standby attempt initialises and parks while another attempt trains. Its
time before promotion is not the job's: an attempt with a ``standby_ready`` mark counts
from its ``promoted`` mark on (its earlier events are dropped, and reported as pre-warm),
and one never promoted is dropped whole, even one ended before it parked (its
``attempt_start`` mark says ``standby``). Its Time to Recover runs, as for any failure,
from the failed attempt's last event to the promoted attempt's first step.

A standby that dies before it is needed (``standby_lost``, marked by the orchestrator, which
starts another behind it) is listed as lost and is none of the job's time: not startup, not
a failure. An attempt that trained is never dropped: an attempt number that a ledger of an
older version reused for a cold relaunch after its standby died counts from that cold
``attempt_start`` (from its first step when even that is missing).

In-process restart: an ``in_process_restart`` mark is a failure inside a living attempt.
Its recovery window runs from the mark to the attempt's next train_step; the steps redone
after it are wasted as usual (the same step number runs again later in the same attempt).

``unknown`` is time the ledger cannot see: a failed attempt whose rank-0 trainer events were
lost (on object storage a killed process's unsent events, when its spool was never
recovered). Evidence, never a guess from durations: the reader's ``ledger_incomplete`` mark
on its trainer file, or the orchestrator's ``failure`` mark naming a later step than the
attempt's last train_step (or a step while the attempt has none). Its window runs from the
attempt's last event seen (the orchestrator's launcher_init, an inference, aside) to the
failure mark, when the orchestrator saw it dead; that death is the failure's ``died_at``,
so recovery starts there. It outranks the inferred windows (recovery, startup), which would
otherwise claim it, and yields to every observed span; it counts in Idleness%.

Recovery actions: every ``resume`` mark (rank 0) is one restore of training state: a cold
attempt, a promoted standby or an in-process restart, from which checkpoint, and which newer
ones it skipped as corrupt (and quarantined). Steps redone because a fallback went back past
a newer committed checkpoint are counted apart (``fallback_redone_s``, a part of
``wasted_training``): the executions, before that resume, of the steps between the
checkpoint loaded and the newest one skipped.

Times are checked before any of this (infra/accounting/clocks.py, through ``read_ledger``): a time
that disagrees with its process's monotonic clock, or an event outside its process's life,
never stretches W; the report says what was rejected and which clock offsets were
corrected.

The windows, the priority sweep and the report derived from them are one algorithm with one
invariant (the buckets partition W exactly), and this docstring is its spec. Beside it:
which events are the job's when a standby ran (infra/accounting/standby.py), the sweep
itself (partition.py), and the checkpoint statistics (checkpoint_stats.py).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import replace
from typing import Any

from infra.accounting.checkpoint_stats import checkpoint_stats, median_or_none
from infra.accounting.clocks import ClockCheck
from infra.accounting.ledger_format import (
    INIT_SPANS,
    PUBLISH_SPANS,
    CheckpointTier,
    Event,
    Mark,
    ResumeHow,
    Span,
)
from infra.accounting.ledger_read import read_ledger
from infra.accounting.partition import critical_path, partition, union_length
from infra.accounting.records import (
    FAILURE_BUCKETS,
    AttemptSummary,
    Bucket,
    EttReport,
    FailureRecord,
    InitBreakdown,
    LostStandby,
    ResizeRecord,
    ResumeRecord,
    StandbyRecord,
    short_reason,
)
from infra.accounting.standby import split_standby_prewarm
from infra.exit_codes import Outcome
from infra.job_layout import JobLayout

# Stages whose overlap decides how long an attempt takes to reach its first step.
STARTUP_STAGES = (Span.SCHEDULING, Span.LAUNCHER_INIT, *INIT_SPANS)
# Spans that are a bucket of their own, wherever they lie.
SPAN_BUCKETS = {
    Span.CHECKPOINT_BLOCKING: Bucket.CHECKPOINT_BLOCKING,
    Span.MEMORY_COPY_BLOCKING: Bucket.CHECKPOINT_BLOCKING,
    Span.EVAL: Bucket.EVAL,
    Span.SHUTDOWN: Bucket.SHUTDOWN,
}
# Work beside the job, not part of its wall time: publishing, the side evaluator.
OFF_JOB_SPANS = frozenset((*PUBLISH_SPANS, Span.ASYNC_EVAL))


def report_for_job(layout: JobLayout, interval_s: float | None = None) -> EttReport:
    """Read a job's ledger (every attempt, rank and role) and compute its report."""
    read = read_ledger(layout)
    return compute_report(read.events, interval_s=interval_s, clock=read.clock)


def _init_breakdown(attempt: int, evs: list[Event], first_step_t: float | None) -> InitBreakdown:
    stages = [
        e
        for e in evs
        if e.kind == "span"
        and e.name in STARTUP_STAGES
        and (first_step_t is None or e.start < first_step_t)
    ]
    durations: dict[str, float] = defaultdict(float)
    for e in stages:
        durations[e.name] += e.duration
    path = critical_path(stages)
    return InitBreakdown(
        attempt=attempt,
        stages=dict(durations),
        sum_s=math.fsum(durations.values()),
        union_s=union_length([(e.start, e.end) for e in stages]),
        wall_s=None if first_step_t is None else first_step_t - min(e.start for e in evs),
        critical_path=tuple(e.name for e in path),
        critical_path_s=union_length([(e.start, e.end) for e in path]),
    )


def _attempts(
    order: list[int], by_attempt: dict[int, list[Event]], steps: list[Event], t0: float
) -> tuple[list[AttemptSummary], list[tuple[float, int, Event | None]], list[tuple[float, int]]]:
    """Classify attempts; return them, the failed ones (last event time, attempt, first failure
    mark) and the clean non-final ends (planned restarts)."""
    attempts, died, restarts = [], [], []
    for a in order:
        marks = sorted((e for e in by_attempt[a] if e.name == Mark.FAILURE), key=lambda e: e.start)
        own = [e for e in by_attempt[a] if e.name != Mark.FAILURE] or by_attempt[a]
        names = {e.name for e in own}
        nums = [e.step for e in steps if e.attempt == a and e.step is not None]
        if marks or (a != order[-1] and not names & {Mark.JOB_END, Span.SHUTDOWN}):
            cause = marks[0].attrs.get("cause") if marks else None
            outcome = Outcome(cause) if cause in set(Outcome) else Outcome.UNOBSERVED
        elif Mark.JOB_END in names:
            outcome = Outcome.SUCCESS
        else:
            outcome = Outcome.STOPPED if Span.SHUTDOWN in names else Outcome.UNFINISHED
        end = max(e.end for e in own)
        start = min(e.start for e in by_attempt[a])
        sized = [e for e in by_attempt[a] if e.name == Mark.MODEL_FLOPS]
        ranks = int(sized[0].attrs.get("world_size", 1)) if sized else None
        first, last = min(nums, default=None), max(nums, default=None)
        attempts.append(AttemptSummary(a, start - t0, end - t0, outcome, first, last, ranks))
        if outcome.failed:
            died.append((end, a, marks[0] if marks else None))
        elif outcome == Outcome.STOPPED and a != order[-1]:
            restarts.append((end, a))
    return attempts, sorted(died, key=lambda d: d[0]), restarts


def _unseen(
    died: list[tuple[float, int, Event | None]], by_attempt: dict[int, list[Event]]
) -> tuple[list[tuple[float, int, Event | None]], list[tuple[float, float, str]]]:
    """Failed attempts whose rank-0 trainer events were lost (module docstring): their
    ``unknown`` windows, and ``died`` with each such death moved to its failure mark."""
    out, windows = [], []
    for t_died, a, mark in died:
        evs = by_attempt[a]
        steps = [e.step for e in evs if e.name == Span.TRAIN_STEP and e.step is not None]
        lost = any(
            e.name == Mark.LEDGER_INCOMPLETE and e.attrs.get("role") == "trainer" for e in evs
        ) or (mark is not None and mark.step is not None and mark.step > max(steps, default=-1))
        if mark is None or not lost:
            out.append((t_died, a, mark))
            continue
        seen = [e.start for e in evs if e.name == Span.LAUNCHER_INIT]
        seen += [e.end for e in evs if e.name not in (Span.LAUNCHER_INIT, Mark.FAILURE)]
        seen_until = max(seen, default=t_died)
        if mark.start > seen_until:
            windows.append((seen_until, mark.start, Bucket.UNKNOWN))
        out.append((max(t_died, mark.start), a, mark))
    return sorted(out, key=lambda d: d[0]), windows


def _minus_unseen(
    failures: list[FailureRecord],
    windows: list[tuple[float, float, str]],
    unseen: list[tuple[float, float, str]],
) -> list[FailureRecord]:
    """Time to Recover without the unknown windows inside a recovery window (a later attempt
    ran unseen there): that time is nobody's recovery."""
    out = []
    for f, (s, e, _) in zip(failures, windows, strict=True):
        hidden = math.fsum(max(0.0, min(e, ue) - max(s, us)) for us, ue, _ in unseen)
        out.append(replace(f, time_to_recover_s=f.time_to_recover_s - hidden) if hidden else f)
    return out


def _failures(
    died: list[tuple[float, int, Event | None]],
    attempts: list[AttemptSummary],
    steps: list[Event],
    t0: float,
    t1: float,
) -> tuple[list[FailureRecord], list[tuple[float, float, str]]]:
    """Per failure: its disjoint recovery window (see FailureRecord) and what the mark says."""
    last_step = {s.attempt: s.last_step for s in attempts}
    out, windows = [], []
    for i, (t_died, a, mark) in enumerate(died):
        resumed = min((e.start for e in steps if e.attempt > a and e.start >= t_died), default=None)
        end = t1 if resumed is None else resumed
        if i + 1 < len(died):
            end = min(end, died[i + 1][0])
        windows.append((t_died, end, Bucket.RECOVERY))
        attrs = mark.attrs if mark else {}
        step = mark.step if mark and mark.step is not None else attrs.get("step")
        known = [s for s in (step, last_step[a]) if s is not None]  # the ledger may know more
        out.append(
            FailureRecord(
                attempt=a,
                cause=str(attrs.get("cause", Outcome.UNOBSERVED)),
                last_step=max(known) if known else None,
                died_at=t_died - t0,
                detected_at=None if mark is None else mark.start - t0,
                resumed_at=None if resumed is None or end != resumed else resumed - t0,
                time_to_recover_s=end - t_died,
            )
        )
    return out, windows


def _resumes(job: list[Event], t0: float) -> list[ResumeRecord]:
    """Every restore of training state by rank 0, with what it skipped on the way."""
    out = []
    for e in sorted((e for e in job if e.name == Mark.RESUME), key=lambda e: e.start):
        how = e.attrs.get("how")  # older ledgers say only ``in_process``
        if how not in set(ResumeHow):
            how = ResumeHow.IN_PROCESS if e.attrs.get("in_process") else ResumeHow.COLD
        skipped = tuple(
            (int(s["step"]), short_reason(str(s.get("reason", ""))), bool(s.get("quarantined")))
            for s in e.attrs.get("skipped") or ()
        )
        newest = e.attrs.get("newest_step")
        tier = e.attrs.get("tier")
        out.append(
            ResumeRecord(
                attempt=e.attempt,
                at=e.start - t0,
                step=int(e.step or 0),
                how=ResumeHow(how),
                url=str(e.attrs.get("url", "")),
                newest_step=None if newest is None else int(newest),
                skipped=skipped,
                tier=CheckpointTier(tier)
                if tier in set(CheckpointTier)
                else CheckpointTier.DURABLE,
            )
        )
    return out


def _resizes(job: list[Event], t0: float) -> list[ResizeRecord]:
    """Every resume on another number of ranks than the checkpoint's writers (rank 0's)."""
    return [
        ResizeRecord(
            attempt=e.attempt,
            at=e.start - t0,
            step=int(e.step or 0),
            from_ranks=int(e.attrs.get("from_ranks", 0)),
            to_ranks=int(e.attrs.get("to_ranks", 0)),
        )
        for e in sorted((e for e in job if e.name == Mark.RESIZE), key=lambda e: e.start)
    ]


def _fallback_redone(resumes: list[ResumeRecord], wasted: list[Event], t0: float) -> float:
    """Redone because a fallback went back past a newer commit: the executions, before the
    resume, of the steps after the checkpoint loaded up to the newest one skipped."""
    total = []
    counted: set[int] = set()
    for r in resumes:
        if not r.skipped:
            continue
        newest = max(step for step, _, _ in r.skipped)
        for e in wasted:
            if id(e) in counted or e.step is None or e.start - t0 >= r.at:
                continue
            if r.step < e.step <= newest:
                counted.add(id(e))
                total.append(e.duration)
    return math.fsum(total)


def _redone_by_tier(
    resumes: list[ResumeRecord], wasted: list[Event], t0: float
) -> dict[str, float]:
    """Each redone step execution, by the tier of the first restore after it that went back
    past its step: how much work each tier's restores cost."""
    out: dict[str, float] = defaultdict(float)
    for e in wasted:
        if e.step is None:
            continue
        later = [r for r in resumes if r.at >= e.start - t0 and r.step < e.step]
        if later:
            out[str(min(later, key=lambda r: r.at).tier)] += e.duration
    return dict(out)


def _in_process_failures(
    job: list[Event], steps: list[Event], t0: float
) -> tuple[list[FailureRecord], list[tuple[float, float, str]]]:
    """Failures recovered inside a living attempt: mark -> that attempt's next step."""
    out, windows = [], []
    for mark in sorted(
        (e for e in job if e.name == Mark.IN_PROCESS_RESTART), key=lambda e: e.start
    ):
        later = [e.start for e in steps if e.attempt == mark.attempt and e.start >= mark.start]
        resumed = min(later, default=None)
        end = resumed if resumed is not None else mark.start
        windows.append((mark.start, end, Bucket.RECOVERY))
        out.append(
            FailureRecord(
                attempt=mark.attempt,
                cause=str(Outcome.CRASH),
                last_step=mark.step,
                died_at=mark.start - t0,
                detected_at=mark.start - t0,
                resumed_at=None if resumed is None else resumed - t0,
                time_to_recover_s=end - mark.start,
                in_process=True,
            )
        )
    return out, windows


def compute_report(
    events: list[Event], interval_s: float | None = None, clock: ClockCheck | None = None
) -> EttReport:
    """Partition W and derive the L1 metrics; ``interval_s`` overrides the observed interval,
    ``clock`` is what the reader's clock checks found (infra/accounting/clocks.py)."""
    events, standbys, lost = split_standby_prewarm(events)
    job = [e for e in events if e.rank == 0 and e.name not in OFF_JOB_SPANS]
    if not job:
        raise ValueError("no rank-0 events in the ledger: nothing to account for")
    t0, t1 = min(e.start for e in job), max(e.end for e in job)
    by_attempt: dict[int, list[Event]] = defaultdict(list)
    for e in job:
        by_attempt[e.attempt].append(e)
    order = sorted(by_attempt)
    steps = sorted(
        (e for e in job if e.name == Span.TRAIN_STEP), key=lambda e: (e.attempt, e.start)
    )
    first_step: dict[int, float] = {}
    last_end: dict[int, float] = {}
    for e in steps:
        first_step.setdefault(e.attempt, e.start)
        last_end[e.attempt] = max(last_end.get(e.attempt, e.end), e.end)
    attempts, died, restarts = _attempts(order, by_attempt, steps, t0)
    died, unseen = _unseen(died, by_attempt)
    failures, windows = _failures(died, attempts, steps, t0, t1)
    failures = _minus_unseen(failures, windows, unseen)
    windows += unseen
    in_process, in_process_windows = _in_process_failures(job, steps, t0)
    failures = sorted(failures + in_process, key=lambda f: f.died_at)
    windows += in_process_windows

    # -- windows, then spans: effective vs wasted steps, then the sweep --------------------
    for t_end, a in restarts:
        resumed = min((e.start for e in steps if e.attempt > a and e.start >= t_end), default=t1)
        windows.append((t_end, resumed, Bucket.STARTUP))
    first = first_step.get(order[0], min((e.start for e in steps), default=None))
    windows.append(
        (t0, min([first if first is not None else t1] + [d[0] for d in died]), Bucket.STARTUP)
    )
    last_exec: dict[Any, Event] = {}
    for e in steps:  # ordered by (attempt, start): the last one seen wins
        last_exec[e.step if e.step is not None else id(e)] = e
    kept = {id(e) for e in last_exec.values()}
    spans = [
        (e.start, e.end, Bucket.EFFECTIVE_TRAINING if id(e) in kept else Bucket.WASTED_TRAINING)
        for e in steps
    ]
    spans += [(e.start, e.end, SPAN_BUCKETS[e.name]) for e in job if e.name in SPAN_BUCKETS]
    buckets, segments = partition(spans + windows, t0, t1)
    wall = t1 - t0
    ett = 100.0 * buckets[Bucket.EFFECTIVE_TRAINING] / wall if wall > 0 else 0.0
    fail = 100.0 * math.fsum(buckets[b] for b in FAILURE_BUCKETS) / wall if wall > 0 else 0.0

    # -- L1 and checkpoint metrics --------------------------------------------------------
    resumes = _resumes(job, t0)
    wasted = [e for e in steps if id(e) not in kept]
    durations = [e.duration for e in steps]
    med = median_or_none(durations)
    loop = math.fsum(last_end[a] - first_step[a] for a in first_step)
    ckpt = checkpoint_stats(job, loop, interval_s)
    per_rank: dict[int, list[float]] = defaultdict(list)
    for e in events:
        if e.name == Span.TRAIN_STEP:
            per_rank[e.rank].append(e.duration)
    return EttReport(
        start_time=t0,
        wall_s=wall,
        buckets=buckets,
        ett_pct=ett,
        failure_pct=fail,
        idleness_pct=100.0 - ett - fail,
        time_to_start_s=None if first is None else first - t0,
        num_failures=len(failures),
        failures=tuple(failures),
        time_to_recover_total_s=math.fsum(f.time_to_recover_s for f in failures),
        observed_unsaved_s=math.fsum(e.duration for e in steps if id(e) not in kept),
        train_loop_s=loop,
        num_steps=len(last_exec),
        num_step_executions=len(steps),
        step_time_median_s=med,
        step_time_mad_s=None if med is None else median_or_none([abs(d - med) for d in durations]),
        checkpoint_blocking_total_s=ckpt.blocking_total_s,
        checkpoint_blocking_mean_s=ckpt.blocking_mean_s,
        num_checkpoints_committed=ckpt.committed,
        checkpoint_interval_s=ckpt.interval_s,
        checkpoint_interval_steps=ckpt.interval_steps,
        commit_latency_s=ckpt.commit_latency_s,
        predicted_unsaved_s=(
            None if ckpt.interval_s is None else len(failures) * ckpt.interval_s / 2
        ),
        predicted_blocking_s=(
            None
            if not ckpt.interval_s or ckpt.blocking_mean_s is None
            else loop / ckpt.interval_s * ckpt.blocking_mean_s
        ),
        attempts=tuple(attempts),
        init=tuple(_init_breakdown(a, by_attempt[a], first_step.get(a)) for a in order),
        rank_step_median_s={r: statistics.median(v) for r, v in sorted(per_rank.items())},
        finished=any(a.outcome == Outcome.SUCCESS for a in attempts),
        segments=tuple(segments),
        standbys=tuple(
            StandbyRecord(r.attempt, r.prewarm_s, r.parked_s, r.promoted_at - t0) for r in standbys
        ),
        checkpoint_interval_reason=ckpt.interval_reason,
        lost_standbys=tuple(
            LostStandby(m.attempt, m.start - t0, parked, str(m.attrs.get("cause", "unknown")))
            for m, parked in lost
        ),
        resumes=tuple(resumes),
        resizes=tuple(_resizes(job, t0)),
        fallback_redone_s=_fallback_redone(resumes, wasted, t0),
        redone_by_tier=_redone_by_tier(resumes, wasted, t0),
        memory_copies=ckpt.memory_copies,
        commit_bytes=ckpt.commit_bytes,
        memory_blocking_total_s=ckpt.memory_blocking_s,
        memory_interval_s=ckpt.memory_interval_s,
        clock=clock or ClockCheck(),
    )
