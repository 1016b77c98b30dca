"""The clock server and client (infra/clock_sync.py), on loopback with free ports.

A skew is injected as ``ETT_FAULT_CLOCK_SHIFT_S`` in a subprocess on one side: its
``clocks.wall()`` runs that far ahead, as a host's clock would. The server's reading happens
between the client's two readings, so |offset - true offset| <= error_s however slow the
machine: the tests assert that bound (plus ``SLACK_S`` for reads not taken at one instant),
never a duration.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from infra import clock_sync
from infra.accounting import clocks
from infra.accounting.ett import compute_report
from infra.accounting.host_offsets import ENV_OFFSET, ClockSample
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_read import read_ledger
from infra.clock_sync import MAX_LINE, ClockServer, ClockSyncError, measure_offset
from infra.job_layout import JobLayout

ROOT = Path(__file__).resolve().parents[2]
SLACK_S = 1e-3
SHIFT_S = 5.0

CLIENT = """
import sys
from infra.accounting.host_offsets import ENV_OFFSET
from infra.clock_sync import measure_offset
sample = measure_offset(sys.argv[1])
print(sample.env()[ENV_OFFSET])
print("torch" in sys.modules)
"""

SERVER = """
import sys
from infra.clock_sync import ClockServer
with ClockServer("127.0.0.1") as server:
    print(server.address, flush=True)
    sys.stdin.read()  # until the test closes it
"""


NODE_RUN = """
import os, sys, time
from infra.accounting.ledger import Ledger
from infra.clock_sync import measure_offset
from infra.job_layout import JobLayout
os.environ.update(measure_offset(sys.argv[1]).env())  # what a node run hands its ranks
with Ledger(JobLayout.at(sys.argv[2])) as led:
    led.mark("attempt_start")
    for step in (1, 2, 3):
        with led.span("train_step", step=step):
            time.sleep(0.01)
    led.mark("job_end", step=3)
"""


def _env(**extra: str) -> dict[str, str]:
    ours = (clocks.ENV_SHIFT, clocks.ENV_HOST, ENV_OFFSET)
    env = {k: v for k, v in os.environ.items() if k not in ours}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _closed_by_peer(conn: socket.socket) -> bool:
    """Whether the other end closed the connection (EOF, or a reset) within 30 s."""
    conn.settimeout(30)
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _socket_inodes() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


@pytest.fixture
def server() -> Iterator[ClockServer]:
    with ClockServer("127.0.0.1") as srv:
        yield srv


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def test_in_one_process_the_offset_is_zero_within_its_error(server: ClockServer) -> None:
    sample = measure_offset(server.address)
    assert sample.reference == clocks.domain_of(clocks.identity())
    assert sample.error_s >= 0
    assert abs(sample.offset_s) <= sample.error_s + SLACK_S


def test_a_reading_late_in_the_round_trip_stays_within_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server reads its clock late in each round trip (it is slow to read it): the
    estimate is off by that asymmetry, never by more than its error."""
    real = clocks.wall

    def late() -> float:
        if threading.current_thread().name.startswith("clock-server"):
            time.sleep(0.02)
        return real()

    monkeypatch.setattr(clocks, "wall", late)
    with ClockServer("127.0.0.1") as server:
        sample = measure_offset(server.address, samples=3)
    assert sample.error_s >= 0.01  # the sleep is inside every round trip
    assert abs(sample.offset_s) <= sample.error_s + SLACK_S


def test_a_measuring_host_whose_clock_runs_ahead_measures_minus_its_shift(
    server: ClockServer,
) -> None:
    """The client (a node run) in a process whose clock runs 5 s ahead: the reference is
    5 s behind it. Its answer is what a node run hands its processes, and the client
    imports no torch."""
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, server.address],
        env=_env(**{clocks.ENV_SHIFT: str(SHIFT_S)}),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    value, torch_imported = done.stdout.splitlines()
    sample = ClockSample.parse(value)
    assert abs(sample.offset_s - -SHIFT_S) <= sample.error_s + SLACK_S
    assert abs(sample.offset_s - -SHIFT_S) < 0.5
    assert sample.reference == clocks.domain_of(clocks.identity())
    assert torch_imported == "False"


def test_a_reference_whose_clock_runs_ahead_is_measured_with_its_domain() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        env=_env(**{clocks.ENV_SHIFT: str(SHIFT_S), clocks.ENV_HOST: "orch-1"}),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        address = proc.stdout.readline().strip()
        sample = measure_offset(address)
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
    assert sample.reference == "orch-1/"
    assert abs(sample.offset_s - SHIFT_S) <= sample.error_s + SLACK_S
    assert abs(sample.offset_s - SHIFT_S) < 0.5
    assert json.loads(sample.env()[ENV_OFFSET])["reference"] == "orch-1/"


def test_an_unreachable_server_is_a_named_error_with_its_address() -> None:
    with socket.socket() as probe:  # a free port, closed again: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    with pytest.raises(ClockSyncError, match=address) as raised:
        measure_offset(address, timeout_s=10)
    assert isinstance(raised.value, OSError)


def test_a_silent_server_is_a_named_error_after_the_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never answers
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(ClockSyncError, match=address):
            measure_offset(address, timeout_s=0.5)


def test_a_bad_address_or_sample_count_is_refused() -> None:
    with pytest.raises(ValueError, match="host:port"):
        measure_offset("localhost")
    with pytest.raises(ValueError, match="samples"):
        measure_offset("127.0.0.1:1", samples=0)


def test_garbage_closes_only_its_own_connection(server: ClockServer) -> None:
    address = server.address
    with _connect(address) as conn:  # not a request: that connection is closed, unanswered
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _closed_by_peer(conn)
    with _connect(address) as conn:  # a line that never ends
        conn.sendall(b"\x00\xff" * MAX_LINE)
        assert _closed_by_peer(conn)
    with _connect(address) as conn:  # a request, then gone before reading the answer
        conn.sendall(b"time\n")
    with _connect(address):  # connected, said nothing, gone
        pass
    with _connect(address) as conn:  # requests in one packet: each answered
        conn.sendall(b"time\ntime\n")
        reader = conn.makefile("rb")
        answers = [json.loads(reader.readline()) for _ in range(2)]
        assert [sorted(a) for a in answers] == [["domain", "t"]] * 2
    sample = measure_offset(address)  # the server still answers
    assert abs(sample.offset_s) <= sample.error_s + SLACK_S


def test_many_clients_at_once_are_all_answered(server: ClockServer) -> None:
    idle = [_connect(server.address) for _ in range(20)]  # holding connections, silent
    try:
        with ThreadPoolExecutor(16) as pool:
            samples = list(pool.map(lambda _: measure_offset(server.address, 4), range(64)))
    finally:
        for conn in idle:
            conn.close()
    assert len(samples) == 64
    assert {s.reference for s in samples} == {clocks.domain_of(clocks.identity())}
    assert all(abs(s.offset_s) <= s.error_s + SLACK_S for s in samples)


def test_close_leaves_no_thread_and_no_socket() -> None:
    before = _socket_inodes()
    server = ClockServer("127.0.0.1").start()
    address = server.address
    name = f"clock-server-{address}"
    assert name in [t.name for t in threading.enumerate()]
    assert address == f"127.0.0.1:{server.port}"
    client = _connect(address)  # still connected when the server closes
    measure_offset(address)  # accepted after the client: the client's is accepted too
    ours = _socket_inodes() - before - {f"socket:[{os.fstat(client.fileno()).st_ino}]"}
    assert len(ours) >= 4  # the listener, the stop pair, the client's connection
    server.close()
    assert name not in [t.name for t in threading.enumerate()]
    assert not ours & _socket_inodes()
    assert _closed_by_peer(client)  # its end was closed too
    client.close()
    with pytest.raises(ClockSyncError, match=address):
        measure_offset(address, timeout_s=10)
    server.close()  # again: nothing to do
    with pytest.raises(RuntimeError):
        _ = server.address


def test_a_full_server_lets_the_next_client_wait_and_closes_silent_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At ``MAX_CLIENTS`` connections the next one waits in the listen backlog until one
    closes; a connection silent for ``IDLE_S`` is closed by the server."""
    monkeypatch.setattr(clock_sync, "MAX_CLIENTS", 2)
    monkeypatch.setattr(clock_sync, "IDLE_S", 0.5)
    with ClockServer("127.0.0.1") as server:
        first, second = _connect(server.address), _connect(server.address)
        with ThreadPoolExecutor(1) as pool:
            # one sample: its request waits in the backlog with it, so it is never idle
            waiting = pool.submit(measure_offset, server.address, 1, 60.0)
            assert _closed_by_peer(first) and _closed_by_peer(second)  # silent: closed
            sample = waiting.result()
        first.close()
        second.close()
    assert abs(sample.offset_s) <= sample.error_s + SLACK_S


def test_a_node_5_s_ahead_measures_writes_and_is_moved_back_end_to_end(tmp_path: Path) -> None:
    """A node run on ``node-1``, its clock 5 s ahead (``ETT_FAULT_CLOCK_SHIFT_S``), measures
    against the orchestrator's server and hands the result to its trainer's ledger; the
    orchestrator records the launch around it. Read back, every node event lies within the
    launch (it cannot have happened outside it), and W is no longer than the launch."""
    layout = JobLayout.at(f"file://{tmp_path}/job")
    with ClockServer("127.0.0.1") as server, Ledger(layout, role="orchestrator") as orch:
        before = clocks.wall()
        done = subprocess.run(
            [sys.executable, "-c", NODE_RUN, server.address, layout.url],
            env=_env(**{clocks.ENV_SHIFT: str(SHIFT_S), clocks.ENV_HOST: "node-1"}),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        after = clocks.wall()
        orch.record_span("launcher_init", before, after)
    assert done.returncode == 0, done.stderr
    read = read_ledger(layout)
    node = [e for e in read.events if e.source.startswith("trainer")]
    assert [e.name for e in node] == ["attempt_start", *["train_step"] * 3, "job_end"]
    assert all(before <= e.start <= e.end <= after for e in node)
    [moved] = read.clock.offsets
    assert moved.what == "host node-1" and abs(moved.offset_s - SHIFT_S) <= moved.error_s + SLACK_S
    report = compute_report(read.events, clock=read.clock)
    assert report.wall_s <= after - before + moved.error_s  # within what was measured
    assert math.isclose(math.fsum(report.buckets.values()), report.wall_s, rel_tol=1e-12)
