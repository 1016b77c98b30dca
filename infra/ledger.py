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
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from infra import storage

log = logging.getLogger(__name__)


class Span(StrEnum):
    """Span names: the closed vocabulary of timed work (docs/ett.md). A ``StrEnum``, so a
    name read back from a ledger file compares equal to its member."""

    # the job, around the trainer
    SCHEDULING = "scheduling"
    LAUNCHER_INIT = "launcher_init"
    SHUTDOWN = "shutdown"
    # trainer init sub-stages
    DEVICE_INIT = "device_init"
    PROCESS_GROUP_INIT = "process_group_init"
    PREPROC_CREATION = "preproc_creation"
    TRAIN_MODULE_CREATION = "train_module_creation"
    INIT_PLUGINS = "init_plugins"
    PRE_TRAIN = "pre_train"
    GET_FIRST_BATCH_DATA = "get_first_batch_data"
    COMPILE = "compile"
    # the training loop
    TRAIN_STEP = "train_step"
    CHECKPOINT_BLOCKING = "checkpoint_blocking"
    EVAL = "eval"
    # work moved off the training job, in its own files
    PUBLISH_LOAD = "publish_load"
    PUBLISH_EXPORT = "publish_export"
    PUBLISH_VALIDATE = "publish_validate"
    PUBLISH_REGISTER = "publish_register"


class Mark(StrEnum):
    """Mark names: the closed vocabulary of instants."""

    ATTEMPT_START = "attempt_start"
    FAILURE = "failure"
    RESUME = "resume"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    ANCHOR_COMMITTED = "anchor_committed"
    RECOMPILE = "recompile"
    MODEL_FLOPS = "model_flops"  # the device and dtype a step's ``flops`` attr ran on (MFU)
    JOB_END = "job_end"


JOB_SPANS = (Span.SCHEDULING, Span.LAUNCHER_INIT, Span.SHUTDOWN)
INIT_SPANS = (
    Span.DEVICE_INIT,
    Span.PROCESS_GROUP_INIT,
    Span.PREPROC_CREATION,
    Span.TRAIN_MODULE_CREATION,
    Span.INIT_PLUGINS,
    Span.PRE_TRAIN,
    Span.GET_FIRST_BATCH_DATA,
)
LOOP_SPANS = (Span.TRAIN_STEP, Span.CHECKPOINT_BLOCKING, Span.EVAL)
PUBLISH_SPANS = (
    Span.PUBLISH_LOAD,
    Span.PUBLISH_EXPORT,
    Span.PUBLISH_VALIDATE,
    Span.PUBLISH_REGISTER,
)
SPAN_NAMES = frozenset(Span)
MARK_NAMES = frozenset(Mark)


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


# For attrs that are not plain scalars (lists, dicts, paths...).
_ATTRS_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


def _json_value(value: Any) -> str:
    """Plain scalars are formatted directly: JSONEncoder.encode builds an encoder per call,
    which dominated the cost of a step's span (the trainer records the loss with each)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else ("true" if value else "false")
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return encode_basestring_ascii(value)
    return _ATTRS_ENCODER.encode(value)


def _attrs_json(attrs: dict[str, Any]) -> str:
    fields = (f"{encode_basestring_ascii(str(k))}:{_json_value(v)}" for k, v in attrs.items())
    return "{" + ",".join(fields) + "}"


def _line(
    kind: str,
    name: str,
    times: str,
    attempt: int,
    rank: int,
    step: int | None,
    attrs: dict[str, Any],
) -> bytes:
    """One event line. The fixed fields are formatted directly (names come from the closed
    vocabulary, numbers are finite): on the step path this costs a third of json.dumps."""
    step_field = "" if step is None else f',"step":{int(step)}'
    attrs_field = f',"attrs":{_attrs_json(attrs)}' if attrs else ""
    return (
        f'{{"v":1,"kind":"{kind}","name":"{name}",{times},"attempt":{attempt},'
        f'"rank":{rank}{step_field}{attrs_field}}}\n'
    ).encode()


def _time(value: float) -> str:
    """A JSON number for a clock reading (repr keeps every digit of the float)."""
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"ledger times must be finite, got {value!r}")
    return repr(value)


class _Span:
    """The context manager of ``Ledger.span``: a plain class, as a generator-based one costs
    several times more on the training step's path."""

    __slots__ = ("_ledger", "_name", "_step", "_start", "attrs")

    def __init__(self, ledger: Ledger, name: str, step: int | None, attrs: dict[str, Any]):
        self._ledger, self._name, self._step, self.attrs = ledger, name, step, attrs
        self._start = 0.0

    def __enter__(self) -> dict[str, Any]:
        self._start = self._ledger.clock()
        return self.attrs

    def __exit__(self, *exc: object) -> None:
        led = self._ledger
        led._write_span(self._name, self._start, led.clock(), self._step, self.attrs)


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
        # One write() per event on an O_APPEND descriptor: no user-space buffer to lose on
        # SIGKILL, and at most the line being written is torn.
        self._fd: int | None = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._sync_every_s = sync_every_s
        self._last_sync = clock()

    # -- writing ----------------------------------------------------------------------------
    def _write(self, line: bytes) -> None:
        with self._lock:
            if self._fd is None:
                return
            os.write(self._fd, line)
            if self._remote and self.clock() - self._last_sync >= self._sync_every_s:
                self._sync_locked()

    def _write_span(
        self, name: str, start: float, end: float, step: int | None, attrs: dict[str, Any]
    ) -> None:
        times = f'"start":{_time(start)},"end":{_time(end)}'
        self._write(_line("span", name, times, self.attempt, self.rank, step, attrs))

    def record_span(
        self, name: str, start: float, end: float, step: int | None = None, **attrs: Any
    ) -> None:
        """Record a span that already happened (e.g. measured by another process)."""
        if name not in SPAN_NAMES:
            raise ValueError(f"unknown span name {name!r}; known: {sorted(SPAN_NAMES)}")
        self._write_span(name, start, end, step, attrs)

    def span(self, name: str, step: int | None = None, **attrs: Any) -> _Span:
        """Time a block (``with ledger.span("eval") as attrs:``); the dict it yields
        collects extra attrs to write with the span, also when the block raises."""
        if name not in SPAN_NAMES:
            raise ValueError(f"unknown span name {name!r}; known: {sorted(SPAN_NAMES)}")
        return _Span(self, name, step, attrs)

    def mark(
        self, name: str, step: int | None = None, t: float | None = None, **attrs: Any
    ) -> None:
        """Record an instant: a failure, a resume, a committed checkpoint, a recompile."""
        if name not in MARK_NAMES:
            raise ValueError(f"unknown mark name {name!r}; known: {sorted(MARK_NAMES)}")
        times = f'"t":{_time(self.clock() if t is None else t)}'
        self._write(_line("mark", name, times, self.attempt, self.rank, step, attrs))

    def _sync_locked(self) -> bool:
        try:
            storage.put_file(self._local, self.url)
            self._last_sync = self.clock()
            return True
        except OSError as exc:  # a storage hiccup must never stop training
            log.warning("ledger upload to %s failed (will retry): %s", self.url, exc)
            return False

    def sync(self) -> None:
        """Push the spooled file to remote storage now (no-op on local disk)."""
        if self._remote:
            with self._lock:
                self._sync_locked()

    def close(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            os.close(self._fd)
            self._fd = None
            if not self._remote:
                return
            if self._sync_locked():
                shutil.rmtree(os.path.dirname(self._local), ignore_errors=True)
            else:  # nothing is lost: the events stay on local disk
                log.error(
                    "ledger %s not uploaded; its events are kept in %s", self.url, self._local
                )

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
