"""Hosts moved onto the job's reference clock by a measured offset (rule 5 of
infra/accounting/clocks.py, infra/accounting/host_offsets.py).

The job: an orchestrator on host ``orch-1`` (the reference) and the trainer's rank 0 on host
``node-1``, two attempts, a SIGKILL after step 27 with step 20 committed. Its ledger files are
written by hand, line by line with the format's own encoder, as infra/accounting/ledger.py
would have written them: every time has its wall reading (the true time, plus the host's
clock error) and its monotonic reading (the host's own monotonic clock, which no clock error
touches). The same job is written once with true clocks and once with ``node-1``'s wall clock
5 s ahead, and the reports are compared.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

from infra.accounting import clocks, host_offsets
from infra.accounting.ett import EttReport, compute_report
from infra.accounting.host_offsets import CLOCK_ATTR, ENV_OFFSET, ClockSample
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import FILE_NAME, encode_line, encode_time
from infra.accounting.ledger_read import LedgerRead, read_ledger
from infra.accounting.report import format_table
from infra.job_layout import JobLayout

T0 = 1_700_000_000.0  # the job's start, on the reference's clock
ORCH, NODE = "orch-1", "node-1"
MONO_AT_T0 = {ORCH: 3_000.0, NODE: 90_000.0}  # each host's monotonic clock: unrelated
BOOT = {ORCH: "0b5e55ed-5d1c-4a44-9d2e-51f0c9a1e001", NODE: "7ac1d00d-0c1e-4d3a-8b7e-0e5a2c9f4002"}
REF = f"{ORCH}/{BOOT[ORCH]}"  # the orchestrator's clock domain (host/boot)
NODE_DOMAIN = f"{NODE}/{BOOT[NODE]}"
SHIFT_S = 5.0

Line = tuple[str, str, float, float, int | None, dict[str, Any]]


def span(name: str, start: float, end: float, step: int | None = None, **attrs: Any) -> Line:
    return ("span", name, start, end, step, attrs)


def mark(name: str, t: float, step: int | None = None, **attrs: Any) -> Line:
    return ("mark", name, t, t, step, attrs)


def _steps(first: int, last: int, at: float) -> list[Line]:
    """Steps of 0.45 s every 0.5 s from ``at``; a checkpoint after every 10th."""
    out = []
    for k in range(first, last + 1):
        s = at + 0.5 * (k - first)
        out.append(span("train_step", s, s + 0.45, step=k))
        if k % 10 == 0:
            out += [span("checkpoint_blocking", s + 0.45, s + 0.5, step=k)]
            out += [mark("checkpoint_committed", s + 0.5, step=k)]
    return out


JOB: dict[tuple[str, str], list[Line]] = {  # (file, host): its lines, in true seconds from T0
    ("orchestrator-attempt000-rank000.jsonl", ORCH): [
        span("scheduling", 0.0, 0.5),
        span("launcher_init", 0.5, 3.0),
        mark("failure", 21.0, step=27, cause="sigkill"),
    ],
    ("orchestrator-attempt001-rank000.jsonl", ORCH): [span("launcher_init", 21.5, 23.0)],
    ("trainer-attempt000-rank000.jsonl", NODE): [
        mark("attempt_start", 1.0),
        span("device_init", 1.0, 1.5),
        span("pre_train", 1.5, 3.5),
        *_steps(1, 27, 4.0),  # killed after step 27; step 20 committed
    ],
    ("trainer-attempt001-rank000.jsonl", NODE): [
        mark("attempt_start", 22.0),
        span("pre_train", 22.0, 23.5),
        *_steps(21, 40, 24.0),
        span("checkpoint_blocking", 34.0, 34.3, step=40),
        mark("checkpoint_committed", 34.3, step=40),
        span("shutdown", 34.0, 35.0, step=40),
        mark("job_end", 35.0, step=40),
    ],
}


def _file(folder: Path, name: str, host: str, lines: list[Line], wall_ahead: float, **clock):
    """One process's ledger file: its ``clock`` line (``clock`` adds attrs), then each line
    as it ended, read from a wall clock ``wall_ahead`` s ahead and the host's monotonic
    clock."""
    m = FILE_NAME.match(name)
    assert m is not None
    attempt, rank = int(m["attempt"]), int(m["rank"])

    def times(start: float, end: float) -> str:
        w = [encode_time(T0 + t + wall_ahead) for t in (start, end)]
        mono = [encode_time(MONO_AT_T0[host] + t) for t in (start, end)]
        if start == end:
            return f'"t":{w[0]},"mono":{mono[0]}'
        return f'"start":{w[0]},"end":{w[1]},"mono":[{mono[0]},{mono[1]}]'

    opened = min(line[2] for line in lines if line[1] != "scheduling")
    attrs = {"host": host, "boot": BOOT[host], "pid": 4711} | clock
    out = [encode_line("mark", "clock", times(opened, opened), attempt, rank, None, attrs)]
    for kind, what, start, end, step, extra in sorted(lines, key=lambda line: line[3]):
        out.append(encode_line(kind, what, times(start, end), attempt, rank, step, extra))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(b"".join(out))


def _job(
    root: Path,
    wall_ahead: dict[str, float],
    measured: dict[str, dict[str, Any]],
    **orchestrator_clock: Any,
) -> JobLayout:
    """The job with each file's wall clock ``wall_ahead`` (by file) and ``measured`` offsets
    (by file: {"offset_s", "error_s"} against the orchestrator's domain)."""
    layout = JobLayout.at(f"file://{root}")
    folder = Path(root, "ledger")
    for (name, host), lines in JOB.items():
        clock: dict[str, Any] = dict(orchestrator_clock) if host == ORCH else {}
        if (sample := measured.get(name)) is not None:
            clock[CLOCK_ATTR] = {"reference": REF, **sample}
        _file(folder, name, host, lines, wall_ahead.get(name, 0.0), **clock)
    return layout


TRAINERS = [name for name, host in JOB if host == NODE]


def _report(read: LedgerRead) -> EttReport:
    return compute_report(read.events, clock=read.clock)


def _assert_partition(report: EttReport) -> None:
    """Every instant of W in exactly one bucket: segments in order, none overlapping, and
    the buckets sum to W."""
    assert math.isclose(math.fsum(report.buckets.values()), report.wall_s, rel_tol=1e-12)
    segments = sorted(report.segments)
    assert all(a[1] <= b[0] for a, b in zip(segments, segments[1:], strict=False))
    assert math.isclose(math.fsum(e - s for s, e, _ in segments), report.wall_s, rel_tol=1e-12)
    for bucket, total in report.buckets.items():
        mine = math.fsum(e - s for s, e, b in segments if b == bucket)
        assert math.isclose(mine, total, rel_tol=1e-9, abs_tol=1e-9)


def _by_line(read: LedgerRead) -> dict[tuple[str, int], tuple[float, float]]:
    return {(e.source, e.seq): (e.start, e.end) for e in read.events}


@pytest.fixture
def clean(tmp_path: Path) -> LedgerRead:
    """The job on true clocks: ``node-1`` measured an offset of 0 (+-0.4 ms) at rendezvous."""
    measured = {name: {"offset_s": 0.0, "error_s": 0.0004} for name in TRAINERS}
    return read_ledger(_job(tmp_path / "clean", {}, measured))


def test_a_host_5_s_ahead_is_moved_onto_the_reference_by_its_measured_offset(
    tmp_path: Path, clean: LedgerRead
) -> None:
    """``node-1``'s wall clock runs 5 s ahead; it measured -5.0003 +- 0.0004 s (the reference's
    time minus its own). Its events land where they happened (within the measurement's
    error), the buckets still partition W, ETT% is the clean job's within 0.5 points, and
    the report says which host was moved and by how much."""
    measured = {name: {"offset_s": -SHIFT_S - 0.0003, "error_s": 0.0004} for name in TRAINERS}
    shifted = read_ledger(_job(tmp_path / "shifted", dict.fromkeys(TRAINERS, SHIFT_S), measured))

    truth, got = _by_line(clean), _by_line(shifted)
    assert got.keys() == truth.keys() and len(got) > 60
    for key, (start, end) in truth.items():
        assert got[key] == pytest.approx((start, end), abs=0.001), key
    report, clean_report = _report(shifted), _report(clean)
    _assert_partition(report)
    assert report.wall_s == pytest.approx(clean_report.wall_s, abs=0.001)
    assert abs(report.ett_pct - clean_report.ett_pct) < 0.5
    for bucket, seconds in clean_report.buckets.items():
        assert report.buckets[bucket] == pytest.approx(seconds, abs=0.002), bucket
    assert clean.clock.notes() == []  # a clean ledger says nothing
    assert shifted.clock.unaligned == ()
    [moved] = shifted.clock.offsets
    assert moved.what == "host node-1, boot 7ac1d00d" and moved.offset_s == pytest.approx(5.0003)
    assert shifted.clock.notes() == [
        "clock offset: host node-1, boot 7ac1d00d ran 5.0 s ahead of the clock of host orch-1, "
        "boot 0b5e55ed (measured)"
    ]
    assert "Ledger checks" in format_table(report)


def test_without_a_measurement_the_host_5_s_ahead_is_named_not_trusted(
    tmp_path: Path, clean: LedgerRead
) -> None:
    """The same shifted job, no measured offset: its times are taken as written (the report
    is wrong by the shift) and the report says that host is not aligned."""
    layout = _job(tmp_path / "unmeasured", dict.fromkeys(TRAINERS, SHIFT_S), {})
    read = read_ledger(layout)
    report = _report(read)
    _assert_partition(report)
    assert abs(report.ett_pct - _report(clean).ett_pct) > 0.5  # so the correction matters
    assert read.clock.unaligned == (NODE_DOMAIN,)
    text = format_table(report)
    assert "Ledger checks" in text
    assert (
        "host node-1, boot 7ac1d00d has no measured offset: its times are taken as written" in text
    )


def test_one_host_one_clock_then_one_correction_per_host(tmp_path: Path, clean: LedgerRead) -> None:
    """``node-1``'s wall clock ran 5 s ahead during attempt 0 (measured -5 +- 0.2 ms) and
    was then stepped right (attempt 1 measured 0 +- 0.5 ms). Rule 4 times attempt 0 by its
    monotonic clock on attempt 1's offset; attempt 0's sample, re-expressed on that clock,
    says 0 too. The smaller error wins (attempt 0's): the host is not moved again."""
    measured = {
        TRAINERS[0]: {"offset_s": -SHIFT_S, "error_s": 0.0002},
        TRAINERS[1]: {"offset_s": 0.0, "error_s": 0.0005},
    }
    read = read_ledger(_job(tmp_path / "stepped", {TRAINERS[0]: SHIFT_S}, measured))
    truth = _by_line(clean)
    for key, (start, end) in _by_line(read).items():
        assert (start, end) == pytest.approx(truth[key], abs=0.001), key
    notes = read.clock.notes()
    assert len(notes) == 1 and "trainer-attempt000-rank000.jsonl" in notes[0]  # rule 4's line
    assert "ran 5.0 s ahead of its newest process" in notes[0]


def test_a_measured_offset_wins_over_a_bound_and_a_large_error_is_said(
    tmp_path: Path, clean: LedgerRead
) -> None:
    """The orchestrator's clock line bounds ``node-1`` as at least 3 s ahead (``ahead``) and
    the node measured -5 s: the measurement is applied, the bound not. Measured with an
    error of 1.5 s, it is applied all the same and the report says it may be off."""
    measured = {name: {"offset_s": -SHIFT_S, "error_s": 1.5} for name in TRAINERS}
    layout = _job(
        tmp_path / "both",
        dict.fromkeys(TRAINERS, SHIFT_S),
        measured,
        ahead={NODE_DOMAIN: 3.0},
    )
    read = read_ledger(layout)
    truth = _by_line(clean)
    for key, (start, end) in _by_line(read).items():
        assert (start, end) == pytest.approx(truth[key], abs=1e-6), key
    assert read.clock.notes() == [
        "clock offset: host node-1, boot 7ac1d00d ran 5.0 s ahead of the clock of host orch-1, "
        "boot 0b5e55ed (measured), +-1.5 s: it may be off by as much"
    ]


def test_a_small_offset_with_a_large_error_is_still_said(tmp_path: Path) -> None:
    measured = {name: {"offset_s": 0.2, "error_s": 1.2} for name in TRAINERS}
    read = read_ledger(_job(tmp_path / "unsure", {}, measured))
    assert read.clock.notes() == [
        "clock offset: host node-1, boot 7ac1d00d ran 0.2 s behind the clock of host orch-1, "
        "boot 0b5e55ed (measured), +-1.2 s: it may be off by as much"
    ]
    [step] = [e for e in read.events if e.name == "train_step" and e.step == 1]
    assert step.start == pytest.approx(T0 + 4.0 + 0.2)  # applied all the same


def test_chains_cycles_and_bounds_between_hosts() -> None:
    """b measured against a, a against the reference r: b ends on r's clock. A host with
    only a bound moves back by it; one measured against a bounded host moves by both. A
    cycle (c against d against c) ends where it closes; a sample against its own host is
    none."""
    sample = lambda ref, off: ClockSample(ref, off, 0.001)  # noqa: E731
    measured = host_offsets.chosen(
        [
            ("a", sample("r", 2.0), 0.0),
            ("b", sample("a", -1.0), 0.0),
            ("e", sample("x", 1.0), 0.0),
            ("c", sample("d", 1.0), 0.0),
            ("d", sample("c", -1.0), 0.0),
            ("r", sample("r", 9.0), 0.0),
        ]
    )
    assert "r" not in measured
    shifts = host_offsets.host_shifts(measured, {"x": 4.0, "a": 7.0})
    assert shifts == {"a": 2.0, "b": 1.0, "x": -4.0, "e": -3.0, "c": 0.0, "d": 0.0}


def test_of_one_hosts_samples_the_smallest_error_wins_after_rule_4() -> None:
    """Two files of one host: the second's wall clock was 3 s ahead of the host's newest
    process (rule 4 moves it by -3), so its -3 s sample re-expressed is 0."""
    chosen = host_offsets.chosen(
        [
            ("n", ClockSample("r", 0.5, 0.004), 0.0),
            ("n", ClockSample("r", -2.5, 0.001), -3.0),
            ("n", ClockSample("r", 7.0, 0.002), 0.0),
        ]
    )
    assert chosen == {"n": ClockSample("r", 0.5, 0.001)}


def test_the_env_value_reaches_the_clock_line_and_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a node run hands its processes (``ClockSample.env()``) is written into their
    ledgers' clock line, read back, and applied."""
    sample = ClockSample(REF, -2.0, 0.001)
    env = sample.env()
    assert list(env) == [ENV_OFFSET] == ["ETT_CLOCK_OFFSET"]
    assert ClockSample.parse(env[ENV_OFFSET]) == sample
    monkeypatch.setenv(ENV_OFFSET, env[ENV_OFFSET])
    monkeypatch.setenv(clocks.ENV_HOST, NODE)
    layout = JobLayout.at(f"file://{tmp_path}/job")
    with Ledger(layout) as led:
        led.mark("attempt_start")
    first = Path(tmp_path, "job", "ledger", "trainer-attempt000-rank000.jsonl").read_text()
    attrs = json.loads(first.splitlines()[0])["attrs"]
    assert attrs[CLOCK_ATTR] == {"reference": REF, "offset_s": -2.0, "error_s": 0.001}
    assert attrs["host"] == NODE
    read = read_ledger(layout)
    assert [(o.what, o.offset_s) for o in read.clock.offsets] == [("host node-1", 2.0)]


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        "[]",
        '{"reference": "orch-1/b"}',
        '{"reference": "", "offset_s": 1.0, "error_s": 0.1}',
        '{"reference": "orch-1/b", "offset_s": "5", "error_s": 0.1}',
        '{"reference": "orch-1/b", "offset_s": NaN, "error_s": 0.1}',
        '{"reference": "orch-1/b", "offset_s": 1.0, "error_s": -0.1}',
        '{"reference": "orch-1/b", "offset_s": true, "error_s": 0.1}',
        '{"reference": "orch-1/b", "offset_s": 1' + "0" * 400 + ', "error_s": 0.1}',
    ],
    ids=["text", "list", "missing", "no-reference", "string", "nan", "negative", "bool", "huge"],
)
def test_a_bad_env_value_is_ignored_with_a_warning_and_the_ledger_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv(ENV_OFFSET, value)
    layout = JobLayout.at(f"file://{tmp_path}/job")
    with caplog.at_level(logging.WARNING, logger=host_offsets.__name__), Ledger(layout) as led:
        led.mark("attempt_start")
        with led.span("train_step", step=1):
            pass
    assert any(ENV_OFFSET in r.getMessage() for r in caplog.records)
    first = Path(tmp_path, "job", "ledger", "trainer-attempt000-rank000.jsonl").read_text()
    assert CLOCK_ATTR not in json.loads(first.splitlines()[0])["attrs"]
    read = read_ledger(layout)
    assert [e.name for e in read.events] == ["attempt_start", "train_step"]
    assert read.clock.clean


def test_a_bad_measured_offset_in_a_clock_line_is_not_used(tmp_path: Path) -> None:
    """A clock line whose measurement is garbled: the report is computed, the host is
    named as unaligned."""
    measured: dict[str, Any] = {name: {"offset_s": "soon", "error_s": 0.1} for name in TRAINERS}
    read = read_ledger(_job(tmp_path / "garbled", {}, measured))
    assert read.clock.unaligned == (NODE_DOMAIN,)
    _assert_partition(_report(read))
