"""One host's part of a job on a Prefect work pool: a node run, from placement to release.

A node run (flows/node_flow.py) is placed by a work pool's worker on some host. It reads the
job's resolved config from the job's storage, parks a torchrun agent (imported, waiting: an
agent pool of one, tasks/agent_pool.py, unless the host runs ``ett pool`` of its own) and
then follows the orchestrator's orders (infra/node_protocol.py): **launch** attempt N as
node rank R (the agent joins the rendezvous the orchestrator hosts), **end** the running
launch (SIGTERM and a grace first when it is a preemption), **release** (the job is over).
Between launches it parks again, so a relaunch on a host that survived starts warm. Its
status, a heartbeat every second, tells the orchestrator where it is, the exit code of each
launch and, on the node holding global rank 0, the training's progress.

It never outlives its job: it exits when released, when its orchestrator's heartbeat goes
silent for ``recovery.node_timeout_s``, and when it is cancelled or killed: its ranks
watch its control pipes (infra/control.py), so even a SIGKILL of the node run ends them.
Everything local lives in its scratch folder (``ETT_SCRATCH_DIR``), removed at the end, as
are the job's in-memory checkpoint copies on this host (infra/memory_tier.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Any

from infra import memory_tier, processes, storage
from infra.accounting import clocks
from infra.accounting.ledger import recover_orphaned_spools
from infra.clock_sync import measure_offset
from infra.control import ENV_ATTEMPT, ControlDir, JobState, Progress
from infra.job_layout import JobLayout
from infra.node_protocol import (
    ENV_SCRATCH,
    HEARTBEAT_S,
    Launch,
    NodeState,
    NodeStatus,
    OrderKind,
    advertise_address,
    orchestrator_url,
    read_order,
    write_status,
)
from infra.settings import JobConfig, load_resolved
from tasks.agent_pool import AgentPool
from tasks.attempt import AttemptProcess, LaunchSpec
from tasks.local_node import LocalNode, Log

POLL_S = 0.2  # how often the running launch is looked at
ORDER_EVERY_S = 0.5  # how often the orders are read from storage
UNIX_PATH_MAX = 107  # a unix socket's path on Linux (sun_path, less its terminator)


class NodeRunner:
    """One node run: ``run`` returns when it is released or its job is gone (the exit code of
    its last launch, 0 when it never launched)."""

    def __init__(
        self,
        layout: JobLayout,
        key: str,
        log: Log,
        scratch: str | None = None,
        **seams: Any,
    ) -> None:
        self.layout, self.key, self.log = layout, key, log
        self.scratch = tempfile.mkdtemp(
            prefix=f"ett-node-{key}-", dir=scratch or os.environ.get(ENV_SCRATCH) or None
        )
        self._seams = seams  # env, launcher, program: tests
        self.address = advertise_address()
        self.host = socket.gethostname()
        self._seq = -1  # the last order acted on
        self._launch: Launch | None = None
        self._attempt: AttemptProcess | None = None
        self._exit_code: int | None = None
        self._state = NodeState.STARTING
        self._pool: AgentPool | None = None
        self._pool_thread: threading.Thread | None = None
        self._next_status = 0.0
        self._next_order = 0.0
        self._stop = threading.Event()
        self._progress: Progress | None = None  # rank 0's last, after its launch ended
        self._next_orphan_check = 0.0
        self._orchestrator_beat: str | None = None
        self._orchestrator_seen = time.monotonic()

    # -- the run's life -------------------------------------------------------------------------
    def run(self) -> int:
        """Park, launch what the orchestrator orders, until released or orphaned."""
        try:
            self._status(force=True)
            self.config = self._read_config()
            self.spec = LaunchSpec.of(self.config, self._config_path, **self._seams)
            self._park()
            while not self._stop.is_set():
                self._follow_orders()
                self._watch_launch()
                self._status()
                if self._orphaned():
                    self.log.warning("node run %s: its orchestrator is gone: ending", self.key)
                    break
                time.sleep(POLL_S)
        finally:
            self._end_launch(preempt=True)
            self._state = NodeState.ENDED
            with contextlib.suppress(OSError):
                self._status(force=True)
            self._close_pool()
            shutil.rmtree(self.scratch, ignore_errors=True)
            memory_tier.remove_segments(self.layout)  # this host's in-memory copies of the job
        return self._exit_code or 0

    def stop(self) -> None:
        """End the run from another thread (a cancellation): the launch is preempted."""
        self._stop.set()

    def _read_config(self) -> JobConfig:
        """The job's resolved config from its storage: the one copy every host reads."""
        self._config_path = os.path.join(self.scratch, "job.yaml")
        with open(self._config_path, "w") as fh:
            fh.write(storage.read_text(self.layout.config))
        config = load_resolved(self._config_path)
        storage.configure(config.storage)  # credentials: this host's environment
        return config

    def _park(self) -> None:
        """An agent imported and waiting, so a launch skips the imports: the host's own
        ``ett pool`` when it runs one, else a pool of one in the scratch folder."""
        if self.config.launch.agent_pool or self._seams.get("launcher"):
            self._agent_pool = self.config.launch.agent_pool
        else:
            path = self._pool_socket()
            self._pool = AgentPool(path, size=1)  # refills once a launch had its start
            self._pool_thread = threading.Thread(target=self._pool.serve, daemon=True)
            self._pool_thread.start()
            self._agent_pool = path
        self._state = NodeState.PARKED
        self._status(force=True)

    def _warm(self) -> bool | None:
        """Whether its own pool has an agent parked and imported; None with the host's pool
        (``ett pool``), which it does not look into."""
        if self._pool is None:
            return None
        return any(agent.ready for agent in list(self._pool.parked))

    def _pool_socket(self) -> str:
        """Its pool's socket: in its scratch folder where the path fits a unix socket's 107
        bytes, else in /tmp (a deep scratch folder would otherwise turn the pool off, and
        every launch would start cold)."""
        path = os.path.join(self.scratch, "agents.sock")
        if len(os.fsencode(path)) <= UNIX_PATH_MAX:
            return path
        return os.path.join("/tmp", f"ett-{self.key}-{os.getpid()}.sock")

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.stop.set()  # serve() releases its parked agent as it returns
        if self._pool_thread is not None:
            self._pool_thread.join(timeout=10)

    # -- orders ---------------------------------------------------------------------------------
    def _follow_orders(self) -> None:
        now = time.monotonic()
        if now < self._next_order:
            return
        self._next_order = now + ORDER_EVERY_S
        order = read_order(self.layout, self.key)
        if order is None or order.seq <= self._seq:
            return
        self._seq = order.seq
        self.log.info("node run %s: order %d: %s", self.key, order.seq, order.kind)
        if order.kind == OrderKind.LAUNCH and order.launch is not None:
            self._end_launch(preempt=False)
            self._start(order.launch)
        elif order.kind == OrderKind.END:
            self._end_launch(order.preempt, order.grace_s)
        elif order.kind == OrderKind.RELEASE:
            self._stop.set()
        self._status(force=True)

    def _spec_of(self, launch: Launch) -> LaunchSpec:
        """The job's launch with the order's node count, not the config's: fewer after a
        lost node with no spare (``recovery.min_nodes``; one node runs standalone)."""
        return dataclasses.replace(self.spec, nnodes=launch.nnodes)

    def _start(self, launch: Launch) -> None:
        spec = self._spec_of(launch)
        command = spec.command(launch.node_rank, launch.rendezvous, launch.run_id, self.address)
        env = {
            **os.environ,
            "PYTHONPATH": processes.repo_pythonpath(os.environ.get("PYTHONPATH")),
            **spec.env,
            **launch.env,
            ENV_ATTEMPT: str(launch.attempt),
        }
        env.update(self._clock_offset(launch))
        attempt = AttemptProcess(launch.attempt, False, spec, self.log)
        control = ControlDir(spec.nproc, prefix=f"ett-a{launch.attempt}-", parent=self.scratch)
        state = JobState(launch.failures, launch.started_at)
        prefix = f"[attempt {launch.attempt} node {launch.node_rank}] "
        try:
            node = LocalNode.start(
                command, env, control, state, False, self.log, prefix, self._agent_pool
            )
        except BaseException:
            control.close()
            raise
        attempt.nodes.append(node)
        self._attempt, self._launch, self._exit_code = attempt, launch, None
        self._state = NodeState.RUNNING
        self._status(force=True)  # the orchestrator sees the launch taken without a beat's wait
        how = " (a parked agent)" if node.pooled else ""
        self.log.info(
            "node run %s: attempt %d node %d started%s",
            self.key,
            launch.attempt,
            launch.node_rank,
            how,
        )

    def _clock_offset(self, launch: Launch) -> dict[str, str]:
        """This host's clock offset to the orchestrator's, measured now, for the ledger of
        every process the launch starts (infra/accounting/host_offsets.py). Unmeasured, the
        report names this host as not aligned; training goes on."""
        if not launch.clock:
            return {}
        try:
            sample = measure_offset(launch.clock)
        except OSError as exc:
            self.log.warning("node run %s: clock not measured: %s", self.key, exc)
            return {}
        self.log.info(
            "node run %s: clock offset to the orchestrator %+.3f s (+-%.3f s)",
            self.key,
            sample.offset_s,
            sample.error_s,
        )
        return sample.env()

    def _watch_launch(self) -> None:
        attempt = self._attempt
        if attempt is None:
            return
        attempt.track()
        code = attempt.poll()
        if code is not None:
            self._finish(code)

    def _end_launch(self, preempt: bool, grace_s: float = 0.0) -> None:
        attempt = self._attempt
        if attempt is None:
            return
        attempt.end(grace_s, preempt=preempt)
        self._finish(attempt.poll() if attempt.poll() is not None else 128 + signal.SIGKILL)

    def _finish(self, code: int) -> None:
        attempt, launch = self._attempt, self._launch
        assert attempt is not None and launch is not None
        self._progress = attempt.progress()  # the last, if this node held rank 0
        attempt.end(0.0, preempt=False)  # what is left of it, its control folder
        if code:  # its ranks' unsent ledger events wait in their spools on this host
            recover_orphaned_spools(self.layout)
        self._attempt, self._exit_code = None, code
        self._state = NodeState.PARKED
        self.log.info("node run %s: attempt %d ended with %d", self.key, launch.attempt, code)
        self._status(force=True)

    # -- status ---------------------------------------------------------------------------------
    def _status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_status:
            return
        self._next_status = now + HEARTBEAT_S
        launch, attempt = self._launch, self._attempt
        # Rank 0's progress, if its ranks include global rank 0: torchrun's c10d rendezvous
        # orders ranks by address, so that may be any node of the launch, not node_rank 0.
        progress = attempt.progress() if attempt is not None else self._progress
        status = NodeStatus(
            state=self._state,
            host=self.host,
            address=self.address,
            heartbeat=clocks.wall(),
            pid=os.getpid(),
            seq=self._seq,
            attempt=None if launch is None else launch.attempt,
            node_rank=None if launch is None else launch.node_rank,
            exit_code=self._exit_code,
            progress=progress,
            warm=self._warm(),
        )
        try:
            write_status(self.layout, self.key, status)
        except OSError as exc:  # a storage hiccup: the next heartbeat tries again
            self.log.warning("node run %s: status not written: %s", self.key, exc)

    def _orphaned(self) -> bool:
        """The orchestrator's heartbeat has not changed for ``recovery.node_timeout_s`` of
        this host's monotonic clock (two hosts' wall clocks are never compared)."""
        now = time.monotonic()
        if now < self._next_orphan_check:
            return False
        self._next_orphan_check = now + 2 * HEARTBEAT_S
        with contextlib.suppress(OSError, ValueError):  # unreadable for now: not evidence
            beat = storage.read_text(orchestrator_url(self.layout))
            if beat != self._orchestrator_beat:
                self._orchestrator_beat, self._orchestrator_seen = beat, now
        return now - self._orchestrator_seen > self.config.recovery.node_timeout_s


def run_node(layout: JobLayout, key: str, log: Log) -> int:
    """Run one node run to its end; SIGTERM (a cancellation) preempts its launch and ends it."""
    runner = NodeRunner(layout, key, log)
    previous = signal.getsignal(signal.SIGTERM)

    def _terminate(signum: int, frame: Any) -> None:
        runner.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return runner.run()
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
