"""Exit classification and the attempt loop, with real subprocesses: a fake trainer
(tests/flows/fake_trainer.py) that keeps the trainer's contract without torch."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from infra.ett import report_for_job
from infra.exit_codes import ExitCode
from infra.ledger import read_events
from infra.settings import dump_config
from tasks import train as t
from tests.factories import tiny_config

FAKE = str(Path(__file__).with_name("fake_trainer.py"))


# -- classification -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exit_code", "workers", "hung", "expected"),
    [
        (0, [], False, t.SUCCESS),
        (ExitCode.PREEMPTED, [], False, t.PREEMPTED),  # the trainer alone
        (1, [ExitCode.PREEMPTED], False, t.PREEMPTED),  # torchrun exits 1, names 83
        (1, [-9], False, t.SIGKILL),  # a SIGKILLed worker
        (1, [ExitCode.PREEMPTED, -9], False, t.SIGKILL),  # any lost worker
        (-9, [], False, t.SIGKILL),  # torchrun itself killed
        (137, [], False, t.SIGKILL),  # shell/container convention
        (1, [1], False, t.CRASH),
        (1, [], False, t.CRASH),
        (-15, [], False, t.CRASH),
        (1, [ExitCode.USAGE], False, t.BAD_CONFIG),
        (ExitCode.CHECKPOINT_INCOMPATIBLE, [], False, t.INCOMPATIBLE),
        (1, [ExitCode.ANCHOR_NOT_SAVED], False, t.CRASH),  # retried from the newest commit
        (-15, [], True, t.HANG),  # killed by us for lack of progress
    ],
)
def test_classify(exit_code: int, workers: list[int], hung: bool, expected: str) -> None:
    assert t.classify(exit_code, workers, hung) == expected


def test_ledger_cause_vocabulary() -> None:
    causes = {
        t.ledger_cause(o)
        for o in (t.CRASH, t.SIGKILL, t.PREEMPTED, t.HANG, t.BAD_CONFIG, t.INCOMPATIBLE)
    }
    assert causes == {"crash", "sigkill", "preempted", "hang"}


def test_watcher_reads_torchrun_summary_and_steps() -> None:
    lines: list[str] = []

    class Log:
        def info(self, fmt: str, *args: object) -> None:
            lines.append(fmt % args)

        def log(self, level: int, fmt: str, *args: object) -> None:
            lines.append(fmt % args)

        debug = info

    seen: list[tuple[int, int]] = []
    w = t._Watcher(Log(), on_step=lambda s, n: seen.append((s, n)))
    assert w.is_progress("any startup line")  # before the first step, output is liveness
    for line in [
        "2026 [rank0] trainer.train: step 5/30 loss 0.6931 1000 examples/s\n",
        "E1130 api.py:1002] failed (exitcode: 83) local_rank: 0 (pid: 15879) of binary: py\n",
        "  exitcode  : 83 (pid: 15879)\n",
        "[1]:\n  exitcode  : -15 (pid: 15880)\n",
    ]:
        w(line)
    assert seen == [(5, 30)] and w.last_step == 5 and w.total_steps == 30
    assert w.worker_codes == [83, -15]
    assert not w.is_progress("W1130 a warning\n") and w.is_progress("x step 6/30 loss 1\n")
    assert t.classify(1, w.worker_codes) == t.PREEMPTED


def test_retry_policy_backoff() -> None:
    p = t.RetryPolicy(max_failures=5, backoff_s=2.0, backoff_max_s=10.0)
    assert [p.delay_s(t.CRASH, n) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 10.0]
    assert p.delay_s(t.PREEMPTED, 3) == 0.0
    assert t.RetryPolicy(backoff_s=0).delay_s(t.SIGKILL, 2) == 0.0


# -- the loop with a real (fake) trainer ----------------------------------------------------
def _job(tmp_path: Path, faults: list[dict], steps: int = 20):
    config = tiny_config(tmp_path, train={"steps": steps, "log_every": 2}, faults=faults)
    path = tmp_path / "job.yaml"
    dump_config(config, path)
    return config, [sys.executable, FAKE, "--config", str(path)]


def _run(tmp_path: Path, faults: list[dict], policy: t.RetryPolicy, **kw):
    config, command = _job(tmp_path, faults)
    sleeps: list[float] = []
    scheduled = (time.time() - 3.0, time.time())
    outcome = t.run_attempts(
        lambda a: t.launch_attempt(
            config.job_url, command, a, scheduling=scheduled if a == 0 else None, **kw
        ),
        policy=policy,
        sleep=sleeps.append,
    )
    return config, outcome, sleeps


def test_loop_recovers_from_sigkill_and_preemption(tmp_path: Path) -> None:
    faults = [
        {"kind": "sigkill", "step": 7, "attempt": 0},
        {"kind": "sigterm", "step": 13, "attempt": 1},
    ]
    config, outcome, sleeps = _run(tmp_path, faults, t.RetryPolicy(max_failures=1, backoff_s=3))

    assert outcome.succeeded, outcome.message
    assert [a.outcome for a in outcome.attempts] == [t.SIGKILL, t.PREEMPTED, t.SUCCESS]
    assert [a.exit_code for a in outcome.attempts] == [-9, ExitCode.PREEMPTED, 0]
    assert outcome.failures == 1 and outcome.preemptions == 1  # preemption is not a failure
    assert sleeps == [3.0]  # backoff after the SIGKILL only
    assert [a.last_step for a in outcome.attempts] == [6, 13, 20]

    events = read_events(config.job_url)
    marks = [e for e in events if e.name == "failure"]
    assert [(e.attempt, e.attrs["cause"], e.step, e.attrs["exit_code"]) for e in marks] == [
        (0, "sigkill", 6, -9),
        (1, "preempted", 13, ExitCode.PREEMPTED),
    ]
    inits = {e.attempt: e for e in events if e.name == "launcher_init"}
    starts = {e.attempt: e for e in events if e.name == "attempt_start"}
    assert sorted(inits) == [0, 1, 2]
    for a, span in inits.items():  # spawn -> the trainer's attempt_start mark
        assert span.end == starts[a].start and span.attrs["reached_trainer"]
        assert outcome.attempts[a].started == span.start
    assert [e.attempt for e in events if e.name == "scheduling"] == [0]

    report = report_for_job(config.job_url)
    assert report.num_failures == 2 and report.finished
    assert {f.cause for f in report.failures} == {"sigkill", "preempted"}
    assert all(f.time_to_recover_s > 0 for f in report.failures)


def test_loop_gives_up_after_max_failures(tmp_path: Path) -> None:
    faults = [{"kind": "crash", "step": 3, "attempt": a} for a in range(3)]
    config, outcome, sleeps = _run(tmp_path, faults, t.RetryPolicy(max_failures=2, backoff_s=1))
    assert not outcome.succeeded
    assert [a.outcome for a in outcome.attempts] == [t.CRASH] * 3
    assert "3 failures exceed max_failures=2" in outcome.message
    assert sleeps == [1.0, 2.0]  # exponential
    report = report_for_job(config.job_url)  # the failed job still has a report
    assert report.num_failures == 3 and not report.finished


def test_hang_is_detected_and_killed(tmp_path: Path) -> None:
    faults = [{"kind": "hang", "step": 5, "attempt": 0}]
    # The timeout must cover the silent start of a process (imports): ~1-4 s here under load.
    config, outcome, _ = _run(tmp_path, faults, t.RetryPolicy(backoff_s=0), hang_timeout_s=8.0)
    assert [a.outcome for a in outcome.attempts] == [t.HANG, t.SUCCESS]
    hung = outcome.attempts[0]
    assert hung.ended - hung.started < 40  # killed ~8 s after its last progress, not 3600 s
    mark = next(e for e in read_events(config.job_url) if e.name == "failure")
    assert mark.attrs["cause"] == "hang" and mark.step == 4


def test_bad_config_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_EXIT_CODE", str(ExitCode.USAGE))
    _, outcome, sleeps = _run(tmp_path, [], t.RetryPolicy(max_failures=3))
    assert not outcome.succeeded and len(outcome.attempts) == 1 and sleeps == []
    assert outcome.attempts[0].outcome == t.BAD_CONFIG and "not retried" in outcome.message


def test_trainer_that_never_starts(tmp_path: Path) -> None:
    """A command that dies before the trainer marks its start: launcher_init runs to the
    death, the failure is a crash before step 1."""
    config, _ = _job(tmp_path, [])
    cmd = [sys.executable, "-c", "import sys; sys.exit(3)"]
    report = t.launch_attempt(config.job_url, cmd, 0)
    assert report.outcome == t.CRASH and report.last_step is None
    assert "before step 1" in report.describe()
    span = next(e for e in read_events(config.job_url) if e.name == "launcher_init")
    assert not span.attrs["reached_trainer"] and span.end == report.ended


def test_next_attempt_continues_numbering(tmp_path: Path) -> None:
    config, command = _job(tmp_path, [{"kind": "crash", "step": 3, "attempt": 0}])
    assert t.next_attempt(config.job_url) == 0
    t.launch_attempt(config.job_url, command, 0)
    assert t.next_attempt(config.job_url) == 1
    report = t.launch_attempt(config.job_url, command, 1)
    assert report.outcome == t.SUCCESS and t.next_attempt(config.job_url) == 2


@pytest.mark.slow
def test_torchrun_exit_codes_are_read_from_its_summary(tmp_path: Path) -> None:
    """torchrun exits 1 for any failed worker; the worker's code comes from its summary."""
    from tasks.launch import torchrun_command

    config, _ = _job(tmp_path, [{"kind": "sigterm", "step": 3, "attempt": 0}], steps=6)
    path = str(tmp_path / "job.yaml")
    command = torchrun_command(path)
    # torchrun runs `-m trainer`; point it at the fake trainer script instead
    command = command[: command.index("-m", 3)] + [FAKE, "--config", path]
    env = {"OMP_NUM_THREADS": "1"}
    first = t.launch_attempt(config.job_url, command, 0, env=env)
    assert (first.launcher_exit_code, first.exit_code, first.outcome) == (
        1,
        ExitCode.PREEMPTED,
        t.PREEMPTED,
    )
    second = t.launch_attempt(config.job_url, command, 1, env=env)
    assert second.outcome == t.SUCCESS and second.last_step == 6
    assert os.path.exists(tmp_path / "store" / "jobs" / config.job_id / "fake_ckpt.txt")


class _Cancelled(BaseException):
    """Stands for Prefect's TerminationSignal, raised in the main thread on SIGTERM."""


def test_cancelled_launcher_preempts_its_attempt(tmp_path: Path) -> None:
    """The attempt runs in its own process group and would outlive an interrupted flow:
    the launcher preempts it (SIGTERM -> checkpoint -> exit) before letting go."""
    import signal

    config, command = _job(tmp_path, [], steps=100000)

    def cancel(*_: object) -> None:
        raise _Cancelled()

    previous = signal.signal(signal.SIGALRM, cancel)
    signal.setitimer(signal.ITIMER_REAL, 6.0)
    try:
        with pytest.raises(_Cancelled):
            t.launch_attempt(config.job_url, command, 0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert t._children_running(command) == []  # nothing left running
    mark = next(e for e in read_events(config.job_url) if e.name == "failure")
    assert mark.attrs["outcome"] == "cancelled" and mark.attrs["stopped_pids"]
    saved = (tmp_path / "store" / "jobs" / config.job_id / "fake_ckpt.txt").read_text()
    assert int(saved) > 0  # the preempted trainer checkpointed on the way out
