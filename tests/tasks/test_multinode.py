"""Two "nodes" on one machine: two torchrun agents joined by c10d rendezvous on loopback, one
rank each, as ``launch: {nnodes: 2, nproc: 1}`` and ``ett train --nnodes 2`` launch them. A
node SIGKILLed from outside mid-training: the job recovers from the newest committed
checkpoint and ends bit-identical to the same job without the loss."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from infra.checkpoint_manifest import committed_checkpoints
from infra.control import Phase, Progress
from infra.exit_codes import Outcome
from infra.settings import JobConfig
from tasks.orchestrator import JobObserver, run
from tasks.retry_policy import JobOutcome
from tests import procs
from tests.factories import assert_bit_identical, resume_marks, tiny_config, write_dataset
from tests.procs import MARKER

# Steps well past the kill point: the kill needs a progress sample (every 50 ms) at which
# step 12 has run and the step-10 checkpoint is committed, before the job ends.
STEPS = 80
SECTIONS = {
    "train": {"steps": STEPS, "eval_every": 0, "eval_rows": 256, "log_every": 5},
    "checkpoint": {
        "mode": "async_staged",
        "every_steps": 5,
        "keep_latest_k": 2,
        "preemption_budget_s": 20,
    },
    "launch": {"nproc": 1, "nnodes": 2},
    "recovery": {"max_failures": 2, "backoff_s": 0},
}
KILL_AFTER = 12  # node 1 goes once a step past the step-10 checkpoint has run


def _node_agents(marker: str, node: int, attempt: int) -> list[int]:
    """The torchrun agent of ``node`` in ``attempt`` (not the standby's)."""
    mine = procs.carrying(**{MARKER: marker, "ETT_ATTEMPT": str(attempt)})
    return procs.launchers([p for p in mine if p in procs.mentioning(f"--node-rank={node}")])


class KillNode1(JobObserver):
    """SIGKILLs node 1's agent from outside once a step past a committed checkpoint ran."""

    def __init__(self, config: JobConfig, marker: str) -> None:
        self.config, self.marker = config, marker
        self.killed: list[int] = []

    def progress(self, progress: Progress) -> None:
        if self.killed or progress.phase != Phase.TRAINING:
            return
        committed = committed_checkpoints(self.config.layout)
        if progress.step >= KILL_AFTER and committed and committed[0].step >= 10:
            (agent,) = _node_agents(self.marker, node=1, attempt=0)
            os.kill(agent, signal.SIGKILL)
            self.killed.append(agent)


def run_two_nodes(config: JobConfig, tmp_path: Path, kill_node_1: bool) -> JobOutcome:
    marker = f"{tmp_path}/{config.job_id}"
    observer = KillNode1(config, marker) if kill_node_1 else None
    env = {"OMP_NUM_THREADS": "1", MARKER: marker}
    outcome = run(config, observer, env=env).outcome
    assert observer is None or observer.killed, "node 1 was never killed"
    deadline = time.monotonic() + 10
    while procs.carrying(**{MARKER: marker}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert procs.carrying(**{MARKER: marker}) == [], "a process of the job outlived it"
    return outcome


@pytest.mark.slow
def test_a_lost_node_is_recovered_bit_identical(tmp_path: Path) -> None:
    clean = tiny_config(tmp_path, job_id="two-nodes-clean", **SECTIONS)
    write_dataset(clean)
    assert run_two_nodes(clean, tmp_path, kill_node_1=False).succeeded

    lost = tiny_config(tmp_path, job_id="two-nodes-lost", **SECTIONS)
    outcome = run_two_nodes(lost, tmp_path, kill_node_1=True)
    assert [a.outcome for a in outcome.attempts] == [Outcome.SIGKILL, Outcome.SUCCESS]
    assert_bit_identical(clean, lost, STEPS)
    [(attempt, step, in_process)] = resume_marks(lost)
    assert attempt == 1 and not in_process and step >= 10 and step % 5 == 0
