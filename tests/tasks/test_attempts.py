"""One attempt and the job's loop (tasks/attempt.py, tasks/orchestrator.py) with real
subprocesses: a fake trainer (tests/fake_trainer.py) that keeps the trainer's contract
without torch, so the loop, the standby, the watch and the process-tree handling are
exercised in seconds."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infra import processes, storage
from infra.accounting.ett import report_for_job
from infra.accounting.ledger import next_attempt
from infra.accounting.ledger_format import Mark, Span
from infra.accounting.ledger_read import read_events
from infra.control import JobState, Phase, Progress
from infra.exit_codes import ExitCode, Outcome, name_of, outcome_of
from infra.settings import JobConfig, dump_config, load_resolved
from tasks.attempt import AttemptProcess, AttemptReport, LaunchSpec, Timeouts, watch
from tasks.orchestrator import JobObserver, Orchestrator, run
from tasks.rendezvous import RendezvousHost
from tasks.retry_policy import JobOutcome
from tests import procs
from tests.factories import tiny_config
from tests.procs import MARKER

FAKE = str(Path(__file__).resolve().parents[1] / "fake_trainer.py")


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (0, Outcome.SUCCESS),
        (ExitCode.PREEMPTED, Outcome.PREEMPTED),
        (137, Outcome.SIGKILL),  # the launcher's code for a SIGKILLed rank
        (-9, Outcome.SIGKILL),  # the launcher itself killed
        (1, Outcome.CRASH),
        (-15, Outcome.CRASH),
        (ExitCode.USAGE, Outcome.BAD_CONFIG),
        (ExitCode.CHECKPOINT_INCOMPATIBLE, Outcome.INCOMPATIBLE),
        (ExitCode.ANCHOR_NOT_SAVED, Outcome.CRASH),  # retried from the newest commit
        (ExitCode.STORAGE_UNAVAILABLE, Outcome.STORAGE),
        (ExitCode.BAD_DATA, Outcome.BAD_DATA),
        (ExitCode.JOB_LOCKED, Outcome.JOB_LOCKED),
    ],
)
def test_outcome_of_exit_code(code: int, expected: Outcome) -> None:
    assert outcome_of(code) == expected


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (137, "killed by SIGKILL (137)"),
        (-9, "killed by SIGKILL"),
        (ExitCode.PREEMPTED, "PREEMPTED (83)"),
        (7, "exit code 7"),
        (128 + 200, "killed by signal 200 (328)"),
    ],
)
def test_exit_codes_are_named_for_the_log(code: int, expected: str) -> None:
    assert name_of(code) == expected


def test_only_fatal_outcomes_stop_and_preemptions_are_not_failures() -> None:
    fatal = {o for o in Outcome if o.fatal}
    assert fatal == {Outcome.BAD_CONFIG, Outcome.BAD_DATA, Outcome.INCOMPATIBLE, Outcome.JOB_LOCKED}
    assert not Outcome.PREEMPTED.counts_as_failure and Outcome.HANG.counts_as_failure


def test_launch_commands_for_one_node_and_for_several() -> None:
    """One node: a standalone agent. Several: one agent per node, each with its node rank,
    joining the store hosted elsewhere (never as its host) and advertising its address;
    restarts are the orchestrator's, never torchrun's."""
    spec = LaunchSpec("job.yaml", nproc=2)
    assert spec.command() == [
        sys.executable,
        "-m",
        "trainer.launch",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "--standalone",
        "-m",
        "trainer",
        "--config",
        "job.yaml",
    ]
    two = LaunchSpec("job.yaml", nproc=1, nnodes=2)
    nodes = [two.command(n, "orch.example:29400", "run-1", f"host{n}") for n in range(2)]
    ranks = [[a for a in c if a.startswith(("--node-rank=", "--local-addr="))] for c in nodes]
    assert ranks == [
        ["--local-addr=host0", "--node-rank=0"],
        ["--local-addr=host1", "--node-rank=1"],
    ]
    for command in nodes:
        assert "--standalone" not in command and "--nnodes=2" in command
        assert "--rdzv-backend=c10d" in command and "--rdzv-id=run-1" in command
        assert "--rdzv-endpoint=orch.example:29400" in command
        assert "--rdzv-conf=is_host=false" in command
        assert command[-4:] == ["-m", "trainer", "--config", "job.yaml"]
    with pytest.raises(ValueError, match="2 nodes need a rendezvous endpoint"):
        two.command(0)
    for bad in ({"nproc": 0}, {"nnodes": 0}):
        with pytest.raises(ValueError, match="need nproc >= 1 and nnodes >= 1"):
            LaunchSpec("job.yaml", **bad)


def test_the_rendezvous_store_takes_a_port_the_os_hands_out_and_frees_it() -> None:
    """The orchestrator's c10d store: a port from the OS's ephemeral range (not a fixed one
    two jobs would fight over), reachable while it lives, closed after."""
    with RendezvousHost("localhost") as host:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        assert low <= host.port <= high and host.endpoint == f"localhost:{host.port}"
        socket.create_connection(("localhost", host.port), timeout=5).close()
    with pytest.raises(OSError):
        socket.create_connection(("localhost", host.port), timeout=5).close()


def test_each_nodes_output_is_named_and_agents_that_exit_0_end_the_attempt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two nodes: every output line names its node, both agents join the same rendezvous.
    Agents that all exit 0 end the attempt with 0, whether or not their ranks left records."""
    argv = "import sys; print(*sys.argv[1:])"  # an agent that prints its flags and exits 0
    spec = LaunchSpec(str(tmp_path / "job.yaml"), nnodes=2, launcher=("-c", argv))
    with caplog.at_level(logging.INFO, logger="test-nodes"):
        attempt = AttemptProcess.spawn(
            spec, 3, False, {}, JobState(), logging.getLogger("test-nodes"), "localhost:29999"
        )
        try:
            for node in attempt.nodes:
                node.proc.wait(timeout=60)
            assert attempt.poll() == 0
        finally:
            attempt.end(0.0, preempt=False)  # reaps the agents, joins their output
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[")]
    assert sorted(line.split("] ")[0] for line in lines) == [
        "[attempt 3 node 0",
        "[attempt 3 node 1",
    ]
    endpoints = {a for line in lines for a in line.split() if "rdzv-endpoint" in a}
    assert endpoints == {"--rdzv-endpoint=localhost:29999"}


def test_reports_say_what_became_of_an_attempt() -> None:
    def report(outcome: Outcome, code: int, step: int | None) -> AttemptReport:
        return AttemptReport(0, outcome, code, started=0.0, ended=1.0, last_step=step)

    crash = report(Outcome.CRASH, 1, 7)
    assert crash.describe() == "attempt 0: crash at step 7 (CRASH (1))"
    assert crash.reason() == "attempt 0 failed: crash at step 7 (CRASH (1))"  # its task's state
    assert report(Outcome.HANG, -9, None).describe() == (
        "attempt 0: hang before step 1 (killed by SIGKILL)"
    )
    assert crash.failed and not crash.fatal
    assert report(Outcome.BAD_CONFIG, 2, None).fatal
    preempted = report(Outcome.PREEMPTED, ExitCode.PREEMPTED, 3)
    done = report(Outcome.SUCCESS, 0, 9)
    assert not done.failed
    job = JobOutcome(True, "ok", (crash, preempted, preempted, done))
    assert (job.failures, job.preemptions) == (1, 2)
    as_dict = job.to_dict()
    assert as_dict["succeeded"] and as_dict["message"] == "ok"
    assert [a["outcome"] for a in as_dict["attempts"]] == [
        "crash",
        "preempted",
        "preempted",
        "success",
    ]


# -- the loop with a (fake) trainer ------------------------------------------------------------
def _config(
    tmp_path: Path, faults: list[dict] = (), steps: int = 20, **recovery: object
) -> JobConfig:
    """A job of the fake trainer: ``recovery`` sets its section (standby, max_failures...);
    preemption_budget_s 1 keeps the kill grace at 11 s."""
    return tiny_config(
        tmp_path,
        train={"steps": steps, "eval": "off"},  # no side evaluator beside a fake trainer
        faults=list(faults),
        checkpoint={"preemption_budget_s": 1},
        recovery={"backoff_s": 0, **recovery},
    )


def _spec(tmp_path: Path, faults: list[dict], steps: int = 20, **env: str) -> tuple:
    config = _config(tmp_path, faults, steps)
    path = tmp_path / "job.yaml"
    dump_config(config, path)
    return config, LaunchSpec(str(path), env=_env(tmp_path, **env), launcher=(FAKE,))


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The fake trainers' environment: a marker naming this test, and ``extra``."""
    return {MARKER: str(tmp_path), **extra}


def _run(tmp_path: Path, faults: list[dict], env: dict[str, str] | None = None, **recovery):
    """The job to its end on the fake trainer: (config, outcome, the backoff sleeps)."""
    steps = recovery.pop("steps", 20)
    config = _config(tmp_path, faults, steps, **recovery)
    sleeps: list[float] = []
    result = run(
        config,
        launcher=(FAKE,),
        env=_env(tmp_path, **(env or {})),
        sleep=sleeps.append,
        scheduling=(time.time() - 3.0, time.time()),
    )
    return config, result.outcome, sleeps


def _fake_pids(tmp_path: Path) -> list[int]:
    """Live fake trainers of this test (their environment names ``tmp_path``): tests on
    another pytest-xdist worker run fake trainers of their own."""
    return procs.carrying(**{MARKER: str(tmp_path)})


def test_standby_is_promoted_after_a_sigkill_and_a_preemption(tmp_path: Path) -> None:
    faults = [
        {"kind": "sigkill", "step": 7, "attempt": 0},
        {"kind": "sigterm", "step": 13, "attempt": 1},
    ]
    config, outcome, sleeps = _run(tmp_path, faults, max_failures=1, backoff_s=3)

    assert outcome.succeeded, outcome.message
    got = [(a.outcome, a.from_standby) for a in outcome.attempts]
    assert got == [(Outcome.SIGKILL, False), (Outcome.PREEMPTED, True), (Outcome.SUCCESS, True)]
    # The fake is its own launcher: killed (-9), or seen dead by its pid file first (137).
    assert outcome.attempts[0].exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL)
    assert [a.exit_code for a in outcome.attempts[1:]] == [ExitCode.PREEMPTED, 0]
    assert outcome.failures == 1 and outcome.preemptions == 1  # preemption is not a failure
    assert sleeps == []  # first of their kind: promoted at once
    assert [a.last_step for a in outcome.attempts] == [6, 13, 20]

    events = read_events(config.layout)
    marks = [e for e in events if e.name == Mark.FAILURE]
    assert [(e.attempt, e.attrs["cause"], e.step) for e in marks] == [
        (0, "sigkill", 6),
        (1, "preempted", 13),
    ]
    promoted = {e.attempt for e in events if e.name == Mark.PROMOTED}
    assert promoted == {1, 2}
    # Only the cold start has a launcher_init span; promoted standbys start at promotion.
    launches = [
        (e.attempt, e.attrs["reached_trainer"]) for e in events if e.name == Span.LAUNCHER_INIT
    ]
    assert launches == [(0, True)]
    assert [e.attempt for e in events if e.name == Span.SCHEDULING] == [0]

    report = report_for_job(config.layout)
    assert report.num_failures == 2 and report.finished
    assert [f.cause for f in report.failures] == ["sigkill", "preempted"]
    assert [s.attempt for s in report.standbys] == [1, 2]
    for f in report.failures:  # recovery = death -> first step of the promoted standby
        assert f.resumed_at is not None and f.resumed_at > f.died_at
    # A standby's pre-warm ran beside attempt 0: none of it is startup of the job.
    assert report.time_to_start_s is not None
    assert report.buckets["startup"] <= report.time_to_start_s + 1e-9
    assert _fake_pids(tmp_path) == []


def _run_in_thread(tmp_path: Path, steps: int, env: dict[str, str], caplog):
    """The job on a thread (its fake trainers see ``env``); returns (config, thread, result)."""
    config = _config(tmp_path, [], steps, max_failures=2)
    result: list[JobOutcome] = []

    def job() -> None:
        result.append(run(config, launcher=(FAKE,), env=_env(tmp_path, **env)).outcome)

    thread = threading.Thread(target=job, daemon=True)
    caplog.set_level(logging.INFO, logger="ett.orchestrator")
    thread.start()
    return config, thread, result


def _has(config, name: str, mark: str) -> bool:
    path = Path(str(config.layout.url).removeprefix("file://"), "ledger", name)
    return path.exists() and f'"name":"{mark}"' in path.read_text()


def _wait_for(what: str, check, thread: threading.Thread, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert thread.is_alive(), f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def _kill_attempt(tmp_path: Path, number: int) -> None:
    pids = [p for p in _fake_pids(tmp_path) if procs.env_var(p, "ETT_ATTEMPT") == str(number)]
    assert pids, f"attempt {number} is not running"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_standby_lost_while_parked_is_marked_and_replaced_under_a_new_number(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Standby 1 dies once it has parked. The orchestrator marks it lost (its own attempt
    number, never the job's startup or a failure) and starts standby 2; the primary's death
    then promotes standby 2. No attempt number is used twice."""
    env = {"FAKE_STANDBY_EXIT": "137", "FAKE_STANDBY_EXIT_ATTEMPTS": "1"}
    config, thread, result = _run_in_thread(tmp_path, 300, env, caplog)
    _wait_for(
        "standby 1 lost",
        lambda: _has(config, "orchestrator-attempt001-rank000.jsonl", "standby_lost"),
        thread,
    )
    _wait_for(
        "standby 2",
        lambda: _has(config, "trainer-attempt002-rank000.jsonl", "standby_ready"),
        thread,
    )
    _kill_attempt(tmp_path, 0)
    thread.join(60)
    [outcome] = result
    assert outcome.succeeded, outcome.message
    assert [(a.attempt, a.outcome) for a in outcome.attempts] == [
        (0, Outcome.SIGKILL),
        (2, Outcome.SUCCESS),
    ]
    assert outcome.attempts[1].from_standby
    assert "standby attempt 1 lost while parked (killed by SIGKILL (137)); starting another" in (
        caplog.text
    )
    assert "promoting standby attempt 2" in caplog.text
    report = report_for_job(config.layout)
    assert report.finished and [s.attempt for s in report.lost_standbys] == [1]
    assert report.num_failures == 1 and [a.attempt for a in report.attempts] == [0, 2]
    assert _fake_pids(tmp_path) == []


def test_standbys_lost_in_a_row_leave_the_job_without_one_and_the_relaunch_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every standby dies once parked: after three in a row the job goes on without one, and
    the primary's death relaunches cold under a new number, naming the last standby lost."""
    config, thread, result = _run_in_thread(tmp_path, 600, {"FAKE_STANDBY_EXIT": "1"}, caplog)
    _wait_for(
        "standby 3 lost",
        lambda: _has(config, "orchestrator-attempt003-rank000.jsonl", "standby_lost"),
        thread,
    )
    _kill_attempt(tmp_path, 0)
    thread.join(60)
    [outcome] = result
    assert outcome.succeeded, outcome.message
    assert [(a.attempt, a.from_standby) for a in outcome.attempts] == [(0, False), (4, False)]
    assert "3 lost in a row: going on without a standby" in caplog.text
    assert re.search(r"relaunching cold \(standby attempt 3 lost at \d\d:\d\d:\d\d\)", caplog.text)
    report = report_for_job(config.layout)
    assert [(s.attempt, s.cause, s.parked) for s in report.lost_standbys] == [
        (1, "crash", True),
        (2, "crash", True),
        (3, "crash", True),
    ]
    assert [a.attempt for a in report.attempts] == [0, 4] and report.finished
    assert not (
        Path(str(config.layout.url).removeprefix("file://"))
        / "ledger"
        / "trainer-attempt005-rank000.jsonl"
    ).exists()  # no standby behind attempt 4
    assert _fake_pids(tmp_path) == []


@pytest.mark.parametrize("standby", [True, False])
def test_failures_recovered_in_process_reach_the_next_attempts_mtbf(
    tmp_path: Path, standby: bool
) -> None:
    """Attempt 0 survives two exceptions in process, then is SIGKILLed: the next attempt
    (promoted or launched cold) is told of all three failures, while ``max_failures``
    counts only the one that ended an attempt."""
    faults = [{"kind": "sigkill", "step": 9, "attempt": 0}]
    env = {"FAKE_EXCEPTION_STEPS": "3,6"}
    config, outcome, _ = _run(tmp_path, faults, env, max_failures=1, standby=standby)
    assert outcome.succeeded, outcome.message
    assert [a.restarts_in_process for a in outcome.attempts] == [2, 0]
    assert outcome.failures == 1  # the in-process restarts are not attempt failures
    events = read_events(config.layout)
    told = {e.attempt: e.attrs["failures"] for e in events if e.name == Mark.ATTEMPT_START}
    if standby:  # spawned before any failure, it reads the job's state again when promoted
        promoted = {e.attempt: e.attrs["failures"] for e in events if e.name == Mark.PROMOTED}
        assert (told[0], promoted) == (0, {1: 3})
        # attempt 1's own standby, when it got as far as starting before the job ended
        assert told.get(2, 3) == 3
    else:
        assert told == {0: 0, 1: 3}
    assert _fake_pids(tmp_path) == []


def test_same_failure_repeating_backs_off(tmp_path: Path) -> None:
    faults = [{"kind": "crash", "step": 3, "attempt": a} for a in range(3)]
    config, outcome, sleeps = _run(tmp_path, faults, max_failures=2, backoff_s=1)
    assert not outcome.succeeded
    assert [a.outcome for a in outcome.attempts] == [Outcome.CRASH] * 3
    assert "3 failures exceed max_failures=2" in outcome.message
    assert sleeps == [1.0]  # the first crash relaunches at once, the repeat waits
    report = report_for_job(config.layout)  # the failed job still has a report
    assert report.num_failures == 3 and not report.finished
    assert _fake_pids(tmp_path) == []


# A hang nobody detects ends the fake's hang as a crash after this long (20x hang_s below),
# so a broken detector fails the assertions; the marker is the backstop.
HANG_LIMIT = {"FAKE_HANG_LIMIT_S": "30"}


@pytest.mark.timeout(120)
def test_hang_with_chatty_output_is_killed_with_its_whole_tree(tmp_path: Path) -> None:
    """The hung trainer keeps printing: output is not progress. It also has a child in a
    session of its own (as torchrun's ranks are): the tree kill must end it too."""
    faults = [{"kind": "hang", "step": 5, "attempt": 0}]
    config, outcome, _ = _run(
        tmp_path,
        faults,
        {"FAKE_RANK_CHILD": str(tmp_path / "child"), **HANG_LIMIT},
        standby=False,
        hang_timeout_s=1.5,
        startup_timeout_s=60,
    )
    assert [a.outcome for a in outcome.attempts] == [Outcome.HANG, Outcome.SUCCESS]
    mark = next(e for e in read_events(config.layout) if e.name == Mark.FAILURE)
    assert mark.attrs["cause"] == "hang" and mark.step == 4
    assert _fake_pids(tmp_path) == []
    children = [int(p.read_text()) for p in tmp_path.glob("child.*")]
    assert len(children) == 2  # one per attempt: the hung one's and the successful one's
    alive = [pid for pid in children if processes.pid_alive(pid)]
    assert alive == [], f"a rank's child outlived its attempt: {alive}"


@pytest.mark.timeout(120)
def test_the_hang_kill_itself_ends_every_process_of_the_attempt(tmp_path: Path) -> None:
    """``watch`` ends a hung attempt's whole tree before it returns, not only its agent:
    right after it, the orchestrator recovers the ranks' ledger spools, which it does only
    for processes that are gone. The hung fake gets SIGTERM (a preemption: it commits and
    exits); its child in a session of its own must be gone too."""
    faults = [{"kind": "hang", "step": 3, "attempt": 0}]
    env = {"FAKE_RANK_CHILD": str(tmp_path / "child"), **HANG_LIMIT}
    _, spec = _spec(tmp_path, faults, **env)
    attempt = AttemptProcess.spawn(spec, 0, False, {}, JobState(), logging.getLogger("test-watch"))
    try:
        code, hung, last = watch(attempt, Timeouts(hang_s=1.0, startup_s=60, grace_s=5.0))
        assert hung and last is not None and last.step == 2
        assert code == ExitCode.PREEMPTED  # it was asked to stop, and did, within the grace
        child = int((tmp_path / "child.0").read_text())
        left = [p for p in (attempt.nodes[0].pids()[0], child) if processes.pid_alive(p)]
        assert left == [], f"alive after the hang kill: {left}"
    finally:
        attempt.end(0.0, preempt=False)


@pytest.mark.timeout(120)
def test_a_child_started_while_training_is_ended_after_its_rank_is_killed(tmp_path: Path) -> None:
    """A rank starts a child while it trains (in a session of its own), then is SIGKILLed:
    the orphan is reparented away, and no change of phase made the orchestrator look at the
    tree since it started. The watcher's periodic scan saw it: it is ended with the attempt."""
    faults = [{"kind": "sigkill", "step": 80, "attempt": 0}]
    env = {"FAKE_RANK_CHILD": str(tmp_path / "child"), "FAKE_RANK_CHILD_STEP": "10"}
    try:
        _, outcome, _ = _run(tmp_path, faults, env, max_failures=0, standby=False, steps=100)
        assert [a.outcome for a in outcome.attempts] == [Outcome.SIGKILL]
        child = int((tmp_path / "child.0").read_text())
        deadline = time.monotonic() + 10  # signalled: it is gone once the kernel delivers it
        while processes.pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not processes.pid_alive(child), "a child started while training outlived it"
    finally:
        for path in tmp_path.glob("child.*"):  # not left behind when the test fails
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(path.read_text()), signal.SIGKILL)


def test_preemptions_are_not_failures(tmp_path: Path) -> None:
    """Two preemptions with max_failures=0: not one failure, the job succeeds."""
    faults = [{"kind": "sigterm", "step": 3 + a, "attempt": a} for a in range(2)]
    _, outcome, sleeps = _run(
        tmp_path, faults, max_failures=0, max_preemptions=2, standby=False, steps=8
    )
    assert outcome.succeeded, outcome.message
    assert [a.outcome for a in outcome.attempts] == [Outcome.PREEMPTED] * 2 + [Outcome.SUCCESS]
    assert [a.last_step for a in outcome.attempts] == [3, 4, 8]
    assert outcome.failures == 0 and outcome.preemptions == 2 and sleeps == []
    assert outcome.message == "succeeded on attempt 2 after 0 failure(s) and 2 preemption(s)"


def test_the_resolved_config_is_kept_in_the_jobs_folder(tmp_path: Path) -> None:
    """job.yaml on the job's storage: what every process of the job reads, credentials out."""
    config, outcome, _ = _run(tmp_path, [], steps=2)
    assert outcome.succeeded, outcome.message
    copy = tmp_path / "kept.yaml"
    copy.write_text(storage.read_text(config.layout.config))
    assert load_resolved(copy).public_dict() == config.public_dict()


def test_an_endless_preemption_loop_stops_at_max_preemptions(tmp_path: Path) -> None:
    faults = [{"kind": "sigterm", "step": 3 + a, "attempt": a} for a in range(4)]
    _, outcome, sleeps = _run(
        tmp_path, faults, max_failures=0, max_preemptions=2, standby=False, steps=8
    )
    assert not outcome.succeeded
    assert [a.outcome for a in outcome.attempts] == [Outcome.PREEMPTED] * 3
    assert outcome.message == "preempted 3 times, more than max_preemptions=2"
    assert outcome.failures == 0 and sleeps == []
    assert _fake_pids(tmp_path) == []


def test_bad_config_is_not_retried(tmp_path: Path) -> None:
    env = {"FAKE_EXIT_CODE": str(ExitCode.USAGE)}
    _, outcome, sleeps = _run(tmp_path, [], env, max_failures=3)
    assert not outcome.succeeded and len(outcome.attempts) == 1 and sleeps == []
    assert outcome.attempts[0].outcome == Outcome.BAD_CONFIG
    assert "not retried" in outcome.message


def test_unpromoted_standby_is_released_and_not_accounted(tmp_path: Path) -> None:
    config, outcome, _ = _run(tmp_path, [], steps=60)
    assert outcome.succeeded and len(outcome.attempts) == 1
    events = read_events(config.layout)
    assert any(e.name == Mark.STANDBY_READY and e.attempt == 1 for e in events)
    assert not any(e.name == Mark.PROMOTED for e in events)
    report = report_for_job(config.layout)
    assert [a.attempt for a in report.attempts] == [0] and report.standbys == ()
    assert _fake_pids(tmp_path) == []


class _Cancelled(BaseException):
    """Stands for Prefect's TerminationSignal, raised in the flow's thread."""


def test_cancelled_job_preempts_its_attempt_and_ends_the_standby(tmp_path: Path) -> None:
    """The flow run is cancelled while it watches attempt 0 (its standby parked): the
    attempt is preempted (it checkpoints at its step boundary), the standby ended."""
    config = _config(tmp_path, [], steps=100_000)
    with (
        pytest.raises(_Cancelled),
        Orchestrator(config, launcher=(FAKE,), env=_env(tmp_path)) as job,
    ):
        for attempt in job:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until the standby is parked
                standby = job._standby.progress() if job._standby is not None else None
                if standby is not None and standby.phase == "parked":
                    raise _Cancelled()
                if (progress := attempt.progress()) is not None:
                    job._progress(progress)
                time.sleep(0.05)
            raise AssertionError("the standby never parked")
    events = read_events(config.layout)
    # SIGTERM -> the attempt checkpointed at its step boundary and exited as preempted.
    assert any(e.name == Mark.CHECKPOINT_COMMITTED and e.attempt == 0 for e in events)
    assert job.result is not None and not job.result.outcome.succeeded
    assert _fake_pids(tmp_path) == []


class _Settled(JobObserver):
    """Stops the job at the first progress after which its side work would start."""

    def __init__(self) -> None:
        self.job: Orchestrator | None = None
        self.seen: list[str | None] = []

    def progress(self, progress: Progress) -> None:
        job = self.job
        assert job is not None
        if job._settled:
            standby = job._standby.progress() if job._standby is not None else None
            self.seen.append(standby.phase if standby is not None else None)
            raise _Cancelled()  # the rest of the job is not needed


@pytest.mark.parametrize("standby", [True, False])
def test_side_work_starts_once_training_runs_and_the_standby_is_parked(
    tmp_path: Path, standby: bool
) -> None:
    """The job settles (where the side evaluator starts) when it trains and its standby,
    if it has one, is parked: not while the standby still starts, as both would compete for
    the CPU. Without a standby it settles at the first step."""
    config = _config(tmp_path, [], steps=1500, standby=standby)  # ~30 s: never settling ends
    observer = _Settled()
    orchestrator = Orchestrator(config, observer, launcher=(FAKE,), env=_env(tmp_path))
    with pytest.raises(_Cancelled), orchestrator as job:
        observer.job = job
        for attempt in job:
            job.watch(attempt)
    assert observer.seen == [Phase.PARKED if standby else None]
    assert _fake_pids(tmp_path) == []


def test_orchestrator_death_stops_its_trainers(tmp_path: Path) -> None:
    """No orchestrator, no training: the lifeline (the control pipe) closes with it."""
    config, spec = _spec(tmp_path, [], steps=100_000)
    root = str(Path(FAKE).parents[1])
    script = (
        f"import sys; sys.path.insert(0, {root!r})\n"
        "from infra.settings import load_resolved\n"
        "from tasks.orchestrator import run\n"
        f"run(load_resolved({spec.config_path!r}), launcher=({FAKE!r},), "
        f"env={_env(tmp_path)!r})\n"
    )
    # Its control folders outlive a SIGKILL (nobody is left to remove them): in the test's.
    temp = tmp_path / "orchestrator-tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    orchestrator = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
        e.name == Mark.STANDBY_READY for e in read_events(config.layout)
    ):
        time.sleep(0.1)
    assert _fake_pids(tmp_path), "the job never started"
    orchestrator.send_signal(signal.SIGKILL)
    orchestrator.wait()
    deadline = time.monotonic() + 30
    while _fake_pids(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _fake_pids(tmp_path) == []
    events = read_events(config.layout)
    assert any(e.name == Mark.CHECKPOINT_COMMITTED and e.attempt == 0 for e in events)


def test_next_attempt_continues_numbering(tmp_path: Path) -> None:
    config, outcome, _ = _run(tmp_path, [{"kind": "crash", "step": 3, "attempt": 0}], standby=False)
    assert outcome.succeeded and next_attempt(config.layout) == 2
    env_attempts = {e.attempt for e in read_events(config.layout)}
    assert env_attempts == {0, 1}
    assert os.path.exists(tmp_path / "store" / "jobs" / config.job_id / "fake_ckpt.txt")


class _EndedAttempt:
    """An attempt that had ended before ``watch`` first looked: its exit and its progress
    record are all there is (a fast failure on a loaded host). ``promoted_at`` set: a
    standby promoted at ``promoted_at``, whose record before it is the parked one."""

    def __init__(self, progress: Progress | None, promoted_at: float | None = None) -> None:
        self._progress, self.promoted_at, self.spawned = progress, promoted_at, 0.0
        self.log = logging.getLogger("test-watch")

    def poll(self) -> int:
        return ExitCode.CRASH

    def progress(self) -> Progress | None:
        return self._progress

    def track(self) -> None:
        pass


def test_an_attempt_that_ended_before_the_first_look_reports_its_last_step() -> None:
    now = time.time()
    record = Progress(Phase.TRAINING, 7, 20, now, now - 1.0)
    timeouts = Timeouts(hang_s=60, startup_s=60, grace_s=1)
    code, hung, last = watch(_EndedAttempt(record), timeouts)  # type: ignore[arg-type]
    assert (code, hung, last) == (ExitCode.CRASH, False, record)
    # A promoted standby's record from before its promotion is its parked one: no step.
    parked = Progress(Phase.INIT, 0, 20, now - 5.0, now - 9.0)
    _, _, last = watch(_EndedAttempt(parked, promoted_at=now), timeouts)  # type: ignore[arg-type]
    assert last is None
