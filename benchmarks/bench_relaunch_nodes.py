"""Restart (a cold relaunch after a failure) against the number of nodes: the points that
``ett simulate --relaunch-fit`` fits its restart-versus-nodes term to.

Workload: the tests' tiny model and data (tests/factories.py), ``--nodes`` local nodes x 1
rank each (``ett train --nnodes N`` with no work pool: every node a torchrun agent of this
host, joined through the orchestrator's c10d store), ``--steps`` steps, a crash on every rank
at ``--at`` of attempt 0, run by the orchestrator's attempt loop with backoff 0.
``recovery.standby`` and ``recovery.in_process_restart`` are off, so the recovery is a cold
relaunch of every node: new agents, imports, rendezvous, process group, model, restore.

Restart is the job's Time to Recover from its ETT report (infra/accounting/ett.py): from the
failed attempt's last event to the first step of the next attempt. First start is its Time
to Start (the job's start to its first step). Sizes alternate within each repeat (forward,
then backward) so that drift on a shared machine hits every size alike; medians over
``--repeats``. Every rank runs one thread (OMP_NUM_THREADS=1).

On one machine the N agents and N ranks import and initialise on the same cores: 4 local
nodes on 2 cores share them, so the slope measured here includes CPU contention. It is an
upper bound on the per-node rendezvous cost of this code, not a cluster measurement, where
each node brings its own CPUs (docs/simulate.md).

    .venv/bin/python benchmarks/bench_relaunch_nodes.py [--nodes 1,2,4] [--repeats 3]

Prints a markdown table and writes benchmarks/results/relaunch-nodes.json (the run in the
docs: ``--out docs/results/relaunch-nodes.json``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_recovery import one_failure  # noqa: E402
from benchmarks.save import run_record, save_json  # noqa: E402
from infra.accounting.ett import report_for_job  # noqa: E402
from infra.accounting.ledger_format import Span  # noqa: E402
from infra.settings import JobConfig  # noqa: E402
from infra.whatif.scaling import fit_restart  # noqa: E402
from tests.factories import tiny_config, write_dataset  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1"}


def job_config(work: Path, nodes: int, rep: int, args: argparse.Namespace) -> JobConfig:
    job_id = f"relaunch-{nodes}n-{rep}"
    return tiny_config(
        work,
        job_id=job_id,
        train={"steps": args.steps, "log_every": 20},
        launch={"nnodes": nodes, "nproc": 1},
        recovery={
            "standby": False,
            "in_process_restart": False,
            "max_failures": 2,
            "backoff_s": 0,
            "startup_timeout_s": 600.0,
        },
        faults=[{"kind": "crash", "step": args.at}],
    )


def one(nodes: int, rep: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One job of ``nodes`` local nodes that crashes once; its restart, first start and the
    relaunch's process-group init (per rank: the ranks' exchange through the c10d store)."""
    config = job_config(work, nodes, rep, args)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    measured = one_failure(config, env=ENV)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = report_for_job(config.layout)
    relaunch = next(i for i in report.init if i.attempt == 1)
    group_init = relaunch.stages.get(Span.PROCESS_GROUP_INIT, 0.0) / nodes
    return {
        "nodes": nodes,
        "repeat": rep,
        "restart_s": measured["time_to_recover_s"],
        "first_start_s": round(report.time_to_start_s or 0.0, 3),
        "relaunch_launcher_init_s": round(relaunch.stages.get(Span.LAUNCHER_INIT, 0.0), 3),
        "relaunch_process_group_init_per_rank_s": round(group_init, 3),
        # CPU seconds of the job's agents and ranks (both starts, the training, the exits)
        "job_cpu_s": round(after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime, 2),
        **{k: v for k, v in measured.items() if k != "time_to_recover_s"},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="1,2,4", help="node counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--at", type=int, default=30, help="the crashing step of attempt 0")
    parser.add_argument("--work-dir")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "relaunch-nodes.json")
    )
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-relaunch-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    write_dataset(tiny_config(work))
    # A first job, not counted: the page cache holds the imports from here on for every size.
    one(min(sizes), -1, work, args)
    rows = []
    started = time.time()
    for rep in range(args.repeats):
        for nodes in sizes if rep % 2 == 0 else sizes[::-1]:
            rows.append(one(nodes, rep, work, args))
            print(f"# {rows[-1]}", flush=True)

    def med(nodes: int, key: str) -> float:
        return round(statistics.median(r[key] for r in rows if r["nodes"] == nodes), 3)

    keys = ("restart_s", "first_start_s", "relaunch_process_group_init_per_rank_s", "job_cpu_s")
    medians = {n: {k: med(n, k) for k in keys} for n in sizes}
    points = [(n, medians[n]["restart_s"]) for n in sizes]
    fit = fit_restart(points, source="medians")
    # The same least squares over the other columns: how each grows per node.
    lines = {k: fit_restart([(n, medians[n][k]) for n in sizes]) for k in keys[1:]}
    print(
        f"\nCold relaunch after a crash, median of {args.repeats} (N local nodes x 1 rank, "
        f"tiny model, {os.cpu_count()} CPUs, crash at step {args.at} of {args.steps})\n"
    )
    print(
        "| nodes | restart (s) | runs (s) | first start (s) | process group init per rank (s) "
        "| job CPU (s) |"
    )
    print("|---:|---:|---|---:|---:|---:|")
    for n in sizes:
        runs = ", ".join(f"{r['restart_s']:.2f}" for r in rows if r["nodes"] == n)
        m = medians[n]
        print(
            f"| {n} | {m['restart_s']:.2f} | {runs} | {m['first_start_s']:.2f} | "
            f"{m['relaunch_process_group_init_per_rank_s']:.3f} | {m['job_cpu_s']:.1f} |"
        )
    print(f"\nrestart: {fit.describe()}")
    for key, line in lines.items():
        print(f"{key}: {line.intercept_s:.3g} s + {line.slope_s_per_node:.3g} s x nodes")
    result = {
        "benchmark": "relaunch-nodes",
        "args": vars(args),
        "medians": medians,
        # (nodes, median restart s): what ``ett simulate --relaunch-fit`` fits
        "fit_points": points,
        "fit": {
            "slope_s_per_node": fit.slope_s_per_node,
            "intercept_s": fit.intercept_s,
            "clamped": fit.clamped,
        },
        "per_node": {
            key: {"slope_s_per_node": line.slope_s_per_node, "intercept_s": line.intercept_s}
            for key, line in lines.items()
        },
        "rows": rows,
        **run_record(started),
    }
    save_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
