"""The interval advisor (Young) and the what-if simulator: against hand-computed timelines,
closed forms, and jobs really run with the change (modeled ledgers)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from infra.accounting.ett import report_for_job
from infra.job_layout import JobLayout
from infra.whatif.advisor import DAY_S, advise_from_report, optimal_interval, waste_fraction
from infra.whatif.checkpoint_cycles import segment, sweep
from infra.whatif.simulate import SimResult, monte_carlo, replay, what_if
from infra.whatif.simulated_job import JobModel
from tests.infra.modeled_job import Plan, write_modeled_job
from tests.infra.test_ett import _write_job


def test_blog_example() -> None:
    """C = 15 s, 3 failures/day -> tau* ~ 929.5 s (~15.5 min), minimum waste ~3.2%."""
    a = optimal_interval(blocking_s=15.0, mtbf_s=DAY_S / 3)
    assert a.mtbf_s == 28_800.0
    assert a.interval_s == pytest.approx(929.5, abs=0.05)
    assert a.interval_s / 60 == pytest.approx(15.5, abs=0.05)
    assert round(100 * a.waste_fraction, 1) == 3.2
    assert a.interval_steps is None and not a.bound_by_upload


def test_interval_in_steps_and_upload_bound() -> None:
    a = optimal_interval(15.0, 28_800.0, step_time_s=2.0)
    assert a.interval_steps == 465 and a.interval_s == 930.0
    # Async: C is staging only (2 s) -> tau* = 339 s, but a 600 s upload must finish first.
    b = optimal_interval(2.0, 28_800.0, step_time_s=0.7, upload_s=600.0)
    assert b.young_interval_s == pytest.approx(339.4, abs=0.1)
    assert b.bound_by_upload and b.interval_steps == 858 and b.interval_s >= 600.0
    assert b.waste_fraction == pytest.approx(waste_fraction(b.interval_s, 2.0, 28_800.0))
    with pytest.raises(ValueError):
        optimal_interval(0.0, 100.0)


def test_advise_from_report(tmp_path) -> None:
    _write_job(str(tmp_path / "job"))
    r = report_for_job(JobLayout.at(str(tmp_path / "job")))
    a = advise_from_report(r)  # observed: 1 failure in 36 s, C = 0.75 s, upload 0.75 s
    assert a.mtbf_s == 36.0 and a.blocking_s == 0.75 and a.upload_s == 0.75
    assert a.young_interval_s == pytest.approx(math.sqrt(2 * 0.75 * 36))
    assert a.step_time_s == 2.0 and a.interval_steps == 4  # round(7.35 / 2)
    assert a.current_interval_s == 8.0
    assert a.current_waste_fraction == pytest.approx(0.75 / 8 + 8 / 72)
    fleet = advise_from_report(r, failures_per_day=3)
    assert fleet.mtbf_s == 28_800.0


# -- simulator: hand-computed replays ---------------------------------------------------
def _total(r: SimResult) -> float:
    return math.fsum(
        [
            r.effective_s,
            r.wasted_s,
            r.blocking_s,
            r.startup_s,
            r.recovery_s,
            r.shutdown_s,
            r.other_s,
        ]
    )


def test_replay_hand_computed_sync() -> None:
    """work 100, tau 10, C 1, startup 3, restart 5, failure at t = 30.

    Training starts at 3; by 30 (27 s) two cycles of 11 s committed 20, then 5 s of training
    are lost. Restart to 35, then 80 left: 80 s + 7 checkpoints = 87 s -> wall 122.
    """
    m = JobModel(work_s=100, interval_s=10, blocking_s=1, startup_s=3, restart_s=5)
    r = replay(m, [30.0])
    assert (r.wall_s, r.startup_s, r.recovery_s, r.wasted_s, r.blocking_s) == (122, 3, 5, 5, 9)
    assert r.failures == 1 and r.ett_pct == pytest.approx(100 * 100 / 122)
    assert _total(r) == r.wall_s
    assert replay(m, []).wall_s == 3 + 100 + 9  # no failure: 9 checkpoints, none at the end


def test_async_upload_wait_and_late_commit() -> None:
    """tau 10, C 1, upload 15: the second save waits 5 s for the first upload."""
    m = JobModel(work_s=30, interval_s=10, blocking_s=1, upload_s=15)
    assert replay(m, []).wall_s == 10 + 1 + 10 + 5 + 1 + 10
    # A failure 12 s in: checkpoint 1 blocked at [10, 11] but its upload runs to 26 -> lost.
    done, train, block = segment(12.0, 10, 1, 15)
    assert (float(done), float(train), float(block)) == (0.0, 11.0, 1.0)
    done, _, _ = segment(26.0, 10, 1, 15)
    assert float(done) == 10.0


def test_replay_accounts_every_second_and_mc_is_seeded() -> None:
    rng = random.Random(5)
    for _ in range(200):
        m = JobModel(
            work_s=rng.uniform(10, 1e4),
            interval_s=rng.uniform(1, 500),
            blocking_s=rng.uniform(0, 30),
            upload_s=rng.choice([0, rng.uniform(0, 600)]),
            startup_s=rng.uniform(0, 100),
            restart_s=rng.uniform(0, 300),
            shutdown_s=rng.uniform(0, 50),
            loop_overhead=rng.uniform(0, 0.2),
        )
        fails = sorted(rng.uniform(0, 3e4) for _ in range(rng.randint(0, 8)))
        r = replay(m, fails)
        assert _total(r) == pytest.approx(r.wall_s, rel=1e-9)
        assert r.wasted_s >= -1e-9 and r.blocking_s >= -1e-9
    m = JobModel(work_s=36_000, interval_s=600, blocking_s=15, restart_s=300)
    assert monte_carlo(m, 7200, runs=50, seed=1) == monte_carlo(m, 7200, runs=50, seed=1)


def test_steady_state_waste_matches_closed_form() -> None:
    """Sync, no restart: efficiency = tau * lambda / (exp(lambda (tau + C)) - 1)."""
    for c, mtbf, tau in [(15, 28_800, 929.5), (60, 7_200, 400), (5, 86_400, 3000)]:
        lam = 1 / mtbf
        exact = 1 - tau * lam / math.expm1(lam * (tau + c))
        [(_, waste)] = sweep([tau], c, mtbf, seed=2)
        assert waste == pytest.approx(exact, rel=0.02)


def test_what_if_from_report(tmp_path) -> None:
    """Calibration from the hand-built job of test_ett (values computed by hand there)."""
    _write_job(str(tmp_path / "job"))
    r = report_for_job(JobLayout.at(str(tmp_path / "job")))
    model = JobModel.from_report(r)
    assert (model.work_s, model.blocking_s, model.startup_s, model.restart_s) == (9, 0.75, 10, 7.5)
    assert model.step_time_s == 9 / 5  # effective training / steps
    assert model.restart_by_cause == {"sigkill": 7.5}
    assert model.loop_overhead == pytest.approx((1 + 1) / (9 + 4))  # eval + other per trained s
    fails = [f.died_at for f in r.failures]
    observed = replay(model, fails)
    assert abs(observed.ett_pct - r.ett_pct) < 5  # a model, not a replay of every step
    assert replay(model.with_changes(blocking_s=0.1), fails).ett_pct > observed.ett_pct


def test_what_if_predicts_the_job_run_with_the_change(tmp_path) -> None:
    """A what-if against the job that really ran with the change: the same failures (wall
    times and kinds), checkpoints blocking 0.2 s instead of 2 s. Both ledgers come from the
    modeled writer (tests/infra/modeled_job.py), not from the replay."""
    fails = ((33.0, "crash"), (95.5, "sigkill"))
    write_modeled_job(str(tmp_path / "slow"), Plan(blocking_s=2.0, failures=fails))
    write_modeled_job(str(tmp_path / "fast"), Plan(blocking_s=0.2, failures=fails))
    slow = report_for_job(JobLayout.at(str(tmp_path / "slow")))
    fast = report_for_job(JobLayout.at(str(tmp_path / "fast")))
    assert fast.ett_pct - slow.ett_pct > 5  # the change matters
    assert what_if(slow, blocking_s=0.2).ett_pct == pytest.approx(fast.ett_pct, abs=0.01)
    assert what_if(slow).ett_pct == pytest.approx(slow.ett_pct, abs=0.01)
    # Measured: each failure costs its own kind's Time to Recover (crash 7; sigkill 6 plus
    # the 0.5 s of the step it cut short); a changed restart cost applies to every failure.
    assert what_if(slow).recovery_s == pytest.approx(7.0 + 6.5)
    assert what_if(slow, restart_s=17.0).recovery_s == pytest.approx(2 * 17.0)


# -- the advisor against a brute-force sweep of the simulator ---------------------------
@pytest.mark.parametrize("blocking_s", [5.0, 15.0, 60.0])
def test_young_within_quarter_pct_of_simulated_optimum(blocking_s: float) -> None:
    """For MTBF in {2 h, 8 h, 24 h}: the simulated waste at tau* is within 0.25% (the README's
    claim) of the smallest waste a sweep (0.33x..3x tau*, 31 points, same 50k failure gaps
    each) finds, and of the exact optimum of the closed form (no simulator involved)."""
    for mtbf in (7_200.0, 28_800.0, 86_400.0):
        tau = optimal_interval(blocking_s, mtbf).interval_s
        grid = [*np.geomspace(tau / 3, tau * 3, 31), tau]
        results = sweep(grid, blocking_s, mtbf, n_failures=50_000, seed=11)
        best = min(w for _, w in results)
        assert results[-1][1] <= 1.0025 * best, (blocking_s, mtbf, results[-1][1], best)
        exact = _closed_form_optimum(blocking_s, mtbf)
        assert _closed_form_waste(tau, blocking_s, mtbf) <= 1.0025 * exact, (blocking_s, mtbf)


def _closed_form_waste(tau: float, c: float, mtbf: float) -> float:
    """Sync checkpoints, no restart cost: 1 - tau * lambda / (exp(lambda (tau + C)) - 1)."""
    lam = 1 / mtbf
    return 1 - tau * lam / math.expm1(lam * (tau + c))


def _closed_form_optimum(c: float, mtbf: float) -> float:
    """The smallest closed-form waste, by golden-section search over tau in (C, 20 tau*)."""
    lo, hi = c, 20 * math.sqrt(2 * c * mtbf)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if _closed_form_waste(a, c, mtbf) < _closed_form_waste(b, c, mtbf):
            hi = b
        else:
            lo = a
    return _closed_form_waste((lo + hi) / 2, c, mtbf)


def test_upload_bound_is_the_simulated_optimum() -> None:
    """Async with C = 2 s, upload 600 s, MTBF 8 h: shorter intervals only add upload waits."""
    a = optimal_interval(2.0, 28_800.0, upload_s=600.0)
    grid = [*np.geomspace(100, 3000, 41), a.interval_s]
    results = sweep(grid, 2.0, 28_800.0, upload_s=600.0, n_failures=50_000, seed=3)
    assert results[-1][1] <= 1.0025 * min(w for _, w in results)


def test_describe() -> None:
    text = optimal_interval(15.0, 28_800.0, step_time_s=2.0).describe()
    assert text.splitlines()[0] == "checkpoint every 930.0 s (465 steps)"
    assert "= 929.5 s" in text and "predicted waste 3.23%" in text
    assert "upload" in optimal_interval(2.0, 28_800.0, upload_s=600.0).describe()
