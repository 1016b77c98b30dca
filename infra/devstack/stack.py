"""The local stack of real servers: S3 (moto), an MLflow tracking server, a Prefect server.

``ett stack up`` (or ``python -m infra.devstack.stack up``) starts them (infra/devstack/servers.py)
as background processes; the URLs and pids go to ``<state>/stack.json`` (never credentials) so
``down`` and ``status`` find them later. ``eval "$(ett stack env)"`` points a shell (flows, workers,
torchrun ranks) at the stack. S3's contents vanish on ``down`` while MLflow's run records persist:
``down --wipe`` clears the state dir for a consistent restart.

Production: the clients read nothing but the variables of ``Stack.env()``, so production
points them elsewhere: ``AWS_ENDPOINT_URL_S3`` unset (real S3) with credentials from the
instance role or secret store; ``MLFLOW_TRACKING_URI`` at a shared MLflow server run with
``--backend-store-uri postgresql://...`` and ``--artifacts-destination s3://<real bucket>``
(plus ``--allowed-hosts``); ``PREFECT_API_URL`` at a Prefect server on Postgres
(``PREFECT_SERVER_DATABASE_CONNECTION_URL=postgresql+asyncpg://...``) or Prefect Cloud.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from infra.devstack.servers import (
    DEFAULT_BUCKET,
    HEALTH_PATHS,
    LOCAL_AWS_ENV,
    SERVICES,
    Service,
    StackError,
    free_port,
    is_running,
    launch,
    port_in_use,
    probe,
    stop,
    wait_ready,
)

DEFAULT_STATE_DIR = ".stack"
DEFAULT_PORTS = {"s3": 9000, "mlflow": 5000, "prefect": 4200}


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
        out[name] = {
            "url": svc.url,
            "pid": svc.pid,
            "running": is_running(svc),
            "healthy": probe(svc.url + HEALTH_PATHS[name]) is None,
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
    """The arguments of ``ett stack`` (and ``python -m infra.devstack.stack``), in any order."""
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
