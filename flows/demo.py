"""``ett demo`` / ``make demo``: the whole pipeline on one machine, no servers to start.

1. Data: the synthetic click log of the embedded default config, unless it is there already
   (``ett generate`` in a subprocess: flows never import the trainer).
2. The ``train`` flow with one injected failure: the trainer is SIGKILLed at half the steps of
   attempt 0; the flow sees the lost worker, backs off, relaunches, and the trainer resumes
   from the newest committed checkpoint, commits the anchor, and the flow emits the anchor
   event and finishes.
3. Publishing as its own flow run on the anchor:
   - against a running Prefect server with the ``publish`` deployment (``ett stack up``,
     ``prefect deploy --all``, a worker): the anchor event triggers that deployment, as in
     production; the demo only waits for the triggered run and reads the version it made;
   - on Prefect's temporary (ephemeral) API, which runs no triggers, or a server without
     the deployment: the demo starts the ``publish`` flow itself, after training has ended.
4. The ETT table of the job and where to look at the results.

Everything lands under the current directory: ``runs/`` (data, checkpoints, ledgers) and
``mlflow.db`` (+ ``mlartifacts/``), as the embedded defaults say, unless the environment
(``eval "$(ett stack env)"``) points storage and MLflow at the stack.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
import urllib.request
from typing import Any

DEFAULT_BACKOFF_S = 2.0
PUBLISH_DEPLOYMENT = "publish/publish"
PUBLISH_WAIT_S = 900.0  # the triggered run: the worker's poll, a process start, publishing
STAGES = ("data", "training", "publishing", "report")
MLFLOW_UI_PORT = 5001  # `ett stack up` serves MLflow on 5000


class DemoError(RuntimeError):
    """The demo cannot run as asked (e.g. PREFECT_API_URL names a server that is down)."""


def command(name: str) -> str:
    """``name`` as a user types it from here: beside this interpreter (``.venv/bin/ett``)
    relative to the current folder when it is under it, else its full path."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _mlflow_hint(tracking_uri: str) -> str:
    if tracking_uri.startswith("sqlite:///"):
        return (
            f"{command('mlflow')} ui --backend-store-uri {tracking_uri} --port {MLFLOW_UI_PORT}"
            f"   # then open http://127.0.0.1:{MLFLOW_UI_PORT} (the experiment, the job's run "
            "and its attempts, the registered model)"
        )
    return f"open {tracking_uri} in a browser"


def closing_lines(
    job_id: str, config: str | None, tracking_uri: str, server: str | None, flow_run_id: Any
) -> list[str]:
    """What to run or open next, each command as it works from the demo's folder."""
    ett = command("ett")
    with_config = f" --config {shlex.quote(config)}" if config else ""
    lines = [
        f"ETT report again: {ett} report {job_id}{with_config}   (--plot ett.png for the picture)",
        f"MLflow UI: {_mlflow_hint(tracking_uri)}",
    ]
    if server:
        ui = server.rstrip("/").removesuffix("/api")
        lines.append(f"Prefect UI: {ui}/runs/flow-run/{flow_run_id}")
    else:
        lines.append(
            f"Prefect: this demo ran on a temporary API; to keep its runs: {ett} stack up, "
            f'eval "$({ett} stack env)", then {ett} demo (README, Orchestration)'
        )
    return lines


def prefect_server() -> str | None:
    """The API URL of the Prefect server this process is pointed at (PREFECT_API_URL, or
    the active profile's), None when it uses the temporary API; DemoError if it is down."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        return None
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{api.rstrip('/')}/health", timeout=10) as resp:
            if resp.status == 200:
                return str(api)
    except OSError as exc:
        raise DemoError(
            f"PREFECT_API_URL={api} does not answer ({exc}): start it (`ett stack up`) "
            "or unset PREFECT_API_URL to run on a temporary API"
        ) from exc
    raise DemoError(f"PREFECT_API_URL={api} answered its health check with HTTP {resp.status}")


def _publish_deployment_id() -> Any | None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(PUBLISH_DEPLOYMENT).id
        except ObjectNotFound:
            return None


def wait_for_triggered_publish(deployment_id: Any, job_id: str, timeout_s: float) -> Any:
    """The ``publish`` flow run the anchor event triggered for ``job_id``, once final."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    only_publish = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
    deadline = time.monotonic() + timeout_s
    run = None
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = client.read_flow_runs(deployment_filter=only_publish)
            mine = [r for r in runs if r.parameters.get("job_id") == job_id]
            run = mine[0] if mine else None
            if run is not None and run.state is not None and run.state.is_final():
                return run
            time.sleep(2.0)
    where = f"run {run.name} is {run.state.name}" if run and run.state else "no run was made"
    raise DemoError(
        f"the triggered publish of {job_id} did not finish in {timeout_s:.0f} s ({where}): "
        "is a worker running? `prefect worker start --pool ett-local`"
    )


def _published_version(tracking_uri: str, model: str, job_id: str) -> dict[str, Any] | None:
    """The registered version made from ``job_id``'s anchor (what the triggered run did)."""
    from infra.tracking.client import client as mlflow_client

    client = mlflow_client(tracking_uri)
    found = client.search_model_versions(f"name = '{model}' AND tags.job_id = '{job_id}'")
    if not found:
        return None
    newest = max(found, key=lambda mv: int(mv.version))
    v = client.get_model_version(model, newest.version)  # search results carry no aliases
    return {"registered_model": model, "version": v.version, "aliases": list(v.aliases)}


def run_demo(steps: int | None = None, nproc: int = 1, config: str | None = None) -> int:
    """Run the demo; returns a process exit code (0: trained, recovered and published)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The temporary API server may take longer than Prefect's 20 s on a busy laptop.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # ensure-data
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "infra,publish,trainer")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the demo has one
    server = prefect_server()  # before the heavy imports: a server that is down fails fast
    from flows.publish_flow import publish_flow
    from flows.train_flow import train_flow
    from infra import progress_bars, storage, tables
    from infra.accounting.report import sections
    from infra.accounting.summary import JobSummary
    from infra.job_layout import JobLayout
    from infra.settings import dump_config, load_config, new_job_id
    from tasks.training import ensure_data

    base = load_config(config)
    steps = steps or base.train.steps
    job_id = new_job_id("demo")
    storage.configure(base.storage)
    t0 = time.monotonic()
    with progress_bars.stages(STAGES, "demo") as stage:
        stage("data")
        with tempfile.TemporaryDirectory(prefix="ett-demo-") as tmp:
            path = os.path.join(tmp, "demo.yaml")
            dump_config(base, path)
            ensure_data(path, base.data.url)
        t_data = time.monotonic() - t0

        stage("training")
        fault = {"kind": "sigkill", "step": max(1, steps // 2), "attempt": 0}
        print(
            f"\n== training job {job_id}: {steps} steps, SIGKILL injected at step "
            f"{fault['step']} of attempt 0 ==\n",
            flush=True,
        )
        t1 = time.monotonic()
        overrides = {
            "job_id": job_id,
            "train": {"steps": steps},
            "launch": {"nproc": nproc},
            "recovery": {"backoff_s": DEFAULT_BACKOFF_S},
            "faults": [fault],
        }
        state = train_flow(config=config, overrides=overrides, return_state=True)
        result: dict[str, Any] = state.result()
        t_train = time.monotonic() - t1

        stage("publishing")
        anchor = result["anchor"]
        published: dict[str, Any] | None = None
        t2 = time.monotonic()
        deployment = _publish_deployment_id() if server else None
        if anchor is None:
            print("no anchor checkpoint was committed: nothing to publish", file=sys.stderr)
        elif deployment is not None:
            print(
                f"\n== the anchor event triggers the {PUBLISH_DEPLOYMENT} deployment on "
                f"{server}; waiting for its run ==\n",
                flush=True,
            )
            run = wait_for_triggered_publish(deployment, job_id, PUBLISH_WAIT_S)
            print(f"triggered publish run {run.name}: {run.state.name}")
            if run.state.is_completed():
                tracking = base.tracking
                published = _published_version(
                    tracking.mlflow_uri, tracking.registered_model, job_id
                )
        else:
            if server:
                print(f"no {PUBLISH_DEPLOYMENT} deployment on {server}: publishing here")
            print(f"\n== publishing the anchor {anchor['uri']} (its own flow run) ==\n", flush=True)
            published = publish_flow(  # this process is the worker: its MLflow is the job's
                uri=anchor["uri"],
                step=anchor["step"],
                job_id=job_id,
                mlflow_run_id=result["mlflow_run_id"],
                settings={"tracking_uri": base.tracking.mlflow_uri},
            )
        t_publish = time.monotonic() - t2

        stage("report")
        summary = JobSummary.read(JobLayout.at(result["job_url"]))
    print(f"\n== ETT report of job {job_id} ==\n")
    tables.show(sections(summary.report, summary.mfu))
    if (cold := summary.cold_start()) is not None:
        print(cold.describe())
    print(f"attempts: {'; '.join(result['attempts'])}")
    if published:
        aliases = ", ".join(published.get("aliases") or []) or "none"
        print(
            f"published: {published.get('registered_model')} version "
            f"{published.get('version')} (aliases: {aliases})"
        )
    print(
        f"time: data {t_data:.0f} s, training flow {t_train:.0f} s, publishing "
        f"{t_publish:.0f} s, total {time.monotonic() - t0:.0f} s"
    )
    flow_run_id = state.state_details.flow_run_id
    print(
        "\n"
        + "\n".join(closing_lines(job_id, config, base.tracking.mlflow_uri, server, flow_run_id))
    )
    return 0 if published is not None and result["failures"] >= 1 else 1
