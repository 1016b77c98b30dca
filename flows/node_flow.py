"""The ``train-node`` flow: one host's part of a training job on a Prefect work pool.

A job whose ``launch.work_pool`` is set runs each node as a flow run of this flow, which a
worker of that pool starts on its host (a process, or a pod: only the pool's base job
template differs). The job's orchestrator (the ``train`` flow, or ``ett train --work-pool``)
submits them and tells each what to run through the job's storage; this flow only runs
tasks/node_runner.py on its host and says how the node's last launch ended.

The host's own settings come from its environment: ``ETT_ADVERTISE_ADDRESS`` (how the other
hosts reach it), ``ETT_SCRATCH_DIR`` (its local disk), the storage credentials.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from infra import storage
from infra.job_layout import JobLayout
from tasks.node_runner import run_node


@flow(name="train-node", log_prints=True)
def train_node_flow(job_url: str, key: str) -> int:
    """Run node ``key`` of the job at ``job_url`` until its orchestrator releases it.

    Returns the exit code of the node's last launch (0 when it never launched)."""
    storage.configure(None)  # credentials: this host's environment
    return run_node(JobLayout.at(job_url), key, get_run_logger())


if __name__ == "__main__":
    import sys

    train_node_flow(job_url=sys.argv[1], key=sys.argv[2])
