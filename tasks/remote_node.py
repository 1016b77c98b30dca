"""A job's nodes as node runs on other hosts: placed by a work pool, told what to run through
the job's storage, and found lost by their silence.

The orchestrator keeps a ``NodeFleet``: ``nnodes`` node runs, plus ``recovery.spare_nodes``
spares, each a flow run that a work pool's worker placed on a host (tasks/node_runs.py
places them through Prefect; this module needs no Prefect). A node run lives for the whole
job and parks between launches (tasks/node_runner.py), so an attempt is a set of launch
orders to parked runs (infra/node_protocol.py) and a relaunch after a failure starts on
hosts that are warm. A node run is **lost** when its flow run ended without being released
(crashed, cancelled, its pod evicted) or its heartbeat has not changed for
``recovery.node_timeout_s`` (its host gone): it is cancelled, forgotten, and another is
submitted in its place. An attempt that lost a node fails (``128 + SIGKILL``); the next one
launches on the survivors and a spare, which parked long before, instead of waiting for a
fresh host to be placed and to import. The spare used up is replaced only once that attempt
trains: placing and importing a node run costs its host's CPU and the pool's capacity, and
neither may delay the relaunch it is there to speed up. With no spare and
``recovery.min_nodes`` set, the orchestrator may launch on fewer node runs than ``nnodes``
(``launch(..., nnodes=)``): the job goes on smaller until the replacement parks.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from infra import storage
from infra.accounting import clocks
from infra.clock_sync import ClockServer
from infra.control import Command, JobState, Phase, Progress
from infra.node_protocol import (
    HEARTBEAT_S,
    Launch,
    NodeState,
    NodeStatus,
    Order,
    OrderKind,
    advertise_address,
    orchestrator_url,
    read_status,
    write_order,
)
from infra.settings import JobConfig
from tasks.local_node import Log, OutputPump

LOST = 128 + signal.SIGKILL  # what an attempt that lost a node ended with
STATUS_EVERY_S = 0.5  # how often a node run's status is read
STATE_EVERY_S = 2.0  # how often its flow run's state is asked for
END_MARGIN_S = 5.0  # beyond the grace, for a node run to say its launch ended


class NodesUnavailable(RuntimeError):
    """Not enough node runs parked within the startup timeout: no worker placed them."""


class NodeRuns(Protocol):
    """How node runs are placed and looked after: tasks/node_runs.py (a Prefect work pool)."""

    def submit(self, key: str) -> str:
        """Ask for a node run with this key; returns its id."""
        ...

    def gone(self, run_id: str) -> str | None:
        """None while it may run; once it ended, its final state, e.g. "CRASHED"."""
        ...

    def cancel(self, run_id: str) -> None: ...


@dataclass
class NodeRun:
    """The orchestrator's view of one node run."""

    key: str
    run_id: str
    spare: bool
    status: NodeStatus | None = None
    beat: float | None = None  # its last heartbeat value seen...
    beat_seen: float = field(default_factory=time.monotonic)  # ...and when it changed
    seq: int = -1  # its last order's sequence number (none yet)
    lost: str | None = None  # why it is lost
    next_status: float = 0.0
    next_state: float = 0.0


class NodeFleet:
    """The node runs of one job: submitted, watched, given launches, replaced when lost."""

    def __init__(self, config: JobConfig, runs: NodeRuns, log: Log) -> None:
        self.config, self.layout, self.runs, self.log = config, config.layout, runs, log
        self.nnodes = config.launch.nnodes
        self.wanted = self.nnodes + config.recovery.spare_nodes
        self.timeout_s = config.recovery.node_timeout_s
        self.members: list[NodeRun] = []
        self.lost: list[NodeRun] = []
        self._counter = itertools.count()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._lock = threading.Lock()
        self.clock: ClockServer | None = None  # what the nodes measure their clocks against
        self._launched = -1  # the last attempt launched
        self._spares_after: int | None = None  # spares wait until an attempt past this trains

    # -- the fleet's life -------------------------------------------------------------------
    def start(self) -> None:
        """Start the orchestrator's heartbeat and submit every node run (spares included)."""
        self.clock = ClockServer(advertise_address()).start()
        self._write_beat()
        self._beat.start()
        self._fill()

    def close(self) -> None:
        """Release every node run (it ends its launch and exits), then cancel the flow runs
        that did not end by themselves; stop the heartbeat."""
        for run in self.members:
            self.order(run, Order(0, OrderKind.RELEASE))
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(self._alive(r) for r in self.members):
            time.sleep(STATUS_EVERY_S)
        for run in self.members:
            if self._alive(run):
                self.runs.cancel(run.run_id)
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join(timeout=5)
        if self.clock is not None:
            self.clock.close()

    def _alive(self, run: NodeRun) -> bool:
        self._refresh(run, force=True)
        ended = run.status is not None and run.status.state == NodeState.ENDED
        return not ended and run.lost is None and self.runs.gone(run.run_id) is None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._write_beat()

    def _write_beat(self) -> None:
        try:
            storage.write_text(orchestrator_url(self.layout), repr(clocks.wall()))
        except OSError as exc:  # the node runs wait node_timeout_s before they give up
            self.log.warning("orchestrator heartbeat not written: %s", exc)

    def _fill(self) -> None:
        """Submit node runs until the fleet has ``wanted`` of them (lost ones replaced), or
        only ``nnodes`` while the spares wait for the relaunch to train."""
        limit = self.wanted if self._spares_after is None else self.nnodes
        while len(self.members) < limit:
            key = f"n{next(self._counter):03d}-{uuid.uuid4().hex[:6]}"
            spare = len(self.members) >= self.nnodes
            run = NodeRun(key, self.runs.submit(key), spare)
            self.members.append(run)
            self.log.info("node run %s submitted (%s)", key, run.run_id)

    # -- watching ---------------------------------------------------------------------------
    def _refresh(self, run: NodeRun, force: bool = False) -> None:
        """Read its status (throttled), and find it lost: flow run over, or silent."""
        now = time.monotonic()
        if run.lost is not None or (not force and now < run.next_status):
            return
        run.next_status = now + STATUS_EVERY_S
        status = read_status(self.layout, run.key)
        if status is not None:
            run.status = status
            if status.heartbeat != run.beat:
                run.beat, run.beat_seen = status.heartbeat, now
        if now >= run.next_state:
            run.next_state = now + STATE_EVERY_S
            state = self.runs.gone(run.run_id)
            released = run.status is not None and run.status.state == NodeState.ENDED
            if state is not None and not released:
                run.lost = f"its flow run is {state.lower()}"
        if run.lost is None and run.beat is not None and now - run.beat_seen > self.timeout_s:
            run.lost = f"no heartbeat for {now - run.beat_seen:.0f} s"

    def check(self) -> list[NodeRun]:
        """Every member refreshed; the ones found lost now are dropped, cancelled and
        replaced. Returns them."""
        with self._lock:
            for run in self.members:
                self._refresh(run)
            gone = [r for r in self.members if r.lost is not None]
            for run in gone:
                self.members.remove(run)
                self.lost.append(run)
                host = run.status.host if run.status is not None else "not yet placed"
                self.log.warning("node run %s (%s) lost: %s", run.key, host, run.lost)
                self.runs.cancel(run.run_id)
            if any(not r.spare for r in gone):  # a node of the attempt: a spare takes its place
                self._spares_after = self._launched
            if gone:
                self._fill()
            elif self._spares_after is not None and self._trains_after(self._spares_after):
                self._spares_after = None
                self._fill()
            return gone

    def _trains_after(self, attempt: int) -> bool:
        """Whether an attempt later than ``attempt`` has reported a training step."""
        return any(
            r.status is not None
            and r.status.attempt is not None
            and r.status.attempt > attempt
            and r.status.progress is not None
            and r.status.progress.phase == Phase.TRAINING
            for r in self.members
        )

    # -- launching --------------------------------------------------------------------------
    def parked(self) -> int:
        """Node runs (spares included) that could take a launch now, every member
        refreshed first: what a relaunch after a lost node may use (tasks/orchestrator.py)."""
        self.check()
        return sum(_parked(r) for r in self.members)

    def launch(
        self,
        number: int,
        state: JobState,
        env: dict[str, str],
        rendezvous: str,
        wait_s: float,
        nnodes: int | None = None,
    ) -> list[RemoteNode]:
        """Attempt ``number`` on ``nnodes`` parked node runs (default: the job's; fewer
        after a lost node with no spare, recovery.min_nodes), spares last; waits up to
        ``wait_s`` for enough of them to park. Raises NodesUnavailable."""
        count = nnodes or self.nnodes
        deadline = time.monotonic() + wait_s
        while True:
            self.check()
            parked = [r for r in self.members if _parked(r)]
            if len(parked) >= count:
                break
            if time.monotonic() > deadline:
                raise NodesUnavailable(
                    f"{len(parked)} of {count} node runs parked after {wait_s:.0f} s "
                    f"(work pool {self.config.launch.work_pool!r}: is a worker polling it, "
                    "with a train-node deployment?)"
                )
            time.sleep(STATUS_EVERY_S)
        chosen = sorted(parked, key=_preference)[:count]
        for run in chosen:
            run.spare = False  # a spare promoted into a node's place is a node now
        for run in self.members:
            if run not in chosen:
                run.spare = True
        self._launched = number
        run_id = f"{self.config.job_id}-attempt{number}"
        nodes = []
        for rank, run in enumerate(chosen):
            launch = Launch(
                number,
                rank,
                count,
                rendezvous,
                run_id,
                env,
                state.failures,
                state.started_at,
                self.clock.address if self.clock is not None else "",
            )
            seq = self.order(run, Order(0, OrderKind.LAUNCH, launch))
            nodes.append(RemoteNode(self, run, launch, seq))
        hosts = ", ".join(f"{r.status.host if r.status else '?'}" for r in chosen)
        self.log.info("attempt %d on node runs %s (%s)", number, [r.key for r in chosen], hosts)
        return nodes

    def order(self, run: NodeRun, order: Order) -> int:
        """Write ``order`` as the run's next; returns its sequence number."""
        run.seq += 1
        try:
            write_order(
                self.layout,
                run.key,
                Order(run.seq, order.kind, order.launch, order.preempt, order.grace_s),
            )
        except OSError as exc:
            self.log.warning("order for node run %s not written: %s", run.key, exc)
        return run.seq


def _preference(run: NodeRun) -> tuple[bool, bool]:
    """Nodes of the last attempt first, then spares whose agent has imported."""
    return run.spare, run.status is not None and run.status.warm is False


def _parked(run: NodeRun) -> bool:
    status = run.status
    return (
        run.lost is None
        and status is not None
        and status.state == NodeState.PARKED
        and (status.seq >= run.seq)
    )


class RemoteNode:
    """One node of an attempt that a node run runs on its host (tasks/attempt.py's Node)."""

    pump: OutputPump | None = None  # its output is its node run's, in its own flow run logs
    pooled = False

    def __init__(self, fleet: NodeFleet, run: NodeRun, launch: Launch, seq: int) -> None:
        self.fleet, self.run, self.launch, self.seq = fleet, run, launch, seq

    def _status(self) -> NodeStatus | None:
        """The node run's status once it acted on this launch's order."""
        self.fleet.check()
        status = self.run.status
        if status is None or status.seq < self.seq or status.attempt != self.launch.attempt:
            return None
        return status

    def agent_code(self) -> int | None:
        if self.run.lost is not None:
            return LOST
        status = self._status()
        if status is None or status.state == NodeState.RUNNING:
            return None
        return status.exit_code

    def rank_exits(self) -> list[tuple[int, int | None]]:
        return []  # its ranks are another host's: its node run combines them

    def progress(self) -> Progress | None:
        status = self._status()
        return None if status is None else status.progress

    def pids(self) -> list[int]:
        return []

    def promote(self, state: JobState, command: Command) -> None:
        raise NotImplementedError("a job on a work pool keeps spare nodes, not a standby")

    def preempt(self, grace_s: float) -> None:
        """Order the node run to preempt its launch (SIGTERM: the trainer commits at its step
        boundary and exits), without waiting: the watch sees it end (a grow-back)."""
        self.fleet.order(self.run, Order(0, OrderKind.END, preempt=True, grace_s=grace_s))

    def end(self, grace_s: float, first: int) -> list[int]:
        """Order the node run to end its launch (SIGTERM and ``grace_s`` first when
        ``first`` is SIGTERM) and wait for it to say so, or to be found lost."""
        if self.run.lost is not None or self.agent_code() is not None:
            return []
        preempt = first == signal.SIGTERM
        seq = self.fleet.order(self.run, Order(0, OrderKind.END, preempt=preempt, grace_s=grace_s))
        deadline = time.monotonic() + grace_s + END_MARGIN_S
        while time.monotonic() < deadline and self.run.lost is None:
            self.fleet.check()
            status = self.run.status
            if status is not None and status.seq >= seq and status.state != NodeState.RUNNING:
                break
            time.sleep(STATUS_EVERY_S)
        return []

    def close(self) -> None:
        return None
