"""The ledger survives what training jobs do to it: torn writes, SIGKILL, object stores."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from infra import storage
from infra.ledger import Ledger, ledger_url, parse_lines, read_events

REPO = Path(__file__).resolve().parents[2]


def _ticking(start: float = 100.0, step: float = 1.0):  # noqa: ANN202 - a fake clock
    t = [start - step]

    def clock() -> float:
        t[0] += step
        return t[0]

    return clock


def test_span_and_mark_roundtrip_with_fake_clock(tmp_path) -> None:
    url = str(tmp_path / "job")
    with Ledger(url, attempt=2, rank=0, clock=_ticking()) as led:
        with led.span("train_step", step=7) as extra:
            extra["loss"] = 0.5
        led.mark("checkpoint_committed", step=7)
    span, mark = read_events(url)
    assert (span.kind, span.name, span.start, span.end, span.step) == (
        "span",
        "train_step",
        101.0,
        102.0,
        7,
    )
    assert span.attrs == {"loss": 0.5} and span.attempt == 2 and span.duration == 1.0
    assert (mark.kind, mark.start, mark.end, mark.step) == ("mark", 103.0, 103.0, 7)
    files = storage.listdir(ledger_url(url))
    assert files == ["trainer-attempt002-rank000.jsonl"]


def test_lines_are_the_documented_json_records(tmp_path) -> None:
    """The hand-formatted lines parse to exactly the records of the module docstring."""
    url = str(tmp_path / "job")
    t = 1764500000.123456789  # a float whose repr needs all 17 digits
    with Ledger(url, attempt=1, rank=3, clock=lambda: t) as led:
        led.record_span(
            "eval", 1e-05, t, step=12, auc=0.75, note='quote " and \\ slash', path=Path("/x")
        )
        led.mark("failure", cause="sigkill")
        with pytest.raises(ValueError, match="finite"):
            led.record_span("eval", 0.0, float("nan"))
    path = tmp_path / "job" / "ledger" / "trainer-attempt001-rank003.jsonl"
    span, mark = (json.loads(line) for line in path.read_text().splitlines())
    assert span == {
        "v": 1,
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
        "v": 1,
        "kind": "mark",
        "name": "failure",
        "t": t,
        "attempt": 1,
        "rank": 3,
        "attrs": {"cause": "sigkill"},
    }


def test_unknown_names_are_rejected(tmp_path) -> None:
    with Ledger(str(tmp_path / "job"), clock=_ticking()) as led:
        with pytest.raises(ValueError, match="unknown span"):
            led.record_span("trian_step", 1.0, 2.0)
        with pytest.raises(ValueError, match="unknown mark"):
            led.mark("failed")
        with pytest.raises(ValueError, match="unknown span"), led.span("warmup"):
            pass
    assert read_events(str(tmp_path / "job")) == []


def test_torn_and_garbage_lines_are_skipped(tmp_path) -> None:
    url = str(tmp_path / "job")
    with Ledger(url, clock=_ticking()) as led:
        for step in range(1, 4):
            led.record_span("train_step", float(step), step + 0.5, step=step)
    path = tmp_path / "job" / "ledger" / "trainer-attempt000-rank000.jsonl"
    with open(path, "a") as fh:
        fh.write('{"v":1,"kind":"span","name":"train_st')  # torn: no end, no newline
    assert [e.step for e in read_events(url)] == [1, 2, 3]
    text = '{"kind":"mark"}\nnot json\n\n{"v":1,"kind":"mark","name":"job_end","t":5}\n'
    (event,) = parse_lines(text)
    assert event.name == "job_end" and event.start == 5.0


def test_memory_url_uploads_on_close_and_periodically() -> None:
    url = f"memory://ledger-{uuid.uuid4().hex}"
    clock = _ticking(step=6.0)
    led = Ledger(url, rank=1, role="orchestrator", clock=clock, sync_every_s=10.0)
    led.record_span("scheduling", 0.0, 1.0)  # clock 106: 6 s since open, not due
    assert read_events(url) == []
    led.record_span("launcher_init", 1.0, 2.0)  # clock 112: due -> uploaded
    assert [e.name for e in read_events(url)] == ["scheduling", "launcher_init"]
    led.mark("failure", t=3.0, cause="hang", step=9)
    led.close()
    events = read_events(url)
    assert events[-1].attrs == {"cause": "hang"} and events[-1].rank == 1
    assert storage.listdir(ledger_url(url)) == ["orchestrator-attempt000-rank001.jsonl"]
    assert not Path(led._local).parent.exists(), "the local spool outlived its upload"


def test_a_failed_final_upload_keeps_the_spooled_events(monkeypatch) -> None:
    led = Ledger(f"memory://ledger-{uuid.uuid4().hex}", clock=_ticking())
    led.mark("failure", cause="sigkill")

    def outage(*args: object) -> None:
        raise OSError("storage unreachable")

    monkeypatch.setattr(storage, "put_file", outage)
    led.close()
    kept = Path(led._local).read_text()
    assert '"cause":"sigkill"' in kept


def test_events_from_all_files_are_merged_in_time_order(tmp_path) -> None:
    url = str(tmp_path / "job")
    with Ledger(url, attempt=1, clock=_ticking()) as a1, Ledger(url, attempt=0, clock=_ticking()):
        a1.record_span("train_step", 5.0, 6.0, step=2)
    with Ledger(url, attempt=0, clock=_ticking()) as a0:
        a0.record_span("train_step", 1.0, 2.0, step=1)
        a0.mark("failure", t=3.0)
    assert [(e.start, e.attempt) for e in read_events(url)] == [(1.0, 0), (3.0, 0), (5.0, 1)]


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from infra.ledger import Ledger
    url, n = sys.argv[1], int(sys.argv[2])
    led = Ledger(url)
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
    events = read_events(url)
    assert len(events) >= n - 1
    assert [e.step for e in events] == list(range(1, len(events) + 1))
    path = tmp_path / "job" / "ledger" / "trainer-attempt000-rank000.jsonl"
    lines = path.read_text().splitlines()
    assert all(json.loads(line)["name"] == "train_step" for line in lines[: n - 1])
