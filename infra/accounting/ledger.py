"""The ETT ledger's writer: an append-only log of timed events, one JSON-lines file per
process (attempt, rank and role), in the format of infra/accounting/ledger_format.py.

Every second of a job is accounted for from these events (infra/accounting/ett.py). Each
event is one line, written with one ``os.write`` as it happens, so a process killed with
SIGKILL loses at most the line being written; the reader skips a torn line.

On local disk the file is appended to in place. Object stores cannot append, so there the
file is spooled on local disk (same single write per event) and a background thread, never
the training thread, uploads what was appended since its last upload as one small object
every ``sync_every_s``, and the rest at close::

    <job>/ledger/trainer-attempt000-rank000.jsonl/000000000000         bytes [0, n1)
    <job>/ledger/trainer-attempt000-rank000.jsonl/000000004711         bytes [n1, n2)
    <job>/ledger/trainer-attempt000-rank000.jsonl/000000009000.final   the rest: sealed

A segment is named by its byte offset in the spool, so uploading it again (a retry, or a
recovery racing another) rewrites the same object. A spool is kept until its file is sealed:
when the process is killed first, the next process of the job on that node uploads the rest
(``recover_orphaned_spools``). A file that is neither sealed nor recovered may miss its last
events; the reader says so with a ``ledger_incomplete`` mark (infra/accounting/ledger_read.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from infra import processes, storage
from infra.accounting import clocks, host_offsets
from infra.accounting.ledger_format import (
    FILE_NAME,
    MARK_NAMES,
    SEGMENT_NAME,
    SPAN_NAMES,
    Mark,
    encode_line,
    encode_time,
    file_name,
    segment_name,
)
from infra.job_layout import JobLayout

log = logging.getLogger(__name__)

FIRST_SYNC_S = 1.0  # the first upload comes early, so a start mark is soon visible
MIN_SYNC_S = 0.05  # the uploader never spins, whatever sync_every_s says


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


def _spool_prefix(layout: JobLayout) -> str:
    """Spool folders are named ``ett-ledger-<job>-<hash of the job URL>-p<pid>-<random>``:
    the job, to find them again; the pid, to know whether their writer still runs."""
    url = layout.url
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
                name = segment_name(self.uploaded, final)
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
        m = SEGMENT_NAME.match(str(info["name"]).rstrip("/").rsplit("/", 1)[-1])
        if m:
            end = max(end, int(m["offset"]) + int(info.get("size") or 0))
            sealed = sealed or bool(m["final"])
    return end, sealed


def recover_orphaned_spools(layout: JobLayout) -> list[str]:
    """Upload and seal what killed processes of this job left in their local spools.

    Call it on each node before a new attempt writes (the trainer does, in ``run``): a
    process killed with SIGKILL leaves its unsent events in a spool folder named with its
    pid; one whose process still runs is left alone. A spool is deleted once its file is
    sealed; one that cannot be uploaded now is kept for the next call. Returns the ledger
    URLs completed. On local disk there are no spools: nothing to do.
    """
    if storage.local_path(layout.url) is not None:
        return []
    prefix = _spool_prefix(layout)
    completed: list[str] = []
    for entry in os.scandir(tempfile.gettempdir()):
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if not entry.name.startswith(prefix) or not pid.isdigit() or not entry.is_dir():
            continue
        if processes.pid_alive(int(pid)):
            continue
        done = True
        for name in sorted(os.listdir(entry.path)):
            if not FILE_NAME.match(name):
                continue
            url = storage.join(layout.ledger, name)
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


def next_attempt(layout: JobLayout, role: str | None = None, rank: int | None = None) -> int:
    """One past the highest attempt number in the job's ledger files (0 for a new job):
    of any writer, or only of ``role`` (and ``rank``). The one rule for numbering attempts,
    so a job that is run again continues its numbering and its report covers every attempt."""
    numbers = []
    for url in storage.glob(storage.join(layout.ledger, "*.jsonl*")):
        m = FILE_NAME.match(url.rstrip("/").rsplit("/", 1)[-1])
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
    the file's first line (``clock``), beside the process's host and pid and its host's
    measured clock offset, when one was handed in (infra/accounting/host_offsets.py).
    """

    def __init__(
        self,
        layout: JobLayout,
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
        name = file_name(attempt, rank, role)
        self.url = storage.join(layout.ledger, name)
        self._lock = threading.Lock()
        local = storage.local_path(self.url)
        self._spool: _Spool | None = None
        if local is None:
            spool_dir = tempfile.mkdtemp(prefix=f"{_spool_prefix(layout)}{os.getpid()}-")
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
        attrs = clocks.identity() | host_offsets.clock_attrs() | (clock_attrs or {})
        self.mark(Mark.CLOCK, t=at, **attrs)

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
        times = f'"start":{encode_time(start)},"end":{encode_time(end)}'
        if self._mono is not None and mono is not None:
            times += f',"mono":[{encode_time(mono[0])},{encode_time(mono[1])}]'
        self._write(encode_line("span", name, times, self.attempt, self.rank, step, attrs))

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
        times = f'"t":{encode_time(t)}'
        if self._mono is not None:
            times += f',"mono":{encode_time(mono)}'
        self._write(encode_line("mark", name, times, self.attempt, self.rank, step, attrs))

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
