"""The retry policy: which attempt ends a job, and how long the next one waits."""

from __future__ import annotations

from infra.exit_codes import Outcome
from infra.settings import RecoveryConfig
from tasks.attempt import AttemptReport
from tasks.retry_policy import RetryPolicy, backoff_s


def _report(number: int, outcome: Outcome) -> AttemptReport:
    code = 0 if outcome == Outcome.SUCCESS else 1
    return AttemptReport(number, outcome, code, started=0.0, ended=1.0, last_step=10)


def _decisions(policy: RetryPolicy, outcomes: list[Outcome]) -> list[bool | None]:
    """Each attempt in turn: None (the job goes on), or whether it succeeded."""
    reports: list[AttemptReport] = []
    out: list[bool | None] = []
    for number, outcome in enumerate(outcomes):
        reports.append(_report(number, outcome))
        decided = policy.decide(reports)
        out.append(None if decided is None else decided.succeeded)
    return out


def test_retry_policy_backs_off_only_a_repeating_failure() -> None:
    rec = RecoveryConfig(max_failures=5, backoff_s=2.0, backoff_max_s=10.0)
    assert backoff_s(rec, Outcome.CRASH, 0) == 0.0  # a first crash: at once
    assert [backoff_s(rec, Outcome.CRASH, n) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 10.0]
    assert backoff_s(rec, Outcome.PREEMPTED, 3) == 0.0
    assert backoff_s(RecoveryConfig(backoff_s=0), Outcome.SIGKILL, 2) == 0.0


def test_the_delay_counts_only_the_same_outcome_in_a_row() -> None:
    policy = RetryPolicy(RecoveryConfig(max_failures=9, backoff_s=1.0, backoff_max_s=60.0))
    crash, hang = Outcome.CRASH, Outcome.HANG
    reports = [_report(i, o) for i, o in enumerate([crash, crash, hang, crash, crash, crash])]
    assert [policy.delay_s(reports[: n + 1]) for n in range(6)] == [0, 1, 0, 0, 1, 2]


def test_failures_past_max_failures_end_the_job_and_preemptions_never_count() -> None:
    policy = RetryPolicy(RecoveryConfig(max_failures=2, max_preemptions=10))
    crash, preempted = Outcome.CRASH, Outcome.PREEMPTED
    assert _decisions(policy, [crash, preempted, preempted, crash, crash]) == [
        None,
        None,
        None,
        None,
        False,
    ]
    assert policy.failures == 3 and policy.describe() == "failures 3/2"


def test_preemptions_past_max_preemptions_end_the_job() -> None:
    policy = RetryPolicy(RecoveryConfig(max_failures=0, max_preemptions=2))
    assert _decisions(policy, [Outcome.PREEMPTED] * 3) == [None, None, False]
    assert policy.failures == 0


def test_success_ends_the_job_and_names_its_failures_and_preemptions() -> None:
    policy = RetryPolicy(RecoveryConfig(max_failures=3))
    reports = [_report(0, Outcome.HANG), _report(1, Outcome.PREEMPTED)]
    assert policy.decide(reports[:1]) is None and policy.decide(reports) is None
    decided = policy.decide([*reports, _report(2, Outcome.SUCCESS)])
    assert decided is not None and decided.succeeded
    assert decided.message == "succeeded on attempt 2 after 1 failure(s) and 1 preemption(s)"
    assert (decided.failures, decided.preemptions) == (1, 1)


def test_a_fatal_outcome_ends_the_job_at_once_whatever_the_budget() -> None:
    for outcome in (o for o in Outcome if o.fatal):
        policy = RetryPolicy(RecoveryConfig(max_failures=100))
        decided = policy.decide([_report(0, outcome)])
        assert decided is not None and not decided.succeeded
        assert decided.message.endswith("not retried, a relaunch cannot fix it")
