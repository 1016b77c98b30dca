"""Headless Chromium driven over the DevTools protocol: what the UI tests read and photograph.

    with Chromium(tmp_path) as browser:
        browser.open(url)
        text = browser.wait_for_text("Model metrics")  # the page's visible text, once it shows
        browser.screenshot(tmp_path / "page.png")

The MLflow and Prefect UIs are single-page apps: what a user sees exists only after their
JavaScript ran, so the tests read the rendered page's ``innerText``, as a user reads it, not
the HTML the server sent. Chromium comes from Debian's packages (``make test`` installs it
where it is missing); the protocol needs nothing but a websocket, which Prefect already
brings, so no driver binary or browser automation package is installed.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from websockets.sync.client import ClientConnection, connect

from infra.devstack import servers

BINARIES = ("chromium", "chromium-browser", "google-chrome")
START_TIMEOUT_S = 60.0
WINDOW = (1440, 1000)


def chromium_binary() -> str:
    """The Chromium on PATH; an error that says how to get one (``make test`` installs it)."""
    for name in BINARIES:
        if found := shutil.which(name):
            return found
    raise RuntimeError(
        "no Chromium on PATH (looked for " + ", ".join(BINARIES) + "): `make test` installs "
        "Debian's package `chromium`; by hand: apt-get install chromium"
    )


class Chromium:
    """One headless Chromium with one tab, its profile in ``workdir``; closed on exit with
    every process it started (its own process group)."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        # A fresh profile each time: an old one's DevToolsActivePort names a dead port.
        self.profile = Path(tempfile.mkdtemp(prefix="chromium-profile-", dir=workdir))
        self.log = workdir / "chromium.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.ws: ClientConnection | None = None
        self._ids = itertools.count(1)

    def __enter__(self) -> Chromium:
        args = [
            chromium_binary(),
            "--headless=new",
            "--no-sandbox",  # root in a container has no user namespace for the sandbox
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={self.profile}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            "about:blank",
        ]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self.ws = connect(self._page_socket(), max_size=None, open_timeout=START_TIMEOUT_S)
            self.call("Page.enable")
            self.call("Runtime.enable")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _page_socket(self) -> str:
        """The tab's DevTools websocket URL, once Chromium wrote its port file."""
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"Chromium exited: {self.log.read_text()[-2000:]}")
            if port_file.exists() and (lines := port_file.read_text().split()):
                url = f"http://127.0.0.1:{lines[0]}/json/list"
                with contextlib.suppress(OSError), urllib.request.urlopen(url) as r:
                    pages = [t for t in json.load(r) if t.get("type") == "page"]
                    if pages:
                        return str(pages[0]["webSocketDebuggerUrl"])
            time.sleep(0.2)
        raise RuntimeError(f"Chromium did not open DevTools in {START_TIMEOUT_S:.0f} s")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events that arrive meanwhile are dropped)."""
        assert self.ws is not None, "use Chromium as a context manager"
        ident = next(self._ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=START_TIMEOUT_S))
            if message.get("id") != ident:
                continue
            if "error" in message:
                raise RuntimeError(f"{method}: {message['error']}")
            return dict(message.get("result", {}))

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def text(self) -> str:
        """The page's visible text, as a user reads it."""
        return str(self.evaluate("document.body ? document.body.innerText : ''") or "")

    def wait_for_text(self, *needles: str, timeout_s: float = 60.0) -> str:
        """The page's text once it shows every one of ``needles``; the error shows what the
        page said instead."""
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.text()
            if all(n in text for n in needles):
                return text
            time.sleep(0.5)
        missing = [n for n in needles if n not in text]
        url = self.evaluate("location.href")
        raise AssertionError(f"{url} never showed {missing}; it shows:\n{text[:3000]}")

    def links(self) -> dict[str, str]:
        """The page's links: visible text -> where it goes."""
        pairs = self.evaluate(
            "[...document.querySelectorAll('a[href]')].map(a => [a.innerText.trim(), a.href])"
        )
        return {text: href for text, href in pairs or [] if text}

    def click_text(self, label: str) -> None:
        """Click the innermost element whose whole visible text is ``label`` (a tab, a
        button, a link: the UIs do not all use buttons for them)."""
        found = self.evaluate(
            "(() => { const want = " + json.dumps(label) + ";"
            " const all = [...document.querySelectorAll('body *')]"
            ".filter(e => e.innerText && e.innerText.trim() === want);"
            " if (!all.length) return false; all[all.length - 1].click(); return true; })()"
        )
        if not found:
            raise AssertionError(f"nothing to click labelled {label!r}:\n{self.text()[:2000]}")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None
        if self.process is not None:  # its renderers and zygotes are in its group
            servers.stop([self.process.pid], grace_s=10.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5.0)
        self.process = None
        shutil.rmtree(self.profile, ignore_errors=True)
