"""The ledger survives what training jobs do to it: torn writes, SIGKILL, object stores."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from infra import storage
from infra.accounting import ledger
from infra.accounting.ledger import Ledger, next_attempt, recover_orphaned_spools
from infra.accounting.ledger_format import parse_lines
from infra.accounting.ledger_read import read_events, read_files
from infra.job_layout import JobLayout

REPO = Path(__file__).resolve().parents[2]


def _ticking(start: float = 100.0, step: float = 1.0):  # noqa: ANN202 - a fake clock
    t = [start - step]

    def clock() -> float:
        t[0] += step
        return t[0]

    return clock


def test_span_and_mark_roundtrip_with_fake_clock(tmp_path) -> None:
    url = str(tmp_path / "job")
    with Ledger(JobLayout.at(url), attempt=2, rank=0, clock=_ticking()) as led:
        with led.span("train_step", step=7) as extra:
            extra["loss"] = 0.5
        led.mark("checkpoint_committed", step=7)
        assert led.sync()  # on local disk every event is stored as it is written
    span, mark = read_events(JobLayout.at(url))
    assert (span.kind, span.name, span.start, span.end, span.step) == (
        "span",
        "train_step",
        100.0,
        101.0,
        7,
    )
    assert span.attrs == {"loss": 0.5} and span.attempt == 2 and span.duration == 1.0
    assert (mark.kind, mark.start, mark.end, mark.step) == ("mark", 102.0, 102.0, 7)
    files = storage.listdir(JobLayout.at(url).ledger)
    assert files == ["trainer-attempt002-rank000.jsonl"]


def test_lines_are_the_documented_json_records(tmp_path) -> None:
    """The hand-formatted lines parse to exactly the records of the module docstring: a
    ``clock`` line naming the process first, then the events (a test's own clock writes no
    monotonic readings)."""
    url = str(tmp_path / "job")
    t = 1764500000.123456789  # a float whose repr needs all 17 digits
    with Ledger(JobLayout.at(url), attempt=1, rank=3, clock=lambda: t) as led:
        led.record_span(
            "eval", 1e-05, t, step=12, auc=0.75, note='quote " and \\ slash', path=Path("/x")
        )
        led.mark("failure", cause="sigkill")
        with pytest.raises(ValueError, match="finite"):
            led.record_span("eval", 0.0, float("nan"))
    path = tmp_path / "job" / "ledger" / "trainer-attempt001-rank003.jsonl"
    clock, span, mark = (json.loads(line) for line in path.read_text().splitlines())
    assert clock == {
        "v": 2,
        "kind": "mark",
        "name": "clock",
        "t": 0.0,
        "attempt": 1,
        "rank": 3,
        "attrs": {"host": socket.gethostname(), "boot": clock["attrs"]["boot"], "pid": os.getpid()},
    }
    assert span == {
        "v": 2,
        "kind": "span",
        "name": "eval",
        "start": 1e-05,
        "end": t,
        "attempt": 1,
        "rank": 3,
        "step": 12,
        "attrs": {"auc": 0.75, "note": 'quote " and \\ slash', "path": "/x"},
    }
    assert mark == {
        "v": 2,
        "kind": "mark",
        "name": "failure",
        "t": t,
        "attempt": 1,
        "rank": 3,
        "attrs": {"cause": "sigkill"},
    }


def test_attrs_of_every_plain_type_round_trip(tmp_path) -> None:
    url = str(tmp_path / "job")
    attrs = {"yes": True, "no": False, "none": None, "n": 7, "x": -0.25, "nan": float("nan")}
    with Ledger(JobLayout.at(url), clock=_ticking()) as led:
        led.mark("checkpoint_failed", step=3, **attrs, tags=["a", 1], more={"k": 2})
    [mark] = read_events(JobLayout.at(url))
    got = dict(mark.attrs)
    assert math.isnan(got.pop("nan"))  # a loss gone NaN is recorded, not dropped
    assert got == {
        "yes": True,
        "no": False,
        "none": None,
        "n": 7,
        "x": -0.25,
        "tags": ["a", 1],
        "more": {"k": 2},
    }
    assert type(got["n"]) is int and type(got["yes"]) is bool


def test_next_attempt_counts_every_writer_or_one_role_and_rank(tmp_path) -> None:
    url = str(tmp_path / "job")
    assert next_attempt(JobLayout.at(url)) == 0  # a new job
    for attempt, rank, role in [
        (0, 0, "trainer"),
        (0, 1, "trainer"),
        (1, 0, "orchestrator"),
        (2, 1, "trainer"),
        (4, 0, "publish"),
    ]:
        Ledger(JobLayout.at(url), attempt=attempt, rank=rank, role=role, clock=_ticking()).close()
    assert next_attempt(JobLayout.at(url)) == 5
    assert next_attempt(JobLayout.at(url), role="trainer") == 3
    assert next_attempt(JobLayout.at(url), role="trainer", rank=0) == 1
    assert next_attempt(JobLayout.at(url), role="orchestrator") == 2
    assert next_attempt(JobLayout.at(url), role="evaluator") == 0


def test_unknown_names_are_rejected(tmp_path) -> None:
    with Ledger(JobLayout.at(str(tmp_path / "job")), clock=_ticking()) as led:
        with pytest.raises(ValueError, match="unknown span"):
            led.record_span("trian_step", 1.0, 2.0)
        with pytest.raises(ValueError, match="unknown mark"):
            led.mark("failed")
        with pytest.raises(ValueError, match="unknown span"), led.span("warmup"):
            pass
    assert read_events(JobLayout.at(str(tmp_path / "job"))) == []


def test_torn_and_garbage_lines_are_skipped(tmp_path, caplog) -> None:
    url = str(tmp_path / "job")
    with Ledger(JobLayout.at(url), clock=_ticking()) as led:
        for step in range(1, 4):
            led.record_span("train_step", float(step), step + 0.5, step=step)
    path = tmp_path / "job" / "ledger" / "trainer-attempt000-rank000.jsonl"
    with open(path, "a") as fh:
        fh.write('{"v":1,"kind":"span","name":"train_st')  # torn: no end, no newline
    assert [e.step for e in read_events(JobLayout.at(url))] == [1, 2, 3]
    text = '{"kind":"mark"}\nnot json\n\n{"v":1,"kind":"mark","name":"job_end","t":5}\n'
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infra.accounting.ledger"):
        (event,) = parse_lines(text, source="hand.jsonl")
    assert event.name == "job_end" and event.start == 5.0
    # A line without the optional fields: attempt 0, rank 0, no step, no attrs.
    assert (event.attempt, event.rank, event.step, event.attrs) == (0, 0, None, {})
    # The warnings name each skipped line by its number in the file, counted from 1.
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping unreadable ledger line hand.jsonl:{n} (torn write?)" for n in (1, 2)
    ]


def _segments(led: Ledger) -> list[str]:
    return storage.listdir(led.url)


def test_object_storage_gets_appended_segments_not_rewrites() -> None:
    """Each upload is one small object holding only the lines appended since the last one;
    the reader reassembles them; close seals the file and deletes the local spool."""
    job = uuid.uuid4().hex
    url = f"memory://ledger-{job}"
    led = Ledger(
        JobLayout.at(url), rank=1, role="orchestrator", clock=_ticking(), sync_every_s=3600
    )
    # The spool folder is named after the job (the URL's last part), then its URL's hash.
    assert Path(led._local).parent.name.startswith(f"ett-ledger-ledger_{job}-")
    led.record_span("scheduling", 0.0, 1.0)
    assert led.sync()
    led.record_span("launcher_init", 1.0, 2.0)
    assert led.sync() and led.sync()  # nothing new: no empty segment
    first, second = _segments(led)
    assert (first, second) == (
        "000000000000",
        f"{len(storage.read_bytes(f'{led.url}/{first}')):012d}",
    )
    names = [e.name for e in parse_lines(storage.read_text(f"{led.url}/{first}"))]
    assert names == ["clock", "scheduling"]
    assert [e.name for e in parse_lines(storage.read_text(f"{led.url}/{second}"))] == [
        "launcher_init"
    ]
    events = read_events(JobLayout.at(url))  # not sealed yet: the reader says the file may go on
    assert [e.name for e in events] == ["scheduling", "launcher_init", "ledger_incomplete"]
    assert events[-1].attrs == {
        "file": "orchestrator-attempt000-rank001.jsonl",
        "role": "orchestrator",
    }
    assert (events[-1].start, events[-1].rank) == (2.0, 1)
    led.mark("failure", t=3.0, cause="hang", step=9)
    assert led.close() is True and led.close() is True
    assert _segments(led)[-1].endswith(".final") and len(_segments(led)) == 3
    events = read_events(JobLayout.at(url))
    assert [e.name for e in events] == ["scheduling", "launcher_init", "failure"]
    assert events[-1].attrs == {"cause": "hang"} and events[-1].rank == 1
    assert storage.listdir(JobLayout.at(url).ledger) == ["orchestrator-attempt000-rank001.jsonl"]
    assert not Path(led._local).parent.exists(), "the local spool outlived its upload"


def test_uploads_run_on_the_uploader_thread_not_the_writer(monkeypatch) -> None:
    writers: list[str] = []
    real = storage.write_bytes

    def recording(url: str, data: bytes) -> None:
        writers.append(threading.current_thread().name)
        real(url, data)

    monkeypatch.setattr(storage, "write_bytes", recording)
    url = f"memory://ledger-{uuid.uuid4().hex}"
    led = Ledger(JobLayout.at(url), clock=_ticking(), sync_every_s=0.05)
    for step in range(1, 4):
        led.record_span("train_step", float(step), step + 0.5, step=step)
    deadline = time.monotonic() + 30
    while len([e for e in read_events(JobLayout.at(url)) if e.name == "train_step"]) < 3:
        assert time.monotonic() < deadline, "the uploader never stored the events"
        time.sleep(0.05)
    # Stored, but not sealed while the writer is open: a reader knows more may come.
    assert read_files(JobLayout.at(url))[0].incomplete
    assert not any(name.endswith(".final") for name in _segments(led))
    assert led.close()
    assert writers and threading.current_thread().name not in writers, writers
    assert set(writers) == {"ledger-trainer-attempt000-rank000.jsonl"}


def test_a_sync_mid_line_stores_only_whole_lines(monkeypatch) -> None:
    """A sync while the writer is mid-line stores the lines before it; the line goes with
    the next segment, whole."""
    monkeypatch.setattr(ledger, "FIRST_SYNC_S", 3600.0)  # only the sync below uploads
    url = f"memory://ledger-{uuid.uuid4().hex}"
    led = Ledger(JobLayout.at(url), clock=_ticking(), sync_every_s=3600)
    led.record_span("train_step", 1.0, 1.5, step=1)
    whole = Path(led._local).read_bytes()
    line = b'{"v":1,"kind":"span","name":"train_step","start":2.0,"end":2.5,"attempt":0,"rank":0}\n'
    os.write(led._fd, line[:20])  # the writer is mid-line
    assert led.sync()
    assert _segments(led) == ["000000000000"]
    assert storage.read_bytes(f"{led.url}/000000000000") == whole
    os.write(led._fd, line[20:])
    assert led.close()
    assert _segments(led) == ["000000000000", f"{len(whole):012d}.final"]
    assert storage.read_bytes(f"{led.url}/{len(whole):012d}.final") == line
    assert [e.start for e in read_events(JobLayout.at(url))] == [1.0, 2.0]


def test_reader_takes_overlapping_segments_once_and_skips_a_torn_tail() -> None:
    """A segment stored again with more bytes (a retry that had in fact succeeded) and a
    recovered tail ending in a torn line: every event once, in order, the torn one skipped."""
    url = f"memory://ledger-{uuid.uuid4().hex}"
    lines = [
        f'{{"v":1,"kind":"span","name":"train_step","start":{s}.0,"end":{s}.5,"attempt":2,'
        f'"rank":0,"step":{s}}}\n'.encode()
        for s in range(1, 5)
    ]
    folder = f"{JobLayout.at(url).ledger}/trainer-attempt002-rank000.jsonl"
    storage.write_bytes(f"{folder}/000000000000", lines[0])
    storage.write_bytes(f"{folder}/{0:012d}.final", lines[0] + lines[1] + b'{"v":1,"ki')
    storage.write_bytes(f"{folder}/{len(lines[0]):012d}", lines[1])
    (file,) = read_files(JobLayout.at(url))
    assert not file.incomplete and file.data == lines[0] + lines[1] + b'{"v":1,"ki'
    assert [e.step for e in read_events(JobLayout.at(url))] == [1, 2]
    # Unsealed: the reader's mark at the last event, with the file's attempt, rank and role.
    other = f"{JobLayout.at(url).ledger}/trainer-attempt003-rank000.jsonl"
    storage.write_bytes(f"{other}/000000000000", lines[2] + lines[3])
    mark = read_events(JobLayout.at(url))[-1]
    assert (mark.name, mark.start, mark.attempt, mark.attrs["role"]) == (
        "ledger_incomplete",
        4.5,
        3,
        "trainer",
    )


def test_a_failed_final_upload_is_reported_and_keeps_the_spooled_events(monkeypatch) -> None:
    led = Ledger(
        JobLayout.at(f"memory://ledger-{uuid.uuid4().hex}"), clock=_ticking(), sync_every_s=3600
    )
    led.mark("failure", cause="sigkill")

    def outage(*args: object) -> None:
        raise OSError("storage unreachable")

    monkeypatch.setattr(storage, "write_bytes", outage)
    assert led.close() is False and led.close() is False
    kept = Path(led._local).read_text()
    assert '"cause":"sigkill"' in kept
    shutil.rmtree(Path(led._local).parent)  # no later attempt of this job will take it


def test_events_from_all_files_are_merged_in_time_order(tmp_path) -> None:
    url = str(tmp_path / "job")
    with (
        Ledger(JobLayout.at(url), attempt=1, clock=_ticking()) as a1,
        Ledger(JobLayout.at(url), attempt=0, clock=_ticking()),
    ):
        a1.record_span("train_step", 5.0, 6.0, step=2)
    with Ledger(JobLayout.at(url), attempt=0, clock=_ticking()) as a0:
        a0.record_span("train_step", 1.0, 2.0, step=1)
        a0.mark("failure", t=3.0)
    assert [(e.start, e.attempt) for e in read_events(JobLayout.at(url))] == [
        (1.0, 0),
        (3.0, 0),
        (5.0, 1),
    ]


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from infra.accounting.ledger import Ledger
    from infra.job_layout import JobLayout
    url, n = sys.argv[1], int(sys.argv[2])
    led = Ledger(JobLayout.at(url))
    for step in range(1, n + 1):
        with led.span("train_step", step=step):
            pass
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_events_survive_sigkill(tmp_path) -> None:
    url, n = str(tmp_path / "job"), 200
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, url, str(n)], cwd=REPO, capture_output=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr.decode()
    events = read_events(JobLayout.at(url))
    assert len(events) >= n - 1
    assert [e.step for e in events] == list(range(1, len(events) + 1))
    path = tmp_path / "job" / "ledger" / "trainer-attempt000-rank000.jsonl"
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines[1:n]]
    assert json.loads(lines[0])["name"] == "clock"
    assert all(r["name"] == "train_step" and len(r["mono"]) == 2 for r in records)


KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys, time
    import infra.accounting.ledger
    from infra.accounting.ledger import Ledger
    from infra.job_layout import JobLayout
    infra.accounting.ledger.FIRST_SYNC_S = 3600.0  # only the explicit sync below uploads
    t0 = time.time() - 10.0  # steps that ended before now, on this process's clock
    for job in sys.argv[1:]:
        led = Ledger(JobLayout.at(job), sync_every_s=3600.0)
        for step in range(1, 4):
            led.record_span("train_step", t0 + step, t0 + step + 0.5, step=step)
        assert led.sync()
        for step in range(4, 8):
            led.record_span("train_step", t0 + step, t0 + step + 0.5, step=step)
        os.write(led._fd, b'{"v":1,"kind":"span","name":"train_st')  # killed mid-line
        print(os.path.dirname(led._local), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_killed_writers_spool_is_recovered_by_the_next_process(s3_server: str) -> None:
    """On S3: a process SIGKILLed after one upload leaves its later events in its spool; the
    next process of the same job on the node uploads and seals them, leaves a live writer's
    spool and another job's spool alone, and deletes the spool it completed."""
    storage.configure(None)
    job, other = (f"s3://ett/{uuid.uuid4().hex[:12]}/jobs/led" for _ in range(2))
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, job, other],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    spool, other_spool = (Path(p) for p in proc.stdout.split())
    before = read_events(JobLayout.at(job))
    assert [e.step for e in before if e.name == "train_step"] == [1, 2, 3]
    # The mark stands at the end of the last event stored: step 3's.
    assert before[-1].name == "ledger_incomplete" and before[-1].start == before[-2].end

    with Ledger(JobLayout.at(job), attempt=1, clock=_ticking(), sync_every_s=3600.0) as live:
        live.mark("attempt_start")
        url = f"{JobLayout.at(job).ledger}/trainer-attempt000-rank000.jsonl"
        assert recover_orphaned_spools(JobLayout.at(job)) == [url]
        assert Path(live._local).exists(), "a live writer's spool was touched"
        assert not spool.exists() and other_spool.exists()
        assert recover_orphaned_spools(JobLayout.at(job)) == []  # done once

    after = [e for e in read_events(JobLayout.at(job)) if e.attempt == 0]
    assert [e.step for e in after] == list(range(1, 8))  # once each, the torn line skipped
    # The rest went as one sealing segment from where the stored part ended: nothing twice.
    first = len(storage.read_bytes(f"{url}/000000000000"))
    assert storage.listdir(url) == ["000000000000", f"{first:012d}.final"]
    assert not any(e.name == "ledger_incomplete" for e in read_events(JobLayout.at(job)))
    assert recover_orphaned_spools(JobLayout.at(other)) and not other_spool.exists()


EXITS_WITHOUT_CLOSING = textwrap.dedent(
    """
    import sys, time
    from infra.accounting.ledger import Ledger
    from infra.job_layout import JobLayout
    t0 = time.time() - 10.0  # steps that ended before now, on this process's clock
    for job in sys.argv[1:]:
        led = Ledger(JobLayout.at(job), sync_every_s=3600.0)
        for step in range(1, 4):
            led.record_span("train_step", t0 + step, t0 + step + 0.5, step=step)
        print(led._local, flush=True)
    """
)


def test_a_writer_that_exits_without_closing_neither_hangs_nor_loses_events() -> None:
    """A process that ends without closing its ledger (an exception out of main) exits: the
    uploader thread does not hold it. Its events wait in its spool and the next process
    uploads and seals them. Its memory:// store ended with it, so seen from here nothing was
    ever uploaded: the whole spool goes. A spool whose file is sealed already (the writer
    died between its last upload and deleting the spool) is only deleted."""
    jobs = [f"memory://ledger-{uuid.uuid4().hex}" for _ in range(2)]
    proc = subprocess.run(
        [sys.executable, "-c", EXITS_WITHOUT_CLOSING, *jobs],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,  # a writer held by its uploader thread never exits
    )
    assert proc.returncode == 0, proc.stderr
    spools = [Path(p) for p in proc.stdout.split()]
    lost, sealed = (f"{JobLayout.at(job).ledger}/trainer-attempt000-rank000.jsonl" for job in jobs)
    storage.write_bytes(f"{sealed}/000000000000.final", spools[1].read_bytes())

    assert recover_orphaned_spools(JobLayout.at(jobs[0])) == [lost]
    assert storage.listdir(lost) == ["000000000000.final"]
    assert [e.step for e in read_events(JobLayout.at(jobs[0]))] == [1, 2, 3]
    assert recover_orphaned_spools(JobLayout.at(jobs[1])) == [sealed]
    assert storage.listdir(sealed) == ["000000000000.final"]
    assert not any(spool.parent.exists() for spool in spools)


def test_a_spool_whose_recovery_upload_fails_is_kept_for_the_next_recovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed writer's spool (its first lines stored, the rest not) met by a storage outage:
    neither a failed listing nor a failed upload loses it. Nothing is reported completed, the
    spool stays as it was, the stored part is untouched; the next recovery, once storage
    answers, stores the rest once, from where the stored part ends, and deletes the spool."""
    job = f"memory://ledger-{uuid.uuid4().hex}"
    with Ledger(
        JobLayout.at(str(tmp_path / "lines")), clock=_ticking()
    ) as local:  # the same lines, on disk
        for step in range(1, 7):
            local.record_span("train_step", float(step), step + 0.5, step=step)
    data = (tmp_path / "lines" / "ledger" / "trainer-attempt000-rank000.jsonl").read_bytes()
    lines = data.splitlines(keepends=True)
    first = len(b"".join(lines[:3]))  # its clock line and two steps stored before the kill
    url = f"{JobLayout.at(job).ledger}/trainer-attempt000-rank000.jsonl"
    storage.write_bytes(f"{url}/000000000000", data[:first])
    dead = subprocess.Popen(["true"])
    dead.wait()
    spool = Path(tempfile.mkdtemp(prefix=f"{ledger._spool_prefix(JobLayout.at(job))}{dead.pid}-"))
    (spool / "trainer-attempt000-rank000.jsonl").write_bytes(data)
    try:
        real_call, real_write = storage.call, storage.write_bytes

        def outage(*args: object, **kwargs: object) -> None:
            raise storage.StorageError("storage unreachable")

        monkeypatch.setattr(storage, "call", outage)  # cannot even list what is stored
        assert recover_orphaned_spools(JobLayout.at(job)) == []
        monkeypatch.setattr(storage, "call", real_call)
        monkeypatch.setattr(storage, "write_bytes", outage)  # lists, cannot upload
        assert recover_orphaned_spools(JobLayout.at(job)) == []
        monkeypatch.setattr(storage, "write_bytes", real_write)

        assert (spool / "trainer-attempt000-rank000.jsonl").read_bytes() == data
        assert storage.listdir(url) == ["000000000000"]
        assert [e.step for e in read_events(JobLayout.at(job)) if e.name == "train_step"] == [1, 2]

        assert recover_orphaned_spools(JobLayout.at(job)) == [url]
        assert not spool.exists()
        assert storage.listdir(url) == ["000000000000", f"{first:012d}.final"]
        events = read_events(JobLayout.at(job))
        assert [e.step for e in events] == list(range(1, 7))  # each once, none missing
        assert recover_orphaned_spools(JobLayout.at(job)) == []
    finally:
        shutil.rmtree(spool, ignore_errors=True)
