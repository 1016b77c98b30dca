"""Which ledger times to believe: every process's clock checked against itself and its host.

A ledger line's times are Unix seconds from the writing process's wall clock, so lines of
different processes and hosts can be compared. A wall clock can lie: a digit flipped on
disk, a clock stepped by NTP mid-job, a host whose clock runs ahead. The report must never
take such a time as truth (one bad ``end`` would stretch the job's wall time to years), so
every writer also records its monotonic clock, and the reader checks what it reads before
the ETT calculator sees anything. The rules, in order:

1. **A process's times come from its monotonic clock.** Each ledger file starts with a
   ``clock`` line naming its process (host, boot, pid); every line carries the monotonic
   reading of each of its times (``mono``). The process's offset is the median of
   wall - monotonic over its lines, and each time is taken as monotonic + offset, so
   durations within a process are monotonic durations.
2. **A time must fit where it was written.** A file is written in order, and no line can
   hold a time later than the lines written after it: a time more than ``TOLERANCE_S``
   after the median end of the next ``NEIGHBOURS`` lines is in the future. Nor can a line
   start more than ``LOOKBACK_S`` before its process opened the file (``scheduling``, the
   flow run's wait before the process existed, excepted).
3. **Two readings, one vote each.** A wall reading more than ``TOLERANCE_S`` from monotonic +
   offset is rejected and the monotonic time taken (``ClockCheck.retimed``); a monotonic
   time that does not fit (rule 2) falls back to a wall reading that does. An event with no
   reading that fits is dropped (``ClockCheck.rejected``). The report names the first few.
4. **One host, one clock.** Processes on one host (and boot) share their monotonic clock,
   so their offsets must agree; where they do not, the wall clock was stepped between
   them (or one was faulted). All of a host's processes are timed with the offset of its
   most recent process (``ClockOffset``, said in the report above ``REPORT_OFFSET_S``).
5. **Hosts are aligned by what was measured between them.** A ``clock`` line may carry
   ``measured_offset``: its host's offset to a reference clock domain, measured at
   rendezvous (``infra/clock_sync.py``; its format, its variable ``ETT_CLOCK_OFFSET`` and
   the choice in ``infra/accounting/host_offsets.py``). The host's events are moved onto
   the reference's clock by it (and by what moves the reference). One per host: of its
   processes' samples, re-expressed on its one clock (rule 4), the one with the smallest
   error. Else a ``clock`` line may carry ``ahead``: for another host, how far its clock
   was at least ahead of this process's (the orchestrator measures it when it resumes a
   job whose ledger ends in its future: that host's last event cannot have happened after
   this process started). That host's events are moved back by the bound. A measured
   offset wins over a bound; a bound still moves a host without one. The report says each
   correction above ``REPORT_OFFSET_S``, and a measured one whose error is over
   ``UNSURE_ERROR_S`` however small (applied all the same). Hosts without any measurement
   keep their times, and the report names them.
6. **Ledgers without monotonic readings** (written by older versions, no ``clock`` line):
   rule 2 with ``LEGACY_TOLERANCE_S`` both ways around the neighbouring lines' median.
   Lines written with a test's own clock (a ``clock`` line without ``mono``) are taken as
   written.

Hand-built event lists (no source file) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from infra.accounting import host_offsets
from infra.accounting.ledger_format import Span

TOLERANCE_S = 1.0  # wall vs monotonic + offset, or a time vs the lines written after it
LOOKBACK_S = 600.0  # how long before its file was opened a line may start (launcher_init:
# the launch that the orchestrator's file records once it watches it)
REPORT_OFFSET_S = 0.5  # an offset between processes or hosts larger than this is reported
UNSURE_ERROR_S = 1.0  # a measured offset with a larger error is reported, however small
LEGACY_TOLERANCE_S = 3600.0  # ledgers without monotonic readings (their wall clock may
# have been stepped mid-file, so only a gross outlier is taken as corrupt)
NEIGHBOURS = 5  # later (and, for legacy files, earlier) lines a line is compared with
EXAMPLES = 3  # rejected lines named in the report

# Fault injection for tests and demos: this process's wall clock runs this many seconds
# ahead, and it says it runs on this host (its own clock domain).
ENV_SHIFT = "ETT_FAULT_CLOCK_SHIFT_S"
ENV_HOST = "ETT_FAULT_HOST_ID"


def _shift() -> float:
    try:
        return float(os.environ.get(ENV_SHIFT, "0") or 0)
    except ValueError:
        return 0.0


_SHIFT = _shift()


def wall() -> float:
    """This process's wall clock: the clock every time written to a ledger is read from
    (``time.time()``, plus the injected shift of ``ETT_FAULT_CLOCK_SHIFT_S``)."""
    return time.time() + _SHIFT


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def identity() -> dict[str, Any]:
    """What a ledger's ``clock`` line says about its process: its host and boot (the
    processes that share a monotonic clock) and its pid."""
    host = os.environ.get(ENV_HOST)
    if host:
        return {"host": host, "boot": "", "pid": os.getpid()}
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": os.getpid()}


def domain_of(attrs: dict[str, Any]) -> str:
    """The clock domain (processes sharing one monotonic clock) of a ``clock`` line."""
    return f"{attrs.get('host', '')}/{attrs.get('boot', '')}"


def label(domain: str) -> str:
    """A domain as a reader names it: ``node-1`` (``node-1, boot 3f2a9c1e`` when the same
    host appears with another boot)."""
    host, _, boot = domain.partition("/")
    return f"{host}, boot {boot[:8]}" if boot else host


class Timed(Protocol):
    """What the checks need of a ledger event (infra/accounting/ledger.py's Event)."""

    @property
    def name(self) -> str: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def step(self) -> int | None: ...
    @property
    def mono(self) -> tuple[float, float] | None: ...
    @property
    def source(self) -> str: ...
    @property
    def seq(self) -> int: ...


E = TypeVar("E", bound=Timed)


@dataclass(frozen=True)
class ProcessClock:
    """A ledger file's ``clock`` lines: its process, and what it measured of other hosts."""

    source: str
    domain: str
    monotonic: bool  # its lines carry monotonic readings
    ahead: dict[str, float] = field(default_factory=dict)  # domain -> at least this far ahead
    measured: host_offsets.ClockSample | None = None  # its host's, to a reference (rule 5)
    opened: tuple[float, float] | None = None  # (wall, monotonic) when the file was opened


@dataclass(frozen=True)
class ClockOffset:
    """A correction applied: ``what`` (a ledger file or a host) was ``offset_s`` ahead of
    the job's reference clock and was moved back by it."""

    what: str
    offset_s: float
    how: str
    error_s: float = 0.0  # of a measured offset


@dataclass(frozen=True)
class ClockCheck:
    """What the checks found: times rejected, events dropped, offsets corrected."""

    retimed: int = 0  # wall readings rejected, the time taken from the monotonic clock
    rejected: int = 0  # events dropped: no reading of theirs was plausible
    examples: tuple[str, ...] = ()
    offsets: tuple[ClockOffset, ...] = ()
    unaligned: tuple[str, ...] = ()  # hosts with no measurement to the reference

    @property
    def clean(self) -> bool:
        return not self.notes()

    def notes(self) -> list[str]:
        """One line per finding worth a reader's attention (empty when all agreed)."""
        out = []
        if self.retimed:
            out.append(
                f"{self.retimed} event time(s) rejected: one of its two clock readings did not "
                "fit its process; timed by the other"
            )
        if self.rejected:
            out.append(f"{self.rejected} event(s) dropped: no reading of theirs fits its process")
        out += [f"  {example}" for example in self.examples]
        for o in self.offsets:
            if abs(o.offset_s) > REPORT_OFFSET_S or o.error_s > UNSURE_ERROR_S:
                side = "ahead of" if o.offset_s > 0 else "behind"
                line = f"clock offset: {o.what} ran {abs(o.offset_s):.1f} s {side} {o.how}"
                if o.error_s > UNSURE_ERROR_S:
                    line += f", +-{o.error_s:.1f} s: it may be off by as much"
                out.append(line)
        out += [
            f"clock offset: host {label(h)} has no measured offset: its times are taken as written"
            for h in self.unaligned
        ]
        return out


@dataclass
class _Source:
    """One file's events while they are being checked."""

    clock: ProcessClock | None
    events: list[Any]
    offset: float | None = None  # wall - monotonic, the median
    latest_mono: float = -math.inf


def _describe(e: Timed, why: str) -> str:
    step = "" if e.step is None else f" step {e.step}"
    return f"{e.source} line {e.seq + 1} ({e.name}{step}): {why}"


def _readings(e: Timed) -> list[tuple[float, float | None]]:
    """(wall, monotonic) of each time of an event: one for a mark, start and end for a span."""
    mono = e.mono
    if e.start == e.end and (mono is None or mono[0] == mono[1]):
        return [(e.start, None if mono is None else mono[0])]
    return [
        (e.start, None if mono is None else mono[0]),
        (e.end, None if mono is None else mono[1]),
    ]


class _Checker:
    """Rules 1-3 and 6 for one file at a time; counts what it rejects."""

    def __init__(self) -> None:
        self.retimed = 0
        self.rejected = 0
        self.examples: list[str] = []

    def _note(self, e: Timed, why: str, dropped: bool) -> None:
        if dropped:
            self.rejected += 1
        else:
            self.retimed += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(_describe(e, why))

    def check(self, src: _Source) -> list[Any]:
        """The file's events, each timed by its best reading (module docstring)."""
        ordered = sorted(src.events, key=lambda e: e.seq)
        legacy = src.clock is None
        pairs = [(w, m) for e in ordered for w, m in _readings(e) if m is not None]
        offset = statistics.median(w - m for w, m in pairs) if pairs else None
        if src.clock is not None and offset is None:
            return src.events  # a test's own clock: its timeline is the test's
        src.offset = offset
        if pairs:
            src.latest_mono = max(m for _, m in pairs)

        def chosen(w: float, m: float | None) -> tuple[float, float | None]:
            """(the monotonic time, the wall reading when it disagrees; else None)."""
            if m is None or offset is None:
                return w, None
            t = m + offset
            return t, (w if abs(w - t) > TOLERANCE_S else None)

        # The time each line ends by its best single reading, for its neighbours' bounds.
        ends = [chosen(*_readings(e)[-1])[0] for e in ordered]
        opened = None
        if src.clock is not None and src.clock.opened is not None:
            opened = chosen(*src.clock.opened)[0]
        tol = LEGACY_TOLERANCE_S if legacy else TOLERANCE_S
        out = []
        for i, e in enumerate(ordered):
            later = ends[i + 1 : i + 1 + NEIGHBOURS]
            hi = statistics.median(later) + tol if later else math.inf
            lo = -math.inf
            if e.name != Span.SCHEDULING:
                if opened is not None:
                    lo = opened - LOOKBACK_S
                elif legacy and (earlier := ends[max(0, i - NEIGHBOURS) : i]):
                    lo = statistics.median(earlier) - tol

            def fits(t: float, lo: float = lo, hi: float = hi) -> bool:
                return lo <= t <= hi

            times, why = [], ""
            for w, m in _readings(e):
                t, bad_wall = chosen(w, m)
                if fits(t) and bad_wall is None:
                    times.append(t)
                elif fits(t):
                    times.append(t)
                    why = (
                        why or f"wall time {bad_wall - t:+.3g} s off its process's monotonic clock"
                    )
                elif bad_wall is not None and fits(bad_wall):
                    times.append(bad_wall)
                    why = why or "monotonic reading does not fit where it was written"
                else:
                    where = "after the lines written after it" if t > hi else "before its process"
                    times = []
                    why = f"{t - (hi if t > hi else lo):+.3g} s {where}"
                    break
            if not times or times[-1] < times[0]:
                self._note(e, why or "ends before it starts", dropped=True)
                continue
            if why:
                self._note(e, why, dropped=False)
            out.append(replace(e, start=times[0], end=times[-1]))
        return out


def align(events: Sequence[E], clocks: dict[str, ProcessClock]) -> tuple[list[E], ClockCheck]:
    """Check and correct every event's times (the module docstring's rules); returns the
    events kept, on one clock, and what was found. ``clocks``: each ledger file's
    ``clock`` lines, by file name (``Event.source``)."""
    checker = _Checker()
    sources: dict[str, _Source] = {}
    loose: list[E] = []
    for e in events:
        if not e.source:
            loose.append(e)
            continue
        src = sources.setdefault(e.source, _Source(clocks.get(e.source), []))
        src.events.append(e)
    for src in sources.values():
        src.events = checker.check(src)

    # Rule 4: one offset per host, its most recent process's.
    offsets: list[ClockOffset] = []
    by_domain: dict[str, list[_Source]] = defaultdict(list)
    for src in sources.values():
        if src.clock is not None and src.offset is not None:
            by_domain[src.clock.domain].append(src)
    shifts: dict[int, float] = {}
    for domain, members in sorted(by_domain.items()):
        newest = max(members, key=lambda s: s.latest_mono)
        assert newest.offset is not None
        off: dict[float, list[str]] = defaultdict(list)  # one line per offset, not per file
        for src in members:
            assert src.offset is not None
            shifts[id(src)] = shift = newest.offset - src.offset
            if abs(shift) > REPORT_OFFSET_S and src.events:
                off[round(-shift, 1)].append(src.events[0].source)
        offsets += [
            ClockOffset(
                f"{len(files)} ledger file(s) of host {label(domain)} "
                f"({', '.join(sorted(files)[:3])}"
                f"{', ...' if len(files) > 3 else ''})",
                value,
                "its newest process: timed by their monotonic clock",
            )
            for value, files in sorted(off.items())
        ]

    # Rule 5: hosts moved onto the reference's clock by a measured offset, else by a bound.
    ahead: dict[str, float] = {}
    for src in sources.values():
        for domain, bound in (src.clock.ahead if src.clock else {}).items():
            ahead[domain] = max(ahead.get(domain, 0.0), bound)
    measured = host_offsets.chosen(
        (s.clock.domain, s.clock.measured, shifts.get(id(s), 0.0))
        for s in sources.values()
        if s.clock is not None and s.clock.measured is not None
    )
    moved = host_offsets.host_shifts(measured, ahead)
    offsets += [
        ClockOffset(
            f"host {label(d)}",
            -moved[d],
            f"the clock of host {label(m.reference)} (measured)",
            m.error_s,
        )
        for d, m in sorted(measured.items())
    ]
    offsets += [
        ClockOffset(f"host {label(d)}", b, "the job's clock (at least: measured when it resumed)")
        for d, b in sorted(ahead.items())
        if b > 0 and d not in measured
    ]
    domains = {src.clock.domain for src in sources.values() if src.clock is not None}
    reference = _reference_domain(sources)
    unaligned = sorted(d for d in domains if d != reference and d not in moved)
    kept: list[E] = list(loose)
    for src in sources.values():
        shift = shifts.get(id(src), 0.0)
        if src.clock is not None:
            shift += moved.get(src.clock.domain, 0.0)
        if shift:
            kept += [replace(e, start=e.start + shift, end=e.end + shift) for e in src.events]
        else:
            kept += src.events
    check = ClockCheck(
        retimed=checker.retimed,
        rejected=checker.rejected,
        examples=tuple(checker.examples),
        offsets=tuple(offsets),
        unaligned=tuple(unaligned),
    )
    return kept, check


def _reference_domain(sources: dict[str, _Source]) -> str | None:
    """The job's clock: the host of its newest orchestrator file (the process that watched
    the job and decided its timeouts), else the host with the most events."""
    orchestrators = [
        (max((e.end for e in s.events), default=-math.inf), s.clock.domain)
        for name, s in sources.items()
        if s.clock is not None and name.startswith("orchestrator")
    ]
    if orchestrators:
        return max(orchestrators)[1]
    counts: dict[str, int] = defaultdict(int)
    for s in sources.values():
        if s.clock is not None:
            counts[s.clock.domain] += len(s.events)
    return max(counts, key=lambda d: counts[d]) if counts else None


def measure_ahead(
    latest_by_domain: dict[str, float], now: Callable[[], float] = wall
) -> dict[str, float]:
    """For each host whose latest ledger time lies in this process's future, how far its
    clock is at least ahead: its last event happened before now. Bounds within
    ``TOLERANCE_S`` are left out (ordinary clock agreement)."""
    t = now()
    return {d: latest - t for d, latest in latest_by_domain.items() if latest - t > TOLERANCE_S}
