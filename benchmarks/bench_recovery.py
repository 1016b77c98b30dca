"""Recovery: what each kind of failure costs a job, end to end, with the real trainer.

Workload: a tiny job (the test factories' config, --steps steps, a checkpoint every
--every steps) run by the orchestrator's attempt loop (tasks/train.py, the same code as the
``train`` flow, without a Prefect server) with one injected failure at --at of attempt 0:
``crash`` (an exception), ``sigkill`` (a lost worker), ``sigterm`` (a preemption: the
trainer checkpoints at the step boundary and exits 83), ``hang`` (no progress: killed after
--hang-timeout s; the timeout also covers the trainer's silent start-up, imports and
torchrun, so it cannot be small). Backoff 0, so the numbers are the mechanism's own.

Per kind, from the job's ETT report (infra/ett.py): detection latency (the failed attempt's
last event -> the orchestrator saw it die), Time to Recover (-> first step of the next
attempt), redone (wasted) steps and seconds, and ETT%. A preemption redoes no steps; a crash
or SIGKILL redoes up to one checkpoint interval; a hang adds the timeout to detection.

    .venv/bin/python benchmarks/bench_recovery.py [--kinds crash,sigkill,sigterm,hang]

Prints a markdown table and writes benchmarks/results/recovery.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.ett import report_for_job  # noqa: E402
from infra.settings import dump_config  # noqa: E402
from tasks.launch import torchrun_command  # noqa: E402
from tasks.train import RetryPolicy, launch_attempt, run_attempts  # noqa: E402
from tests.factories import tiny_config, write_dataset  # noqa: E402


def one(kind: str, args: argparse.Namespace, tmp: Path) -> dict[str, float | int | str]:
    config = tiny_config(
        tmp,
        job_id=f"bench-{kind}",
        train={"steps": args.steps, "log_every": 5},
        checkpoint={"every_steps": args.every},
        faults=[{"kind": kind, "step": args.at}],
    )
    path = tmp / f"{kind}.yaml"
    dump_config(config, path)
    command = torchrun_command(str(path))
    env = {"OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    outcome = run_attempts(
        lambda a: launch_attempt(config.job_url, command, a, args.hang_timeout, env),
        policy=RetryPolicy(max_failures=2, backoff_s=0),
    )
    wall = time.perf_counter() - start
    report = report_for_job(config.job_url)
    f = report.failures[0]
    wasted_steps = report.num_step_executions - report.num_steps
    return {
        "kind": kind,
        "outcome": " > ".join(a.outcome for a in outcome.attempts),
        "detect_s": (f.detected_at - f.died_at) if f.detected_at is not None else float("nan"),
        "recover_s": f.time_to_recover_s,
        "wasted_steps": wasted_steps,
        "wasted_s": report.observed_unsaved_s,
        "ett_pct": report.ett_pct,
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default="crash,sigkill,sigterm,hang")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--at", type=int, default=35)
    parser.add_argument("--hang-timeout", type=float, default=180.0)  # > silent start
    args = parser.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    rows = []
    with tempfile.TemporaryDirectory(prefix="ett-bench-recovery-") as tmp:
        data = tiny_config(Path(tmp))
        write_dataset(data)
        for kind in args.kinds.split(","):
            rows.append(one(kind.strip(), args, Path(tmp)))
            print(f"# {rows[-1]}", flush=True)
    print(
        f"\nRecovery per failure kind ({args.steps} steps, checkpoint every {args.every}, "
        f"failure at step {args.at}, backoff 0, hang timeout {args.hang_timeout:g} s)\n"
    )
    print(
        "| failure | attempts | detection s | time to recover s | redone steps | "
        "redone s | ETT% | job wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kind']} | {r['outcome']} | {r['detect_s']:.1f} | {r['recover_s']:.1f} | "
            f"{r['wasted_steps']} | {r['wasted_s']:.2f} | {r['ett_pct']:.1f} | "
            f"{r['wall_s']:.0f} |"
        )
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
