"""The ETT ledger: an append-only log of timed events, one JSON-lines file per attempt and rank.

Every second of a job is accounted for from these events (see infra/accounting/ett.py). Each event
is one line, written with one ``os.write`` as it happens, so a process killed with SIGKILL loses at
most the line being written; the reader skips a torn line.

On local disk the file is appended to in place. Object stores cannot append, so there the
file is spooled on local disk (same single write per event) and a background thread, never
the training thread, uploads what was appended since its last upload as one small object
every ``sync_every_s``, and the rest at close::

    <job_url>/ledger/trainer-attempt000-rank000.jsonl/000000000000         bytes [0, n1)
    <job_url>/ledger/trainer-attempt000-rank000.jsonl/000000004711         bytes [n1, n2)
    <job_url>/ledger/trainer-attempt000-rank000.jsonl/000000009000.final   the rest: sealed

A segment is named by its byte offset in the spool, so uploading it again (a retry, or a
recovery racing another) rewrites the same object. A spool is kept until its file is sealed:
when the process is killed first, the next process of the job on that node uploads the rest
(``recover_orphaned_spools``). A file that is neither sealed nor recovered may miss its last
events; the reader says so with a ``ledger_incomplete`` mark (see ``read_events``).

Event line format (version 2)::

    {"v": 2, "kind": "mark", "name": "clock", "t": 0.5, "mono": 80.5, "attempt": 0,
     "rank": 0, "attrs": {"host": "node-1", "boot": "...", "pid": 4711}}
    {"v": 2, "kind": "span", "name": "train_step", "start": 1.0, "end": 2.0,
     "mono": [81.0, 82.0], "attempt": 0, "rank": 0, "step": 7, "attrs": {...}}
    {"v": 2, "kind": "mark", "name": "failure", "t": 3.0, "mono": 83.0, "attempt": 0,
     "rank": 0, "step": 7, "attrs": {"cause": "sigkill"}}

Times are Unix seconds (the process's wall clock, ``infra.accounting.clocks.wall``) so spans written
by different processes of one job (the orchestrator and the ranks) share a clock; ``mono`` holds the
monotonic clock's reading of each, and the first line of every file (``clock``) names the process
and its host. The reader checks the two clocks against each other and across processes before
anything is computed from them (infra/accounting/clocks.py). Version 1 lines (no ``mono``, no
``clock`` line) are still read.

One module on purpose: the writer, the segmented upload, the spool recovery and the reader
share one on-storage format (the names and offsets above), which is defined here once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from infra import processes, storage
from infra.accounting import clocks

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
    # the side evaluator (trainer/checkpoint_evaluator.py), beside the job
    ASYNC_EVAL = "async_eval"
    # work moved off the training job, in its own files
    PUBLISH_LOAD = "publish_load"
    PUBLISH_EXPORT = "publish_export"
    PUBLISH_VALIDATE = "publish_validate"
    PUBLISH_REGISTER = "publish_register"


class Mark(StrEnum):
    """Mark names: the closed vocabulary of instants."""

    ATTEMPT_START = "attempt_start"
    STANDBY_READY = "standby_ready"  # a warm standby finished its init and parked
    PROMOTED = "promoted"  # ...and was promoted: the job's time for it starts here
    STANDBY_LOST = "standby_lost"  # ...or died before it was needed (the orchestrator saw it)
    IN_PROCESS_RESTART = "in_process_restart"  # an exception in a step, recovered in place
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # the interval chosen, and why
    FAILURE = "failure"
    RESUME = "resume"  # training state loaded: from which checkpoint, and what was skipped
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    ANCHOR_COMMITTED = "anchor_committed"
    RECOMPILE = "recompile"
    MODEL_FLOPS = "model_flops"  # the device and dtype a step's ``flops`` attr ran on (MFU)
    JOB_END = "job_end"
    # Made by the reader, never written: this file's writer neither sealed it nor had its
    # spool recovered, so events after this instant (its last one) may be missing.
    LEDGER_INCOMPLETE = "ledger_incomplete"
    # The first line of every file: its process and clock (infra/accounting/clocks.py). Consumed by
    # the reader, never passed on as an event.
    CLOCK = "clock"


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
PUBLISH_SPANS = tuple(span for span in Span if span.startswith("publish_"))  # publish/ writes
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
    # Where it was read from: the monotonic readings of its times, its file and line.
    mono: tuple[float, float] | None = field(default=None, compare=False, repr=False)
    source: str = field(default="", compare=False, repr=False)
    seq: int = field(default=0, compare=False, repr=False)

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


VERSION = 2


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
        f'{{"v":{VERSION},"kind":"{kind}","name":"{name}",{times},"attempt":{attempt},'
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

    __slots__ = ("_ledger", "_name", "_step", "_start", "_mono", "attrs")

    def __init__(self, ledger: Ledger, name: str, step: int | None, attrs: dict[str, Any]):
        self._ledger, self._name, self._step, self.attrs = ledger, name, step, attrs
        self._start = self._mono = 0.0

    def __enter__(self) -> dict[str, Any]:
        led = self._ledger
        self._start, self._mono = led.clock(), led._read_mono()
        return self.attrs

    def __exit__(self, *exc: object) -> None:
        led = self._ledger
        end, mono = led.clock(), led._read_mono()
        led._write_span(self._name, self._start, end, self._step, self.attrs, (self._mono, mono))


def ledger_url(job_url: str) -> str:
    return storage.join(job_url, "ledger")


def _file_name(attempt: int, rank: int, role: str) -> str:
    return f"{role}-attempt{attempt:03d}-rank{rank:03d}.jsonl"


_FILE_NAME = re.compile(r"^(?P<role>[a-z_]+)-attempt(?P<attempt>\d+)-rank(?P<rank>\d+)\.jsonl$")

# -- object storage: segments and spools ----------------------------------------------------
FINAL = ".final"  # the suffix of the segment that seals a file
_SEGMENT_NAME = re.compile(r"^(?P<offset>\d{12})(?P<final>\.final)?$")
FIRST_SYNC_S = 1.0  # the first upload comes early, so a start mark is soon visible
MIN_SYNC_S = 0.05  # the uploader never spins, whatever sync_every_s says


def _segment_name(offset: int, final: bool) -> str:
    return f"{offset:012d}{FINAL if final else ''}"


def _spool_prefix(job_url: str) -> str:
    """Spool folders are named ``ett-ledger-<job>-<hash of the job URL>-p<pid>-<random>``:
    the job, to find them again; the pid, to know whether their writer still runs."""
    url = job_url.rstrip("/")
    tail = re.sub(r"[^A-Za-z0-9_.]", "_", url.rsplit("/", 1)[-1])[:40]
    key = hashlib.sha256(url.encode()).hexdigest()[:12]
    return f"ett-ledger-{tail}-{key}-p"


class _Spool:
    """A local spool file and how much of it is stored as segments under ``url``."""

    def __init__(self, local: str, url: str, uploaded: int = 0) -> None:
        self.local, self.url, self.uploaded = local, url, uploaded
        self._lock = threading.Lock()  # the uploader thread, sync() and close() take turns

    def push(self, final: bool) -> bool:
        """Upload what was appended since the last push as one segment; returns whether it
        is stored. Before ``final`` only whole lines go (the writer may be mid-line); the
        final push takes everything (a torn last line of a killed writer included, which
        the reader skips) and seals the file, even with nothing new."""
        with self._lock:
            try:
                with open(self.local, "rb") as fh:
                    fh.seek(self.uploaded)
                    data = fh.read()
                if not final:
                    data = data[: data.rfind(b"\n") + 1]
                    if not data:
                        return True
                name = _segment_name(self.uploaded, final)
                storage.write_bytes(storage.join(self.url, name), data)
            except Exception as exc:  # noqa: BLE001 - a storage hiccup must never stop training
                log.warning("ledger upload to %s failed (kept on local disk): %s", self.url, exc)
                return False
            self.uploaded += len(data)
            return True


def _stored_extent(url: str) -> tuple[int, bool]:
    """How many bytes of a segmented file are stored, and whether it is sealed."""
    fs, path = storage.split(url)
    try:
        infos = storage.call(f"list {url}", lambda: fs.ls(path, detail=True))
    except FileNotFoundError:
        return 0, False
    end, sealed = 0, False
    for info in infos:
        m = _SEGMENT_NAME.match(str(info["name"]).rstrip("/").rsplit("/", 1)[-1])
        if m:
            end = max(end, int(m["offset"]) + int(info.get("size") or 0))
            sealed = sealed or bool(m["final"])
    return end, sealed


def recover_orphaned_spools(job_url: str) -> list[str]:
    """Upload and seal what killed processes of this job left in their local spools.

    Call it on each node before a new attempt writes (the trainer does, in ``run``): a
    process killed with SIGKILL leaves its unsent events in a spool folder named with its
    pid; one whose process still runs is left alone. A spool is deleted once its file is
    sealed; one that cannot be uploaded now is kept for the next call. Returns the ledger
    URLs completed. On local disk there are no spools: nothing to do.
    """
    if storage.local_path(job_url) is not None:
        return []
    prefix = _spool_prefix(job_url)
    completed: list[str] = []
    for entry in os.scandir(tempfile.gettempdir()):
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if not entry.name.startswith(prefix) or not pid.isdigit() or not entry.is_dir():
            continue
        if processes.pid_alive(int(pid)):
            continue
        done = True
        for name in sorted(os.listdir(entry.path)):
            if not _FILE_NAME.match(name):
                continue
            url = storage.join(ledger_url(job_url), name)
            try:
                stored, sealed = _stored_extent(url)
            except Exception as exc:  # noqa: BLE001 - never stops an attempt from starting
                log.warning("cannot recover ledger spool %s now: %s", entry.path, exc)
                done = False
                continue
            if sealed or _Spool(os.path.join(entry.path, name), url, stored).push(final=True):
                completed.append(url)
            else:
                done = False
        if done:
            shutil.rmtree(entry.path, ignore_errors=True)
    if completed:
        log.info("recovered %d ledger file(s) of killed processes: %s", len(completed), completed)
    return completed


def next_attempt(job_url: str, role: str | None = None, rank: int | None = None) -> int:
    """One past the highest attempt number in the job's ledger files (0 for a new job):
    of any writer, or only of ``role`` (and ``rank``). The one rule for numbering attempts,
    so a job that is run again continues its numbering and its report covers every attempt."""
    numbers = []
    for url in storage.glob(storage.join(ledger_url(job_url), "*.jsonl*")):
        m = _FILE_NAME.match(url.rstrip("/").rsplit("/", 1)[-1])
        if m and role in (None, m["role"]) and rank in (None, int(m["rank"])):
            numbers.append(int(m["attempt"]))
    return max(numbers) + 1 if numbers else 0


class Ledger:
    """Writes one process's events for one attempt of a job.

    ``role`` separates writers that share an attempt and rank: the trainer ("trainer"),
    the orchestrator ("orchestrator"), the publisher ("publish"). On object storage
    ``sync_every_s`` is how often the uploader thread stores new events.

    Every time is read from ``clock`` (the process's wall clock) and, with the default
    clock, from the monotonic clock beside it (infra/accounting/clocks.py checks one against the
    other). A test's own ``clock`` writes no monotonic readings. ``clock_attrs`` go into
    the file's first line (``clock``), beside the process's host and pid.
    """

    def __init__(
        self,
        job_url: str,
        attempt: int = 0,
        rank: int = 0,
        role: str = "trainer",
        clock: Callable[[], float] = clocks.wall,
        sync_every_s: float = 10.0,
        clock_attrs: dict[str, Any] | None = None,
    ) -> None:
        self.attempt = attempt
        self.rank = rank
        self.clock = clock
        self._mono: Callable[[], float] | None = time.monotonic if clock is clocks.wall else None
        name = _file_name(attempt, rank, role)
        self.url = storage.join(ledger_url(job_url), name)
        self._lock = threading.Lock()
        local = storage.local_path(self.url)
        self._spool: _Spool | None = None
        if local is None:
            spool_dir = tempfile.mkdtemp(prefix=f"{_spool_prefix(job_url)}{os.getpid()}-")
            local = os.path.join(spool_dir, name)
            self._spool = _Spool(local, self.url)
        else:
            os.makedirs(os.path.dirname(local), exist_ok=True)
        self._local = local
        # One write() per event on an O_APPEND descriptor: no user-space buffer to lose on
        # SIGKILL, and at most the line being written is torn.
        self._fd: int | None = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._stored = self._spool is None
        self._closing = threading.Event()
        self._uploader: threading.Thread | None = None
        if self._spool is not None:
            self._uploader = threading.Thread(
                target=self._upload_loop, args=(sync_every_s,), name=f"ledger-{name}", daemon=True
            )
            self._uploader.start()
        # A test's clock is left alone: its readings are the test's timeline.
        at = None if self._mono is not None else 0.0
        self.mark(Mark.CLOCK, t=at, **clocks.identity(), **(clock_attrs or {}))

    # -- writing ----------------------------------------------------------------------------
    def _write(self, line: bytes) -> None:
        with self._lock:
            if self._fd is None:
                return
            os.write(self._fd, line)

    def _read_mono(self) -> float:
        return self._mono() if self._mono is not None else 0.0

    def _mono_of(self, t: float) -> float:
        """The monotonic reading of a wall time ``t`` of this process (now: offset applied)."""
        assert self._mono is not None
        return self._mono() - (self.clock() - t)

    def _write_span(
        self,
        name: str,
        start: float,
        end: float,
        step: int | None,
        attrs: dict[str, Any],
        mono: tuple[float, float] | None,
    ) -> None:
        times = f'"start":{_time(start)},"end":{_time(end)}'
        if self._mono is not None and mono is not None:
            times += f',"mono":[{_time(mono[0])},{_time(mono[1])}]'
        self._write(_line("span", name, times, self.attempt, self.rank, step, attrs))

    def record_span(
        self, name: str, start: float, end: float, step: int | None = None, **attrs: Any
    ) -> None:
        """Record a span that already happened (e.g. measured by another process): its
        times are this process's wall clock, read earlier."""
        if name not in SPAN_NAMES:
            raise ValueError(f"unknown span name {name!r}; known: {sorted(SPAN_NAMES)}")
        mono = (self._mono_of(start), self._mono_of(end)) if self._mono is not None else None
        self._write_span(name, start, end, step, attrs, mono)

    def span(self, name: str, step: int | None = None, **attrs: Any) -> _Span:
        """Time a block (``with ledger.span("eval") as attrs:``); the dict it yields
        collects extra attrs to write with the span, also when the block raises."""
        if name not in SPAN_NAMES:
            raise ValueError(f"unknown span name {name!r}; known: {sorted(SPAN_NAMES)}")
        return _Span(self, name, step, attrs)

    def mark(
        self, name: str, step: int | None = None, t: float | None = None, **attrs: Any
    ) -> None:
        """Record an instant: a failure, a resume, a committed checkpoint, a recompile.
        ``t`` (this process's wall clock) when it happened earlier than now."""
        if name not in MARK_NAMES:
            raise ValueError(f"unknown mark name {name!r}; known: {sorted(MARK_NAMES)}")
        if t is None:
            t = self.clock()
            mono = self._read_mono()
        else:
            mono = self._mono_of(t) if self._mono is not None else 0.0
        times = f'"t":{_time(t)}'
        if self._mono is not None:
            times += f',"mono":{_time(mono)}'
        self._write(_line("mark", name, times, self.attempt, self.rank, step, attrs))

    # -- storing (object storage) -------------------------------------------------------------
    def _upload_loop(self, every_s: float) -> None:
        """The uploader thread: new whole lines every ``every_s``, then the seal at close."""
        assert self._spool is not None
        wait = min(every_s, FIRST_SYNC_S)
        while not self._closing.wait(max(wait, MIN_SYNC_S)):
            self._spool.push(final=False)
            wait = every_s
        self._stored = self._spool.push(final=True)

    def sync(self) -> bool:
        """Store the events written so far now, from the calling thread (on local disk they
        are stored already); returns whether they are."""
        if self._spool is None:
            return True
        return self._spool.push(final=False)

    def close(self) -> bool:
        """Stop writing and store the rest; returns whether every event is stored.

        On object storage this waits for the uploader's last segment. When it fails nothing
        is lost: the spool stays on local disk (logged) and the next process of the job on
        this node uploads it (``recover_orphaned_spools``). Calling it again answers again.
        """
        with self._lock:
            if self._fd is None:
                return self._stored
            os.close(self._fd)
            self._fd = None
        if self._uploader is None:
            return True
        self._closing.set()
        self._uploader.join()
        if self._stored:
            shutil.rmtree(os.path.dirname(self._local), ignore_errors=True)
        else:
            log.error(
                "ledger %s NOT stored; its events are kept in %s for the next attempt on "
                "this node to upload",
                self.url,
                self._local,
            )
        return self._stored

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- reading --------------------------------------------------------------------------------
def parse_lines(text: str, source: str = "<ledger>", name: str = "") -> list[Event]:
    """Parse ledger lines, skipping (and logging) torn or malformed ones. ``name`` (the
    file's name) becomes each event's ``source``, with its line number as ``seq``."""
    events: list[Event] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            mono = rec.get("mono")
            if rec["kind"] == "span":
                start, end = float(rec["start"]), float(rec["end"])
                mono = None if mono is None else (float(mono[0]), float(mono[1]))
            else:
                start = end = float(rec["t"])
                mono = None if mono is None else (float(mono), float(mono))
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
                    mono=mono,
                    source=name,
                    seq=lineno - 1,
                )
            )
        except (ValueError, KeyError, TypeError, IndexError):
            log.warning("skipping unreadable ledger line %s:%d (torn write?)", source, lineno)
    return events


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
        m = _SEGMENT_NAME.match(name)
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


def read_files(job_url: str) -> list[LedgerFile]:
    """Every ledger file of a job (every attempt, rank and role), sorted by name: plain
    files (local disk, and object stores before segments) and segmented ones alike."""
    root_url = ledger_url(job_url)
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
    m = _FILE_NAME.match(file.name)
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
        opened=None if first.mono is None else (first.start, first.mono[0]),
    )


@dataclass(frozen=True)
class LedgerRead:
    """A job's events, checked and on one clock (infra/accounting/clocks.py), and what the check
    found."""

    events: list[Event]
    clock: clocks.ClockCheck


def _read_raw(
    job_url: str,
) -> tuple[list[Event], dict[str, clocks.ProcessClock], list[LedgerFile]]:
    """Every file's events as written, each file's ``clock`` lines, and the files that may
    miss their last events."""
    events: list[Event] = []
    process_clocks: dict[str, clocks.ProcessClock] = {}
    incomplete: list[LedgerFile] = []
    for file in read_files(job_url):
        found = parse_lines(file.data.decode("utf-8", errors="replace"), file.url, file.name)
        header = [e for e in found if e.name == Mark.CLOCK]
        if (process := _process_clock(file.name, header)) is not None:
            process_clocks[file.name] = process
        events += [e for e in found if e.name != Mark.CLOCK]
        if file.incomplete:
            incomplete.append(file)
    return events, process_clocks, incomplete


def read_ledger(job_url: str) -> LedgerRead:
    """All events of a job, from every attempt, rank and role, sorted by start time, after
    the clock checks of infra/accounting/clocks.py (each file's ``clock`` lines are consumed there).

    A file that may miss its last events (``LedgerFile.incomplete``) adds the reader's
    ``ledger_incomplete`` mark at its last event, so the ETT calculator can tell time it
    did not see from time that it saw pass without events.
    """
    events, process_clocks, incomplete = _read_raw(job_url)
    events, check = clocks.align(events, process_clocks)
    for file in incomplete:
        mine = [e for e in events if e.source == file.name]
        if mine:
            events.append(_incomplete_mark(file, mine))
    events.sort(key=lambda e: (e.start, e.end))
    return LedgerRead(events, check)


def domains_ahead(job_url: str, now: Callable[[], float] = clocks.wall) -> dict[str, float]:
    """Other hosts whose part of this job's ledger ends in this process's future, and how
    far their clocks run ahead at least: what an orchestrator resuming the job records in
    its first ``clock`` line (infra/accounting/clocks.py, rule 4). This host's own earlier processes
    are aligned by its monotonic clock instead."""
    events, process_clocks, _ = _read_raw(job_url)
    as_measured = {name: replace(c, ahead={}) for name, c in process_clocks.items()}
    aligned, _ = clocks.align(events, as_measured)
    latest: dict[str, float] = {}
    for e in aligned:
        if (c := process_clocks.get(e.source)) is not None:
            latest[c.domain] = max(latest.get(c.domain, e.end), e.end)
    latest.pop(clocks.domain_of(clocks.identity()), None)
    return clocks.measure_ahead(latest, now)


def read_events(job_url: str) -> list[Event]:
    """``read_ledger(job_url).events``: every event of a job, checked and on one clock."""
    return read_ledger(job_url).events
