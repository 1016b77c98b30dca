"""The ETT ledger: an append-only log of timed events, one JSON-lines file per attempt and rank.

Every second of a job is accounted for from these events (see infra/ett.py). Each event is
one line, written and flushed as it happens, so a process killed with SIGKILL loses at most
the line being written; the reader skips a torn line. On object stores, which cannot append,
the file is spooled on local disk and uploaded whole every ``sync_every_s`` and on close.

Event line format (version 1)::

    {"v": 1, "kind": "span", "name": "train_step", "start": 1.0, "end": 2.0,
     "attempt": 0, "rank": 0, "step": 7, "attrs": {...}}
    {"v": 1, "kind": "mark", "name": "failure", "t": 3.0, "attempt": 0, "rank": 0,
     "step": 7, "attrs": {"cause": "sigkill"}}

Times are Unix seconds (time.time()) so spans written by different processes of one job
(the orchestrator and the ranks) share a clock.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from infra import storage

log = logging.getLogger(__name__)

# The vocabulary of DESIGN.md; writing another name is a programming error.
JOB_SPANS = ("scheduling", "hardware_setup", "launcher_init", "shutdown")
INIT_SPANS = (
    "device_init",
    "process_group_init",
    "preproc_creation",
    "train_module_creation",
    "init_plugins",
    "pre_train",
    "get_first_batch_data",
)
LOOP_SPANS = ("train_step", "checkpoint_blocking", "eval")
# Spans of work moved off the training job (publishing), kept in their own files.
PUBLISH_SPANS = ("publish_load", "publish_export", "publish_validate", "publish_register")
SPAN_NAMES = frozenset(JOB_SPANS + INIT_SPANS + LOOP_SPANS + PUBLISH_SPANS + ("compile",))
MARK_NAMES = frozenset(
    (
        "attempt_start",
        "failure",
        "resume",
        "checkpoint_committed",
        "checkpoint_failed",
        "anchor_committed",
        "recompile",
        "job_end",
    )
)


@dataclass(frozen=True)
class Event:
    """One ledger line. Spans have start < end; marks have start == end == t."""

    kind: str
    name: str
    start: float
    end: float
    attempt: int
    rank: int
    step: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


def ledger_url(job_url: str) -> str:
    return storage.join(job_url, "ledger")


def _file_name(attempt: int, rank: int, role: str) -> str:
    return f"{role}-attempt{attempt:03d}-rank{rank:03d}.jsonl"


class Ledger:
    """Writes one process's events for one attempt of a job.

    ``role`` separates writers that share an attempt and rank: the trainer ("trainer"),
    the orchestrator ("orchestrator"), the publisher ("publish").
    """

    def __init__(
        self,
        job_url: str,
        attempt: int = 0,
        rank: int = 0,
        role: str = "trainer",
        clock: Callable[[], float] = time.time,
        sync_every_s: float = 10.0,
    ) -> None:
        self.attempt = attempt
        self.rank = rank
        self.clock = clock
        self.url = storage.join(ledger_url(job_url), _file_name(attempt, rank, role))
        self._lock = threading.Lock()
        local = storage.local_path(self.url)
        self._remote = local is None
        if self._remote:
            spool_dir = tempfile.mkdtemp(prefix="ett-ledger-")
            local = os.path.join(spool_dir, _file_name(attempt, rank, role))
        else:
            os.makedirs(os.path.dirname(local), exist_ok=True)
        self._local = local
        self._fh = open(local, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._sync_every_s = sync_every_s
        self._last_sync = clock()

    # -- writing ----------------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if self._fh.closed:
                return
            self._fh.write(line)
            self._fh.flush()
            if self._remote and self.clock() - self._last_sync >= self._sync_every_s:
                self._sync_locked()

    def record_span(
        self, name: str, start: float, end: float, step: int | None = None, **attrs: Any
    ) -> None:
        """Record a span that already happened (e.g. measured by another process)."""
        if name not in SPAN_NAMES:
            raise ValueError(f"unknown span name {name!r}; known: {sorted(SPAN_NAMES)}")
        record: dict[str, Any] = {"v": 1, "kind": "span", "name": name, "start": start}
        record.update(end=end, attempt=self.attempt, rank=self.rank)
        if step is not None:
            record["step"] = step
        if attrs:
            record["attrs"] = attrs
        self._write(record)

    @contextmanager
    def span(self, name: str, step: int | None = None, **attrs: Any) -> Iterator[dict[str, Any]]:
        """Time a block; the yielded dict collects extra attrs to write with the span."""
        start = self.clock()
        extra: dict[str, Any] = dict(attrs)
        try:
            yield extra
        finally:
            self.record_span(name, start, self.clock(), step=step, **extra)

    def mark(
        self, name: str, step: int | None = None, t: float | None = None, **attrs: Any
    ) -> None:
        """Record an instant: a failure, a resume, a committed checkpoint, a recompile."""
        if name not in MARK_NAMES:
            raise ValueError(f"unknown mark name {name!r}; known: {sorted(MARK_NAMES)}")
        record: dict[str, Any] = {"v": 1, "kind": "mark", "name": name}
        record.update(t=self.clock() if t is None else t, attempt=self.attempt, rank=self.rank)
        if step is not None:
            record["step"] = step
        if attrs:
            record["attrs"] = attrs
        self._write(record)

    def _sync_locked(self) -> None:
        try:
            storage.put_file(self._local, self.url)
            self._last_sync = self.clock()
        except OSError as exc:  # a storage hiccup must never stop training
            log.warning("ledger upload to %s failed (will retry): %s", self.url, exc)

    def sync(self) -> None:
        """Push the spooled file to remote storage now (no-op on local disk)."""
        if self._remote:
            with self._lock:
                self._sync_locked()

    def close(self) -> None:
        with self._lock:
            if self._fh.closed:
                return
            self._fh.close()
            if self._remote:
                self._sync_locked()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- reading --------------------------------------------------------------------------------
def parse_lines(text: str, source: str = "<ledger>") -> list[Event]:
    """Parse ledger lines, skipping (and logging) torn or malformed ones."""
    events: list[Event] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if rec["kind"] == "span":
                start, end = float(rec["start"]), float(rec["end"])
            else:
                start = end = float(rec["t"])
            events.append(
                Event(
                    kind=rec["kind"],
                    name=rec["name"],
                    start=start,
                    end=end,
                    attempt=int(rec.get("attempt", 0)),
                    rank=int(rec.get("rank", 0)),
                    step=rec.get("step"),
                    attrs=rec.get("attrs") or {},
                )
            )
        except (ValueError, KeyError, TypeError):
            log.warning("skipping unreadable ledger line %s:%d (torn write?)", source, lineno)
    return events


def read_events(job_url: str) -> list[Event]:
    """All events of a job, from every attempt, rank and role, sorted by start time."""
    events: list[Event] = []
    for url in storage.glob(storage.join(ledger_url(job_url), "*.jsonl")):
        events.extend(parse_lines(storage.read_text(url), source=url))
    events.sort(key=lambda e: (e.start, e.end))
    return events
