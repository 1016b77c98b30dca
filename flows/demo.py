"""``ett demo`` / ``make demo``: the whole pipeline on one machine, no servers to start.

1. Data: the synthetic click log of the embedded default config, unless it is there already
   (``ett generate`` in a subprocess: flows never import the trainer).
2. The ``train`` flow with one injected failure: the trainer is SIGKILLed at half the steps of
   attempt 0; the flow sees the lost worker, backs off, relaunches, and the trainer resumes
   from the newest committed checkpoint, commits the anchor, and the flow emits the anchor
   event and finishes.
3. Publishing as its own flow run on the anchor. With a Prefect server the event triggers the
   ``publish`` deployment; the ephemeral API used here runs no triggers, so the demo starts
   the ``publish`` flow itself, after training has ended.
4. The ETT table of the job and how to open the results in the MLflow UI.

Everything lands under the current directory: ``runs/`` (data, checkpoints, ledgers) and
``mlflow.db`` (+ ``mlartifacts/``), as the embedded defaults say.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

DEFAULT_BACKOFF_S = 2.0


def _mlflow_hint(tracking_uri: str) -> str:
    if tracking_uri.startswith("sqlite:///"):
        return (
            f"mlflow ui --backend-store-uri {tracking_uri}   # then open "
            "http://127.0.0.1:5000 (experiment, nested attempt runs, registered model)"
        )
    return f"open {tracking_uri} in a browser"


def run_demo(steps: int | None = None, nproc: int = 1) -> int:
    """Run the demo; returns a process exit code (0: trained, recovered and published)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The temporary API server may take longer than Prefect's 20 s on a busy laptop.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # ensure-data
    from flows.publish_flow import publish_flow
    from flows.train_flow import train_flow
    from infra import storage
    from infra.ett import report_for_job
    from infra.ett_report import format_table
    from infra.settings import dump_config, load_config
    from tasks.train import ensure_data

    base = load_config()
    steps = steps or base.train.steps
    job_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    storage.configure(base.storage)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ett-demo-") as tmp:
        path = os.path.join(tmp, "demo.yaml")
        dump_config(base, path)
        ensure_data(path, base.data.url)
    t_data = time.monotonic() - t0

    fault = {"kind": "sigkill", "step": max(1, steps // 2), "attempt": 0}
    print(
        f"\n== training job {job_id}: {steps} steps, SIGKILL injected at step "
        f"{fault['step']} of attempt 0 ==\n",
        flush=True,
    )
    t1 = time.monotonic()
    result: dict[str, Any] = train_flow(
        overrides={"job_id": job_id, "train": {"steps": steps}},
        nproc=nproc,
        backoff_s=DEFAULT_BACKOFF_S,
        faults=[fault],
    )
    t_train = time.monotonic() - t1

    anchor = result["anchor"]
    published: dict[str, Any] | None = None
    t2 = time.monotonic()
    if anchor is None:
        print("no anchor checkpoint was committed: nothing to publish", file=sys.stderr)
    else:
        print(f"\n== publishing the anchor {anchor['uri']} (its own flow run) ==\n", flush=True)
        published = publish_flow(
            uri=anchor["uri"],
            step=anchor["step"],
            job_id=job_id,
            mlflow_run_id=result["mlflow_run_id"],
        )
    t_publish = time.monotonic() - t2

    report = report_for_job(result["job_url"])
    print(f"\n== ETT report of job {job_id} ==\n")
    print(format_table(report))
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
    print(f"\nMLflow UI: {_mlflow_hint(base.tracking.mlflow_uri)}")
    print(
        "Prefect: this demo ran on a temporary API; start `prefect server start` and set "
        "PREFECT_API_URL to keep the runs, or see README for the full local stack."
    )
    return 0 if published is not None and result["failures"] >= 1 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ett demo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, help="training steps (default: the config's)")
    parser.add_argument("--nproc", type=int, default=1, help="trainer processes (ranks)")
    args = parser.parse_args(argv)
    return run_demo(steps=args.steps, nproc=args.nproc)


if __name__ == "__main__":
    sys.exit(main())
