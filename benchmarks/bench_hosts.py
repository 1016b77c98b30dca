"""A job across "hosts" on a Prefect work pool: what a spare host saves after a node loss,
and the headline scenario on 2 hosts x 1 rank.

Each "host" is a process worker of the ``ett-nodes`` pool (``prefect worker start --limit
1``) with its own loopback address (127.0.0.2 up) and scratch folder; a real ``prefect
server`` and moto's S3, the only storage the hosts share, run on loopback
(docs/multi-host.md). The orchestrator runs in this process.

- ``spare``: 2 nodes x 1 rank, the tests' tiny model, 3 hosts. Node 1's run is SIGKILLed from
  outside at ``--kill-at``; ``recovery.spare_nodes`` 1 and 0 alternate, ``--repeats`` each.
  Time to Recover comes from the job's ETT report: from the failed attempt's last event to
  the first step of the next. The workers poll the pool every ``--poll-s`` (Prefect's
  default, 10 s): without a spare the replacement waits for a worker to pick it up, start
  its process and import. Each step lasts at least ``--step-delay-s`` (the slow-host fault
  of trainer/faults.py), so the kill lands mid-job however fast the machine.
- ``headline``: benchmarks/bench_ett.py's optimized job (the demo model and data,
  ``--steps``) through the ``train`` flow on 2 hosts x 1 rank and a spare host: a crash at
  24% of the steps, the loss of the host of node 1 at 50% (every process on it SIGKILLed,
  its worker too: the host is gone) and a preemption at 76%.

    .venv/bin/python benchmarks/bench_hosts.py spare [--repeats 3]
    .venv/bin/python benchmarks/bench_hosts.py headline [--steps 5000]

Writes benchmarks/results/hosts-spare.json or hosts-headline.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.save import run_record, save_json  # noqa: E402
from infra.accounting.ett import report_for_job  # noqa: E402
from infra.devstack import servers  # noqa: E402
from infra.job_layout import JobLayout  # noqa: E402
from infra.node_protocol import (  # noqa: E402
    ENV_ADVERTISE,
    ENV_SCRATCH,
    NodeState,
    attempt_nodes,
    node_statuses,
)
from infra.settings import JobConfig, dump_config, load_config  # noqa: E402
from tests import procs  # noqa: E402
from tests.node_hosts import Host, hosts  # noqa: E402
from trainer.faults import ENV_STEP_DELAY  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
ORCHESTRATOR_ADDRESS = "127.0.0.1"


@contextlib.contextmanager
def cluster(
    work: Path, count: int, poll_s: float, host_env: dict[str, str] | None = None
) -> Iterator[tuple[list[Host], list[Any]]]:
    """S3 and a Prefect server on loopback, the deployments, and ``count`` hosts with a node
    worker each (``host_env`` in their environment); everything stopped afterwards."""
    state = work / "servers"
    s3, prefect = servers.launch("s3", state), servers.launch("prefect", state)
    try:
        servers.wait_ready(s3, 240)
        servers.wait_ready(prefect, 240)
        os.environ.update(
            servers.LOCAL_AWS_ENV
            | {
                "AWS_ENDPOINT_URL_S3": s3.url,
                "PREFECT_API_URL": prefect.url + "/api",
                ENV_ADVERTISE: ORCHESTRATOR_ADDRESS,
                "OMP_NUM_THREADS": "1",
            }
        )
        from tests.prefect_worker import deploy, node_workers  # Prefect reads the env above

        deploy()
        placed = hosts(work, count)
        env = {"PREFECT_WORKER_QUERY_SECONDS": f"{poll_s:g}", **(host_env or {})}
        with node_workers(placed, env, work) as workers:
            yield placed, workers
    finally:
        servers.stop([s3.pid, prefect.pid])


def kill_node_at(layout: JobLayout, step: int, host_of: dict[str, Host] | None) -> threading.Thread:
    """From outside, once the job is past ``step`` and every spare has imported: SIGKILL the
    run of a node without rank 0, or with ``host_of`` (address -> host) every process of its
    host, its worker too."""

    def watch() -> None:
        said = None
        while True:  # until rank 0's node is past ``step`` with another running beside it,
            nodes = attempt_nodes(layout)  # and every spare has imported (as in a long job)
            spares = [s for s in node_statuses(layout).values() if s.state == NodeState.PARKED]
            running = [(n.attempt, n.address, n.progress is not None) for n in nodes]
            seen = (running, [s.warm for s in spares])
            if seen != said:
                print(f"# {layout.url}: running (attempt, host, rank 0), spares warm {seen}")
                said = seen
            lead, victim = (nodes[0], nodes[-1]) if len(nodes) > 1 else (None, None)
            past = lead and lead.progress and lead.progress.step >= step
            if past and victim and all(s.warm is not False for s in spares):
                break
            time.sleep(0.2)
        if host_of is None:
            os.kill(victim.pid, signal.SIGKILL)
            return
        scratch = str(host_of[victim.address].scratch)
        for pid in procs.carrying(**{ENV_SCRATCH: scratch}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        print(f"# host {victim.address} gone at step {step}+", flush=True)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# -- spare ------------------------------------------------------------------------------------
def spare_config(work: Path, data_url: str, spare: int, rep: int, args: Any) -> JobConfig:
    from tests.factories import tiny_config

    job_id = f"spare{spare}-{rep}"
    return tiny_config(
        work / job_id,
        job_id=job_id,
        storage={"root": f"s3://ett/bench-hosts/{job_id}"},
        data={"url": data_url},
        train={"steps": args.steps, "log_every": 20},
        launch={"nnodes": 2, "nproc": 1, "work_pool": "ett-nodes"},
        recovery={"backoff_s": 0, "max_failures": 2, "node_timeout_s": 10, "spare_nodes": spare},
    )


def spare_job(work: Path, data_url: str, spare: int, rep: int, args: Any) -> dict[str, Any]:
    from benchmarks.bench_recovery import one_failure  # imports Prefect: after cluster()

    config = spare_config(work, data_url, spare, rep, args)
    killer = kill_node_at(config.layout, args.kill_at, None)
    measured = one_failure(config)
    killer.join(timeout=5)
    return {"spare_nodes": spare, "repeat": rep, **measured}


def bench_spare(work: Path, args: Any) -> dict[str, Any]:
    from tests.factories import tiny_config, write_dataset

    rows: list[dict[str, Any]] = []
    slow = {ENV_STEP_DELAY: f"{args.step_delay_s:g}"}  # so the kill lands mid-job
    with cluster(work, 3, args.poll_s, slow):
        data_url = "s3://ett/bench-hosts/data"
        write_dataset(tiny_config(work / "data", data={"url": data_url}))
        for rep in range(args.repeats):
            for spare in (1, 0) if rep % 2 == 0 else (0, 1):
                rows.append(spare_job(work, data_url, spare, rep, args))
                print(f"# {rows[-1]}", flush=True)
    medians = {
        spare: statistics.median(r["time_to_recover_s"] for r in rows if r["spare_nodes"] == spare)
        for spare in (1, 0)
    }
    print(
        f"\nTime to Recover after a node run is SIGKILLed, median of {args.repeats} "
        f"(2 nodes x 1 rank, tiny model, workers polling every {args.poll_s:g} s)\n"
    )
    print("| spare_nodes | Time to Recover (s) | runs (s) |")
    print("|---:|---:|---|")
    for spare in (1, 0):
        runs = ", ".join(f"{r['time_to_recover_s']:.1f}" for r in rows if r["spare_nodes"] == spare)
        print(f"| {spare} | {medians[spare]:.1f} | {runs} |")
    print(f"\nwithout / with a spare: {medians[0] / medians[1]:.1f}x")
    return {"benchmark": "hosts-spare", "medians_s": medians, "rows": rows}


# -- headline ---------------------------------------------------------------------------------
def headline_config(work: Path, steps: int, job_id: str) -> JobConfig:
    from benchmarks.bench_ett import overrides

    base = overrides("optimized", work, steps)
    return load_config(
        **{
            **base,
            "job_id": job_id,
            "storage": {"root": "s3://ett/bench-hosts/headline"},
            "data": {"url": "s3://ett/bench-hosts/demo-data"},
            "launch": {"nnodes": 2, "nproc": 1, "work_pool": "ett-nodes"},
            "recovery": {"spare_nodes": 1, "node_timeout_s": 10},
        }
    )


def bench_headline(work: Path, args: Any) -> dict[str, Any]:
    from benchmarks.bench_ett import SCHEDULE, summarize
    from trainer.data.synthetic import generate

    (crash, crash_at), (_, loss_at), (preempt, preempt_at) = SCHEDULE
    with cluster(work, 3, args.poll_s) as (placed, _):
        from flows.train_flow import train_flow  # Prefect reads the server's URL on import

        config = headline_config(work, args.steps, "hosts-headline")
        generate(config.data, config.data.url)
        warm = work / "prewarm.yaml"  # fills the shared compile cache, as bench_ett does
        dump_config(headline_config(work, 30, "hosts-prewarm"), warm)
        train_flow(config=str(warm))
        path = work / "headline.yaml"
        dump_config(config, path)
        faults = [
            {"kind": crash, "step": round(crash_at * args.steps), "attempt": 0},
            {"kind": preempt, "step": round(preempt_at * args.steps), "attempt": 1},
        ]
        host_of = {h.address: h for h in placed}
        killer = kill_node_at(config.layout, round(loss_at * args.steps), host_of)
        result = train_flow(
            config=str(path), overrides={"faults": faults, "recovery": {"backoff_s": 2.0}}
        )
        killer.join(timeout=5)
        report = report_for_job(JobLayout.at(result["job_url"]))  # while S3 is up
    row = summarize("2 hosts x 1 rank", report)
    row["attempts"] = result["attempts"]
    print(f"\nETT {row['ett_pct']:.1f}%, wall {row['wall_s']:.1f} s, lost {row['lost_s']:.1f} s")
    for f in row["time_to_recover_s"]:
        print(f"  {f['cause']}{' (in process)' if f['in_process'] else ''}: {f['seconds']:.1f} s")
    return {"benchmark": "hosts-headline", "row": row}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("spare", "headline"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, help="spare: 400, headline: 5000")
    parser.add_argument("--kill-at", type=int, default=60, help="spare: rank 0's step")
    parser.add_argument("--poll-s", type=float, default=10.0, help="the workers' poll interval")
    parser.add_argument(
        "--step-delay-s", type=float, default=0.02, help="spare: each step at least this long"
    )
    parser.add_argument("--work-dir")
    parser.add_argument("--out")
    args = parser.parse_args()
    args.steps = args.steps or (400 if args.what == "spare" else 5000)
    # SIGTERM (a timeout, a Ctrl-C's cousin) unwinds like an exception: the servers, workers
    # and hosts this started are stopped by the context managers on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix=f"bench-hosts-{args.what}-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result = (bench_spare if args.what == "spare" else bench_headline)(work, args)
    result |= {
        "args": vars(args),
        **run_record(started),
    }
    save_json(result, args.out or OUT / f"hosts-{args.what}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
