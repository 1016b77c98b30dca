"""A job across "hosts", through the engines a cluster uses: a real Prefect server, one
process worker per host on the ``ett-nodes`` pool (each advertising its own loopback
address, 127.0.0.2 up, with a scratch folder of its own), moto's S3 as the only storage the
hosts share, and the orchestrator as users start it (``ett train --config``, the config's
``launch.work_pool``). docs/multi-host.md describes what is tested here.

The module runs its own Prefect server (not the session's), so that it can be restarted
mid-job. The first job, with a skewed host and that restart, is the reference the faulted one
is compared with.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from infra.accounting import clocks, host_offsets
from infra.accounting.ett import compute_report, report_for_job
from infra.accounting.ledger_read import LedgerFile, ledger_of, read_files
from infra.devstack import servers
from infra.node_protocol import ENV_ADVERTISE, ENV_SCRATCH, attempt_nodes, node_statuses
from infra.settings import JobConfig
from tests import procs
from tests.factories import assert_bit_identical, tiny_config, write_dataset
from tests.node_hosts import Host, hosts
from tests.prefect_worker import NODE_POOL, deploy, node_workers
from tests.reliability.ett_job import EttTrain
from tests.servers import STARTUP_TIMEOUT_S, prefect_api
from trainer.faults import ENV_STEP_DELAY

pytestmark = pytest.mark.slow

STEPS = 300
STEP_DELAY_S = 0.02  # each step at least this long: a job of 6 s or more, however fast the
# machine, so that a kill or a restart lands mid-job (the hosts' statuses come every second)
KILL_AT = 40
SHIFT_S = 5.0  # the skewed host's clock runs this far ahead
SKEWED = "skewed-host"  # its ledger's host name (ETT_FAULT_HOST_ID)
ORCHESTRATOR_ADDRESS = "127.0.0.1"  # where the rendezvous and clock server listen
GONE_WITHIN_S = 30.0


class RestartablePrefect:
    """``prefect server start`` on a fixed port and state folder, so that a restart comes
    back at the same address with the same database, as a server redeployed would."""

    def __init__(self, state: Path) -> None:
        self.state, self.port = state, servers.free_port()
        self.service: servers.Service | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> None:
        self.service = servers.launch("prefect", self.state, port=self.port)
        servers.wait_ready(self.service, STARTUP_TIMEOUT_S)

    def stop(self) -> None:
        if self.service is not None:
            servers.stop([self.service.pid])
            self.service = None


@pytest.fixture(scope="module")
def prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestartablePrefect]:
    server = RestartablePrefect(tmp_path_factory.mktemp("prefect-hosts"))
    server.start()
    try:
        with prefect_api(server.api_url):
            deploy()
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def data_url(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"s3://ett/hosts-data-{uuid.uuid4().hex[:8]}"
    write_dataset(_config(tmp_path_factory.mktemp("data"), url, "data"))
    return url


def _config(
    tmp_path: Path, data_url: str, job_id: str, steps: int = STEPS, **recovery: object
) -> JobConfig:
    return tiny_config(
        tmp_path,
        job_id=job_id,
        storage={"root": f"s3://ett/{job_id}-{uuid.uuid4().hex[:8]}"},
        data={"url": data_url},
        train={"steps": steps, "log_every": 50},
        checkpoint={"every_steps": 25},
        launch={"nnodes": 2, "nproc": 1, "work_pool": NODE_POOL},
        recovery={"backoff_s": 0, "max_failures": 2, "node_timeout_s": 10, **recovery},
    )


@dataclass
class HostsJob:
    """One job's orchestrator and the workers of its hosts."""

    config: JobConfig
    train: EttTrain
    hosts: list[Host]
    workers: list[subprocess.Popen[bytes]]

    def wait_for_step(self, step: int, timeout: float = 240) -> int:
        """Until the status of the node that holds rank 0 (on storage, rewritten every
        second) says ``step``; the step it says."""
        deadline = time.monotonic() + timeout
        seen: list[tuple[float, int | None]] = []  # when, and which step, it said
        while True:
            status = next(iter(attempt_nodes(self.config.layout)), None)
            if status and status.progress and status.progress.step >= step:
                return status.progress.step
            seen.append(
                (time.monotonic(), status.progress.step if status and status.progress else None)
            )
            said = f"rank 0's node said {seen[-8:]}\n{self.train.tail()}"
            assert self.train.proc.poll() is None, f"ett exited before step {step}; {said}"
            assert time.monotonic() < deadline, f"no step {step}; {said}"
            time.sleep(0.2)

    def left_on_hosts(self) -> list[int]:
        """Processes of the job still on any host once it is over: those that carry a
        host's scratch folder, the hosts' workers aside."""
        workers = {w.pid for w in self.workers}
        found: list[int] = []
        deadline = time.monotonic() + GONE_WITHIN_S
        while time.monotonic() < deadline:
            found = [
                pid
                for host in self.hosts
                for pid in procs.carrying(**{ENV_SCRATCH: str(host.scratch)})
                if pid not in workers
            ]
            if not found:
                break
            time.sleep(0.2)
        return found


@contextlib.contextmanager
def hosts_job(
    tmp_path: Path, config: JobConfig, count: int = 2, skewed: int | None = None
) -> Iterator[HostsJob]:
    """``count`` hosts with a worker each (host ``skewed``'s clock SHIFT_S ahead) and the
    job's orchestrator, ``ett train --config``; every process of it ended afterwards."""
    placed = hosts(count)
    slow = {ENV_STEP_DELAY: str(STEP_DELAY_S)}
    with node_workers(placed, slow, tmp_path, host_env=_skew(skewed)) as workers:
        train = EttTrain(config, tmp_path, env={ENV_ADVERTISE: ORCHESTRATOR_ADDRESS})
        try:
            yield HostsJob(config, train, placed, workers)
        finally:
            train.end()


def _skew(skewed: int | None) -> dict[int, dict[str, str]]:
    if skewed is None:
        return {}
    return {skewed: {clocks.ENV_SHIFT: str(SHIFT_S), clocks.ENV_HOST: SKEWED}}


def _finished(job: HostsJob, timeout: float = 420) -> None:
    code = job.train.wait(timeout)
    assert code == 0, job.train.tail()
    job.train.assert_left_nothing()
    assert job.left_on_hosts() == [], "a node run or rank outlived the job"


@dataclass(frozen=True)
class Reference:
    """The module's uninterrupted job, and how far it trained while the API was down."""

    config: JobConfig
    step_at_stop: int  # rank 0's step when the Prefect server was stopped
    step_while_down: int  # ...and the step it reached before the server was started again
    api_answered: str | None  # what the API answered then (None: it was up)


@pytest.fixture(scope="module")
def reference(
    prefect: RestartablePrefect, data_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    """Two nodes train to the end with no failure: host 1's clock runs SHIFT_S ahead, and
    the Prefect server is restarted mid-job (a restart interrupts no training)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    config = _config(tmp_path, data_url, "hosts-ref")
    with hosts_job(tmp_path, config, skewed=1) as job:
        at_stop = job.wait_for_step(50)
        prefect.stop()
        while_down = job.wait_for_step(at_stop + 50)  # trains on with no API
        answered = servers.probe(prefect.api_url + "/health")
        prefect.start()
        _finished(job)
    return Reference(config, at_stop, while_down, answered)


def test_two_nodes_train_to_the_end_each_on_its_host(reference: Reference) -> None:
    report = report_for_job(reference.config.layout)
    assert report.finished and report.num_failures == 0 and report.num_steps == STEPS
    statuses = node_statuses(reference.config.layout).values()
    assert {s.address for s in statuses} == {"127.0.0.2", "127.0.0.3"}  # one on each host
    assert {s.node_rank for s in statuses} == {0, 1}


def test_the_prefect_server_restarted_mid_job_and_the_job_finishes(reference: Reference) -> None:
    """The API went away for as long as a restart takes: the node runs trained on while it
    was down (orders, heartbeats and progress go through storage), and the job ended with no
    failure once it was back."""
    steps = (reference.step_at_stop, reference.step_while_down)
    assert reference.api_answered is not None, f"the API was up while node 0 trained {steps}"
    report = report_for_job(reference.config.layout)
    assert report.finished and report.num_failures == 0


def test_a_host_5_s_ahead_keeps_the_buckets_whole_and_ett_true(reference: Reference) -> None:
    """The skewed host measured its offset to the orchestrator's clock; the report built on
    it is within 0.5 points of the one built from that host's events moved back by exactly
    SHIFT_S, its buckets sum to W, and W is no longer than the job ran."""
    files = read_files(reference.config.layout)
    skewed = [f for f in files if _host_of(f) == SKEWED]
    assert skewed, f"no ledger file of the skewed host: {[(f.name, _host_of(f)) for f in files]}"
    read = ledger_of(files)
    [measured] = [o for o in read.clock.offsets if o.what == f"host {SKEWED}"]
    assert abs(measured.offset_s - SHIFT_S) <= measured.error_s + 0.05
    report = compute_report(read.events, clock=read.clock)
    truth_read = ledger_of([_moved_back(f) if f in skewed else f for f in files])
    truth = compute_report(truth_read.events, clock=truth_read.clock)
    assert math.isclose(math.fsum(report.buckets.values()), report.wall_s, rel_tol=1e-9)
    pairs = zip(report.segments, report.segments[1:], strict=False)
    assert all(later[0] >= earlier[1] - 1e-9 for earlier, later in pairs)  # disjoint
    assert abs(report.ett_pct - truth.ett_pct) <= 0.5, (report.ett_pct, truth.ett_pct)
    assert abs(report.wall_s - truth.wall_s) <= 0.5
    assert report.finished and report.num_steps == truth.num_steps == STEPS


def _host_of(file: LedgerFile) -> str | None:
    for line in file.data.decode().splitlines():
        rec = json.loads(line)
        if rec.get("name") == "clock":
            return rec.get("attrs", {}).get("host")
    return None


def _moved_back(file: LedgerFile) -> LedgerFile:
    """The file as a host with a true clock would have written it: every time SHIFT_S
    earlier, and no measured offset (none is needed)."""
    lines = []
    for line in file.data.decode().splitlines():
        rec = json.loads(line)
        for key in ("t", "start", "end"):
            if key in rec:
                rec[key] -= SHIFT_S
        rec.get("attrs", {}).pop(host_offsets.CLOCK_ATTR, None)
        lines.append(json.dumps(rec))
    return replace(file, data=("\n".join(lines) + "\n").encode())


def test_a_node_run_killed_mid_job_recovers_bit_identical(
    reference: Reference, data_url: str, tmp_path: Path
) -> None:
    """The run of the node without rank 0 is SIGKILLed from outside mid-job: the loss is
    found, the other node is ended, both are relaunched, and the job ends with the
    reference's weights and nothing left."""
    config = _config(tmp_path, data_url, "hosts-kill")
    with hosts_job(tmp_path, config) as job:
        job.wait_for_step(KILL_AT)
        victim = attempt_nodes(config.layout)[-1]  # the node without rank 0
        assert victim.pid and victim.progress is None, "the other node is not running"
        os.kill(victim.pid, signal.SIGKILL)
        _finished(job)
    report = report_for_job(config.layout)
    assert report.finished and report.num_failures == 1
    assert "lost" in job.train.output()
    assert_bit_identical(reference.config, config, STEPS)
