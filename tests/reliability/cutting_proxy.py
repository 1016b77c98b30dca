"""A cuttable S3 proxy that fails chosen HTTP requests, not whole connections.

    proxy = RequestCutter(("127.0.0.1", moto_port)).start()
    rule = proxy.cut("GET", r"/step-000000010/", how="500")  # answer those with a 500
    rule = proxy.cut("PUT", r"/manifest.json$", after=1)  # let one through first
    ...
    rule.count        # how many requests the rule failed

Built on tests/tcp_proxy.py: real sockets, so the trainer's botocore/s3fs run their own
code for a reset connection or a server error, retries included. A request is recognised
by its request line at the start of what the client sends (botocore sends one request at
a time on a connection and waits for the answer).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import urllib.parse
from dataclasses import dataclass

from tests.tcp_proxy import TcpProxy, _reset

_BODY = b"<Error><Code>InternalError</Code><Message>injected by the test</Message></Error>"
_ERROR_500 = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BODY), _BODY)
)


@dataclass
class Rule:
    method: str
    pattern: re.Pattern[str]
    after: int  # let this many matching requests through first
    how: str  # "reset" (TCP RST) or "500" (an S3 InternalError answer)
    matched: int = 0
    count: int = 0  # requests failed


class RequestCutter(TcpProxy):
    """A TcpProxy whose rules fail matching requests; ``requests`` lists every request
    line seen (method, unquoted path)."""

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(target)
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str]] = []
        self._rules_lock = threading.Lock()

    def cut(self, method: str, pattern: str, after: int = 0, how: str = "reset") -> Rule:
        if how not in ("reset", "500"):
            raise ValueError(f"how must be 'reset' or '500', got {how!r}")
        rule = Rule(method, re.compile(pattern), after, how)
        with self._rules_lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._rules_lock:
            self.rules.clear()

    def _match(self, chunk: bytes) -> Rule | None:
        line = chunk.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return None  # a request body, not a new request
        method, path = parts[0], urllib.parse.unquote(parts[1])
        with self._rules_lock:
            self.requests.append((method, path))
            for rule in self.rules:
                if rule.method == method and rule.pattern.search(path):
                    rule.matched += 1
                    if rule.matched > rule.after:
                        rule.count += 1
                        return rule
        return None

    def _pump(self, src: socket.socket, dst: socket.socket, ends: list[int]) -> None:
        try:
            from_client = src.getsockname()[1] == self.port
        except OSError:
            from_client = False
        if not from_client:
            super()._pump(src, dst, ends)
            return
        cut = False
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                rule = self._match(data)
                if rule is not None:
                    cut = True
                    if rule.how == "500":  # for requests without a body (GET, HEAD)
                        src.sendall(_ERROR_500)
                        src.shutdown(socket.SHUT_WR)
                    else:
                        _reset(src)
                    _reset(dst)
                    break
                dst.sendall(data)
        except OSError:
            pass
        if not cut:
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
