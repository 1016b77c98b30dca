"""What a job's orchestrator and its node runs tell each other, through the job's storage.

A job on a Prefect work pool runs one **node run** per host (flows/node_flow.py): a flow run
that a worker starts wherever it runs, and that starts the torchrun agent of one node for
each attempt it is given. The hosts share nothing but the job's storage, so that is where
both sides talk, each writing only its own file (no two writers, no locking):

    <job>/nodes/<key>/status.json   the node run's: its state, host, address, a heartbeat,
                                    the last launch's exit code, rank 0's progress
    <job>/nodes/<key>/order.json    the orchestrator's: launch attempt N as node rank R,
                                    end the running launch, or release the node run
    <job>/nodes/orchestrator.json   the orchestrator's heartbeat: node runs whose
                                    orchestrator went silent end what they run and exit

Each write replaces the whole file; each order carries a sequence number, so a node run
acts on each order once however often it reads it. A node run lives across attempts: it
parks (an agent imported and waiting, tasks/agent_pool.py) between launches, so a relaunch
on a host that survived starts warm, and a **spare** node run parks on a host of its own
until a lost node's place needs it (docs/multi-host.md).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from infra import storage
from infra.control import Phase, Progress
from infra.job_layout import JobLayout
from infra.urls import join

ENV_ADVERTISE = "ETT_ADVERTISE_ADDRESS"  # how other hosts reach this one (default: its name)
ENV_SCRATCH = "ETT_SCRATCH_DIR"  # a node run's local disk (default: the temp folder)
NODES = "nodes"
HEARTBEAT_S = 1.0  # how often both sides rewrite their file
ORCHESTRATOR = "orchestrator.json"


def advertise_address() -> str:
    """The address other hosts reach this one at: ``ETT_ADVERTISE_ADDRESS``, else the host's
    name (its resolvable name on a cluster; a pod's IP through the downward API)."""
    return os.environ.get(ENV_ADVERTISE) or socket.gethostname()


class NodeState(StrEnum):
    """Where a node run is, as it reports it."""

    STARTING = "starting"  # placed, reading the job's config
    PARKED = "parked"  # waiting for a launch, its agent imported
    RUNNING = "running"  # its agent runs an attempt
    ENDED = "ended"  # released, or its orchestrator is gone: it exits


class OrderKind(StrEnum):
    LAUNCH = "launch"  # start the node's agent for an attempt
    END = "end"  # end the running launch (SIGTERM first when ``preempt``); park again
    RELEASE = "release"  # the job is over: end everything and exit


@dataclass(frozen=True)
class Launch:
    """One node's part of an attempt: what its torchrun agent is started with."""

    attempt: int
    node_rank: int
    nnodes: int
    rendezvous: str  # host:port of the c10d store the orchestrator hosts
    run_id: str  # the rendezvous id: one per attempt
    env: dict[str, str] = field(default_factory=dict)  # the job's lease, and the like
    failures: int = 0  # the job's state the attempt starts from (infra/control.py JobState)
    started_at: float | None = None
    clock: str = ""  # host:port of the orchestrator's clock server (infra/clock_sync.py)


@dataclass(frozen=True)
class Order:
    seq: int
    kind: OrderKind
    launch: Launch | None = None
    preempt: bool = False
    grace_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Order:
        data = json.loads(text)
        launch = data.get("launch")
        return cls(
            seq=int(data["seq"]),
            kind=OrderKind(data["kind"]),
            launch=None if launch is None else Launch(**launch),
            preempt=bool(data.get("preempt", False)),
            grace_s=float(data.get("grace_s", 0.0)),
        )


@dataclass(frozen=True)
class NodeStatus:
    state: NodeState
    host: str
    address: str
    heartbeat: float  # the node run's wall clock when it wrote this
    pid: int = 0  # the node run's process, on its host
    seq: int = -1  # the last order it acted on
    attempt: int | None = None  # the launch it runs or ran last...
    node_rank: int | None = None  # ...as this node
    exit_code: int | None = None  # that launch's, once it ended
    progress: Progress | None = None  # rank 0's, on the node that holds it
    warm: bool | None = None  # an agent imported for its next launch (None: the host's pool)

    def to_json(self) -> str:
        data = asdict(self)
        if self.progress is not None:
            data["progress"] = {**asdict(self.progress), "phase": str(self.progress.phase)}
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> NodeStatus:
        data = json.loads(text)
        progress = data.get("progress")
        if progress is not None:
            progress = Progress(**{**progress, "phase": Phase(progress["phase"])})
        return cls(**{**data, "state": NodeState(data["state"]), "progress": progress})


def node_folder(layout: JobLayout, key: str) -> str:
    return join(layout.url, NODES, key)


def orchestrator_url(layout: JobLayout) -> str:
    return join(layout.url, NODES, ORCHESTRATOR)


def write_status(layout: JobLayout, key: str, status: NodeStatus) -> None:
    storage.write_text(join(node_folder(layout, key), "status.json"), status.to_json())


def read_status(layout: JobLayout, key: str) -> NodeStatus | None:
    """The node run's last status; None before its first (or when it cannot be read)."""
    return _read(join(node_folder(layout, key), "status.json"), NodeStatus.from_json)


def node_statuses(layout: JobLayout) -> dict[str, NodeStatus]:
    """Every node run's last status, by key, as an operator (or a test) finds them on the
    job's storage without asking the orchestrator."""
    try:
        urls = storage.glob(join(layout.url, NODES, "*", "status.json"))
    except FileNotFoundError:
        return {}
    found = {}
    for url in urls:
        key = url.rstrip("/").rsplit("/", 2)[-2]
        if (status := read_status(layout, key)) is not None:
            found[key] = status
    return found


def attempt_nodes(layout: JobLayout) -> list[NodeStatus]:
    """The running node runs of the newest attempt, the one whose status carries progress
    first: it holds global rank 0. torchrun's c10d rendezvous orders ranks by the nodes'
    addresses, not by the launch's node rank, so rank 0 may be on any node."""
    running = [s for s in node_statuses(layout).values() if s.state == NodeState.RUNNING]
    newest = max((s.attempt or 0 for s in running), default=0)
    nodes = [s for s in running if (s.attempt or 0) == newest]
    return sorted(nodes, key=lambda s: (s.progress is None, s.node_rank or 0))


def write_order(layout: JobLayout, key: str, order: Order) -> None:
    storage.write_text(join(node_folder(layout, key), "order.json"), order.to_json())


def read_order(layout: JobLayout, key: str) -> Order | None:
    return _read(join(node_folder(layout, key), "order.json"), Order.from_json)


def _read(url: str, parse: Any) -> Any:
    try:
        return parse(storage.read_text(url))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):  # half-visible, or storage hiccup
        return None
