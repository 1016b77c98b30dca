"""A job whose nodes are node runs on other "hosts" (tasks/remote_node.py, tasks/node_runner.py),
without Prefect: node runs placed as subprocesses on loopback hosts (tests/node_hosts.py), the
fake trainer in place of torchrun. Through a real Prefect server and workers:
tests/reliability/test_multi_host.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import storage
from infra.accounting.ett import report_for_job
from infra.control import Phase, Progress
from infra.exit_codes import Outcome
from infra.node_protocol import (
    Launch,
    NodeState,
    NodeStatus,
    Order,
    OrderKind,
    attempt_nodes,
    node_statuses,
    read_status,
)
from infra.settings import JobConfig
from tasks.attempt import AttemptProcess, LaunchSpec
from tasks.node_runner import NodeRunner
from tasks.orchestrator import JobObserver, run
from tests import procs
from tests.factories import tiny_config
from tests.node_hosts import SubprocessNodeRuns, hosts
from tests.procs import MARKER

FAKE = str(Path(__file__).resolve().parents[1] / "fake_trainer.py")
KILL_AT = 10


def _config(tmp_path: Path, **recovery: object) -> JobConfig:
    return tiny_config(
        tmp_path,
        train={"steps": 40, "eval": "off"},
        checkpoint={"preemption_budget_s": 1},
        recovery={"backoff_s": 0, "max_failures": 2, "node_timeout_s": 4, **recovery},
    )


@pytest.fixture
def node_runs(tmp_path: Path) -> Iterator[tuple[JobConfig, SubprocessNodeRuns]]:
    """Factory of (config, node runs on 2 loopback hosts); every node run and fake trainer
    of the test is gone afterwards."""
    made: list[SubprocessNodeRuns] = []

    def make(count: int = 2, host_env: dict[str, str] | None = None, **recovery: object):
        config = _config(tmp_path, **recovery)
        env = {MARKER: str(tmp_path), "FAKE_STEP_S": "0.1", **(host_env or {})}
        runs = SubprocessNodeRuns(
            config.layout.url, hosts(count, tmp_path), env, {"launcher": [FAKE]}
        )
        made.append(runs)
        return config, runs

    yield make
    for runs in made:
        runs.close()
    left = procs.end_leftovers(**{MARKER: str(tmp_path)})
    assert left == [], "a node run or trainer outlived it"


class KillRunningNode(JobObserver):
    """SIGKILLs the node run that runs the attempt, from outside, once it is past KILL_AT."""

    def __init__(self, config: JobConfig, runs: SubprocessNodeRuns, how: int) -> None:
        self.config, self.runs, self.how = config, runs, how
        self.killed: list[str] = []

    def progress(self, progress: Progress) -> None:
        if self.killed or progress.phase != Phase.TRAINING or progress.step < KILL_AT:
            return
        for key, proc in self.runs.procs.items():
            status = read_status(self.config.layout, key)
            if proc.poll() is None and status is not None and status.state == NodeState.RUNNING:
                os.kill(proc.pid, self.how)
                self.killed.append(key)
                return


def test_orders_and_statuses_round_trip_through_json() -> None:
    launch = Launch(3, 1, 2, "orch:29400", "job-attempt3", {"K": "v"}, 2, 10.5, "orch:1234")
    order = Order(7, OrderKind.LAUNCH, launch)
    assert Order.from_json(order.to_json()) == order
    progress = Progress(Phase.TRAINING, 12, 40, 99.5, 90.0, 1)
    status = NodeStatus(
        NodeState.RUNNING, "h", "127.0.0.2", 100.0, 4711, 7, 3, 1, None, progress, True
    )
    assert NodeStatus.from_json(status.to_json()) == status


def test_a_node_run_killed_mid_job_is_replaced_by_the_spare_at_once(node_runs) -> None:
    """spare_nodes 1: the attempt after the loss launches on the spare, which parked long
    before; a replacement is placed behind it once that attempt trains; the job ends on the
    spare."""
    config, runs = node_runs(spare_nodes=1)
    killer = KillRunningNode(config, runs, signal.SIGKILL)
    result = run(config, killer, node_runs=runs)
    outcome = result.outcome
    assert outcome.succeeded, outcome.message
    assert [a.outcome for a in outcome.attempts] == [Outcome.SIGKILL, Outcome.SUCCESS]
    [lost] = killer.killed
    first, spare = list(runs.procs)[:2]
    assert lost == first  # attempt 0 ran on the first node run, the spare parked
    status = read_status(config.layout, spare)
    assert status is not None and status.attempt == 1 and status.exit_code == 0
    assert len(runs.procs) == 3  # the replacement, submitted after the loss...
    [replacement] = [key for key in runs.procs if key not in (first, spare)]
    started = status.progress.started if status.progress is not None else None
    assert started is not None and runs.submitted[replacement] > started, (
        "...only once the relaunch trains: it must not compete with the relaunch"
    )
    report = result.summary.report if result.summary is not None else None
    assert report is not None and report.finished and report.num_failures == 1


def test_without_a_spare_the_relaunch_waits_for_a_new_node_run(node_runs) -> None:
    config, runs = node_runs(count=2, spare_nodes=0)
    killer = KillRunningNode(config, runs, signal.SIGKILL)
    outcome = run(config, killer, node_runs=runs).outcome
    assert outcome.succeeded, outcome.message
    first, second = list(runs.procs)
    assert killer.killed == [first]
    status = read_status(config.layout, second)
    assert status is not None and status.attempt == 1 and status.exit_code == 0


@pytest.mark.timeout(120)  # a heartbeat check that is off would wait for ever
def test_a_silent_node_run_is_found_lost_by_its_heartbeat(node_runs) -> None:
    """SIGSTOP: the node run's process is there, its flow run says nothing, its heartbeat
    stops. Lost after node_timeout_s, cancelled, and the job goes on on the spare."""
    config, runs = node_runs(spare_nodes=1)
    killer = KillRunningNode(config, runs, signal.SIGSTOP)
    outcome = run(config, killer, node_runs=runs).outcome
    [stopped] = killer.killed
    assert outcome.succeeded, outcome.message
    assert outcome.attempts[0].outcome == Outcome.SIGKILL
    assert stopped in runs.cancelled and runs.procs[stopped].poll() is not None


def test_node_runs_end_when_their_orchestrator_is_killed(node_runs, tmp_path: Path) -> None:
    """The orchestrator SIGKILLed mid-job: its heartbeat stops, every node run ends what it
    runs and exits within node_timeout_s, and nothing of the job is left on any host."""
    config, _ = node_runs(count=2, spare_nodes=1)
    script = tmp_path / "orchestrate.py"
    script.write_text(
        "import json, sys\n"
        "from infra.settings import JobConfig\n"
        "from tasks.orchestrator import run\n"
        "from tests.node_hosts import SubprocessNodeRuns, hosts\n"
        "from pathlib import Path\n"
        "config = JobConfig.model_validate_json(sys.argv[1])\n"
        f"env = {{{MARKER!r}: {str(tmp_path)!r}, 'FAKE_STEP_S': '0.2'}}\n"
        "runs = SubprocessNodeRuns(config.layout.url, hosts(2, Path(sys.argv[2])), env,"
        f" {{'launcher': [{FAKE!r}]}})\n"
        "run(config, node_runs=runs)\n"
    )
    env = {**os.environ, MARKER: str(tmp_path), "PYTHONPATH": str(Path(FAKE).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, str(script), config.model_dump_json(), str(tmp_path / "h")], env=env
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            zero = next(iter(attempt_nodes(config.layout)), None)
            if zero is not None and zero.progress is not None and zero.progress.step > 5:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the job never trained")
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + config.recovery.node_timeout_s + 20
        while procs.carrying(**{MARKER: str(tmp_path)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert procs.carrying(**{MARKER: str(tmp_path)}) == []
        assert all(s.state == NodeState.ENDED for s in node_statuses(config.layout).values())
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_host_whose_clock_runs_5_s_ahead_is_measured_and_moved_back(node_runs) -> None:
    """Every host ahead by 5 s (injected): each launch measures its offset to the
    orchestrator's clock, the ledger says it, and the report moves that host's events onto
    the orchestrator's clock: the job's wall time is its real one, give or take a second."""
    shifted = {"ETT_FAULT_CLOCK_SHIFT_S": "5", "ETT_FAULT_HOST_ID": "host-ahead"}
    config, runs = node_runs(count=1, host_env=shifted)
    started = time.time()
    outcome = run(config, node_runs=runs).outcome
    elapsed = time.time() - started
    assert outcome.succeeded, outcome.message
    report = report_for_job(config.layout)
    assert report.wall_s <= elapsed + 1.0, (report.wall_s, elapsed)
    assert any("(measured)" in note for note in report.clock.notes()), report.clock.notes()
    ledger = config.layout.ledger
    firsts = [
        storage.read_text(storage.join(ledger, n)).splitlines()[0] for n in storage.listdir(ledger)
    ]
    clocks = [json.loads(line)["attrs"] for line in firsts]
    offsets = [c["measured_offset"] for c in clocks if "measured_offset" in c]
    assert offsets and all(-5.5 < o["offset_s"] < -4.5 for o in offsets), offsets


class _Ranks:
    """A launch's nodes as far as progress goes: only the one holding global rank 0 has it."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress

    def progress(self) -> Progress | None:
        return self._progress


def test_rank_0s_progress_is_reported_from_whichever_node_holds_it(tmp_path: Path) -> None:
    """c10d orders ranks by address, not by node rank: global rank 0 may run on node 1. Its
    node run's status carries the progress, and a local attempt finds it on any node."""
    progress = Progress(Phase.TRAINING, 12, 40, 99.5, 90.0)
    config = _config(tmp_path)
    runner = NodeRunner(config.layout, "n1", logging.getLogger("test"), scratch=str(tmp_path))
    runner._launch = Launch(0, 1, 2, "orch:29400", "job-attempt0", {}, 0, 1.0, "")
    runner._attempt = _Ranks(progress)  # type: ignore[assignment]
    runner._status(force=True)
    status = read_status(config.layout, "n1")
    assert status is not None and status.node_rank == 1 and status.progress == progress
    attempt = AttemptProcess(0, False, LaunchSpec.of(config, "unused.yaml"), logging.getLogger("t"))
    attempt.nodes = [_Ranks(None), _Ranks(progress)]  # type: ignore[list-item]
    assert attempt.progress() == progress


def test_a_node_runs_pool_socket_fits_however_deep_its_scratch_folder(tmp_path: Path) -> None:
    """A unix socket's path has 107 bytes: in a deep scratch folder the pool would be
    unusable and every launch would start a cold launcher."""
    config = _config(tmp_path)
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    for scratch in (tmp_path, deep):
        runner = NodeRunner(config.layout, "n7", logging.getLogger("test"), scratch=str(scratch))
        path = runner._pool_socket()
        assert len(os.fsencode(path)) <= 107, path
        assert path.startswith(runner.scratch) == (scratch == tmp_path), path
