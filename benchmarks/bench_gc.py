"""The garbage collector's policy (trainer/gc_policy.py) against Python's default, side by side.

Workload: the demo model and data (embedded defaults, ``train.eval: off``), one rank,
``python -m trainer.launch --standalone`` run directly (no orchestrator) through
benchmarks/gc_launch.py, which switches the policy off for ``default``. Every job shares one
compile cache, warmed by a first job that is not counted.

- **Start**: ``--pairs`` pairs of ``--steps``-step jobs, the variants' order reversed in every
  other pair. Time to the first step runs from starting the launcher's interpreter to the
  rank's first step in its ledger. The full collections of the launcher and the rank before
  that step are counted, with their time.
- **Loop**: one job of each with ``--loop-steps`` steps: the full collections between its
  first and last step, in the launcher and the rank, with their time. (Those after the last
  step are the processes' exits, counted apart.)

    .venv/bin/python benchmarks/bench_gc.py [--pairs 4] [--steps 20] [--loop-steps 1500]

Prints a markdown table and writes benchmarks/results/gc.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.save import save_run  # noqa: E402
from infra.accounting.ledger_format import Mark, Span  # noqa: E402
from infra.accounting.ledger_read import read_events  # noqa: E402
from infra.settings import dump_config, load_config  # noqa: E402

VARIANTS = ("default", "policy")


def run_job(work: Path, variant: str, name: str, steps: int) -> dict[str, Any]:
    """One job; its time to the first step and the full collections before and after it."""
    config = load_config(
        job_id=name,
        storage={"root": f"file://{work}/store"},
        data={"url": f"file://{work}/data"},
        train={"steps": steps, "eval": "off"},
        tracking={"mlflow_uri": f"sqlite:///{work}/mlflow.db"},
    )
    path = work / f"{name}.yaml"
    dump_config(config, path)
    log_dir = work / "gc" / name
    log_dir.mkdir(parents=True)
    env = {**os.environ, "BENCH_GC_LOG": str(log_dir), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(ROOT / "benchmarks" / "gc_launch.py"), variant]
    argv += ["--standalone", "--nproc-per-node=1", "-m", "trainer", "--config", str(path)]
    began = time.time()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200, cwd=work)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit code {proc.returncode}\n{proc.stderr[-3000:]}")
    events = read_events(config.layout)
    rank_pid = next(e.attrs["pid"] for e in events if e.name == Mark.ATTEMPT_START)
    spans = [e for e in events if e.name == Span.TRAIN_STEP]
    first_step, last_step = min(e.start for e in spans), max(e.end for e in spans)
    start: dict[str, list[float]] = {"launcher": [], "rank": []}
    loop: list[float] = []
    after: list[float] = []  # the processes' exits
    for log in log_dir.glob("*.txt"):
        who = "rank" if int(log.stem) == rank_pid else "launcher"
        for line in log.read_text().splitlines():
            at, took = (float(x) for x in line.split())
            if at < first_step:
                start[who].append(took)
            else:
                (loop if at < last_step else after).append(took)
    return {
        "variant": variant,
        "job": name,
        "steps": steps,
        "to_first_step_s": round(first_step - began, 3),
        "full_collections_start": {who: len(x) for who, x in start.items()},
        "full_collections_start_s": round(sum(map(sum, start.values())), 3),
        "full_collections_loop": len(loop),
        "full_collections_loop_s": round(sum(loop), 3),
        "full_collections_after_last_step": len(after),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--loop-steps", type=int, default=1500)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gc.json"))
    args = parser.parse_args()
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="bench-gc-"))
    data = load_config(data={"url": f"file://{work}/data"}).data
    from trainer.data.synthetic import generate

    generate(data, data.url)
    run_job(work, "policy", "warm-cache", args.steps)  # fills the shared compile cache
    rows = []
    for pair in range(args.pairs):
        for variant in VARIANTS if pair % 2 == 0 else VARIANTS[::-1]:
            rows.append(run_job(work, variant, f"start-{variant}-{pair}", args.steps))
            print(f"# pair {pair} {variant}: {rows[-1]['to_first_step_s']:.2f} s", flush=True)
    for variant in VARIANTS:
        rows.append(run_job(work, variant, f"loop-{variant}", args.loop_steps))
    loop_rows = {r["variant"]: r for r in rows if r["job"].startswith("loop-")}
    start_rows = {
        v: [r for r in rows if r["variant"] == v and r["job"].startswith("start-")]
        for v in VARIANTS
    }
    firsts = {v: [r["to_first_step_s"] for r in start_rows[v]] for v in VARIANTS}
    ratios = [round(p / d, 3) for d, p in zip(firsts["default"], firsts["policy"], strict=True)]
    summary = {
        v: {
            "to_first_step_median_s": round(statistics.median(firsts[v]), 3),
            "full_collections_start_median": statistics.median(
                sum(r["full_collections_start"].values()) for r in start_rows[v]
            ),
            "full_collections_loop": loop_rows[v]["full_collections_loop"],
            "full_collections_loop_s": loop_rows[v]["full_collections_loop_s"],
        }
        for v in VARIANTS
    }
    summary["to_first_step_ratio_per_pair"] = ratios
    summary["to_first_step_ratio_median"] = statistics.median(ratios)
    print(
        "| collector | to the first step, median (s) | range (s) "
        "| full collections before it | in the loop | their time in the loop (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for v in VARIANTS:
        s = summary[v]
        print(
            f"| {v} | {s['to_first_step_median_s']:.2f} "
            f"| {min(firsts[v]):.2f}-{max(firsts[v]):.2f} "
            f"| {s['full_collections_start_median']:g} | {s['full_collections_loop']} "
            f"({args.loop_steps} steps) | {s['full_collections_loop_s']:.2f} |"
        )
    print(
        f"\npolicy / default, to the first step, per pair: {', '.join(map(str, ratios))}; "
        f"median {summary['to_first_step_ratio_median']:.3f}"
    )
    save_run("gc", args, summary, rows, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
