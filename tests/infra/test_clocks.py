"""Which ledger times the reader believes (infra/accounting/clocks.py): real writers on a real
clock, their files then altered the way a fault alters them (a flipped digit, a clock that ran
ahead), read back through ``read_ledger``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from infra.accounting import clocks
from infra.accounting.clocks import TOLERANCE_S
from infra.accounting.ett import report_for_job
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Event
from infra.accounting.ledger_read import read_ledger
from infra.job_layout import JobLayout


def _job(tmp_path: Path) -> str:
    return f"file://{tmp_path}/job"


def _write(job: str, attempt: int, steps: int, role: str = "trainer") -> None:
    """A process that trains ``steps`` steps of 10 ms, on the real clocks."""
    with Ledger(JobLayout.at(job), attempt=attempt, role=role) as led:
        led.mark("attempt_start")
        for step in range(1, steps + 1):
            with led.span("train_step", step=step):
                time.sleep(0.01)
        led.mark("job_end", step=steps)


def _edit(job: str, name: str, change) -> None:
    """Rewrite a ledger file line by line: ``change(record) -> record``."""
    path = Path(job.removeprefix("file://")) / "ledger" / name
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(change(r)) + "\n" for r in lines))


def test_times_that_agree_are_kept_and_durations_are_monotonic(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _write(job, 0, 5)
    read = read_ledger(JobLayout.at(job))
    steps = [e for e in read.events if e.name == "train_step"]
    assert read.clock.clean and read.clock.notes() == []
    for e in steps:
        assert e.mono is not None
        assert e.duration == pytest.approx(e.mono[1] - e.mono[0], abs=1e-6)
        assert e.source == "trainer-attempt000-rank000.jsonl"
    assert [e.step for e in steps] == [1, 2, 3, 4, 5]


def test_a_flipped_digit_in_a_steps_end_never_stretches_the_wall_time(tmp_path: Path) -> None:
    """The finding: one ``end`` with a flipped digit (valid JSON) made the report say wall
    8.0e9 s and ETT 100%. Now the wall reading is rejected, counted, and the step is timed
    by its monotonic reading."""
    job = _job(tmp_path)
    _write(job, 0, 20)
    clean = report_for_job(JobLayout.at(job))

    def flip(rec: dict) -> dict:
        if rec.get("step") == 7 and rec["name"] == "train_step":
            rec["end"] = float("8" + repr(rec["end"])[1:])  # 1.7e9 -> 8.7e9
        return rec

    _edit(job, "trainer-attempt000-rank000.jsonl", flip)
    report = report_for_job(JobLayout.at(job))
    assert report.wall_s == pytest.approx(clean.wall_s, abs=1e-3)
    assert report.ett_pct == pytest.approx(clean.ett_pct, abs=0.01)
    assert report.num_steps == 20
    assert report.clock.retimed == 1 and report.clock.rejected == 0
    notes = report.clock.notes()
    assert "1 event time(s) rejected" in notes[0]
    assert "trainer-attempt000-rank000.jsonl line" in notes[1] and "step 7" in notes[1]


def test_a_corrupt_monotonic_reading_falls_back_to_the_wall_time(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _write(job, 0, 10)
    clean = report_for_job(JobLayout.at(job))

    def corrupt(rec: dict) -> dict:
        if rec.get("step") == 4 and rec["name"] == "train_step":
            rec["mono"] = [rec["mono"][0], rec["mono"][1] + 9e6]
        return rec

    _edit(job, "trainer-attempt000-rank000.jsonl", corrupt)
    report = report_for_job(JobLayout.at(job))
    assert report.wall_s == pytest.approx(clean.wall_s, abs=1e-3)
    assert report.clock.retimed == 1
    assert "monotonic reading does not fit" in report.clock.notes()[1]


def test_an_event_with_no_plausible_time_is_dropped(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _write(job, 0, 10)

    def both(rec: dict) -> dict:
        if rec.get("step") == 4 and rec["name"] == "train_step":
            rec["end"] += 5e8
            rec["mono"] = [rec["mono"][0], rec["mono"][1] + 5e8]
        return rec

    _edit(job, "trainer-attempt000-rank000.jsonl", both)
    report = report_for_job(JobLayout.at(job))
    assert report.clock.rejected == 1
    assert report.wall_s < 10  # the job took well under a second of steps
    assert report.num_steps == 9


def test_a_process_whose_clock_ran_ahead_on_this_host_is_timed_by_its_monotonic_clock(
    tmp_path: Path,
) -> None:
    """The finding: a resumed job whose earlier ledger is 90 s ahead of this host's clock
    reported a stretched wall and a wrong ETT. Processes of one host share a monotonic
    clock: the earlier one is moved onto the newest one's offset, and the report says so."""
    job = _job(tmp_path)
    _write(job, 0, 10)
    _write(job, 1, 10)
    clean = report_for_job(JobLayout.at(job))

    def ahead(rec: dict) -> dict:
        for key in ("start", "end", "t"):
            if key in rec and rec["name"] != "clock":
                rec[key] += 90.0
        return rec

    _edit(job, "trainer-attempt000-rank000.jsonl", ahead)
    report = report_for_job(JobLayout.at(job))
    assert report.wall_s == pytest.approx(clean.wall_s, abs=1e-3)
    [offset] = report.clock.offsets
    assert offset.offset_s == pytest.approx(90.0, abs=0.01)
    assert "trainer-attempt000-rank000.jsonl" in offset.what
    assert "ran 90.0 s ahead" in report.clock.notes()[0]


def test_another_hosts_lead_is_taken_from_the_bound_measured_at_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host (its own monotonic clock) ran 90 s ahead: the orchestrator that resumed
    the job found that host's last event in its own future and recorded the bound; the
    report moves that host's events back by it."""
    job = _job(tmp_path)
    monkeypatch.setattr(clocks, "_SHIFT", 90.0)
    monkeypatch.setenv(clocks.ENV_HOST, "other-host")
    _write(job, 0, 10)
    monkeypatch.setattr(clocks, "_SHIFT", 0.0)
    monkeypatch.delenv(clocks.ENV_HOST)
    from infra.accounting.ledger_read import domains_ahead

    ahead = domains_ahead(JobLayout.at(job))
    assert list(ahead) == ["other-host/"] and 85.0 < ahead["other-host/"] <= 90.0
    with Ledger(
        JobLayout.at(job), attempt=1, role="orchestrator", clock_attrs={"ahead": ahead}
    ) as orch:
        orch.mark("failure", cause="crash")
    _write(job, 1, 10)
    report = report_for_job(JobLayout.at(job))
    assert report.wall_s < 5.0  # 20 steps of 10 ms and the gap between the writers
    assert any("host other-host ran" in note for note in report.clock.notes())


def test_a_host_without_any_measurement_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path)
    monkeypatch.setenv(clocks.ENV_HOST, "unmeasured")
    _write(job, 0, 3)
    monkeypatch.delenv(clocks.ENV_HOST)
    with Ledger(JobLayout.at(job), attempt=1, role="orchestrator") as orch:
        orch.mark("failure", cause="crash")
    read = read_ledger(JobLayout.at(job))
    assert read.clock.unaligned == ("unmeasured/",)
    assert "host unmeasured has no measured offset" in read.clock.notes()[-1]


def test_a_ledger_of_version_1_drops_a_line_far_from_its_neighbours(tmp_path: Path) -> None:
    """No monotonic readings and no ``clock`` line (written before version 2): a line whose
    time lies hours from the lines written around it is dropped and counted."""
    folder = Path(tmp_path, "job", "ledger")
    folder.mkdir(parents=True)
    t0 = 1_700_000_000.0
    lines = [
        {
            "v": 1,
            "kind": "span",
            "name": "train_step",
            "start": t0 + i,
            "end": t0 + i + 0.5,
            "attempt": 0,
            "rank": 0,
            "step": i,
        }
        for i in range(1, 9)
    ]
    lines[3]["end"] = 8.7e9
    (folder / "trainer-attempt000-rank000.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines)
    )
    report = report_for_job(JobLayout.at(_job(tmp_path)))
    assert report.clock.rejected == 1 and report.num_steps == 7
    assert report.wall_s == pytest.approx(7.5)


def test_a_tests_own_clock_and_hand_built_events_are_taken_as_written(tmp_path: Path) -> None:
    job = _job(tmp_path)
    with Ledger(JobLayout.at(job), clock=lambda: 5.0) as led:
        led.record_span("train_step", 1.0, 2.0, step=1)
        led.record_span("train_step", 9.0e9, 9.0e9 + 1, step=2)  # a test's timeline
    read = read_ledger(JobLayout.at(job))
    assert [(e.start, e.end) for e in read.events] == [(1.0, 2.0), (9.0e9, 9.0e9 + 1)]
    loose = [Event("span", "train_step", 1.0, 2.0, 0, 0, 1)]
    assert clocks.align(loose, {}) == (loose, clocks.ClockCheck())


def test_the_clock_line_names_the_process_and_is_never_an_event(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _write(job, 0, 1)
    path = Path(
        JobLayout.at(job).ledger.removeprefix("file://"), "trainer-attempt000-rank000.jsonl"
    )
    first = json.loads(path.read_text().splitlines()[0])
    assert first["name"] == "clock" and set(first["attrs"]) >= {"host", "boot", "pid"}
    assert abs(first["t"] - first["mono"] - (time.time() - time.monotonic())) < TOLERANCE_S
    assert "clock" not in {e.name for e in read_ledger(JobLayout.at(job)).events}


def test_a_wall_reading_is_believed_within_a_second_and_rejected_beyond(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _write(job, 0, 12)

    def off(rec: dict) -> dict:
        if rec["name"] == "train_step" and rec["step"] in (3, 8):
            rec["end"] += 0.6 if rec["step"] == 3 else 1.5
        return rec

    _edit(job, "trainer-attempt000-rank000.jsonl", off)
    read = read_ledger(JobLayout.at(job))
    assert read.clock.retimed == 1  # step 8's; step 3's 0.6 s is within the tolerance
    assert "(train_step step 8)" in read.clock.examples[0]


def test_the_report_names_the_first_three_rejected_lines_by_their_line_number(
    tmp_path: Path,
) -> None:
    """Line 1 is the clock line, line 2 attempt_start: step n is on line n + 2."""
    job = _job(tmp_path)
    _write(job, 0, 12)

    def flip(rec: dict) -> dict:
        if rec["name"] == "train_step" and rec["step"] in (2, 4, 6, 8):
            rec["end"] += 1e6
        return rec

    _edit(job, "trainer-attempt000-rank000.jsonl", flip)
    check = read_ledger(JobLayout.at(job)).clock
    assert check.retimed == 4
    assert [e.split(" (")[0] for e in check.examples] == [
        f"trainer-attempt000-rank000.jsonl line {n}" for n in (4, 6, 8)
    ]


def test_times_that_agree_with_each_other_but_not_with_where_they_were_written(
    tmp_path: Path,
) -> None:
    """Both readings moved alike: the line is out of place in its file. 100 s after the
    lines written after it: dropped. 700 s before its process opened the file: dropped,
    except ``scheduling`` (the flow run's wait before the process). Ending before it starts:
    dropped."""
    job = _job(tmp_path)
    with Ledger(JobLayout.at(job)) as led:
        t = led.clock()
        led.record_span("scheduling", t - 3600.0, t - 1.0)
        led.record_span("launcher_init", t - 700.0, t - 0.5)
        for step in range(1, 9):
            with led.span("train_step", step=step):
                time.sleep(0.005)
        led.record_span("eval", t + 0.2, t + 0.1)

    def move(rec: dict) -> dict:
        if rec["name"] == "train_step" and rec["step"] == 3:
            rec["start"] += 100.0
            rec["end"] += 100.0
            rec["mono"] = [m + 100.0 for m in rec["mono"]]
        return rec

    _edit(job, "trainer-attempt000-rank000.jsonl", move)
    read = read_ledger(JobLayout.at(job))
    names = [(e.name, e.step) for e in read.events]
    assert ("scheduling", None) in names
    assert ("launcher_init", None) not in names and ("train_step", 3) not in names
    assert ("eval", None) not in names
    assert read.clock.rejected == 3 and read.clock.retimed == 0
    why = {e.split(": ", 1)[0].split("(")[1]: e.split(": ", 1)[1] for e in read.clock.examples}
    assert why["launcher_init)"].endswith("s before its process")
    assert why["train_step step 3)"].endswith("s after the lines written after it")
    assert why["eval)"] == "ends before it starts"


def test_a_process_whose_clock_ran_behind_is_said_behind(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _write(job, 0, 5)
    _write(job, 1, 5)

    def behind(rec: dict) -> dict:
        for key in ("start", "end", "t"):
            if key in rec and rec["name"] != "clock":
                rec[key] -= 30.0
        return rec

    _edit(job, "trainer-attempt000-rank000.jsonl", behind)
    notes = read_ledger(JobLayout.at(job)).clock.notes()
    assert len(notes) == 1 and "ran 30.0 s behind its newest process" in notes[0]


def test_the_injected_clock_fault_and_host_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, shift in (("90", 90.0), ("-2.5", -2.5), ("", 0.0), ("soon", 0.0)):
        monkeypatch.setenv(clocks.ENV_SHIFT, text)
        assert clocks._shift() == shift
    assert clocks.label("node-1/0123456789abcdef") == "node-1, boot 01234567"
    assert clocks.label("other-host/") == "other-host"
    monkeypatch.setenv(clocks.ENV_HOST, "h2")
    assert clocks.identity()["host"] == "h2" and clocks.domain_of(clocks.identity()) == "h2/"
