"""A host's clock offset to the job's reference clock, measured over TCP (NTP-style).

The hosts of one job run clocks that disagree, by seconds where nothing keeps them in step.
The orchestrator runs a ``ClockServer``; each node run, at rendezvous, calls
``measure_offset(address)`` and hands the result to the processes it starts
(``ClockSample.env()``), whose ledgers record it; the reader then moves that host's events
onto the reference's clock (rule 5 of infra/accounting/clocks.py). Stdlib only: a node run
imports this before torch.

Protocol, one TCP connection per measurement: the client sends ``time\\n``; the server
answers one JSON line, ``{"t": <its clocks.wall()>, "domain": "<host/boot>"}``, read as it
answers. The client reads its own ``clocks.wall()`` before sending (t0) and the monotonic
round trip ``rtt`` until the answer: the server's reading happened within [t0, t0 + rtt] of
the client's clock, so offset = t - (t0 + rtt / 2), true to within rtt / 2 whatever the
path's asymmetry. Of ``samples`` exchanges the one with the smallest round trip wins (NTP's
clock filter, at its simplest). Both sides read ``clocks.wall()``, so
``ETT_FAULT_CLOCK_SHIFT_S`` on either side is what gets measured.

The server answers any number of clients from one thread; anything but a request closes that
connection and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import selectors
import socket
import threading
import time
from typing import Any

from infra.accounting import clocks
from infra.accounting.host_offsets import ClockSample

log = logging.getLogger(__name__)

REQUEST = b"time\n"
MAX_LINE = 256  # a request or an answer longer than this is garbage
MAX_CLIENTS = 256  # connections held at once; more wait in the listen backlog
IDLE_S = 30.0  # a connection silent this long is closed (a client that went away)
DEFAULT_TIMEOUT_S = 10.0


class ClockSyncError(OSError):
    """The clock server could not be measured against (unreachable, silent, or garbled)."""


class _Client:
    """One connection's unread bytes and when it last spoke."""

    __slots__ = ("buffer", "seen")

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.seen = time.monotonic()


class ClockServer:
    """Answers each request with this process's wall clock and clock domain, from a daemon
    thread. ``with ClockServer("0.0.0.0") as server: ... server.port``; ``close()`` leaves
    no thread and no socket behind. ``address`` is what it bound (``host:port``): bound to a
    wildcard, tell the nodes this host's name with ``port``."""

    def __init__(self, host: str, port: int = 0) -> None:
        self._bind = (host, port)
        self._domain = clocks.domain_of(clocks.identity())
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop_r: socket.socket | None = None
        self._stop_w: socket.socket | None = None

    @property
    def address(self) -> str:
        host, port = self._bound()
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def port(self) -> int:
        return self._bound()[1]

    def _bound(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("the clock server is not started")
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self) -> ClockServer:
        if self._thread is not None:
            raise RuntimeError("the clock server is started already")
        host, port = self._bind
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=1024)
        try:
            self._listener.setblocking(False)
            self._stop_r, self._stop_w = socket.socketpair()
            self._thread = threading.Thread(
                target=self._serve, name=f"clock-server-{self.address}", daemon=True
            )
            self._thread.start()
        except BaseException:
            for sock in (self._listener, self._stop_r, self._stop_w):
                if sock is not None:
                    sock.close()
            self._thread = self._listener = self._stop_r = self._stop_w = None
            raise
        return self

    def close(self) -> None:
        """Stop answering and close every socket; again: nothing to do."""
        if self._thread is None:
            return
        assert self._stop_w is not None and self._stop_r is not None
        with contextlib.suppress(OSError):
            self._stop_w.send(b"x")
        self._thread.join()
        self._stop_w.close()
        self._stop_r.close()
        self._thread = self._listener = self._stop_r = self._stop_w = None

    def __enter__(self) -> ClockServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the server's thread ------------------------------------------------------------------
    def _serve(self) -> None:
        assert self._listener is not None and self._stop_r is not None
        sel = selectors.DefaultSelector()
        clients: dict[socket.socket, _Client] = {}
        listening = True
        sel.register(self._stop_r, selectors.EVENT_READ)
        sel.register(self._listener, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in sel.select(timeout=1.0):
                    if key.fileobj is self._stop_r:
                        return
                    if key.fileobj is self._listener:
                        self._accept(sel, clients)
                    else:
                        conn = key.fileobj
                        assert isinstance(conn, socket.socket)
                        try:
                            keep = self._answer(conn, clients[conn])
                        except Exception:  # noqa: BLE001 - one client never stops the server
                            log.exception("clock server: dropping a connection")
                            keep = False
                        if not keep:
                            _drop(sel, clients, conn)
                now = time.monotonic()
                for conn in [c for c, client in clients.items() if now - client.seen > IDLE_S]:
                    _drop(sel, clients, conn)
                if listening != (len(clients) < MAX_CLIENTS):  # full: the rest wait in line
                    listening = not listening
                    if listening:
                        sel.register(self._listener, selectors.EVENT_READ)
                    else:
                        sel.unregister(self._listener)
        finally:
            for conn in list(clients):
                _drop(sel, clients, conn)
            sel.close()
            self._listener.close()

    def _accept(self, sel: selectors.BaseSelector, clients: dict[socket.socket, _Client]) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError:  # gone before it was accepted, or out of descriptors: try again later
            return
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        clients[conn] = _Client()
        sel.register(conn, selectors.EVENT_READ)

    def _answer(self, conn: socket.socket, client: _Client) -> bool:
        """Answer every whole request received; False when the connection is to be closed
        (gone, or it sent anything but a request)."""
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        client.seen = time.monotonic()
        client.buffer += data
        while (end := client.buffer.find(b"\n")) >= 0:
            line = bytes(client.buffer[: end + 1])
            del client.buffer[: end + 1]
            if line != REQUEST:
                return False
            answer = json.dumps({"t": clocks.wall(), "domain": self._domain}).encode() + b"\n"
            try:
                if conn.send(answer) != len(answer):  # a client that does not read its answers
                    return False
            except OSError:
                return False
        return len(client.buffer) < MAX_LINE


def _drop(
    sel: selectors.BaseSelector, clients: dict[socket.socket, _Client], conn: socket.socket
) -> None:
    clients.pop(conn, None)
    with contextlib.suppress(KeyError, ValueError):
        sel.unregister(conn)
    conn.close()


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a clock server address is host:port, got {address!r}")
    return host.strip("[]"), int(port)


def measure_offset(
    address: str, samples: int = 8, timeout_s: float = DEFAULT_TIMEOUT_S
) -> ClockSample:
    """This host's offset to the clock server at ``address``: the reference's time minus
    this process's ``clocks.wall()`` at one instant, from the sample with the smallest round
    trip (module docstring). ``timeout_s`` bounds the whole measurement. Raises
    ClockSyncError (an OSError) naming the address when it cannot measure."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    host, port = _split(address)
    deadline = time.monotonic() + timeout_s
    best: tuple[float, float, str] | None = None  # (round trip, offset, domain)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buffer = bytearray()
            for _ in range(samples):
                t0, m0 = clocks.wall(), time.monotonic()
                conn.sendall(REQUEST)
                while (end := buffer.find(b"\n")) < 0:
                    if len(buffer) > MAX_LINE:
                        raise ClockSyncError(f"clock server {address}: answer too long")
                    conn.settimeout(max(deadline - time.monotonic(), 1e-3))
                    chunk = conn.recv(4096)
                    if not chunk:
                        raise ClockSyncError(f"clock server {address} closed the connection")
                    buffer += chunk
                rtt = time.monotonic() - m0
                answer = _parse(address, bytes(buffer[:end]))
                del buffer[: end + 1]
                offset = answer["t"] - (t0 + rtt / 2)
                if best is None or rtt < best[0]:
                    best = (rtt, offset, answer["domain"])
    except ClockSyncError:
        raise
    except OSError as exc:  # refused, unreachable, timed out
        raise ClockSyncError(f"clock server {address} cannot be measured against: {exc}") from exc
    assert best is not None
    rtt, offset, domain = best
    return ClockSample(reference=domain, offset_s=offset, error_s=rtt / 2)


def _parse(address: str, line: bytes) -> dict[str, Any]:
    try:
        answer = json.loads(line)
        t, domain = float(answer["t"]), answer["domain"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ClockSyncError(f"clock server {address}: not an answer: {line[:80]!r}") from exc
    if not math.isfinite(t) or not isinstance(domain, str) or not domain:
        raise ClockSyncError(f"clock server {address}: not an answer: {line[:80]!r}")
    return {"t": t, "domain": domain}
