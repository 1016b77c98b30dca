"""The ETT ledger's reader: every file of a job, reassembled from its segments, parsed, its
times checked (infra/accounting/clocks.py), in one list of events.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from infra import storage
from infra.accounting import clocks, host_offsets
from infra.accounting.ledger_format import FILE_NAME, SEGMENT_NAME, Event, Mark, parse_lines
from infra.job_layout import JobLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LedgerFile:
    """One ledger file's bytes, reassembled from its segments on object storage.

    ``incomplete``: stored as segments but never sealed (its writer was killed and its spool
    not recovered, or it is still writing): events after the last one may be missing.
    """

    name: str
    url: str
    data: bytes
    incomplete: bool = False


def _reassemble(url: str, segments: dict[str, bytes]) -> tuple[bytes, bool]:
    """A file's bytes from its segments, in offset order; overlaps (a segment uploaded again
    with more bytes) are taken once. Returns the bytes and whether the file is sealed."""
    parts = []
    for name, data in segments.items():
        m = SEGMENT_NAME.match(name)
        if m:
            parts.append((int(m["offset"]), -len(data), bool(m["final"]), data))
    out, covered, sealed = bytearray(), 0, False
    for offset, _, final, data in sorted(parts):
        if offset > covered:
            log.warning("ledger %s: bytes [%d, %d) are missing", url, covered, offset)
            covered = offset
        out += data[covered - offset :]
        covered = max(covered, offset + len(data))
        sealed = sealed or final
    return bytes(out), sealed


def read_files(layout: JobLayout) -> list[LedgerFile]:
    """Every ledger file of a job (every attempt, rank and role), sorted by name: plain
    files (local disk, and object stores before segments) and segmented ones alike."""
    root_url = layout.ledger
    fs, root = storage.split(root_url)
    try:
        paths = storage.call(f"list {root_url}", lambda: fs.find(root))
    except FileNotFoundError:
        return []
    plain: list[str] = []
    segmented: dict[str, list[str]] = {}
    for path in paths:
        parts = path[len(root) :].strip("/").split("/")
        if len(parts) == 1 and parts[0].endswith(".jsonl"):
            plain.append(path)
        elif len(parts) == 2 and parts[0].endswith(".jsonl"):
            segmented.setdefault(parts[0], []).append(path)
    wanted = plain + [p for ps in segmented.values() for p in ps]
    if not wanted:
        return []
    blobs: dict[str, bytes] = storage.call(
        f"read {root_url}", lambda: fs.cat(wanted, on_error="raise")
    )
    files = []
    for path in plain:
        name = path.rsplit("/", 1)[-1]
        files.append(LedgerFile(name, storage.join(root_url, name), blobs[path]))
    for name, ps in segmented.items():
        url = storage.join(root_url, name)
        data, sealed = _reassemble(url, {p.rsplit("/", 1)[-1]: blobs[p] for p in ps})
        files.append(LedgerFile(name, url, data, incomplete=not sealed))
    return sorted(files, key=lambda f: f.name)


def _incomplete_mark(file: LedgerFile, events: list[Event]) -> Event:
    """The reader's ``ledger_incomplete`` mark for a file, at its last event."""
    m = FILE_NAME.match(file.name)
    last = max(events, key=lambda e: e.end)
    return Event(
        kind="mark",
        name=Mark.LEDGER_INCOMPLETE,
        start=last.end,
        end=last.end,
        attempt=int(m["attempt"]) if m else last.attempt,
        rank=int(m["rank"]) if m else last.rank,
        attrs={"file": file.name, "role": m["role"] if m else ""},
    )


def _process_clock(name: str, lines: list[Event]) -> clocks.ProcessClock | None:
    """A file's ``clock`` lines as one ProcessClock; None for a file without any (written
    before version 2)."""
    if not lines:
        return None
    attrs: dict[str, Any] = {}
    for line in lines:
        attrs |= line.attrs
    ahead = attrs.get("ahead")
    first = lines[0]
    return clocks.ProcessClock(
        source=name,
        domain=clocks.domain_of(attrs),
        monotonic=first.mono is not None,
        ahead={str(k): float(v) for k, v in ahead.items()} if isinstance(ahead, dict) else {},
        measured=host_offsets.from_clock_attrs(attrs, name),
        opened=None if first.mono is None else (first.start, first.mono[0]),
    )


@dataclass(frozen=True)
class LedgerRead:
    """A job's events, checked and on one clock (infra/accounting/clocks.py), and what the check
    found."""

    events: list[Event]
    clock: clocks.ClockCheck


def _parse(
    files: list[LedgerFile],
) -> tuple[list[Event], dict[str, clocks.ProcessClock], list[LedgerFile]]:
    """Every file's events as written, each file's ``clock`` lines, and the files that may
    miss their last events."""
    events: list[Event] = []
    process_clocks: dict[str, clocks.ProcessClock] = {}
    incomplete: list[LedgerFile] = []
    for file in files:
        found = parse_lines(file.data.decode("utf-8", errors="replace"), file.url, file.name)
        header = [e for e in found if e.name == Mark.CLOCK]
        if (process := _process_clock(file.name, header)) is not None:
            process_clocks[file.name] = process
        events += [e for e in found if e.name != Mark.CLOCK]
        if file.incomplete:
            incomplete.append(file)
    return events, process_clocks, incomplete


def ledger_of(files: list[LedgerFile]) -> LedgerRead:
    """The events of these ledger files, sorted by start time, after the clock checks of
    infra/accounting/clocks.py (each file's ``clock`` lines are consumed there).

    A file that may miss its last events (``LedgerFile.incomplete``) adds the reader's
    ``ledger_incomplete`` mark at its last event, so the ETT calculator can tell time it
    did not see from time that it saw pass without events.
    """
    events, process_clocks, incomplete = _parse(files)
    events, check = clocks.align(events, process_clocks)
    for file in incomplete:
        mine = [e for e in events if e.source == file.name]
        if mine:
            events.append(_incomplete_mark(file, mine))
    events.sort(key=lambda e: (e.start, e.end))
    return LedgerRead(events, check)


def read_ledger(layout: JobLayout) -> LedgerRead:
    """All events of a job, from every attempt, rank and role (``ledger_of`` its files)."""
    return ledger_of(read_files(layout))


def domains_ahead(layout: JobLayout, now: Callable[[], float] = clocks.wall) -> dict[str, float]:
    """Other hosts whose part of this job's ledger ends in this process's future, and how
    far their clocks run ahead at least: what an orchestrator resuming the job records in
    its first ``clock`` line (infra/accounting/clocks.py, rule 5). This host's own earlier processes
    are aligned by its monotonic clock instead."""
    events, process_clocks, _ = _parse(read_files(layout))
    as_measured = {name: replace(c, ahead={}) for name, c in process_clocks.items()}
    aligned, _ = clocks.align(events, as_measured)
    latest: dict[str, float] = {}
    for e in aligned:
        if (c := process_clocks.get(e.source)) is not None:
            latest[c.domain] = max(latest.get(c.domain, e.end), e.end)
    latest.pop(clocks.domain_of(clocks.identity()), None)
    return clocks.measure_ahead(latest, now)


def read_events(layout: JobLayout) -> list[Event]:
    """``read_ledger(layout).events``: every event of a job, checked and on one clock."""
    return read_ledger(layout).events
