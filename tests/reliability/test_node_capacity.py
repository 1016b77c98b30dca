"""A multi-host job that loses a node with no spare goes on smaller (issue 29, Deliver 3,
``recovery.min_nodes``), and grows back when a node run parks again.

Two "hosts" on loopback (tests/node_hosts.py: node runs as subprocesses, each host its own
address and scratch folder, the real trainer, 1 rank per node) and no spare. Attempt 0 is
held in step 12 (after its commit of step 10); then one host is lost: every process on it
SIGKILLed from outside, and nothing can be placed there. Its replacement waits for a host,
so after ``recovery.wait_for_capacity_s`` attempt 1 runs on the surviving node alone,
resharded from step 10. The host comes back once attempt 1 is launched: the replacement
parks, attempt 1 is preempted (it commits at its step boundary) and attempt 2 runs on both
nodes from that commit. Every global batch's rows are consumed once, as in an uninterrupted
2-rank run, and the report shows both resizes."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import pytest

from infra.accounting.ett import report_for_job
from infra.accounting.report import format_table, recovery_lines
from infra.checkpoint_manifest import committed_checkpoints
from infra.control import Phase, Progress
from infra.exit_codes import ExitCode, Outcome
from infra.node_protocol import Launch, NodeState, NodeStatus, OrderKind, node_statuses, read_order
from infra.settings import JobConfig
from tasks.attempt import AttemptProcess, LaunchSpec
from tasks.node_runner import NodeRunner
from tasks.orchestrator import Orchestrator
from tasks.remote_node import NodeFleet, NodeRun, RemoteNode
from tests import procs
from tests.factories import assert_same_rows, tiny_config
from tests.node_hosts import Host, SubprocessNodeRuns, hosts
from tests.procs import MARKER
from tests.reliability.jobs import job_config, run_to_end
from trainer.faults import ENV_STEP_DELAY

STEPS = 40
HELD_S = 120  # the longest attempt 0 is held in step 12 before its host is lost
WAIT_S = 1.0  # recovery.wait_for_capacity_s
STEP_DELAY_S = 0.2  # each step at least this long: the shrunk attempt trains while the
# replacement node run is placed and parks, so the grow-back lands mid-job
LOG = logging.getLogger("test")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, data_url: str) -> JobConfig:
    """The same job on 2 ranks throughout, uninterrupted: the rows every run must match
    (a rank's share of a global batch depends on the world size and its rank only)."""
    tmp_path = tmp_path_factory.mktemp("clean")
    config = job_config(tmp_path, data_url, STEPS, job_id="clean")
    code, out = run_to_end(config, tmp_path, nproc=2)
    assert code == ExitCode.SUCCESS, out[-3000:]
    return config


def _lose_a_host(config: JobConfig, runs: SubprocessNodeRuns, lost: list[Host]) -> None:
    """Once attempt 0 has committed step 10: the host of its node rank 1 lost."""
    deadline = time.monotonic() + HELD_S
    while time.monotonic() < deadline:
        committed = committed_checkpoints(config.layout)
        running = [
            key
            for key, s in node_statuses(config.layout).items()
            if s.attempt == 0 and s.node_rank == 1 and s.state == NodeState.RUNNING
        ]
        if committed and committed[0].step >= 10 and running:
            lost.append(runs.lose_host(running[0]))
            return
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(HELD_S + 300)
def test_a_lost_node_with_no_spare_goes_on_with_one_node_and_grows_back(
    tmp_path: Path, data_url: str, clean: JobConfig
) -> None:
    config = job_config(
        tmp_path,
        data_url,
        STEPS,
        job_id="nodes",
        launch={"nnodes": 2, "nproc": 1},
        faults=[{"kind": "hang", "step": 12, "attempt": 0}],  # held there until the loss
        recovery={
            "max_failures": 1,
            "backoff_s": 0,
            "hang_timeout_s": HELD_S,
            "startup_timeout_s": 120,
            "node_timeout_s": 10,
            "min_nodes": 1,
            "wait_for_capacity_s": WAIT_S,
        },
    )
    marker = str(tmp_path)
    env = {MARKER: marker, "OMP_NUM_THREADS": "1", ENV_STEP_DELAY: str(STEP_DELAY_S)}
    runs = SubprocessNodeRuns(config.layout.url, hosts(2, tmp_path / "hosts"), env)
    waits: list[float] = []  # the orchestrator's waits for capacity (backoff_s is 0)
    lost: list[Host] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        time.sleep(seconds)

    try:
        with Orchestrator(config, node_runs=runs, sleep=sleep) as job:
            for attempt in job:
                if attempt.number == 0:
                    args = (config, runs, lost)
                    threading.Thread(target=_lose_a_host, args=args, daemon=True).start()
                elif attempt.number == 1:  # the job runs on one node: the host comes back
                    runs.return_host(lost[0])
                job.watch(attempt)
    finally:
        runs.close()
        assert procs.end_leftovers(**{MARKER: marker}) == [], "a node run or rank outlived it"

    assert job.result is not None
    outcome = job.result.outcome
    got = [a.outcome for a in outcome.attempts]
    # Attempt 0 ends lost (SIGKILL) or, if the survivor's rank saw its peer go first, crashed.
    assert got[0].failed and got[1:] == [Outcome.PREEMPTED, Outcome.SUCCESS], outcome.message
    assert outcome.succeeded, outcome.message
    assert sum(waits) == pytest.approx(WAIT_S)  # it waited for the host, then went on
    lost_key = next(k for k, h in runs.placed.items() if h == lost[0])
    assert lost_key in runs.cancelled
    assert_same_rows(clean, config, STEPS)

    report = report_for_job(config.layout)
    shrink, grow = report.resizes
    assert (shrink.attempt, shrink.step, shrink.from_ranks, shrink.to_ranks) == (1, 10, 2, 1)
    assert (grow.attempt, grow.from_ranks, grow.to_ranks) == (2, 1, 2)
    assert grow.step > shrink.step  # the commit attempt 1 made when it was preempted
    assert [(a.attempt, a.ranks) for a in report.attempts] == [(0, 2), (1, 1), (2, 2)]
    assert "attempt 1 resized at step 10: 2 -> 1 ranks" in "\n".join(recovery_lines(report))
    assert "World size per attempt" in format_table(report)


# -- the decisions, without processes -----------------------------------------------------------
class _Runs:
    """``NodeRuns`` whose runs never end and are never placed: members are set by hand."""

    def submit(self, key: str) -> str:
        return key

    def gone(self, run_id: str) -> str | None:
        return None

    def cancel(self, run_id: str) -> None:
        return None


def _status(state: NodeState, attempt: int | None = None) -> NodeStatus:
    return NodeStatus(
        state=state,
        host="h",
        address="127.0.0.2",
        heartbeat=1.0,
        pid=1,
        seq=-1,
        attempt=attempt,
        node_rank=None,
        exit_code=None,
        progress=None,
        warm=True,
    )


def _job(
    tmp_path: Path, nnodes: int, min_nodes: int | None, parked: int, spares: int = 0
) -> tuple[Orchestrator, list[float]]:
    """An orchestrator never entered, with a fleet of ``nnodes`` (+ ``spares``) node runs of
    which ``parked`` are parked (the others placed nowhere), and a sleep that records its
    waits instead of waiting."""
    recovery = {"min_nodes": min_nodes, "wait_for_capacity_s": 3.0, "spare_nodes": spares}
    config = tiny_config(tmp_path, launch={"nnodes": nnodes}, recovery=recovery)
    waits: list[float] = []
    job = Orchestrator(config, sleep=waits.append)
    job._fleet = NodeFleet(config, _Runs(), LOG)
    job._fleet.members = [
        NodeRun(f"n{i}", f"n{i}", i >= nnodes, _status(NodeState.PARKED) if i < parked else None)
        for i in range(nnodes + spares)
    ]
    return job, waits


def test_fewer_nodes_than_min_nodes_fail_the_job_in_one_line_after_the_wait(
    tmp_path: Path,
) -> None:
    job, waits = _job(tmp_path, nnodes=3, min_nodes=2, parked=1)
    assert job._nodes_for_next() is None
    assert sum(waits) == pytest.approx(3.0)
    assert job._outcome is not None and not job._outcome.succeeded
    assert job._outcome.message == (
        "capacity lost: 1 of 3 nodes left after 3 s, recovery.min_nodes is 2"
    )


def test_as_many_nodes_as_min_nodes_go_on_smaller_after_the_wait(tmp_path: Path) -> None:
    job, waits = _job(tmp_path, nnodes=3, min_nodes=2, parked=2)
    assert job._nodes_for_next() == 2
    assert sum(waits) == pytest.approx(3.0) and job._outcome is None


def test_a_parked_spare_takes_the_lost_nodes_place_and_never_adds_one(tmp_path: Path) -> None:
    """Every node and the spare parked: the job's size at once, not one node more."""
    job, waits = _job(tmp_path, nnodes=2, min_nodes=1, parked=3, spares=1)
    assert job._nodes_for_next() == 2
    assert waits == []


def test_without_min_nodes_a_job_never_shrinks(tmp_path: Path) -> None:
    """null: the launch itself waits for a replacement to park (startup_timeout_s)."""
    job, waits = _job(tmp_path, nnodes=2, min_nodes=None, parked=1)
    assert job._nodes_for_next() == 2
    assert waits == [] and job._outcome is None


def test_a_node_run_parked_beside_a_smaller_attempt_preempts_it_once(tmp_path: Path) -> None:
    """The grow-back: the attempt on 1 of 2 nodes is told to preempt (SIGTERM and the grace:
    it commits at its step boundary) once a node run parks, and only once."""
    job, _ = _job(tmp_path, nnodes=2, min_nodes=1, parked=0)
    assert job._fleet is not None
    running, idle = job._fleet.members
    running.status = _status(NodeState.RUNNING, attempt=1)
    job.spec = dataclasses.replace(LaunchSpec.of(job.config, "unused.yaml"), nnodes=1)
    attempt = AttemptProcess(1, False, job.spec, LOG)
    launch = Launch(1, 0, 1, "orch:29400", "job-attempt1")
    attempt.nodes = [RemoteNode(job._fleet, running, launch, seq=-1)]
    job._current = attempt
    training = Progress(Phase.TRAINING, 12, 40, 99.5, 90.0)

    job._grow_back_nodes(training)
    assert read_order(job.layout, running.key) is None  # nothing parked beside it yet

    idle.status = _status(NodeState.PARKED)
    job._grow_back_nodes(training)
    order = read_order(job.layout, running.key)
    assert order is not None and order.kind == OrderKind.END
    assert order.preempt and order.grace_s == job.timeouts.grace_s
    job._grow_back_nodes(training)
    again = read_order(job.layout, running.key)
    assert again is not None and again.seq == order.seq


def test_a_node_run_launches_as_many_nodes_as_its_order_says(tmp_path: Path) -> None:
    """A launch on 1 node (the job shrunk) runs standalone; on 2 it joins the rendezvous."""
    config = tiny_config(tmp_path, launch={"nnodes": 2})
    runner = NodeRunner(config.layout, "n1", LOG, scratch=str(tmp_path))
    runner.spec = LaunchSpec.of(config, "job.yaml")
    one = Launch(1, 0, 1, "orch:29400", "job-attempt1")
    two = Launch(2, 0, 2, "orch:29400", "job-attempt2")
    assert "--standalone" in runner._spec_of(one).command(0, one.rendezvous, one.run_id)
    command = runner._spec_of(two).command(0, two.rendezvous, two.run_id)
    assert "--nnodes=2" in command and "--standalone" not in command
