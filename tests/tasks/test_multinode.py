"""Two "nodes" on one machine: two torchrun agents joined by c10d rendezvous on loopback, one
rank each, as ``train_flow(nnodes=2, nproc=1)`` and ``ett train --nnodes 2`` launch them. A
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
from infra.settings import JobConfig, dump_config
from tasks.attempts import JobOutcome, JobRunner, LaunchSpec, RetryPolicy, Timeouts
from tests import procs
from tests.factories import assert_bit_identical, resume_marks, tiny_config, write_dataset

# Steps well past the kill point: the kill needs a progress sample (every 50 ms) at which
# step 12 has run and the step-10 checkpoint is committed, before the job ends.
STEPS = 80
SECTIONS = {
    "train": {"steps": STEPS, "eval_every": 0, "eval_rows": 256, "log_every": 5},
    "checkpoint": {"mode": "async_staged", "every_steps": 5, "keep_latest_k": 2},
}
KILL_AFTER = 12  # node 1 goes once a step past the step-10 checkpoint has run


def _node_agents(config_path: str, node: int, attempt: int) -> list[int]:
    """The torchrun agent of ``node`` in ``attempt`` (not the standby's)."""
    agents = procs.launchers(procs.mentioning(config_path, f"--node-rank={node}"))
    return [p for p in agents if procs.env_var(p, "ETT_ATTEMPT") == str(attempt)]


def run_two_nodes(config: JobConfig, tmp_path: Path, kill_node_1: bool) -> JobOutcome:
    path = tmp_path / f"{config.job_id}.yaml"
    dump_config(config, path)
    killed: list[int] = []

    def on_progress(progress: Progress) -> None:
        if not kill_node_1 or killed or progress.phase != Phase.TRAINING:
            return
        committed = committed_checkpoints(config.job_url)
        if progress.step >= KILL_AFTER and committed and committed[0].step >= 10:
            (agent,) = _node_agents(str(path), node=1, attempt=0)
            os.kill(agent, signal.SIGKILL)
            killed.append(agent)

    spec = LaunchSpec(str(path), nproc=1, nnodes=2, env={"OMP_NUM_THREADS": "1"})
    runner = JobRunner(
        config.job_url,
        spec,
        RetryPolicy(max_failures=2, backoff_s=0),
        Timeouts(grace_s=30),
        on_progress=on_progress,
    )
    outcome = runner.run()
    assert killed or not kill_node_1, "node 1 was never killed"
    deadline = time.monotonic() + 10
    while procs.mentioning(str(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert procs.mentioning(str(path)) == [], "a process of the job outlived it"
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
