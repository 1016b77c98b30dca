"""The ETT calculator against hand-computed timelines and random ledgers.

The hand-built job (seconds after T0; orchestrator events are rank 0, role "orchestrator")::

    attempt 0  orch  scheduling [0,2]  launcher_init [2,5]
               train device_init [3,4] process_group_init [4,6] train_module_creation [6,8]
                     pre_train [7,9] get_first_batch_data [9,10]
                     step1 [10,12] step2 [12,14] (checkpoint_blocking [13,14] nested, commit @15)
                     step3 [14,16]  gap  step4 [16.5,18.5]  -- SIGKILL during step 5 (no span)
               orch  failure @20 (cause sigkill, step 4)
    attempt 1  orch  scheduling [20,21] launcher_init [21,23]
               train device_init [22,23] pre_train [23,25] get_first_batch_data [25,26]
                     step3 [26,28] step4 [28,30] eval [30,31] checkpoint_blocking [31,31.5]
                     (commit @32) step5 [31.5,33.5] shutdown [34,36] job_end @36
    rank 1     steps of 2.5 s and a shutdown to 40 (must not move W's end)

By hand, W = 36 and:
    startup   [0,10]                                   = 10
    effective step1 2 + step2 1 (minus blocking) + a1 steps 3,4,5 (2 each) = 9
    wasted    a0 step3 [14,16] + step4 [16.5,18.5]      = 4  (redone by attempt 1)
    blocking  [13,14] + [31,31.5]                       = 1.5
    recovery  [18.5,26] (a0's last event -> a1 step 3) = 7.5
    eval 1, shutdown 2, other [16,16.5] + [33.5,34]     = 1
ETT% = 9/36 = 25%, Failure% = 11.5/36.
"""

from __future__ import annotations

import math
import random
import re
import uuid
from pathlib import Path

import pytest

from infra import storage
from infra.accounting import ett, records
from infra.accounting.ett import compute_report, report_for_job
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import INIT_SPANS, Event
from infra.accounting.ledger_read import read_events
from infra.accounting.partition import critical_path, partition
from infra.accounting.records import FailureRecord, StandbyRecord
from infra.accounting.report import sections
from infra.job_layout import JobLayout

T0 = 1_700_000_000.0  # realistic Unix times: exactness must survive large magnitudes
ROOT = Path(__file__).resolve().parents[2]


def _write_job(job_url: str) -> None:
    clock = lambda: T0  # noqa: E731 - every time below is given explicitly
    orch0 = Ledger(JobLayout.at(job_url), attempt=0, role="orchestrator", clock=clock)
    orch0.record_span("scheduling", T0 + 0, T0 + 2)
    orch0.record_span("launcher_init", T0 + 2, T0 + 5)
    with Ledger(JobLayout.at(job_url), attempt=0, clock=clock) as tr:
        tr.mark("attempt_start", t=T0 + 3)
        for name, s, e in [
            ("device_init", 3, 4),
            ("process_group_init", 4, 6),
            ("train_module_creation", 6, 8),
            ("pre_train", 7, 9),
            ("get_first_batch_data", 9, 10),
        ]:
            tr.record_span(name, T0 + s, T0 + e)
        for step, s, e in [(1, 10, 12), (2, 12, 14), (3, 14, 16), (4, 16.5, 18.5)]:
            tr.record_span("train_step", T0 + s, T0 + e, step=step)
            if step == 2:
                tr.record_span("checkpoint_blocking", T0 + 13, T0 + 14, step=2)
                tr.mark("checkpoint_committed", step=2, t=T0 + 15)
    orch0.mark("failure", step=4, t=T0 + 20, cause="sigkill")
    orch0.close()
    with Ledger(JobLayout.at(job_url), attempt=1, role="orchestrator", clock=clock) as orch1:
        orch1.record_span("scheduling", T0 + 20, T0 + 21)
        orch1.record_span("launcher_init", T0 + 21, T0 + 23)
    with Ledger(JobLayout.at(job_url), attempt=1, clock=clock) as tr:
        tr.mark("attempt_start", t=T0 + 22)
        tr.mark("resume", step=2, t=T0 + 23)
        for name, s, e in [
            ("device_init", 22, 23),
            ("pre_train", 23, 25),
            ("get_first_batch_data", 25, 26),
        ]:
            tr.record_span(name, T0 + s, T0 + e)
        for step, s, e in [(3, 26, 28), (4, 28, 30), (5, 31.5, 33.5)]:
            tr.record_span("train_step", T0 + s, T0 + e, step=step)
            if step == 4:
                tr.record_span("eval", T0 + 30, T0 + 31)
                tr.record_span("checkpoint_blocking", T0 + 31, T0 + 31.5, step=4)
                tr.mark("checkpoint_committed", step=4, t=T0 + 32)
        tr.record_span("shutdown", T0 + 34, T0 + 36)
        tr.mark("job_end", t=T0 + 36)
    with Ledger(JobLayout.at(job_url), attempt=1, rank=1, clock=clock) as r1:
        for step, s in [(3, 26), (4, 28.5), (5, 31.5)]:
            r1.record_span("train_step", T0 + s, T0 + s + 2.5, step=step)
        r1.record_span("shutdown", T0 + 34, T0 + 40)


EXPECTED = {
    "effective_training": 9.0,
    "wasted_training": 4.0,
    "checkpoint_blocking": 1.5,
    "startup": 10.0,
    "recovery": 7.5,
    "eval": 1.0,
    "shutdown": 2.0,
    "unknown": 0.0,
    "other": 1.0,
}


@pytest.fixture(params=["file", "memory"])
def job_url(request: pytest.FixtureRequest, tmp_path) -> str:
    url = str(tmp_path / "job") if request.param == "file" else f"memory://ett-{uuid.uuid4().hex}"
    _write_job(url)
    return url


def test_hand_computed_buckets_and_l1_metrics(job_url: str) -> None:
    r = report_for_job(JobLayout.at(job_url))
    assert r.wall_s == 36.0 and r.start_time == T0
    assert r.buckets == EXPECTED
    assert r.ett_pct == 25.0
    assert r.failure_pct == pytest.approx(100 * 11.5 / 36, abs=1e-12)
    assert r.ett_pct + r.failure_pct + r.idleness_pct == pytest.approx(100.0, abs=1e-12)
    assert r.time_to_start_s == 10.0
    assert r.num_failures == 1 and r.time_to_recover_total_s == 7.5
    (f,) = r.failures
    assert (f.attempt, f.cause, f.last_step) == (0, "sigkill", 4)
    assert (f.died_at, f.detected_at, f.resumed_at, f.time_to_recover_s) == (18.5, 20, 26, 7.5)
    assert r.observed_unsaved_s == 4.0
    assert (r.num_steps, r.num_step_executions) == (5, 7)
    assert (r.step_time_median_s, r.step_time_mad_s) == (2.0, 0.0)
    assert r.checkpoint_blocking_total_s == 1.5 and r.checkpoint_blocking_mean_s == 0.75
    assert r.num_checkpoints_committed == 2 and r.commit_latency_s == 0.75
    # One checkpoint per attempt: interval = train-loop time / checkpoints = (8.5 + 7.5) / 2.
    assert r.train_loop_s == 16.0 and r.checkpoint_interval_s == 8.0
    assert r.predicted_unsaved_s == 4.0  # 1 failure x 8 / 2
    assert r.predicted_blocking_s == 1.5  # 16 / 8 x 0.75
    assert [(a.attempt, a.outcome, a.first_step, a.last_step) for a in r.attempts] == [
        (0, "sigkill", 1, 4),
        (1, "success", 3, 5),
    ]
    assert r.finished and r.rank_step_median_s == {0: 2.0, 1: 2.5}
    assert r.checkpoint_interval_reason is None and r.checkpoint_interval_steps is None


def test_startup_substages_and_critical_path(job_url: str) -> None:
    a0, a1 = report_for_job(JobLayout.at(job_url)).init
    assert a0.stages["launcher_init"] == 3.0 and a0.stages["pre_train"] == 2.0
    assert (a0.sum_s, a0.union_s, a0.wall_s) == (13.0, 10.0, 10.0)
    # pre_train began at 7 while train_module_creation [6,8] still ran: it is on the path;
    # device_init began at 3 while launcher_init [2,5] ran (launcher_init started the trainer).
    assert a0.critical_path == (
        "scheduling",
        "launcher_init",
        "device_init",
        "process_group_init",
        "train_module_creation",
        "pre_train",
        "get_first_batch_data",
    )
    assert a0.critical_path_s == 10.0
    assert (a1.sum_s, a1.union_s, a1.wall_s, a1.critical_path_s) == (7.0, 6.0, 6.0, 6.0)
    assert a1.critical_path == (
        "scheduling",
        "launcher_init",
        "device_init",
        "pre_train",
        "get_first_batch_data",
    )


def test_torn_last_line_is_ignored(tmp_path) -> None:
    url = str(tmp_path / "job")
    _write_job(url)
    path = tmp_path / "job" / "ledger" / "trainer-attempt001-rank000.jsonl"
    with open(path, "a") as fh:
        fh.write('{"v":1,"kind":"span","name":"train_step","start":17000')
    assert report_for_job(JobLayout.at(url)).buckets == EXPECTED


def test_to_dict_is_json_and_metrics_are_flat(job_url: str) -> None:
    import json

    r = report_for_job(JobLayout.at(job_url))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["buckets"] == EXPECTED and "segments" not in d
    assert d["bucket_pct"]["effective_training"] == 25.0
    assert all(isinstance(v, float) for v in r.to_metrics().values())
    segs = r.to_dict(include_segments=True)["segments"]
    assert segs[0] == (0.0, 10.0, "startup") and segs[-1] == (34.0, 36.0, "shutdown")


def test_unmarked_death_counts_as_failure_and_planned_restart_is_startup(tmp_path) -> None:
    """Attempt 0 dies without a failure mark (a later attempt exists, no shutdown): failure.
    Attempt 1 ends with a shutdown but no job_end, attempt 2 follows: a planned restart."""
    url = str(tmp_path / "job")
    for attempt, (s, e, steps) in enumerate([(0, 5, [1, 2]), (8, 12, [2, 3]), (14, 17, [4])]):
        with Ledger(JobLayout.at(url), attempt=attempt, clock=lambda: T0) as tr:
            tr.record_span("device_init", T0 + s, T0 + s + 1)
            for i, step in enumerate(steps):
                tr.record_span("train_step", T0 + s + 1 + i, T0 + s + 2 + i, step=step)
            if attempt:
                tr.record_span("shutdown", T0 + e - 1, T0 + e)
        if attempt == 2:
            Ledger(JobLayout.at(url), attempt=2, clock=lambda: T0).mark("job_end", t=T0 + e)
    r = report_for_job(JobLayout.at(url))
    assert [a.outcome for a in r.attempts] == ["unobserved", "stopped", "success"]
    assert r.num_failures == 1 and r.failures[0].cause == "unobserved"
    # startup [0,1]; a0 steps [1,2] wasted? no: step 1 kept, step 2 redone -> [2,3] wasted;
    # recovery [3,9]; a1 steps [9,11] effective; shutdown [11,12]; restart [12,15] startup
    # (device_init inside); step 4 [15,16]; shutdown [16,17].
    assert r.buckets["wasted_training"] == 1.0 and r.buckets["recovery"] == 6.0
    assert r.buckets["startup"] == 1.0 + 3.0 and r.buckets["effective_training"] == 4.0
    assert r.buckets["shutdown"] == 2.0 and r.buckets["other"] == 0.0
    assert r.wall_s == 17.0


def test_a_redone_step_counts_its_last_execution_not_its_first(tmp_path) -> None:
    """Step 3 runs twice for different lengths: 1 s in attempt 0 (lost when it is killed),
    3 s in attempt 1 (kept). The kept run is effective, the lost one wasted; taking the
    first run as the kept one would give effective 3 and wasted 3.

    a0: steps 1-2 [0,2], step 3 [2,3], killed (failure mark @4, step 3);
    a1: step 3 [5,8], shutdown [8,9], job_end @9. W = 9: effective 1+1+3, wasted 1,
    recovery [3,5] = 2 (a0's last event -> a1's first step), shutdown 1."""
    url = str(tmp_path / "job")
    clock = lambda: T0  # noqa: E731
    with Ledger(JobLayout.at(url), attempt=0, clock=clock) as tr:
        for step, s, e in [(1, 0, 1), (2, 1, 2), (3, 2, 3)]:
            tr.record_span("train_step", T0 + s, T0 + e, step=step)
    with Ledger(JobLayout.at(url), attempt=0, role="orchestrator", clock=clock) as o:
        o.mark("failure", step=3, t=T0 + 4, cause="sigkill")
    with Ledger(JobLayout.at(url), attempt=1, clock=clock) as tr:
        tr.record_span("train_step", T0 + 5, T0 + 8, step=3)
        tr.record_span("shutdown", T0 + 8, T0 + 9)
        tr.mark("job_end", t=T0 + 9)
    r = report_for_job(JobLayout.at(url))
    assert r.wall_s == 9
    assert r.buckets["effective_training"] == 5 and r.buckets["wasted_training"] == 1
    assert r.buckets["recovery"] == 2 and r.buckets["shutdown"] == 1
    assert r.ett_pct == pytest.approx(100 * 5 / 9)
    assert r.observed_unsaved_s == 1 and (r.num_steps, r.num_step_executions) == (3, 4)
    assert [s for s in r.segments if s[2] in ("effective_training", "wasted_training")] == [
        (0, 2, "effective_training"),
        (2, 3, "wasted_training"),
        (5, 8, "effective_training"),
    ]


def test_publishing_and_the_side_evaluator_are_not_the_jobs_time(job_url: str) -> None:
    """Publishing (its own ledger file, role "publish") runs after the job and the side
    evaluator (role "evaluator") beside it: neither moves W nor claims any of its time."""
    clock = lambda: T0  # noqa: E731
    with Ledger(JobLayout.at(job_url), attempt=0, role="publish", clock=clock) as pub:
        for name, s, e in [
            ("publish_load", 37, 38),
            ("publish_export", 38, 40),
            ("publish_validate", 40, 41),
            ("publish_register", 41, 42),
        ]:
            pub.record_span(name, T0 + s, T0 + e)
    with Ledger(JobLayout.at(job_url), attempt=0, role="evaluator", clock=clock) as ev:
        ev.record_span("async_eval", T0 + 16, T0 + 26, step=2)  # over a0's death and a1's init
        ev.record_span("async_eval", T0 + 33, T0 + 45, step=4)  # past the job's end
    r = report_for_job(JobLayout.at(job_url))
    assert r.wall_s == 36.0 and r.start_time == T0
    assert r.buckets == EXPECTED
    assert [(a.attempt, a.outcome) for a in r.attempts] == [(0, "sigkill"), (1, "success")]


def test_empty_ledger_is_an_error() -> None:
    with pytest.raises(ValueError):
        compute_report([])


# -- property-style checks ----------------------------------------------------------------
def _written_priority(text: str) -> tuple[str, ...]:
    """The bucket order written as ``a > b > c (window) > ...`` in ``text``."""
    chain = re.search(r"\w+(?:\s*\(\w+\))?(?:\s*>\s*\w+(?:\s*\(\w+\))?)+", text)
    assert chain is not None, "no bucket order written in the text"
    return tuple(part.split()[0] for part in chain.group(0).split(">"))


# The order docs/ett.md gives, read from the docs rather than from records.PRIORITY, so the
# reference below cannot follow a change to the code.
DOCUMENTED_PRIORITY = _written_priority((ROOT / "docs" / "ett.md").read_text())


def test_the_docs_and_the_docstring_give_the_code_s_priority() -> None:
    assert sorted(DOCUMENTED_PRIORITY) == sorted(records.BUCKETS)
    assert _written_priority(ett.__doc__ or "") == DOCUMENTED_PRIORITY
    assert records.PRIORITY == DOCUMENTED_PRIORITY


def _naive_partition(intervals, t0, t1):
    """Reference: classify the midpoint of each elementary interval by scanning all spans."""
    cuts = sorted({t0, t1, *(max(t0, min(t1, x)) for s, e, _ in intervals for x in (s, e))})
    out = dict.fromkeys(records.BUCKETS, 0.0)
    for a, b in zip(cuts, cuts[1:], strict=False):
        mid = (a + b) / 2
        cover = [k for s, e, k in intervals if s <= mid < e]
        out[min(cover, key=DOCUMENTED_PRIORITY.index) if cover else "other"] += b - a
    return out


def test_partition_matches_naive_sweep_on_random_intervals() -> None:
    rng = random.Random(7)
    for _ in range(200):
        t0 = T0 + rng.uniform(0, 10)
        t1 = t0 + rng.uniform(1, 100)
        ivs = []
        for _ in range(rng.randint(0, 30)):
            s = rng.uniform(t0 - 5, t1)
            ivs.append((s, s + rng.uniform(0, 20), rng.choice(DOCUMENTED_PRIORITY[:-1])))
        got, segments = partition(ivs, t0, t1)
        ref = _naive_partition(ivs, t0, t1)
        for b in records.BUCKETS:
            assert got[b] == pytest.approx(ref[b], abs=1e-6)
        assert math.fsum(got.values()) == pytest.approx(t1 - t0, rel=1e-12)
        assert all(a < b for a, b, _ in segments)


def _random_job(rng: random.Random, url: str) -> None:
    t, step = T0 + rng.uniform(0, 1e5), 1
    n_attempts = rng.randint(1, 4)
    for attempt in range(n_attempts):
        orch = Ledger(JobLayout.at(url), attempt=attempt, role="orchestrator", clock=lambda: T0)
        tr = Ledger(JobLayout.at(url), attempt=attempt, clock=lambda: T0)
        d = rng.uniform(0, 3)
        orch.record_span("scheduling", t, t + d)
        orch.record_span("launcher_init", t + d, t + d + rng.uniform(0, 3))
        t += d + rng.uniform(0, 2)
        for name in rng.sample(INIT_SPANS, rng.randint(0, len(INIT_SPANS))):
            s = t + rng.uniform(-0.5, 1)
            tr.record_span(name, s, s + rng.uniform(0.01, 2))
            t = max(t, s + rng.uniform(0, 2))
        step = max(1, step - rng.randint(0, 5))  # resumed attempts redo a few steps
        for _ in range(rng.randint(0, 30)):
            dur = rng.uniform(0.05, 1)
            tr.record_span("train_step", t, t + dur, step=step)
            if rng.random() < 0.2:
                s = t + rng.uniform(0, dur)
                tr.record_span("checkpoint_blocking", s, s + rng.uniform(0, 1), step=step)
            if rng.random() < 0.1:
                tr.record_span("eval", t + dur, t + dur + rng.uniform(0, 1))
            t += dur + rng.choice([0.0, 0.0, rng.uniform(0, 0.5)])
            step += 1
        last = attempt == n_attempts - 1
        if last or rng.random() < 0.3:
            tr.record_span("shutdown", t, t + rng.uniform(0, 2))
        if not last and rng.random() < 0.8:
            orch.mark("failure", t=t + rng.uniform(0, 5), cause="crash", step=step - 1)
        if last and rng.random() < 0.8:
            tr.mark("job_end", t=t + 2)
        t += rng.uniform(0, 10)
        tr.close()
        orch.close()


def test_invariants_on_random_ledgers(tmp_path) -> None:
    rng = random.Random(2026)
    for i in range(60):
        url = str(tmp_path / f"job{i}")
        _random_job(rng, url)
        r = report_for_job(JobLayout.at(url))
        assert set(r.buckets) == set(records.BUCKETS)
        assert all(v >= 0 for v in r.buckets.values())
        assert math.fsum(r.buckets.values()) == pytest.approx(r.wall_s, rel=1e-9, abs=1e-12)
        assert r.ett_pct + r.idleness_pct + r.failure_pct == pytest.approx(100.0, abs=1e-9)
        assert r.time_to_recover_total_s == pytest.approx(
            math.fsum(f.time_to_recover_s for f in r.failures)
        )
        assert r.buckets["wasted_training"] <= r.observed_unsaved_s + 1e-9
        seg_total = math.fsum(b - a for a, b, _ in r.segments)
        assert seg_total == pytest.approx(r.wall_s, rel=1e-9, abs=1e-12)
        assert read_events(JobLayout.at(url)) and JobLayout.at(url).ledger.endswith("ledger")


def test_rendering(tmp_path) -> None:
    from infra.accounting.report import format_table, plot_breakdown, to_markdown

    _write_job(str(tmp_path / "job"))
    r = report_for_job(JobLayout.at(str(tmp_path / "job")))
    text = format_table(r)
    assert "effective_training   9.000    25.00" in text
    assert "critical path" in text and "sigkill" in text
    md = to_markdown(r)
    assert md.startswith("# ETT report: **25.0%** effective")
    assert "| bucket | seconds | % of W |" in md and "| recovery | 7.500 | 20.83 |" in md
    png = plot_breakdown(r, tmp_path / "out" / "ett.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_first_attempt_dies_during_init(tmp_path) -> None:
    """a0: scheduling [0,2], pre_train [2,5], dies (failure mark @7); a1: scheduling [8,9],
    steps 1-2 [10,14], shutdown [14,15]. startup [0,5]; recovery [5,10]; TTS = 10 (first step
    of the job, since attempt 0 never stepped)."""
    url = str(tmp_path / "job")
    with Ledger(JobLayout.at(url), attempt=0, role="orchestrator", clock=lambda: T0) as o:
        o.record_span("scheduling", T0, T0 + 2)
        o.mark("failure", t=T0 + 7, cause="crash")
    with Ledger(JobLayout.at(url), attempt=0, clock=lambda: T0) as tr:
        tr.record_span("pre_train", T0 + 2, T0 + 5)
    with Ledger(JobLayout.at(url), attempt=1, clock=lambda: T0) as tr:
        tr.record_span("scheduling", T0 + 8, T0 + 9)
        tr.record_span("train_step", T0 + 10, T0 + 12, step=1)
        tr.record_span("train_step", T0 + 12, T0 + 14, step=2)
        tr.record_span("shutdown", T0 + 14, T0 + 15)
        tr.mark("job_end", t=T0 + 15)
    r = report_for_job(JobLayout.at(url))
    assert r.buckets["startup"] == 5 and r.buckets["recovery"] == 5
    assert r.buckets["effective_training"] == 4 and r.buckets["shutdown"] == 1
    assert r.time_to_start_s == 10 and r.num_failures == 1
    (f,) = r.failures
    assert (f.cause, f.last_step, f.died_at) == ("crash", None, 5)
    assert (f.detected_at, f.resumed_at, f.time_to_recover_s) == (7, 10, 5)
    assert r.init[0].wall_s is None and r.init[0].critical_path == ("scheduling", "pre_train")


def test_save_and_staging_wait_of_one_checkpoint_count_once(tmp_path) -> None:
    """An async_staged checkpoint blocks twice (the save call, then the wait for staging
    before the next step); both spans carry its step and must count as ONE checkpoint."""
    led = Ledger(JobLayout.at(f"file://{tmp_path}/job"), clock=lambda: 0.0)
    led.mark("attempt_start", t=0.0)
    for step, start in ((1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)):
        led.record_span("train_step", start, start + 0.9, step=step)
    led.record_span("checkpoint_blocking", 2.9, 2.95, step=2)  # the save call
    led.record_span("checkpoint_blocking", 2.95, 3.0, step=2, phase="staging")
    led.record_span("checkpoint_blocking", 4.9, 5.0, step=4)
    led.record_span("shutdown", 5.0, 5.5, step=4)
    led.mark("job_end", step=4, t=5.5)
    led.close()
    report = report_for_job(JobLayout.at(f"file://{tmp_path}/job"))
    assert report.checkpoint_blocking_total_s == pytest.approx(0.2)
    assert report.checkpoint_blocking_mean_s == pytest.approx(0.1)  # 2 checkpoints, not 3
    assert report.checkpoint_interval_s == pytest.approx(2.0)
    assert report.checkpoint_interval_steps == 2.0


def test_the_report_names_the_last_interval_the_trainer_chose(tmp_path) -> None:
    led = Ledger(JobLayout.at(f"file://{tmp_path}/job"), clock=lambda: 0.0)
    led.mark("checkpoint_interval", t=0.5, reason="first", interval_s=1.0)
    for step in (1, 2, 3):
        led.record_span("train_step", float(step), step + 1.0, step=step)
    led.mark("checkpoint_interval", t=2.5, reason="budget", interval_s=40.0)
    led.mark("job_end", step=3, t=4.0)
    led.close()
    assert (
        report_for_job(JobLayout.at(f"file://{tmp_path}/job")).checkpoint_interval_reason
        == "budget"
    )


def test_no_interval_is_made_up_without_training_or_checkpoints(tmp_path) -> None:
    """An attempt preempted during init: its save on SIGTERM found the step committed (a
    blocking span, no step). With no training there is no observed interval, and without
    checkpoints no predicted blocking, even with an interval given."""
    url = f"file://{tmp_path}/job"
    with Ledger(JobLayout.at(url), clock=lambda: 0.0) as led:
        led.record_span("device_init", 0.0, 1.0)
        led.record_span("checkpoint_blocking", 1.0, 1.5, step=5)
    r = report_for_job(JobLayout.at(url))
    assert (r.train_loop_s, r.checkpoint_interval_s) == (0.0, None)
    assert r.predicted_unsaved_s is None and r.predicted_blocking_s is None
    bare = f"file://{tmp_path}/bare"
    with Ledger(JobLayout.at(bare), clock=lambda: 0.0) as led:
        led.record_span("train_step", 0.0, 1.0, step=1)
    r = report_for_job(JobLayout.at(bare), interval_s=10.0)
    assert r.checkpoint_interval_s == 10.0 and r.predicted_blocking_s is None
    assert r.predicted_unsaved_s == 0.0  # no failure


def test_critical_path_ends_at_the_stage_that_ends_last_the_earliest_on_a_tie() -> None:
    """Two stages end together: the one that began first spans the other, and is the end
    of the path (alone: nothing began before it)."""

    def span(name: str, start: float, end: float) -> Event:
        return Event("span", name, start, end, attempt=0, rank=0)

    long, short = span("pre_train", 0.0, 5.0), span("get_first_batch_data", 3.0, 5.0)
    assert [e.name for e in critical_path([short, long])] == ["pre_train"]
    first = span("device_init", 0.0, 2.0)
    assert [e.name for e in critical_path([short, first])] == ["device_init", short.name]


def test_a_promoted_standby_counts_from_its_promotion(tmp_path) -> None:
    """a0: device_init [0,2], steps 1-4 [2,6], killed (failure mark @8, step 4).
    a1, the standby: starts @3 (beside a0), device_init [3,5], parked @5, promoted @8,
    restores [8,9], steps 3-5 [9,12], shutdown [12,13], job_end @13.
    a2, a standby never promoted: starts @10, parked @11: none of the job's time.
    a3, a standby ended before it parked (the job ended first): starts @12: none either.

    W = 13: startup [0,2], effective 1-2 + 3-5 = 5, wasted a0's 3-4 = 2, recovery [6,9] = 3
    (a1's restore inside it), shutdown 1. a1's pre-warm: 2 s, parked 3 s, promoted at 8."""
    url = str(tmp_path / "job")
    clock = lambda: T0  # noqa: E731
    with Ledger(JobLayout.at(url), attempt=0, clock=clock) as tr:
        tr.record_span("device_init", T0, T0 + 2)
        _steps(tr, 1, 2, 4)
    with Ledger(JobLayout.at(url), attempt=0, role="orchestrator", clock=clock) as o:
        o.mark("failure", step=4, t=T0 + 8, cause="sigkill")
    with Ledger(JobLayout.at(url), attempt=1, clock=clock) as tr:
        tr.mark("attempt_start", t=T0 + 3, standby=True)
        tr.record_span("device_init", T0 + 3, T0 + 5)
        tr.mark("standby_ready", t=T0 + 5)
        tr.mark("promoted", t=T0 + 8)
        tr.record_span("pre_train", T0 + 8, T0 + 9)
        _steps(tr, 3, 9, 3)
        tr.record_span("shutdown", T0 + 12, T0 + 13)
        tr.mark("job_end", step=5, t=T0 + 13)
    with Ledger(JobLayout.at(url), attempt=2, clock=clock) as tr:
        tr.mark("attempt_start", t=T0 + 10, standby=True)
        tr.record_span("device_init", T0 + 10, T0 + 11)
        tr.mark("standby_ready", t=T0 + 11)
    with Ledger(JobLayout.at(url), attempt=3, clock=clock) as tr:
        tr.mark("attempt_start", t=T0 + 12, standby=True)
        tr.record_span("device_init", T0 + 12, T0 + 12.5)
    r = report_for_job(JobLayout.at(url))
    assert r.wall_s == 13 and r.start_time == T0
    assert r.buckets == {
        "effective_training": 5,
        "wasted_training": 2,
        "checkpoint_blocking": 0,
        "startup": 2,
        "recovery": 3,
        "eval": 0,
        "shutdown": 1,
        "unknown": 0,
        "other": 0,
    }
    assert r.standbys == (StandbyRecord(attempt=1, prewarm_s=2, parked_s=3, promoted_at=8),)
    assert [(a.attempt, a.outcome, a.start, a.end) for a in r.attempts] == [
        (0, "sigkill", 0, 6),
        (1, "success", 8, 13),
    ]
    assert r.failures == (
        FailureRecord(0, "sigkill", 4, died_at=6, detected_at=8, resumed_at=9, time_to_recover_s=3),
    )
    assert r.time_to_start_s == 2 and r.init[1].wall_s == 1  # promoted -> its first step


def test_a_job_shorter_than_a_second_gets_its_percentages(tmp_path) -> None:
    """In tenths of a second: a0 device_init [0,1], steps 1-2 [1,3], killed (failure mark @4,
    step 2); a1 device_init [4,5], steps 2-3 [5,7], job_end @7.

    W = 0.7 s: startup 0.1, effective a0's step 1 + a1's steps 2-3 = 0.3, wasted a0's step 2
    = 0.1, recovery [3,5] = 0.2 (a1's init inside it). ETT% = Failure% = 300/7."""
    url = str(tmp_path / "job")
    clock = lambda: T0  # noqa: E731
    tenth = lambda x: T0 + x / 10  # noqa: E731
    with Ledger(JobLayout.at(url), attempt=0, clock=clock) as tr:
        tr.record_span("device_init", tenth(0), tenth(1))
        for step in (1, 2):
            tr.record_span("train_step", tenth(step), tenth(step + 1), step=step)
    with Ledger(JobLayout.at(url), attempt=0, role="orchestrator", clock=clock) as o:
        o.mark("failure", step=2, t=tenth(4), cause="sigkill")
    with Ledger(JobLayout.at(url), attempt=1, clock=clock) as tr:
        tr.record_span("device_init", tenth(4), tenth(5))
        for step in (2, 3):
            tr.record_span("train_step", tenth(step + 3), tenth(step + 4), step=step)
        tr.mark("job_end", step=3, t=tenth(7))
    r = report_for_job(JobLayout.at(url))
    assert r.wall_s == pytest.approx(0.7, abs=1e-6)
    assert r.buckets["effective_training"] == pytest.approx(0.3, abs=1e-6)
    assert r.buckets["wasted_training"] == pytest.approx(0.1, abs=1e-6)
    assert r.buckets["recovery"] == pytest.approx(0.2, abs=1e-6)
    assert r.ett_pct == pytest.approx(300 / 7, abs=1e-4)
    assert r.failure_pct == pytest.approx(300 / 7, abs=1e-4)


def test_an_in_process_restart_is_a_failure_inside_the_attempt(tmp_path) -> None:
    """One attempt: device_init [0,1], steps 1-3 [1,4]; step 4 raises @4.5 and is recovered
    in place from the commit of step 2; steps 3-5 [6,9], shutdown [9,10], job_end @10.

    W = 10: startup 1, effective 1-2 + 3-5 = 5, wasted the first step 3 = 1, other [4,4.5]
    (step 4 ran, unrecorded, until it raised), recovery [4.5,6] = 1.5, shutdown 1."""
    url = str(tmp_path / "job")
    with Ledger(JobLayout.at(url), clock=lambda: T0) as tr:
        tr.record_span("device_init", T0, T0 + 1)
        _steps(tr, 1, 1, 3)
        tr.mark("in_process_restart", step=4, t=T0 + 4.5, error="RuntimeError: boom")
        tr.mark("resume", step=2, t=T0 + 5.5, in_process=True)
        _steps(tr, 3, 6, 3)
        tr.record_span("shutdown", T0 + 9, T0 + 10)
        tr.mark("job_end", step=5, t=T0 + 10)
    r = report_for_job(JobLayout.at(url))
    assert r.wall_s == 10
    expected = {"startup": 1, "effective_training": 5, "wasted_training": 1, "other": 0.5}
    assert {b: r.buckets[b] for b in expected} == expected
    assert r.buckets["recovery"] == 1.5 and r.buckets["shutdown"] == 1
    assert r.failures == (
        FailureRecord(
            attempt=0,
            cause="crash",
            last_step=4,
            died_at=4.5,
            detected_at=4.5,
            resumed_at=6,
            time_to_recover_s=1.5,
            in_process=True,
        ),
    )
    assert r.num_failures == 1 and r.failure_pct == pytest.approx(100 * 2.5 / 10)
    assert [(a.outcome, a.first_step, a.last_step) for a in r.attempts] == [("success", 1, 5)]


def test_redone_steps_are_split_by_the_tier_their_restore_came_from(tmp_path) -> None:
    """Steps 1-4 [1,5] with in-memory copies of steps 2 and 3 (blocking 0.1 each); step 5
    raises @5.5, restored in process from the copy of step 3: step 4 is redone (memory).
    Steps 4-6 [6,9]; step 7 raises @9.5, restored from the commit of step 5: step 6 is
    redone (durable). Steps 6-8 [10,13]."""
    url = str(tmp_path / "job")
    with Ledger(JobLayout.at(url), clock=lambda: T0) as tr:
        tr.record_span("device_init", T0, T0 + 1)
        _steps(tr, 1, 1, 4)
        for step in (2, 3):
            tr.record_span("memory_copy_blocking", T0 + step, T0 + step + 0.1, step=step)
            tr.mark("memory_copy", step=step, t=T0 + step + 0.2, seq=step, bytes=10)
        tr.mark("checkpoint_interval", t=T0 + 1, tier="memory", reason="fixed", interval_s=0.5)
        tr.mark("in_process_restart", step=5, t=T0 + 5.5, error="RuntimeError: boom")
        tr.mark("resume", step=3, t=T0 + 5.6, how="in_process", tier="memory")
        _steps(tr, 4, 6, 3)
        tr.mark("in_process_restart", step=7, t=T0 + 9.5, error="RuntimeError: boom")
        tr.mark("resume", step=5, t=T0 + 9.6, how="in_process", tier="durable")
        _steps(tr, 6, 10, 3)
        tr.mark("job_end", step=8, t=T0 + 13)
    r = report_for_job(JobLayout.at(url))
    assert r.redone_by_tier == {"memory": 1.0, "durable": 1.0}
    assert [res.tier for res in r.resumes] == ["memory", "durable"]
    assert "in-memory copy" in r.resumes[0].describe()
    assert (r.memory_copies, r.memory_interval_s) == (2, 0.5)
    assert r.memory_blocking_total_s == pytest.approx(0.2)


def test_bytes_per_commit_are_reported_full_against_delta(tmp_path) -> None:
    """Commits at steps 1-5: full (1000 B), three deltas (100, 300, 200 B), full (1200 B);
    a commit marked without a kind (an older trainer) counts as full."""
    url = str(tmp_path / "job")
    with Ledger(JobLayout.at(url), clock=lambda: T0) as tr:
        _steps(tr, 1, 1, 5)
        for step, kind, size in [(1, "full", 1000), (2, "delta", 100), (3, "delta", 300)]:
            tr.mark("checkpoint_committed", step=step, t=T0 + step + 1, kind=kind, bytes=size)
        tr.mark("checkpoint_committed", step=4, t=T0 + 5, kind="delta", bytes=200)
        tr.mark("checkpoint_committed", step=5, t=T0 + 6, bytes=1200)
        tr.mark("job_end", step=5, t=T0 + 6)
    r = report_for_job(JobLayout.at(url))
    assert r.commit_bytes == {"delta": (3, 200.0), "full": (2, 1100.0)}
    rows = dict((row[0], row[1]) for _, _, body in sections(r) for row in body if row)
    assert rows["Bytes per commit (median)"] == "delta 200 B x 3, full 1.1 kB x 2"


# -- time the ledger cannot see -------------------------------------------------------------
def _steps(led: Ledger, first: int, t: float, n: int) -> None:
    for step in range(first, first + n):
        led.record_span("train_step", T0 + t + step - first, T0 + t + step - first + 1, step=step)


def _killed_attempt0(url: str, sealed: bool, tmp_path) -> None:
    """a0: launcher_init [0,1], steps 1-4 [2,6] (step 2 committed), killed unseen; the
    orchestrator sees it dead @20 (step 4). a1: launcher_init [20,22], steps 3-6 [25,29],
    shutdown [29,30]. ``sealed``: a0's trainer file is whole; else its events stop at 6 and
    the file was never sealed (an unrecovered spool on object storage)."""
    clock = lambda: T0  # noqa: E731
    with Ledger(JobLayout.at(url), attempt=0, role="orchestrator", clock=clock) as o:
        o.record_span("launcher_init", T0, T0 + 1, reached_trainer=True)
        o.mark("failure", step=4, t=T0 + 20, cause="sigkill")
    trainer = Ledger(
        JobLayout.at(url if sealed else str(tmp_path / "spool")), attempt=0, clock=clock
    )
    trainer.mark("attempt_start", t=T0 + 1)
    _steps(trainer, 1, 2, 4)
    trainer.close()
    if not sealed:  # what the uploader had stored when the process was killed
        spool = tmp_path / "spool" / "ledger" / "trainer-attempt000-rank000.jsonl"
        name = "trainer-attempt000-rank000.jsonl/000000000000"
        storage.write_bytes(f"{JobLayout.at(url).ledger}/{name}", spool.read_bytes())
    with Ledger(JobLayout.at(url), attempt=1, role="orchestrator", clock=clock) as o:
        o.record_span("launcher_init", T0 + 20, T0 + 22, reached_trainer=True)
    with Ledger(JobLayout.at(url), attempt=1, clock=clock) as tr:
        tr.mark("attempt_start", t=T0 + 22)
        _steps(tr, 3, 25, 4)
        tr.record_span("shutdown", T0 + 29, T0 + 30)
        tr.mark("job_end", t=T0 + 30)


def test_lost_events_are_unknown_not_recovery(tmp_path) -> None:
    """An unsealed trainer file: [6,20] is unknown (the attempt may have trained there);
    recovery starts when the orchestrator saw it dead. Sealed, the same gap is recovery."""
    lost = f"memory://ett-{uuid.uuid4().hex}"
    _killed_attempt0(lost, sealed=False, tmp_path=tmp_path)
    r = report_for_job(JobLayout.at(lost))
    assert r.wall_s == 30
    assert r.buckets == {
        "effective_training": 2 + 4,
        "wasted_training": 2,
        "checkpoint_blocking": 0,
        "startup": 2,
        "recovery": 5,
        "eval": 0,
        "shutdown": 1,
        "unknown": 14,
        "other": 0,
    }
    (f,) = r.failures
    assert (f.last_step, f.died_at, f.detected_at, f.resumed_at) == (4, 20, 20, 25)
    assert f.time_to_recover_s == 5 == r.time_to_recover_total_s
    assert r.idleness_pct == pytest.approx(100 * (14 + 2 + 1) / 30)
    assert any(s == (6, 20, "unknown") for s in r.segments)

    whole = f"memory://ett-{uuid.uuid4().hex}"
    _killed_attempt0(whole, sealed=True, tmp_path=tmp_path / "b")
    r = report_for_job(JobLayout.at(whole))
    assert r.buckets["unknown"] == 0 and r.buckets["recovery"] == 19
    assert (r.failures[0].died_at, r.failures[0].time_to_recover_s) == (6, 19)


def test_an_attempt_without_a_trainer_ledger_is_unknown(tmp_path) -> None:
    """a0 crashes at step 5 (seen); a1 has no trainer file at all, but the orchestrator saw
    it reach step 7 before it died @20; a2 resumes at step 6. a1's [10,20] is unknown, and
    neither a0's recovery nor a1's startup claims it."""
    url = str(tmp_path / "job")
    clock = lambda: T0  # noqa: E731
    with Ledger(JobLayout.at(url), attempt=0, role="orchestrator", clock=clock) as o:
        o.record_span("launcher_init", T0, T0 + 1, reached_trainer=True)
        o.mark("failure", step=5, t=T0 + 8, cause="crash")
    with Ledger(JobLayout.at(url), attempt=0, clock=clock) as tr:
        tr.mark("attempt_start", t=T0 + 1)
        _steps(tr, 1, 2, 5)
    with Ledger(JobLayout.at(url), attempt=1, role="orchestrator", clock=clock) as o:
        o.record_span("launcher_init", T0 + 10, T0 + 20, reached_trainer=False)
        o.mark("failure", step=7, t=T0 + 20, cause="sigkill")
    with Ledger(JobLayout.at(url), attempt=2, role="orchestrator", clock=clock) as o:
        o.record_span("launcher_init", T0 + 21, T0 + 22, reached_trainer=True)
    with Ledger(JobLayout.at(url), attempt=2, clock=clock) as tr:
        tr.mark("attempt_start", t=T0 + 22)
        _steps(tr, 6, 23, 3)
        tr.record_span("shutdown", T0 + 26, T0 + 27)
        tr.mark("job_end", t=T0 + 27)
    r = report_for_job(JobLayout.at(url))
    assert r.buckets["unknown"] == 10 and r.buckets["recovery"] == 3 + 3
    assert r.buckets["startup"] == 2 and r.buckets["effective_training"] == 5 + 3
    assert math.fsum(r.buckets.values()) == r.wall_s == 27
    assert [(f.attempt, f.last_step, f.died_at, f.time_to_recover_s) for f in r.failures] == [
        (0, 5, 7, 3),
        (1, 7, 20, 3),
    ]
    assert r.time_to_recover_total_s == r.buckets["recovery"]


def test_a_lost_standby_is_no_attempt_no_startup_and_no_failure(tmp_path) -> None:
    """a0 trains steps 1-6 [0,6] and finishes; a1, its standby, started @2 and parked @3; a2,
    the one after it, was killed during its imports, before it wrote anything: only the
    orchestrator's ``standby_lost`` marks know of either (a1 @4 parked, a2 @5 starting).

    W = 6.5 (a0's shutdown to 6.5): effective 6, shutdown 0.5, nothing else; two lost
    standbys, in attempt order, none of them an attempt or a failure."""
    url = str(tmp_path / "job")
    clock = lambda: T0  # noqa: E731
    with Ledger(JobLayout.at(url), attempt=0, clock=clock) as tr:
        _steps(tr, 1, 0, 6)
        tr.record_span("shutdown", T0 + 6, T0 + 6.5)
        tr.mark("job_end", step=6, t=T0 + 6.5)
    with Ledger(JobLayout.at(url), attempt=1, clock=clock) as tr:
        tr.mark("attempt_start", t=T0 + 2, standby=True)
        tr.mark("standby_ready", t=T0 + 3)
    with Ledger(JobLayout.at(url), attempt=1, role="orchestrator", clock=clock) as o:
        o.mark("standby_lost", t=T0 + 4, cause="sigkill", parked=True)
    with Ledger(JobLayout.at(url), attempt=2, role="orchestrator", clock=clock) as o:
        o.mark("standby_lost", t=T0 + 5, cause="crash", parked=False)
    r = report_for_job(JobLayout.at(url))
    assert r.wall_s == 6.5 and r.finished and r.num_failures == 0
    assert [a.attempt for a in r.attempts] == [0]
    assert r.buckets["effective_training"] == 6 and r.buckets["shutdown"] == 0.5
    assert r.lost_standbys == (
        records.LostStandby(1, 4.0, True, "sigkill"),
        records.LostStandby(2, 5.0, False, "crash"),
    )


def test_an_attempt_that_trained_is_never_dropped_as_a_standby(tmp_path) -> None:
    """A ledger of an older version: a1's standby died parked (attempt_start standby @2,
    parked @3) and a0's failure relaunched cold under the same number 1 (attempt_start @8,
    steps 4-6 [9,12], job_end @12). a0: steps 1-5 [0,5], failure mark @7.

    The cold launch counts from its own attempt_start: recovery [5,9] = 4, effective 1-3 and
    4-6 = 6, wasted a0's 4-5 = 2; W = 12, finished."""
    url = str(tmp_path / "job")
    clock = lambda: T0  # noqa: E731
    with Ledger(JobLayout.at(url), attempt=0, clock=clock) as tr:
        _steps(tr, 1, 0, 5)
    with Ledger(JobLayout.at(url), attempt=0, role="orchestrator", clock=clock) as o:
        o.mark("failure", step=5, t=T0 + 7, cause="sigkill")
    with Ledger(JobLayout.at(url), attempt=1, clock=clock) as tr:
        tr.mark("attempt_start", t=T0 + 2, standby=True)
        tr.mark("standby_ready", t=T0 + 3)
        tr.mark("attempt_start", t=T0 + 8, standby=False)
        _steps(tr, 4, 9, 3)
        tr.mark("job_end", step=6, t=T0 + 12)
    r = report_for_job(JobLayout.at(url))
    assert r.finished and r.num_steps == 6 and r.wall_s == 12
    assert [(a.attempt, a.outcome) for a in r.attempts] == [(0, "sigkill"), (1, "success")]
    assert r.buckets["effective_training"] == 6 and r.buckets["wasted_training"] == 2
    assert r.buckets["recovery"] == 4


def test_a_fallback_names_its_source_and_its_redone_steps_are_counted_apart(tmp_path) -> None:
    """a0: steps 1-8 [0,8] (commits at 4 and 6; 6 turns out corrupt), killed: failure @8.
    a1 (cold): resume @9 from step 4, skipping 6 (quarantined), steps 5-10 [10,16], job_end.

    Wasted: a0's steps 5-8 = 4 s, of which 5-6 (between the checkpoint loaded and the newest
    one skipped) = 2 s redone because of the fallback; 7-8 would have been redone anyway."""
    url = str(tmp_path / "job")
    clock = lambda: T0  # noqa: E731
    with Ledger(JobLayout.at(url), attempt=0, clock=clock) as tr:
        _steps(tr, 1, 0, 8)
    with Ledger(JobLayout.at(url), attempt=0, role="orchestrator", clock=clock) as o:
        o.mark("failure", step=8, t=T0 + 8, cause="sigkill")
    skipped = [
        {
            "step": 6,
            "reason": "checkpoint file:///x/step-000000006 is corrupt: "
            "checksum mismatch in __0_0.distcp",
            "quarantined": True,
        }
    ]
    with Ledger(JobLayout.at(url), attempt=1, clock=clock) as tr:
        tr.mark(
            "resume",
            step=4,
            t=T0 + 9,
            url="file:///x/step-000000004",
            how="cold",
            newest_step=6,
            skipped=skipped,
        )
        _steps(tr, 5, 10, 6)
        tr.mark("job_end", step=10, t=T0 + 16)
    r = report_for_job(JobLayout.at(url))
    assert r.buckets["wasted_training"] == 4 and r.fallback_redone_s == 2
    [resume] = r.resumes
    assert (resume.attempt, resume.step, resume.newest_step, resume.at) == (1, 4, 6, 9)
    assert resume.describe() == (
        "attempt 1 (cold) resumed from step 4, step 6 quarantined: checksum mismatch in "
        "__0_0.distcp"
    )
