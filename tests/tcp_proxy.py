"""A TCP proxy on 127.0.0.1 that can simulate a network outage, for storage-failure tests.

    proxy = TcpProxy(("127.0.0.1", moto_port)).start()
    url = proxy.url                  # point the client here instead of at the server
    with proxy.outage():             # every open connection is reset, new ones are reset
        ...                          # at once (the client sees "connection reset/closed")
    proxy.close()

Real sockets, real threads: the client (botocore, in another process) runs its own code
paths for a broken connection, its retries included. During an outage the listening socket
stays open (so the port is never lost to another process) but each accepted connection is
closed with a TCP reset before a byte is read.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator

_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, not FIN


def _reset(sock: socket.socket) -> None:
    """Abort a connection: wake a thread blocked reading it, then close with a TCP reset."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)  # sends nothing; a blocked recv() returns b""
    with contextlib.suppress(OSError):
        sock.close()


class TcpProxy:
    """Forwards every connection to ``target``; ``down`` resets them instead."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self._listener = socket.create_server((host, 0))
        self.host, self.port = host, int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._down = threading.Event()
        self._closed = threading.Event()
        self.accepted = 0  # connections forwarded
        self.refused = 0  # connections reset during an outage

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> TcpProxy:
        threading.Thread(target=self._accept_loop, name="tcp-proxy", daemon=True).start()
        return self

    # -- outage control -----------------------------------------------------------------------
    def go_down(self) -> None:
        """Start an outage: reset every open connection and every new one."""
        self._down.set()
        with self._lock:
            doomed, self._open = list(self._open), set()
        for sock in doomed:
            _reset(sock)

    def come_up(self) -> None:
        self._down.clear()

    @property
    def is_down(self) -> bool:
        return self._down.is_set()

    @contextlib.contextmanager
    def outage(self) -> Iterator[TcpProxy]:
        self.go_down()
        try:
            yield self
        finally:
            self.come_up()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.go_down()

    # -- forwarding -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if self._down.is_set():
                self.refused += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._down.is_set():  # an outage began meanwhile
                    _reset(client)
                    _reset(upstream)
                    continue
                self._open.update((client, upstream))
                self.accepted += 1
            ends = [2]  # the pair is closed when both directions have ended
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(src, dst, ends), name="tcp-proxy-pump", daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, ends: list[int]) -> None:
        """Copy bytes one way until ``src`` ends, pass the end on (half-close) and, once the
        other direction has ended too, close both sockets."""
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._lock:
            ends[0] -= 1
            last = ends[0] == 0
            if last:
                self._open.discard(src)
                self._open.discard(dst)
        if last:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.close()
