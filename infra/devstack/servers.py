"""One local server (moto S3, MLflow, Prefect) as a background process: start, health, stop.

Each server runs in its own process group bound to 127.0.0.1, logging to ``<state>/<name>.log``, so
stopping it takes every process it forked, and a recorded pid that now belongs to an unrelated
process is never signalled. infra/devstack/stack.py runs the three together as ``ett stack``; the
test-suite starts the same servers through ``tests/servers.py``.

- S3: ``python -m moto.server``; an in-memory object store with a bucket (default ``ett``).
- MLflow: ``mlflow server`` with a SQLite backend in the state dir and artifacts proxied to
  ``s3://<bucket>/mlflow-artifacts`` (clients need no S3 credentials to log artifacts).
- Prefect: ``prefect server start`` with its own PREFECT_HOME and SQLite DB in the state dir;
  the scheduler and triggers services run (unlike the ephemeral server).

Only dummy AWS credentials (``testing``) exist here; they are meaningful to moto alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infra import processes

SERVICES = ("s3", "mlflow", "prefect")
DEFAULT_BUCKET = "ett"
HEALTH_PATHS = {"s3": "/moto-api/", "mlflow": "/health", "prefect": "/api/health"}
_MARKERS = {"s3": "moto.server", "mlflow": "mlflow", "prefect": "prefect"}  # in their argv
# Never handed to the servers: settings that would point them elsewhere, and real credentials.
_NOT_INHERITED = {
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "PREFECT_API_URL",
    "PREFECT_API_KEY",
    "PREFECT_UI_API_URL",
    "PREFECT_SERVER_UI_API_URL",
    "PREFECT_API_DATABASE_CONNECTION_URL",
    "PREFECT_PROFILE",
    "PREFECT_PROFILES_PATH",
}
# Meaningful to moto only; never real credentials.
LOCAL_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookups (no network here)
}

_children: dict[int, subprocess.Popen[bytes]] = {}  # processes started by this process
_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class StackError(RuntimeError):
    """A server failed to start or the stack's state is unusable; the message says why."""


@dataclass(frozen=True)
class Service:
    """One running server: its base URL, port, process (group) id and log file."""

    name: str
    url: str
    port: int
    pid: int
    log: str


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def log_tail(path: str | Path | None, lines: int = 30) -> str:
    if path is None or not Path(path).is_file():
        return "(no log)"
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(log is empty)"


def probe(url: str) -> str | None:
    """None when ``url`` answers HTTP 200 now, else what it answered (or why it did not)."""
    try:
        with _no_proxy.open(url, timeout=2) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return str(exc)


def _exit_code(pid: int) -> int | None:
    """The exit code of a process this process started, None while it runs (or unknown)."""
    proc = _children.get(pid)
    return proc.poll() if proc is not None else None


def wait_healthy(
    url: str,
    timeout_s: float = 120.0,
    *,
    log_path: str | Path | None = None,
    pid: int | None = None,
) -> float:
    """Poll ``url`` until it answers HTTP 200; return the seconds waited.

    Raises TimeoutError after ``timeout_s`` (StackError at once if process ``pid`` exits),
    with the tail of the server's log in the message.
    """
    start = time.monotonic()
    while True:
        last = probe(url)
        if last is None:
            return time.monotonic() - start
        code = _exit_code(pid) if pid is not None else None
        if code is not None:
            raise StackError(
                f"server for {url} exited with code {code} before becoming healthy; "
                f"log {log_path}:\n{log_tail(log_path)}"
            )
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(
                f"{url} not healthy after {timeout_s:.0f}s (last: {last}); "
                f"log {log_path}:\n{log_tail(log_path)}"
            )
        time.sleep(0.25)


def _command(
    name: str, port: int, state: Path, s3_endpoint: str | None, bucket: str
) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment of one server."""
    py = sys.executable
    host = "127.0.0.1"
    if name == "s3":
        return [py, "-m", "moto.server", "-H", host, "-p", str(port)], dict(LOCAL_AWS_ENV)
    if name == "mlflow":
        if not s3_endpoint:
            raise StackError("the mlflow server needs the s3 service (its artifact store)")
        argv = [
            py,
            "-m",
            "mlflow",
            "server",
            "--host",
            host,
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{state / 'mlflow.db'}",
            "--artifacts-destination",
            f"s3://{bucket}/mlflow-artifacts",
        ]
        env = LOCAL_AWS_ENV | {
            "MLFLOW_S3_ENDPOINT_URL": s3_endpoint,
            "AWS_ENDPOINT_URL_S3": s3_endpoint,
            "MLFLOW_DISABLE_TELEMETRY": "true",
            # GenAI job runner: 6+ huey consumer processes we do not use (2 cores here).
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        return argv, env
    if name == "prefect":
        argv = [py, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)]
        env = {
            "PREFECT_HOME": str(state / "prefect"),
            "PREFECT_API_URL": f"http://{host}:{port}/api",  # also the UI's API URL
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{state / 'prefect.db'}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "true",
            "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "true",
        }
        return argv, env
    raise StackError(f"unknown service {name!r}; known: {', '.join(SERVICES)}")


def launch(
    name: str,
    state_dir: str | Path,
    port: int | None = None,
    *,
    s3_endpoint: str | None = None,
    bucket: str = DEFAULT_BUCKET,
) -> Service:
    """Start one server in the background (its own process group) without waiting for it."""
    state = Path(state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    if port_in_use(port):
        raise StackError(f"cannot start {name}: port {port} on 127.0.0.1 is in use")
    argv, extra = _command(name, port, state, s3_endpoint, bucket)
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED} | extra
    log = state / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            cwd=state,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _children[proc.pid] = proc
    return Service(name, f"http://127.0.0.1:{port}", port, proc.pid, str(log))


def create_bucket(endpoint: str, bucket: str = DEFAULT_BUCKET) -> None:
    """Create ``bucket`` on the local S3 endpoint (dummy credentials); no-op if it exists."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key=LOCAL_AWS_ENV["AWS_ACCESS_KEY_ID"],
        secret=LOCAL_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={
            "endpoint_url": endpoint,
            "region_name": LOCAL_AWS_ENV["AWS_DEFAULT_REGION"],
        },
        skip_instance_cache=True,
    )
    if not fs.exists(bucket):
        # us-east-1 takes no LocationConstraint (s3fs.mkdir would send one and fail).
        fs.call_s3("create_bucket", Bucket=bucket)


def wait_ready(service: Service, timeout_s: float = 180.0, bucket: str = DEFAULT_BUCKET) -> float:
    """Wait until a launched server is healthy (and, for S3, holds ``bucket``); seconds waited.
    A server that never gets there is stopped again before the error is raised."""
    try:
        waited = wait_healthy(
            service.url + HEALTH_PATHS[service.name],
            timeout_s,
            log_path=service.log,
            pid=service.pid,
        )
        if service.name == "s3":
            create_bucket(service.url, bucket)
    except BaseException:
        stop([service.pid])
        raise
    return waited


def _group_cmdlines(pgid: int) -> list[str] | None:
    _exit_code(pgid)  # reap our own child so it does not linger as a zombie
    return processes.group_cmdlines(pgid)


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group ``pgid``."""
    _exit_code(pgid)
    return processes.group_alive(pgid)


def is_running(service: Service) -> bool:
    """Whether the service's process group still runs *that* server (a recorded pid may have
    been reused by an unrelated process, e.g. after a reboot: that one is never signalled)."""
    cmdlines = _group_cmdlines(service.pid)
    if cmdlines is None:
        return group_alive(service.pid)
    return any(_MARKERS[service.name] in cmd for cmd in cmdlines)


def stop(pids: list[int], grace_s: float = 15.0) -> None:
    """SIGTERM each server's process group, then SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while any(group_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not any(group_alive(p) for p in pids):
            break
    for pgid in pids:  # reap our own children: a leader that died after group_alive's
        proc = _children.pop(pgid, None)  # last poll would otherwise stay a zombie
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
