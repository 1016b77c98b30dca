"""The local stack of real servers: S3 (moto), an MLflow tracking server, a Prefect server.

``ett stack up`` (or ``python -m infra.stack up``) starts them as background processes bound
to 127.0.0.1, each in its own process group, logging to ``<state>/<name>.log``; the URLs and
pids go to ``<state>/stack.json`` (never credentials) so ``down`` and ``status`` find them
later. ``eval "$(ett stack env)"`` points a shell (flows, workers, torchrun ranks)
at the stack. The test-suite starts the same servers through ``tests/servers.py``.

- S3: ``python -m moto.server``; an in-memory object store with a bucket (default ``ett``).
  Its contents vanish on ``down`` while MLflow's run records persist: ``down --wipe`` clears
  the state dir for a consistent restart.
- MLflow: ``mlflow server`` with a SQLite backend in the state dir and artifacts proxied to
  ``s3://<bucket>/mlflow-artifacts`` (clients need no S3 credentials to log artifacts).
- Prefect: ``prefect server start`` with its own PREFECT_HOME and SQLite DB in the state dir;
  the scheduler and triggers services run (unlike the ephemeral server).

Only dummy AWS credentials (``testing``) exist here; they are meaningful to moto alone.

Production: the clients read nothing but the variables of ``Stack.env()``, so production
points them elsewhere: ``AWS_ENDPOINT_URL_S3`` unset (real S3) with credentials from the
instance role or secret store; ``MLFLOW_TRACKING_URI`` at a shared MLflow server run with
``--backend-store-uri postgresql://...`` and ``--artifacts-destination s3://<real bucket>``
(plus ``--allowed-hosts``); ``PREFECT_API_URL`` at a Prefect server on Postgres
(``PREFECT_SERVER_DATABASE_CONNECTION_URL=postgresql+asyncpg://...``) or Prefect Cloud.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from infra import processes

SERVICES = ("s3", "mlflow", "prefect")
DEFAULT_STATE_DIR = ".stack"
DEFAULT_BUCKET = "ett"
DEFAULT_PORTS = {"s3": 9000, "mlflow": 5000, "prefect": 4200}
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


@dataclass(frozen=True)
class Stack:
    """Where the servers are; ``env()`` is what a client process needs to use them."""

    state_dir: str
    bucket: str = DEFAULT_BUCKET
    s3_endpoint: str | None = None
    mlflow_uri: str | None = None
    prefect_api_url: str | None = None
    services: dict[str, Service] = field(default_factory=dict)
    ready_s: dict[str, float] = field(default_factory=dict)  # seconds each took to be healthy

    @property
    def prefect_ui_url(self) -> str | None:
        return self.prefect_api_url.removesuffix("/api") if self.prefect_api_url else None

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {"MLFLOW_DISABLE_TELEMETRY": "true"}
        if self.s3_endpoint:
            out |= LOCAL_AWS_ENV | {
                "AWS_ENDPOINT_URL_S3": self.s3_endpoint,
                "MLFLOW_S3_ENDPOINT_URL": self.s3_endpoint,
                "ETT_STORAGE__ROOT": f"s3://{self.bucket}/runs",
                "ETT_STORAGE__S3_ENDPOINT_URL": self.s3_endpoint,
            }
        if self.mlflow_uri:
            out |= {
                "MLFLOW_TRACKING_URI": self.mlflow_uri,
                "ETT_TRACKING__MLFLOW_URI": self.mlflow_uri,
            }
        if self.prefect_api_url:
            out["PREFECT_API_URL"] = self.prefect_api_url
        return out


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
    last = "no answer yet"
    while True:
        try:
            with _no_proxy.open(url, timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            last = str(exc)
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


def _command(name: str, port: int, state: Path, s3_endpoint: str | None, bucket: str):
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
    state_dir: str | Path = DEFAULT_STATE_DIR,
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
    """Wait until a launched server is healthy (and, for S3, holds ``bucket``); seconds waited."""
    url = service.url + HEALTH_PATHS[service.name]
    waited = wait_healthy(url, timeout_s, log_path=service.log, pid=service.pid)
    if service.name == "s3":
        create_bucket(service.url, bucket)
    return waited


def start(
    name: str,
    state_dir: str | Path = DEFAULT_STATE_DIR,
    port: int | None = None,
    *,
    s3_endpoint: str | None = None,
    bucket: str = DEFAULT_BUCKET,
    timeout_s: float = 180.0,
) -> Service:
    """Start one server and wait until it is healthy; stop it again if it never gets there."""
    service = launch(name, state_dir, port, s3_endpoint=s3_endpoint, bucket=bucket)
    try:
        wait_ready(service, timeout_s, bucket)
    except BaseException:
        stop([service.pid])
        raise
    return service


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


def _stack_file(state_dir: str | Path) -> Path:
    return Path(state_dir).resolve() / "stack.json"


def _save(stack: Stack) -> None:
    data = {
        "bucket": stack.bucket,
        "services": {name: vars(svc) for name, svc in stack.services.items()},
        "ready_s": stack.ready_s,
    }
    _stack_file(stack.state_dir).write_text(json.dumps(data, indent=2) + "\n")


def _make_stack(
    state_dir: str | Path,
    bucket: str,
    services: dict[str, Service],
    ready_s: dict[str, float] | None = None,
) -> Stack:
    return Stack(
        state_dir=str(Path(state_dir).resolve()),
        bucket=bucket,
        s3_endpoint=services["s3"].url if "s3" in services else None,
        mlflow_uri=services["mlflow"].url if "mlflow" in services else None,
        prefect_api_url=services["prefect"].url + "/api" if "prefect" in services else None,
        services=services,
        ready_s=ready_s or {},
    )


def load(state_dir: str | Path = DEFAULT_STATE_DIR) -> Stack:
    """The stack recorded in ``<state>/stack.json``; StackError if there is none."""
    path = _stack_file(state_dir)
    if not path.is_file():
        raise StackError(f"no stack recorded in {path.parent}; run `ett stack up` first")
    data = json.loads(path.read_text())
    services = {name: Service(**svc) for name, svc in data["services"].items()}
    return _make_stack(state_dir, data["bucket"], services, data.get("ready_s"))


def up(
    state_dir: str | Path = DEFAULT_STATE_DIR,
    ports: dict[str, int] | None = None,
    services: tuple[str, ...] | list[str] = SERVICES,
    *,
    bucket: str = DEFAULT_BUCKET,
    timeout_s: float = 180.0,
) -> Stack:
    """Start the servers (all at once; they boot in parallel) and wait until all are healthy.

    ``ports`` maps a service name to its port; missing ones get a free port. Raises
    StackError if a stack recorded in ``state_dir`` still runs. On failure everything
    started is stopped again and the error carries the failing server's log tail.
    """
    unknown = set(services) - set(SERVICES)
    if unknown:
        raise StackError(f"unknown services {sorted(unknown)}; known: {', '.join(SERVICES)}")
    running = running_services(state_dir)
    if running:
        raise StackError(f"stack in {state_dir} already runs {running}; run `down` first")
    ports = ports or {}
    ordered = [name for name in SERVICES if name in services]
    started: dict[str, Service] = {}
    try:
        s3_endpoint = None
        for name in ordered:  # MLflow only needs S3 for its first artifact, not to boot
            if name == "s3":
                started[name] = launch("s3", state_dir, ports.get("s3"), bucket=bucket)
                s3_endpoint = started[name].url
            else:
                started[name] = launch(
                    name, state_dir, ports.get(name), s3_endpoint=s3_endpoint, bucket=bucket
                )
        _save(_make_stack(state_dir, bucket, started))  # so `down` can clean up after ^C
        # Wait in threads so each server's startup time is measured on its own.
        pool = ThreadPoolExecutor(len(ordered), thread_name_prefix="stack-wait")
        try:
            futures = {n: pool.submit(wait_ready, started[n], timeout_s, bucket) for n in ordered}
            ready_s = {name: round(fut.result(), 1) for name, fut in futures.items()}
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    except BaseException:
        stop([s.pid for s in started.values()])
        _stack_file(state_dir).unlink(missing_ok=True)
        raise
    stack = _make_stack(state_dir, bucket, started, ready_s)
    _save(stack)
    return stack


def running_services(state_dir: str | Path = DEFAULT_STATE_DIR) -> list[str]:
    """Names of the services recorded in ``state_dir`` whose processes still run."""
    if not _stack_file(state_dir).is_file():
        return []
    return [n for n, s in load(state_dir).services.items() if is_running(s)]


def down(state_dir: str | Path = DEFAULT_STATE_DIR, *, wipe: bool = False) -> list[str]:
    """Stop every server recorded in ``state_dir``; return their names. ``wipe`` also
    deletes the state dir (databases, logs)."""
    path = _stack_file(state_dir)
    names: list[str] = []
    if path.is_file():
        stack = load(state_dir)
        stop([s.pid for s in stack.services.values() if is_running(s)])
        names = list(stack.services)
        path.unlink()
    if wipe and Path(state_dir).is_dir():
        shutil.rmtree(state_dir)
    return names


def status(state_dir: str | Path = DEFAULT_STATE_DIR) -> dict[str, dict[str, object]]:
    """Per recorded service: url, pid, whether its process runs and whether it is healthy."""
    if not _stack_file(state_dir).is_file():
        return {}
    out: dict[str, dict[str, object]] = {}
    for name, svc in load(state_dir).services.items():
        healthy = False
        try:
            with _no_proxy.open(svc.url + HEALTH_PATHS[name], timeout=2) as resp:
                healthy = resp.status == 200
        except (OSError, ValueError):
            pass
        out[name] = {
            "url": svc.url,
            "pid": svc.pid,
            "running": is_running(svc),
            "healthy": healthy,
            "log": svc.log,
        }
    return out


def describe(stack: Stack) -> list[str]:
    """One line per service saying where it is."""
    lines = []
    if stack.s3_endpoint:
        lines.append(f"S3 endpoint: {stack.s3_endpoint} (bucket s3://{stack.bucket})")
    if stack.mlflow_uri:
        lines.append(f"MLflow UI: {stack.mlflow_uri}")
    if stack.prefect_api_url:
        lines.append(f"Prefect UI: {stack.prefect_ui_url} (API {stack.prefect_api_url})")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``ett stack`` (and ``python -m infra.stack``), in any order."""
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    parser.add_argument("--services", default=",".join(SERVICES), help="comma-separated")
    parser.add_argument("--bucket", default=DEFAULT_BUCKET)
    parser.add_argument("--wipe", action="store_true", help="down: also delete the state dir")
    parser.add_argument("--timeout", type=float, default=180.0, help="up: seconds per server")
    for name in SERVICES:
        parser.add_argument(f"--{name}-port", type=int, default=DEFAULT_PORTS[name])


def _up(args: argparse.Namespace) -> None:
    services = tuple(s.strip() for s in args.services.split(",") if s.strip())
    unknown = sorted(set(services) - set(SERVICES))
    if unknown:
        raise StackError(f"unknown services {unknown}; known: {', '.join(SERVICES)}")
    if running_services(args.state_dir):
        raise StackError(f"a stack in {args.state_dir} already runs; see `ett stack status`")
    ports = {}
    for name in services:
        wanted = getattr(args, f"{name}_port", None)
        ports[name] = wanted if wanted and not port_in_use(wanted) else free_port()
        if wanted and ports[name] != wanted:
            print(f"port {wanted} is busy: {name} uses {ports[name]}", file=sys.stderr)
    t0 = time.monotonic()
    stack = up(args.state_dir, ports, services, bucket=args.bucket, timeout_s=args.timeout)
    print("\n".join(describe(stack)))
    took = ", ".join(f"{n} {t:.1f}s" for n, t in stack.ready_s.items())
    print(f"ready in {time.monotonic() - t0:.1f}s ({took}); logs in {stack.state_dir}")
    env_cmd = f"ett stack env --state-dir {shlex.quote(args.state_dir)}"
    print(f'point a shell at it: eval "$({env_cmd})"')


def _status(args: argparse.Namespace) -> int:
    from infra import tables

    info = status(args.state_dir)
    if not info:
        print("no stack recorded; run `ett stack up`")
        return 1
    rows = [
        [
            name,
            str(row["url"]),
            str(row["pid"]),
            "healthy" if row["healthy"] else "running" if row["running"] else "stopped",
            str(row["log"]),
        ]
        for name, row in info.items()
    ]
    tables.show([("Stack", ["service", "url", "pid", "state", "log"], rows)])
    return 0 if all(r["healthy"] for r in info.values()) else 1


def run(args: argparse.Namespace) -> int:
    """Carry out a parsed ``ett stack`` command; StackError/TimeoutError say what failed."""
    if args.command == "up":
        _up(args)
    elif args.command == "down":
        stopped = down(args.state_dir, wipe=args.wipe)
        print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    elif args.command == "status":
        return _status(args)
    else:
        for key, value in load(args.state_dir).env().items():
            print(f"export {key}={shlex.quote(value)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ett stack", description="Local S3 + MLflow + Prefect.")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except (StackError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
