"""Node runs placed by a Prefect work pool: the ``train-node`` deployment of that pool, one
flow run per node, asked for with ``run_deployment`` and looked after through the API.

The same code serves every kind of pool: a process pool runs a node run as a process on the
worker's host, a Kubernetes pool as a pod (deploy/kubernetes/, docs/kubernetes.md); only
the pool's base job template differs. The pool is ``launch.work_pool``; its deployment of
the ``train-node`` flow (prefect.yaml) is found by the flow's name.

The API is asked, never trusted alone: a flow run the API cannot be asked about right now
(the server restarting) is not lost; its heartbeat on storage decides (tasks/remote_node.py).
"""

from __future__ import annotations

import logging
from typing import Any
from uuid import UUID

from infra.job_layout import JobLayout

NODE_FLOW = "train-node"  # flows/node_flow.py

log = logging.getLogger(__name__)


class NoNodeDeployment(RuntimeError):
    """The work pool has no deployment of the train-node flow."""


class WorkPoolNodeRuns:
    """``NodeRuns`` (tasks/remote_node.py) on a Prefect work pool."""

    def __init__(
        self, work_pool: str, layout: JobLayout, job_variables: dict[str, Any] | None = None
    ) -> None:
        self.work_pool, self.layout = work_pool, layout
        self.deployment = self._find_deployment()
        self.job_variables = {**self._job_variables(), **(job_variables or {})}

    def _find_deployment(self) -> UUID:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            FlowFilter,
            FlowFilterName,
            WorkPoolFilter,
            WorkPoolFilterName,
        )

        with get_client(sync_client=True) as client:
            found = client.read_deployments(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[NODE_FLOW])),
                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[self.work_pool])),
            )
        if not found:
            raise NoNodeDeployment(
                f"work pool {self.work_pool!r} has no deployment of the {NODE_FLOW!r} flow: "
                "deploy it there (prefect.yaml's train-node, or docs/multi-host.md)"
            )
        return found[0].id

    def _job_variables(self) -> dict[str, Any]:
        """``job_id`` for a pool whose template asks for it: the Kubernetes template labels
        its pods with it, so no two nodes of a job share a host (deploy/kubernetes/)."""
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            template = client.read_work_pool(self.work_pool).base_job_template
        declared = template.get("variables", {}).get("properties", {})
        return {"job_id": self.layout.job_id} if "job_id" in declared else {}

    def submit(self, key: str) -> str:
        from prefect.deployments import run_deployment

        run = run_deployment(
            self.deployment,
            parameters={"job_url": self.layout.url, "key": key},
            flow_run_name=f"{self.layout.job_id}-{key}",
            timeout=0,  # placed by a worker, watched through storage and the API
            tags=[f"ett-job:{self.layout.job_id}"],
            job_variables=self.job_variables,
            as_subflow=False,  # a node run outlives no flow: its job's orchestrator ends it
        )
        return str(run.id)

    def gone(self, run_id: str) -> str | None:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(UUID(run_id)).state
        except Exception as exc:  # noqa: BLE001 - the API unreachable is no evidence
            log.debug("flow run %s: state unknown: %s", run_id, exc)
            return None
        if state is None or not state.is_final():
            return None
        return str(state.type.value)

    def cancel(self, run_id: str) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        try:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(UUID(run_id), Cancelling(), force=True)
        except Exception as exc:  # noqa: BLE001 - the node run ends by itself when orphaned
            log.warning("flow run %s not cancelled: %s", run_id, exc)
